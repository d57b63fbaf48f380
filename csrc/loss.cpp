// The ops' CPU and CUDA implementations: each a Call (call.h: options, problem, counted rows, plan, the rows
// run) and its executor.
#include "loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "call.h"
#include "executors.h"
#include "format.h"
#include "loss_terms.h"
#include "plan.h"
#include "policy.h"
#include "problem.h"
#include "targets.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

// The kernels' own ATen calls (GEMMs, reductions) run in the dtypes they are given: under autocast, nested
// calls would otherwise round, say, the logits of a float32 GEMM to bfloat16. Autocast is the ops' own
// (ops.cpp: it casts the linear's operands, like F.linear).
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

// The gradients the row blocks form: dW too unless it comes from vocabulary slices (Plan::weight_grad_slice_classes).
GradMask without_weight_grad(GradMask need, bool slices) {
  if (slices) need[1] = false;
  return need;
}

// The forward's outputs (loss, lse, entropy, argmax): the Forward pipeline.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(const LossInputs& in, LossOptions o) {
  const Call call(in, std::move(o), Pass::Forward, {});
  const Problem shard = call.shard();
  const RowStats s = forward_stats(shard, call.options, call.plan);
  if (call.options.vocab_parallel()) combine_vocab_shards(shard, s, call.options);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  return forward_outputs({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                         LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)));
}

CrossEntropyGrads linear_cross_entropy_backward(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                                                const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input,
                                                const at::Tensor& linear_weight, const at::Tensor& target,
                                                const std::optional<at::Tensor>& linear_bias,
                                                const std::optional<at::Tensor>& weight, const at::Tensor& lse,
                                                const std::optional<at::Tensor>& entropy,
                                                std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                                    FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  // (the forward checked these targets; ignored rows have no gradient unless their lse has one)
  const bool lse_grad = grad_lse && grad_lse->defined();
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                  LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)), Pass::Backward, {/*check=*/false}, -1,
                  /*every_row=*/lse_grad);
  GradCoefficients c = grad_coefficients(call.problem, call.options, grad_loss, grad_lse, grad_entropy,
                                         entropy ? *entropy : at::Tensor());
  c.lse = lse.reshape({call.problem.N}).to(loss_dtype(call.problem)).contiguous();
  const Problem shard = call.shard();
  const GradCoefficients run = call.of_run(c);
  const bool slices = output_mask[1] && call.plan.weight_grad_slice_classes > 0;
  Grads g = recomputed_grads(shard, call.options, call.plan, run, without_weight_grad(output_mask, slices));
  if (slices) g.weight = weight_grad_by_slices(shard, call.options, call.plan, run);
  return std::tuple_cat(call.grads(g), call.low_rank_grads(g));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_keeping_logits(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  const std::optional<c10::SymInt> kept = kept_logit_rows(input, linear_weight, target, o, device_facts(input));
  if (!kept) {  // none kept: the forward alone
    return std::tuple_cat(
        forward_outputs({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                        std::move(o)),
        std::make_tuple(at::empty({0, linear_weight.size(0)}, input.options())));
  }
  const int64_t capacity = kept->guard_int(__FILE__, __LINE__);
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight}, std::move(o),
                  Pass::ForwardKeepingLogits, {}, capacity);
  const Problem shard = call.shard();
  const int64_t kept_n = std::min(capacity, call.run.N);  // the first rows of the run's order
  at::Tensor logits;
  RowStats s;
  if (kept_n == call.run.N) {
    logits = at::empty({capacity, shard.V}, call.problem.x.options());
    s = forward_stats(shard, call.options, call.plan, logits);
  } else {
    // the other rows first, in blocks of their own workspace, freed before the kept logits take its place
    const Problem rest = shard.row_range(kept_n, call.run.N);
    const RowStats rest_stats =
        forward_stats(rest, call.options, make_plan(rest, call.options, call.plan.device, Pass::Forward));
    logits = at::empty({capacity, shard.V}, call.problem.x.options());
    const Problem kept_part = shard.row_range(0, kept_n);
    const RowStats kept_stats = forward_stats(
        kept_part, call.options,
        make_plan(kept_part, call.options, call.plan.device, Pass::ForwardKeepingLogits, -1, kept_n), logits);
    s = RowStats::allocate(shard, {call.options.smoothing(), call.options.return_entropy, call.options.return_argmax});
    s.block(0, kept_n).copy_(kept_stats);
    s.block(kept_n, call.run.N).copy_(rest_stats);
  }
  if (call.options.vocab_parallel()) combine_vocab_shards(shard, s, call.options);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax, logits};
}

