// fused_ce::linear_policy_loss: the policy-gradient objective of RL fine-tuning (policy.h: its per-token terms,
// coefficients and stats) over a linear head, with its gradients formed in the forward from the same logits as the
// loss (6NDV; their coefficients need only the forward's row stats and the per-token inputs) and scaled in the
// backward. Its schemas, its CPU and CUDA kernels, its autograd formula (OpFunction<PolicyLossOp>, op_function.h).
#include <torch/library.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "executors.h"
#include "format.h"
#include "library.h"
#include "op_function.h"
#include "policy.h"

namespace fused_ce {
namespace {

using PolicyOutputs = std::tuple<at::Tensor, at::Tensor>;

// fused_ce::linear_policy_loss_with_grad: (loss, stats, grad_input, grad_linear_weight, grad_linear_bias,
// grad_low_rank_input, grad_low_rank_weight) for an upstream gradient of 1; stats [6] with return_stats (else
// empty); the low-rank term's gradients empty without one. float16's gradients in float32 (as
// linear_cross_entropy_with_grad's, cross_entropy.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_policy_loss_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                             const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                             const std::optional<at::Tensor>& old_log_probs,
                             const std::optional<at::Tensor>& ref_log_probs,
                             const std::optional<at::Tensor>& linear_bias,
                             std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                 FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  const TemperedLogits tempered = at_temperature("linear_policy_loss", temperature, softcap, logit_scale);
  TORCH_CHECK_VALUE(clip_low >= 0.0 && clip_low < 1.0 && clip_high >= 0.0 && std::isfinite(clip_high),
                    "linear_policy_loss: clip_low must be in [0, 1) and clip_high >= 0, got ", num(clip_low), ", ",
                    num(clip_high));
  TORCH_CHECK_VALUE(std::isfinite(kl_coef) && std::isfinite(entropy_coef),
                    "linear_policy_loss: kl_coef and entropy_coef must be finite");
  LossOptions o =
      log_prob_options("linear_policy_loss", "sum", tempered, ignore_index, workspace_bytes,
                       entropy_coef != 0.0 || return_stats, return_stats FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  o.policy_loss = true;
  const std::optional<at::Tensor> no_class_weights;
  const Call call({input, linear_weight, target, linear_bias, no_class_weights, low_rank_input, low_rank_weight},
                  std::move(o), Pass::ForwardWithGrad, {});
  const auto per_token = [&](const char* name, const std::optional<at::Tensor>& t) {
    if (!t || !t->defined()) return;
    TORCH_CHECK_VALUE(t->sizes() == target.sizes(), "linear_policy_loss: ", name, " must have the target's shape ",
                      shape(target.sizes()), ", got ", shape(t->sizes()));
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), "linear_policy_loss: ", name, " must be floating point");
    TORCH_CHECK(t->device() == input.device(), "linear_policy_loss: ", name, " is on ", t->device().str(),
                " but input is on ", input.device().str());
  };
  per_token("advantages", advantages);
  per_token("token_weights", token_weights);
  per_token("old_log_probs", old_log_probs);
  per_token("ref_log_probs", ref_log_probs);
  PolicyOptions options{clip_low, clip_high, kl_coef, entropy_coef, kl_times_ratio, return_stats};
  const PolicyRows policy(call.run, options, *call.of_run(advantages), call.of_run(token_weights),
                          call.of_run(old_log_probs), call.of_run(ref_log_probs));
  CoefficientSource source;
  source.from_stats = [&policy](int64_t begin, int64_t end, const RowStats& s) {
    return policy.coefficients(begin, end, s);
  };
  const auto [s, g] = forward_with_grad(call.shard(), call.options, call.plan, source, output_mask);
  const bool half = input.scalar_type() == at::kHalf;
  const auto [gx, gw, gb] = call.grads(g, half);
  const auto [gu, gb_low_rank] = call.low_rank_grads(g, half);
  const at::Tensor stats = policy.stats();
  return {call.flagged(policy.loss()), stats.numel() > 0 ? call.per_target(stats) : stats, gx, gw, gb, gu, gb_low_rank};
}

// linear_policy_loss's: the gradients formed in the forward (their coefficients need only the forward's row
// stats and the per-token inputs), the backward scales them, as the scalar cross-entropy's.
struct PolicyLossOp : torch::CustomClassHolder {
  variable_list args;                // target, advantages, token_weights, old_log_probs, ref_log_probs
  std::vector<c10::IValue> options;  // in schema order, as the with-grad op takes them

  std::string caller() const { return "linear_policy_loss"; }

