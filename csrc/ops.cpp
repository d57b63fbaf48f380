// The op library fused_ce: schemas and registration, autocast, linear_log_probs, and what the build embedded. The
// CPU/CUDA kernels are in loss.cpp, the autograd formulas in autograd.cpp.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "aten_stages.h"
#include "autograd.h"
#include "cuda_stages.h"
#include "device.h"
#include "distillation.h"
#include "format.h"
#include "kernel_table.h"
#include "loss.h"
#include "plan.h"

namespace fused_ce {
namespace {

// The arguments autocast casts: each linear map's (the student's and, for distillation, the teacher's).
bool linear_operand(const std::string& name) {
  for (const char* operand : {"input", "linear_weight", "linear_bias", "low_rank_input", "low_rank_weight",
                              "teacher_input", "teacher_weight", "teacher_bias"}) {
    if (name == operand) return true;
  }
  return false;
}

// Autocast, one boxed kernel for every op: like F.linear, the linear's operands (the arguments input,
// linear_weight and linear_bias) in the autocast dtype; the rest (targets, class weights, per-token inputs) as
// given, the loss float32 inside anyway. Then the op below autocast.
template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
void autocast_linear_operands(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto& arguments = op.schema().arguments();
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    const std::string& name = arguments[i].name();
    c10::IValue& value = (*stack)[first + i];
    if (linear_operand(name) && value.isTensor())
      value = at::autocast::cached_cast(dtype, value.toTensor(), device_type);
  }
  op.callBoxed(stack);
}

// fused_ce::linear_log_probs: log softmax(softcap(logit_scale * z) / temperature)[target] per row (0 where
// ignored), the entropy and the argmax of that distribution, as _linear_cross_entropy with reduction 'none'
// (minus its loss; at_temperature). Composite, so autograd, torch.compile and export see the op it calls.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_LOG_PROB_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const TemperedLogits tempered = at_temperature("linear_log_probs", temperature, softcap, logit_scale);
  const LossOptions o = log_prob_options("linear_log_probs", "none", tempered, ignore_index, workspace_bytes,
                                         return_entropy, return_argmax FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  const auto [loss, lse, entropy, argmax] =
      call_loss_op(input, linear_weight, target, linear_bias, std::nullopt, o, low_rank_input, low_rank_weight);
  return {loss.neg(), entropy, argmax};
}

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

// The tensor arguments every loss op begins with.
#define FUSED_CE_TENSORS \
  "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None"
// The backward ops': the upstream gradients, then (after the kept logits, where they are) the forward's arguments
// and outputs.
#define FUSED_CE_UPSTREAM_GRADS "Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, "
#define FUSED_CE_BACKWARD_TENSORS                                                                                \
  "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, Tensor lse, Tensor? " \
  "entropy, bool[3] output_mask"
// Their gradients (CrossEntropyGrads, loss.h).
#define FUSED_CE_GRADS "Tensor, Tensor, Tensor, Tensor, Tensor"

}  // namespace