CrossEntropyGrads _linear_cross_entropy_backward_from_logits(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, at::Tensor& logits, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const bool lse_of_ignored = grad_lse && grad_lse->defined();
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                  LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)), Pass::BackwardFromLogits,
                  {/*check=*/false}, logits.size(0));
  if (lse_of_ignored && !(call.counted_rows.known() && call.counted_rows.counted == call.problem.N)) {
    // the lse of ignored rows has a gradient, and their logits may not have been kept: computed again
    return linear_cross_entropy_backward(grad_loss, grad_lse, grad_entropy, input, linear_weight, target, linear_bias,
                                         weight, lse, entropy, output_mask FUSED_CE_ARGS(FUSED_CE_ALL_OPTIONS),
                                         low_rank_input, low_rank_weight);
  }
  GradCoefficients c = grad_coefficients(call.problem, call.options, grad_loss, grad_lse, grad_entropy,
                                         entropy ? *entropy : at::Tensor());
  c.lse = lse.reshape({call.problem.N}).to(loss_dtype(call.problem)).contiguous();
  const Problem shard = call.shard();
  const GradCoefficients run = call.of_run(c);
  const bool slices = output_mask[1] && call.plan.weight_grad_slice_classes > 0;
  Grads g =
      grads_from_kept_logits(shard, call.options, call.plan, run, without_weight_grad(output_mask, slices), logits);
  if (slices) g.weight = weight_grad_by_slices(shard, call.options, call.plan, run);
  return std::tuple_cat(call.grads(g), call.low_rank_grads(g));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
linear_cross_entropy_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                               const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                               std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                   FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  TORCH_CHECK_VALUE(o.scalar(), "fused_ce::linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum'");
  GradCoefficients unit;
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight}, std::move(o),
                  Pass::ForwardWithGrad, {/*check=*/true, &unit});
  CoefficientSource source;
  source.fixed = call.of_run(unit);
  const Problem shard = call.shard();
  const bool slices = output_mask[1] && call.plan.weight_grad_slice_classes > 0;
  auto [s, g] = forward_with_grad(shard, call.options, call.plan, source, without_weight_grad(output_mask, slices));
  if (slices) {  // dW from the vocabulary slices, at the forward's lse
    GradCoefficients c = source.fixed;
    c.lse = s.lse;
    g.weight = weight_grad_by_slices(shard, call.options, call.plan, c);
  }
  // float16's dX and db come back in float32, dW in float16 times a power of two (loss.h): at unit scale, before
  // the upstream gradient, float16 would lose them to underflow.
  const bool half = input.scalar_type() == at::kHalf;
  auto [gx, gw, gb] = call.grads(g, half);
  at::Tensor gw_scale = at::empty({0}, input.options().dtype(at::kFloat));
  if (half) {
    if (gw.numel() > 0) {
      std::tie(gw, gw_scale) = float16_weight_grad(gw, call.plan.grad_weight_scale);
    } else {
      gw = gw.to(at::kHalf);
      gw_scale = at::ones({}, gw_scale.options());
    }
  }
  const auto [gu, gb_low_rank] = call.low_rank_grads(g, half);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax, gx, gw, gb, gw_scale, gu, gb_low_rank};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_policy_loss_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                             const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                             const std::optional<at::Tensor>& old_log_probs,
                             const std::optional<at::Tensor>& ref_log_probs,
                             const std::optional<at::Tensor>& linear_bias,
                             std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                 FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
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

bool gradients_in_forward(const LossOptions& o, const at::Tensor& input) {
  return o.scalar() && !(input.scalar_type() == at::kHalf && input.device().is_cpu());
}

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

}  // namespace fused_ce
