// The ops: options, problem and plan, then the plan's executor and the loss.
#include "loss.h"

#include <limits>

#include "executors.h"
#include "loss_terms.h"
#include "plan.h"
#include "problem.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

at::Tensor no_grad(const Problem& p) {
  return at::empty({0}, p.x.options());
}

// The executors' 2-D gradients in the shapes and dtypes of the arguments; with `keep_dtypes`, in their own.
std::tuple<at::Tensor, at::Tensor, at::Tensor> shaped_grads(const Problem& p, const Grads& g, const at::Tensor& input,
                                                            const at::Tensor& linear_weight, bool keep_dtypes = false) {
  const auto to = [&](const at::Tensor& t, at::ScalarType dtype) { return keep_dtypes ? t : t.to(dtype); };
  return {g.input.defined() ? to(g.input, input.scalar_type()).reshape(input.sizes()) : no_grad(p),
          g.weight.defined() ? to(g.weight, linear_weight.scalar_type()) : no_grad(p),
          g.bias.defined() ? to(g.bias, p.bias.scalar_type()) : no_grad(p)};
}

// A loss computed under CUDA graph capture with bad class indices (Problem::unreported_bad_targets) is NaN.
at::Tensor flag_bad_targets(const Problem& p, const at::Tensor& loss) {
  if (!p.unreported_bad_targets.defined()) return loss;
  const at::Tensor nan = at::full({}, std::numeric_limits<double>::quiet_NaN(), loss.options());
  return at::where(p.unreported_bad_targets.gt(0).reshape({}), nan, loss);
}

std::string dtype_name(at::ScalarType t) {
  return t == at::ScalarType::Undefined ? "" : c10::toString(t);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                                        const at::Tensor& target,
                                                        const std::optional<at::Tensor>& linear_bias,
                                                        const std::optional<at::Tensor>& weight,
                                                        FUSED_CE_LOSS_OPTION_PARAMS) {
  return vocab_parallel_linear_cross_entropy(input, linear_weight, target, linear_bias, weight,
                                             FUSED_CE_LOSS_OPTION_ARGS, FUSED_CE_NO_SHARD_ARGS);
}

std::tuple<at::Tensor, at::Tensor> vocab_parallel_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, FUSED_CE_OPTION_PARAMS) {
  const LossOptions o = LossOptions::parse(FUSED_CE_OPTION_ARGS);
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const Plan plan = make_plan(p, o, Pass::Forward);
  prepare_targets(p, o, plan, /*check=*/true, nullptr);
  const Problem shard = vocab_shard(p, o);
  const RowStats s = forward_stats(shard, o, plan);
  if (o.vocab_parallel()) combine_vocab_shards(shard, s, o);
  return {flag_bad_targets(p, assemble_loss(p, o, plan, s, target.sizes())), s.lse.reshape(target.sizes())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, std::array<bool, 3> output_mask,
    FUSED_CE_OPTION_PARAMS) {
  const LossOptions o = LossOptions::parse(FUSED_CE_OPTION_ARGS);
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const Plan plan = make_plan(p, o, Pass::Backward);
  prepare_targets(p, o, plan, /*check=*/false, nullptr);  // the forward checked these targets
  GradCoefficients c = grad_coefficients(p, o, grad_loss, grad_lse);
  c.lse = lse.reshape({p.N}).to(loss_dtype(p)).contiguous();
  return shaped_grads(p, recomputed_grads(vocab_shard(p, o), plan, c, output_mask), input, linear_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    std::array<bool, 3> output_mask, FUSED_CE_OPTION_PARAMS) {
  const LossOptions o = LossOptions::parse(FUSED_CE_OPTION_ARGS);
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const Plan plan = make_plan(p, o, Pass::ForwardWithGrad);
  GradCoefficients unit;
  prepare_targets(p, o, plan, /*check=*/true, &unit);
  const auto [s, g] = forward_with_grad(vocab_shard(p, o), o, plan, unit, output_mask);
  // float16's come back in float32 (loss.h): at unit scale, before the upstream gradient, float16 would
  // lose them to underflow.
  const auto [gx, gw, gb] = shaped_grads(p, g, input, linear_weight, input.scalar_type() == at::kHalf);
  return {flag_bad_targets(p, assemble_loss(p, o, plan, s, target.sizes())), s.lse.reshape(target.sizes()), gx, gw, gb};
}

std::tuple<std::string, std::string, int64_t, int64_t, int64_t, std::string, double, std::string, std::string, double,
           bool, bool, int64_t, int64_t>
plan_of(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, c10::string_view pass,
        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, FUSED_CE_OPTION_PARAMS) {
  const LossOptions o = LossOptions::parse(FUSED_CE_OPTION_ARGS);
  const Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const Plan plan = make_plan(p, o, parse_pass(pass));
  return {std::string(pass),
          strategy_name(plan.strategy),
          plan.block_rows,
          plan.tile_cols,
          plan.stats_block_rows,
          dtype_name(plan.logits_dtype),
          plan.logits_scale,
          dtype_name(plan.grad_input_dtype),
          dtype_name(plan.grad_weight_dtype),
          plan.grad_scale,
          plan.rank_one_smoothing,
          plan.rows_on_device,
          plan.budget_bytes,
          plan.workspace_bytes};
}

}  // namespace fused_ce
