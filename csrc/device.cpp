#include "device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "format.h"

namespace fused_ce {

namespace {

// The kernels the build embedded in a dtype ("bf16", ...), on any architecture: read off the table once.
const std::vector<const char*>& kernels_in_dtype(const char* dtype) {
  static const auto table = [] {
    std::map<std::string, std::vector<const char*>> kernels;
    for (int i = 0; i < kNumKernelVariants; ++i) {
      const KernelVariant& v = kKernelVariants[i];
      std::vector<const char*>& names = kernels[v.dtype];
      if (std::none_of(names.begin(), names.end(), [&](const char* k) { return std::strcmp(k, v.kernel) == 0; }))
        names.push_back(v.kernel);
    }
    return kernels;
  }();
  static const std::vector<const char*> none;
  const auto it = table.find(dtype);
  return it == table.end() ? none : it->second;
}

}  // namespace

bool cuda_kernels_embedded(const at::Device& device, at::ScalarType dtype) {
  const char* name = cuda_kernel_dtype(dtype);
  if (!device.is_cuda() || name == nullptr || cuda_kernels_disabled()) return false;
  const int arch = device_arch(device.index());
  // every kernel the build embedded in this dtype for any architecture (configs.KERNELS and their flavors, as
  // the generated kernel table lists them), for this one
  for (const char* kernel : kernels_in_dtype(name)) {
    if (find_variant(kernel, name, "general", arch) == nullptr) return false;
  }
  return find_variant("prepare_rows", "fp32", "general", arch) != nullptr &&
         find_variant("assemble_loss", "fp32", "general", arch) != nullptr;
}

bool cuda_kernels_available(const Problem& p) {
  return cuda_kernels_embedded(p.x.device(), p.x.scalar_type());
}

bool uses_row_kernels(const Problem& p) {
  if (!p.x.is_cuda() || p.N == 0) return false;
  if (cuda_kernels_available(p)) return true;
  const auto dtype = p.x.scalar_type();
  const bool kernel_dtype = dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat;
  if (kernel_dtype && !cuda_kernels_disabled()) {
    TORCH_WARN_ONCE("fused_ce: this build has no kernel for sm_", num(device_arch(p.x.device().index())),
                    "; using the slower chunked ATen path on CUDA. Rebuild with this architecture in "
                    "FUSED_CE_CUDA_ARCHS (see fused_ce.cuda_archs()).");
  }
  return false;
}

}  // namespace fused_ce
