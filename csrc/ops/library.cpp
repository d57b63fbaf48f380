// The library fused_ce opened (every op family's file adds its ops as fragments: library.h), with the ops of the
// library itself: the backward's in-place scaling, what the build embedded, and what the fake kernels and the JIT
// launchers share with C++ (the kept rows' sizing, the combination of row-stat splits).
#include "library.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <string>
#include <vector>

#include "device.h"
#include "format.h"
#include "kernel_table.h"
#include "op_function.h"
#include "plan.h"
#include "problem.h"

namespace fused_ce {
namespace {

// What the build embedded: architectures, kernels, and one cubin's bytes (for tests).
std::vector<int64_t> _embedded_archs() {
  std::vector<int64_t> archs;
  for (int i = 0; i < kNumKernelVariants; ++i) {
    if (std::find(archs.begin(), archs.end(), kKernelVariants[i].arch) == archs.end()) {
      archs.push_back(kKernelVariants[i].arch);
    }
  }
  std::sort(archs.begin(), archs.end());
  return archs;
}

std::vector<std::string> _embedded_kernels() {
  std::vector<std::string> names;
  for (int i = 0; i < kNumKernelVariants; ++i) {
    if (std::find(names.begin(), names.end(), kKernelVariants[i].kernel) == names.end()) {
      names.emplace_back(kKernelVariants[i].kernel);
    }
  }
  return names;
}

at::Tensor _embedded_cubin(int64_t arch, c10::string_view kernel, c10::string_view dtype, c10::string_view layout) {
  for (int i = 0; i < kNumKernelVariants; ++i) {
    const KernelVariant& v = kKernelVariants[i];
    if (v.arch == arch && kernel == v.kernel && dtype == v.dtype && layout == v.layout) {
      const auto size = static_cast<int64_t>(v.cubin_end - v.cubin_begin);
      return at::from_blob(const_cast<unsigned char*>(v.cubin_begin), {size}, at::kByte).clone();
    }
  }
  TORCH_CHECK(false, "fused_ce: no embedded cubin for sm_", num(arch), " ", std::string(kernel), "/",
              std::string(dtype), "/", std::string(layout));
  return at::Tensor();
}

// fused_ce::_combine_row_stat_splits: combine_row_stat_splits (problem.h) for kernels/jit.py, which launches
// the row_stats kernel itself: one source for the combination. Undefined stats come back empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _combine_row_stat_splits(
    const at::Tensor& partial, const std::optional<at::Tensor>& argmax_partial, const at::Tensor& target,
    bool weighted_sums, bool entropy, bool argmax) {
  const RowStats s =
      combine_row_stat_splits(partial, argmax_partial.value_or(at::Tensor()), target, {weighted_sums, entropy, argmax});
  const auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, partial.options()); };
  return {s.lse, s.target_gap, s.log_sum, or_empty(s.weighted_z_sum), or_empty(s.entropy), or_empty(s.argmax)};
}

// fused_ce::_cuda_kernels_embedded: cuda_kernels_embedded (device.h) for the fake kernel of
// _linear_cross_entropy_keeping_logits, whose kept rows (none without the kernels) it sizes; a device without an
// index is the current one's.
bool _cuda_kernels_embedded(at::Device device, at::ScalarType dtype) {
  if (device.is_cuda() && !device.has_index()) device = c10::impl::getDeviceGuardImpl(device.type())->getDevice();
  return cuda_kernels_embedded(device, dtype);
}

}  // namespace
}  // namespace fused_ce

TORCH_LIBRARY(fused_ce, m) {
  m.def("_scale_grad_(Tensor(a!) grad, Tensor scale) -> ()");
  m.def(
      "_combine_row_stat_splits(Tensor partial, Tensor? argmax_partial, Tensor target, bool weighted_sums, bool "
      "entropy, bool argmax) -> (Tensor lse, Tensor target_gap, Tensor log_sum, Tensor weighted_z_sum, Tensor "
      "entropy, Tensor argmax)",
      &fused_ce::_combine_row_stat_splits);
  m.def("_embedded_archs() -> int[]", &fused_ce::_embedded_archs);
  m.def("_cuda_kernels_embedded(Device device, ScalarType dtype) -> bool", &fused_ce::_cuda_kernels_embedded);
  m.def("_kept_logit_rows_constants() -> int[]", &fused_ce::_kept_logit_rows_constants);
  m.def("_kept_logit_rows_of(int rows, int V, int D, int elem, int? workspace_bytes) -> int",
        &fused_ce::_kept_logit_rows_of);
  m.def("_embedded_kernels() -> str[]", &fused_ce::_embedded_kernels);
  m.def("_embedded_cubin(int arch, str kernel, str dtype, str layout) -> Tensor", &fused_ce::_embedded_cubin);
}

namespace {
void library_kernels(torch::Library& m) {
  m.impl("_scale_grad_", &fused_ce::_scale_grad_);
}
}  // namespace

FUSED_CE_CPU_AND_CUDA(library_kernels)