  // linear_policy_loss_with_grad below autograd: (loss, stats), the gradients asked for in `mask` in *grads.
  variable_list with_grad(const Linear& l, const Mask& mask, variable_list* grads) const {
    static const auto op = op_handle("fused_ce::linear_policy_loss_with_grad");
    torch::jit::Stack stack{l.input,           l.weight,          args[0],
                            args[1],           optional(args[2]), optional(args[3]),
                            optional(args[4]), optional(l.bias),  std::vector<bool>(mask.begin(), mask.end())};
    stack.insert(stack.end(), options.begin(), options.end());
    stack.insert(stack.end(), {optional(l.low_rank_input), optional(l.low_rank_weight)});
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(&stack);
    if (grads) {
      *grads = {stack[2].toTensor(), stack[3].toTensor(), stack[4].toTensor()};
      if (l.low_rank_input.defined()) {  // (after dW's scale, which the policy loss has not: scaled_forward_grads)
        grads->insert(grads->end(), {at::empty({0}, l.input.options()), stack[5].toTensor(), stack[6].toTensor()});
      }
    }
    return {stack[0].toTensor(), stack[1].toTensor()};
  }

  Forward forward(const Linear& l, const Mask& needs) const {
    Forward f;
    f.outputs = with_grad(l, needs, &f.used_up);
    f.non_differentiable = {f.outputs[1]};
    return f;
  }

  variable_list backward(const Linear& l, const variable_list&, const variable_list& grads, const Mask& mask,
                         std::optional<variable_list> used_up) const {
    const auto recompute = [&] {
      variable_list again;
      with_grad(l, mask, &again);
      return again;
    };
    return scaled_forward_grads(std::move(used_up), recompute, l, grads[0], mask);
  }
};

// The policy loss's op, its option values in schema order, boxed (they travel to the with-grad op in that order).
c10::intrusive_ptr<PolicyLossOp> policy_loss_op(
    const at::Tensor& target, const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
    const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
  auto op = c10::make_intrusive<PolicyLossOp>();
  op->args = {target, advantages, token_weights.value_or(at::Tensor()), old_log_probs.value_or(at::Tensor()),
              ref_log_probs.value_or(at::Tensor())};
  op->options = {FUSED_CE_IVALUE_LIST(FUSED_CE_POLICY_OPTIONS) FUSED_CE_IVALUES(FUSED_CE_SHARD_OPTIONS)};
  return op;
}

// The CPU and CUDA kernel of linear_policy_loss: its forward with gradient asked for none.
PolicyOutputs linear_policy_loss(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                 const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                                 const std::optional<at::Tensor>& old_log_probs,
                                 const std::optional<at::Tensor>& ref_log_probs,
                                 const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                     FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const auto op =
      policy_loss_op(target, advantages, token_weights, old_log_probs,
                     ref_log_probs FUSED_CE_ARGS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  const auto out = op->with_grad({input, linear_weight, linear_bias.value_or(at::Tensor()),
                                  low_rank_input.value_or(at::Tensor()), low_rank_weight.value_or(at::Tensor())},
                                 {false, false, false}, nullptr);
  return {out[0], out[1]};
}

// Its Autograd kernel.
PolicyOutputs linear_policy_loss_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const char* caller = "linear_policy_loss";
  for (const auto& [name, t] : {std::pair<const char*, std::optional<at::Tensor>>{"advantages", advantages},
                                {"token_weights", token_weights},
                                {"old_log_probs", old_log_probs},
                                {"ref_log_probs", ref_log_probs}}) {
    check_not_differentiable(caller, name, t);
  }
  const Linear l{input, linear_weight, linear_bias.value_or(at::Tensor()), low_rank_input.value_or(at::Tensor()),
                 low_rank_weight.value_or(at::Tensor())};
  auto op = policy_loss_op(target, advantages, token_weights, old_log_probs,
                           ref_log_probs FUSED_CE_ARGS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  if (!needs_autograd(caller, l)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto out = op->with_grad(l, {false, false, false}, nullptr);
    return {out[0], out[1]};
  }
  auto out = OpFunction<PolicyLossOp>::apply(input, linear_weight, linear_bias, low_rank_input, low_rank_weight, op);
  return {out[0], out[1]};
}

void policy_loss_kernels(torch::Library& m) {
  m.impl("linear_policy_loss", &linear_policy_loss);
  m.impl("linear_policy_loss_with_grad", &linear_policy_loss_with_grad);
}

}  // namespace
}  // namespace fused_ce

TORCH_LIBRARY_FRAGMENT(fused_ce, m) {
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
}

FUSED_CE_CPU_AND_CUDA(fused_ce::policy_loss_kernels)
FUSED_CE_AUTOCAST("linear_policy_loss")

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  m.impl("linear_policy_loss", &fused_ce::linear_policy_loss_autograd);
}
