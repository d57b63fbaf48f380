// fused_ce::_plan: the plan of one of the cross-entropy ops for these arguments (plan.h, plan_fields), without
// running it (the targets are prepared: one host read); fused_ce.plan shows it, so tests and benchmarks see the
// path a call takes.
#include "plan.h"

#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>

#include "call.h"
#include "device.h"

namespace fused_ce {
namespace {

void _plan(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, n);
  const at::Tensor input = args[0].toTensor(), linear_weight = args[1].toTensor(), target = args[2].toTensor();
  const auto linear_bias = args[4].toOptional<at::Tensor>(), weight = args[5].toOptional<at::Tensor>();
  const auto low_rank_input = args[n - 2].toOptional<at::Tensor>(),
             low_rank_weight = args[n - 1].toOptional<at::Tensor>();
  const LossOptions o = LossOptions::from_ivalues(args.slice(6, n - 8));
  const auto wants_grad = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
  const DeviceFacts device = device_facts(input);
  // "first": the pass a call with these arguments runs first, chosen as the ops choose it (the autograd formula's
  // gradients_in_forward, then whether the per-token loss keeps its logits: kept_logit_rows)
  const bool differentiable = at::GradMode::is_enabled() &&
                              (input.requires_grad() || linear_weight.requires_grad() || wants_grad(linear_bias) ||
                               wants_grad(low_rank_input) || wants_grad(low_rank_weight));
  const auto kept_logits = [&] { return kept_logit_rows(input, linear_weight, target, o, device); };
  const Pass pass = args[3].toStringView() != "first" ? parse_pass(args[3].toStringView())
                    : !differentiable                 ? Pass::Forward
                    : gradients_in_forward(o, input)  ? Pass::ForwardWithGrad
                    : kept_logits()                   ? Pass::ForwardKeepingLogits
                                                      : Pass::Forward;
  // (the kept passes: the rows the forward's kept tensor would have; none kept: Backward's kept tensor has no
  // rows, the forward plans every row)
  const bool kept_pass = pass == Pass::BackwardFromLogits || pass == Pass::ForwardKeepingLogits;
  const std::optional<c10::SymInt> kept_rows = kept_pass ? kept_logits() : std::nullopt;
  const int64_t kept = kept_rows ? kept_rows->guard_int(__FILE__, __LINE__) : pass == Pass::BackwardFromLogits ? 0 : -1;
  // the op's own pipeline up to its plan (the targets unchecked: a plan of expanded tensors reads none)
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight}, o, pass,
                  {/*check=*/false}, kept);
  const Plan& plan = call.plan;
  torch::jit::drop(*stack, n);
  for (auto& [name, value] : plan_fields(plan)) stack->push_back(std::move(value));
}

std::string plan_schema() {
  std::string schema =
      "_plan(Tensor input, Tensor linear_weight, Tensor target, str pass_, Tensor? linear_bias=None, "
      "Tensor? weight=None" FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA ") -> (";
  const char* separator = "";
  for (const auto& [name, value] : plan_fields(Plan{})) {
    const char* type = value.isString() ? "str" : value.isBool() ? "bool" : value.isInt() ? "int" : "float";
    schema += std::string(separator) + type + " " + name;
    separator = ", ";
  }
  return schema + ")";
}

}  // namespace
}  // namespace fused_ce

TORCH_LIBRARY_FRAGMENT(fused_ce, m) {
  m.def(fused_ce::plan_schema().c_str(), torch::CppFunction::makeFromBoxedFunction<&fused_ce::_plan>());
}
