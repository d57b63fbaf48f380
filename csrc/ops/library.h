// What every op family's registration shares. The library fused_ce is opened in library.cpp (with the ops of the
// library itself: what the build embedded, _scale_grad_, helpers for the fake kernels and the JIT launchers); each
// op family's file in csrc/ops/ defines its schemas and registers its kernels as fragments of it, so that an op
// family is one file (two for cross-entropy: its autograd formula apart). The static registrations of the files
// may run in any order: the dispatcher joins a kernel to its schema whichever comes first.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <initializer_list>
#include <string>

namespace fused_ce {

// Autocast, one boxed kernel for every op: like F.linear, the linear's operands (the student's and, for
// distillation, the teacher's: input, linear_weight, linear_bias, the low-rank term's) in the autocast dtype; the
// rest (targets, class weights, per-token inputs) as given, the loss float32 inside anyway. Then the op below
// autocast.
template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
void autocast_linear_operands(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const std::initializer_list<const char*> operands = {"input",          "linear_weight",   "linear_bias",
                                                              "low_rank_input", "low_rank_weight", "teacher_input",
                                                              "teacher_weight", "teacher_bias"};
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto& arguments = op.schema().arguments();
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  const size_t first = stack->size() - arguments.size();
  for (size_t i = 0; i < arguments.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    bool operand = false;
    for (const char* name : operands) operand = operand || arguments[i].name() == name;
    if (operand && value.isTensor()) value = at::autocast::cached_cast(dtype, value.toTensor(), device_type);
  }
  op.callBoxed(stack);
}

// Inside the ops' kernels: their own ATen calls (GEMMs, reductions) run in the dtypes they are given (under
// autocast, nested calls would otherwise round, say, the logits of a float32 GEMM to bfloat16); autocast is the
// ops' own, autocast_linear_operands.
struct NoAutocast : c10::impl::ExcludeDispatchKeyGuard {
  NoAutocast() : ExcludeDispatchKeyGuard(c10::autocast_dispatch_keyset) {}
};

template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
void register_autocast(torch::Library& m, std::initializer_list<const char*> ops) {
  for (const char* op : ops) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&autocast_linear_operands<device_type, autocast_key>>());
  }
}

}  // namespace fused_ce

// The autocast kernel for these ops (those that take a linear map's operands), on the CPU and CUDA.
#define FUSED_CE_AUTOCAST(...)                                                                            \
  TORCH_LIBRARY_IMPL(fused_ce, AutocastCPU, m) {                                                          \
    fused_ce::register_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>(m, {__VA_ARGS__});   \
  }                                                                                                       \
  TORCH_LIBRARY_IMPL(fused_ce, AutocastCUDA, m) {                                                         \
    fused_ce::register_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>(m, {__VA_ARGS__}); \
  }

// One list of kernels (`kernels`, a function of a torch::Library&) for the CPU and CUDA: the ops' kernels are the
// same functions on both, dispatching on the device inside.
#define FUSED_CE_CPU_AND_CUDA(kernels)    \
  TORCH_LIBRARY_IMPL(fused_ce, CPU, m) {  \
    kernels(m);                           \
  }                                       \
  TORCH_LIBRARY_IMPL(fused_ce, CUDA, m) { \
    kernels(m);                           \
  }