TORCH_LIBRARY(fused_ce, m) {
  // The public op: graphs saved with it (TorchScript, torch.export, AOTInductor) keep loading as long as its
  // options are only ever appended, with defaults (options.h).
  m.def("linear_cross_entropy(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_LOSS_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax)",
        {at::Tag::pt2_compliant_tag});
  m.def("linear_cross_entropy_backward(" FUSED_CE_UPSTREAM_GRADS FUSED_CE_BACKWARD_TENSORS FUSED_CE_SCHEMA(
            FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA ") -> (" FUSED_CE_GRADS ")",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy_keeping_logits(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS)
            FUSED_CE_LOW_RANK_SCHEMA ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax, Tensor logits)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy_backward_from_logits(" FUSED_CE_UPSTREAM_GRADS
        "Tensor(a!) logits, " FUSED_CE_BACKWARD_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (" FUSED_CE_GRADS ")",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "linear_cross_entropy_with_grad(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, "
      "Tensor? weight, bool[3] output_mask" FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
      ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax, Tensor, Tensor, "
      "Tensor, Tensor grad_weight_scale, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("linear_log_probs(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None" FUSED_CE_SCHEMA(
            FUSED_CE_LOG_PROB_OPTIONS) FUSED_CE_SCHEMA(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor log_probs, Tensor entropy, Tensor argmax)",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "linear_policy_loss(Tensor input, Tensor linear_weight, Tensor target, Tensor advantages, "
      "Tensor? token_weights=None, Tensor? old_log_probs=None, Tensor? ref_log_probs=None, "
      "Tensor? linear_bias=None" FUSED_CE_SCHEMA(FUSED_CE_POLICY_OPTIONS) FUSED_CE_SCHEMA(FUSED_CE_SHARD_OPTIONS)
          FUSED_CE_LOW_RANK_SCHEMA ") -> (Tensor loss, Tensor stats)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "linear_policy_loss_with_grad(Tensor input, Tensor linear_weight, Tensor target, Tensor advantages, "
      "Tensor? token_weights, Tensor? old_log_probs, Tensor? ref_log_probs, Tensor? linear_bias, "
      "bool[3] output_mask" FUSED_CE_SCHEMA(FUSED_CE_POLICY_OPTIONS) FUSED_CE_SCHEMA(FUSED_CE_SHARD_OPTIONS)
          FUSED_CE_LOW_RANK_SCHEMA ") -> (Tensor loss, Tensor stats, Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("linear_distillation_loss(" FUSED_CE_DISTILLATION_TENSORS("=None")
            FUSED_CE_SCHEMA(FUSED_CE_DISTILLATION_OPTIONS) ") -> (Tensor loss, Tensor entropy)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_distillation_with_grad(" FUSED_CE_DISTILLATION_TENSORS("") ", Tensor? row_scale, bool[3] output_mask"
            FUSED_CE_SCHEMA(FUSED_CE_DISTILLATION_OPTIONS) ") -> (Tensor loss, Tensor entropy, Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("_scale_grad_(Tensor(a!) grad, Tensor scale) -> ()");
  m.def(plan_schema().c_str(), torch::CppFunction::makeFromBoxedFunction<&_plan>());
  m.def(
      "_combine_row_stat_splits(Tensor partial, Tensor? argmax_partial, Tensor target, bool weighted_sums, bool "
      "entropy, bool argmax) -> (Tensor lse, Tensor target_gap, Tensor log_sum, Tensor weighted_z_sum, Tensor "
      "entropy, Tensor argmax)",
      &_combine_row_stat_splits);
  m.def("_embedded_archs() -> int[]", &_embedded_archs);
  m.def("_cuda_kernels_embedded(Device device, ScalarType dtype) -> bool", &_cuda_kernels_embedded);
  m.def("_kept_logit_rows_constants() -> int[]", &_kept_logit_rows_constants);
  m.def("_kept_logit_rows_of(int rows, int V, int D, int elem, int? workspace_bytes) -> int", &_kept_logit_rows_of);
  m.def("_embedded_kernels() -> str[]", &_embedded_kernels);
  m.def("_embedded_cubin(int arch, str kernel, str dtype, str layout) -> Tensor", &_embedded_cubin);
}

namespace {

// The ops' CPU and CUDA kernels: the same functions (loss.cpp), which dispatch on the device inside.
void register_kernels(torch::Library& m) {
  m.impl("_scale_grad_", &_scale_grad_);
  m.impl("_linear_cross_entropy_keeping_logits", &_linear_cross_entropy_keeping_logits);
  m.impl("_linear_cross_entropy_backward_from_logits", &_linear_cross_entropy_backward_from_logits);
  m.impl("linear_policy_loss", &linear_policy_loss);
  m.impl("linear_policy_loss_with_grad", &linear_policy_loss_with_grad);
  m.impl("linear_cross_entropy", &public_loss<&_linear_cross_entropy>);
  m.impl("_linear_cross_entropy", &_linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
  m.impl("linear_cross_entropy_with_grad", &linear_cross_entropy_with_grad);
  m.impl("linear_distillation_loss", &linear_distillation_loss);
  m.impl("_linear_distillation_with_grad", &_linear_distillation_with_grad);
}

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
void register_autocast(torch::Library& m) {
  for (const char* op :
       {"linear_cross_entropy", "_linear_cross_entropy", "linear_policy_loss", "linear_distillation_loss"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&autocast_linear_operands<device_type, autocast_key>>());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fused_ce, CPU, m) {
  register_kernels(m);
}

TORCH_LIBRARY_IMPL(fused_ce, CUDA, m) {
  register_kernels(m);
}

TORCH_LIBRARY_IMPL(fused_ce, CompositeImplicitAutograd, m) {
  m.impl("linear_log_probs", &linear_log_probs);
}

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  m.impl("linear_policy_loss", &linear_policy_loss_autograd);
  m.impl("linear_cross_entropy", &public_loss<&_linear_cross_entropy_autograd>);
  m.impl("_linear_cross_entropy", &_linear_cross_entropy_autograd);
  m.impl("linear_distillation_loss", &linear_distillation_loss_autograd);
}

TORCH_LIBRARY_IMPL(fused_ce, AutocastCUDA, m) {
  register_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>(m);
}

TORCH_LIBRARY_IMPL(fused_ce, AutocastCPU, m) {
  register_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>(m);
}

}  // namespace fused_ce
