// The ops: options, problem and targets, plan, then the plan's executor and the loss.
#include "loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cmath>
#include <limits>
#include <string>

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

// The problem the executors run on: p's counted rows where the plan says so (Plan::counted_rows_only), else p.
Problem rows_to_run(const Problem& p, const Plan& plan, const CountedRows& rows) {
  return plan.counted_rows_only ? p.select_rows(rows.counted_index()) : p;
}

// values ([K, ...]) of the rows `index` of N rows, `fill` elsewhere (index_copy_: deterministic).
at::Tensor expand_rows(const at::Tensor& values, const at::Tensor& index, int64_t N, double fill) {
  at::Tensor out = at::full({N}, fill, values.options());
  return out.index_copy_(0, index, values);
}

// The row stats of every row of p from the counted rows' (`counted`): the ignored rows' lse, where asked for
// (lse_of_ignored_rows), from a forward pass over them; their other stats 0 (the argmax -1: outputs()).
RowStats every_row(const Problem& p, const LossOptions& o, const CountedRows& rows, const RowStats& counted) {
  const at::Tensor index = rows.counted_index();
  const auto expand = [&](const at::Tensor& t) { return t.defined() ? expand_rows(t, index, p.N, 0.0) : t; };
  RowStats s{expand(counted.lse),     expand(counted.target_gap),
             expand(counted.log_sum), expand(counted.weighted_z_sum),
             expand(counted.entropy), expand(counted.argmax)};
  if (o.lse_of_ignored_rows && rows.counted < p.N) {
    const at::Tensor ignored_index = rows.ignored_index();
    const Problem ignored = p.select_rows(ignored_index);
    const Plan plan = make_plan(ignored, o, Pass::Forward);
    const Problem shard = vocab_shard(ignored, o);
    const RowStats part = forward_stats(shard, o, plan);
    if (o.vocab_parallel()) combine_vocab_shards(shard, part, o);
    s.lse.index_copy_(0, ignored_index, part.lse.to(s.lse.scalar_type()));
  }
  return s;
}

// The loss shaped like the target: of every row for 'none' (0 at rows not run), else the scalar.
at::Tensor shaped_loss(const Problem& run, const LossOptions& o, const Plan& plan, const RowStats& s,
                       const CountedRows& rows, int64_t N, at::IntArrayRef target_shape) {
  at::Tensor loss = assemble_loss(run, o, plan, s, o.scalar() ? target_shape : at::IntArrayRef{run.N});
  if (!o.scalar() && plan.counted_rows_only) loss = expand_rows(loss, rows.counted_index(), N, 0.0);
  return o.scalar() ? loss : loss.reshape(target_shape);
}

// The rows a call that keeps its logits runs on, in the order of the kept rows (linear_cross_entropy_keeping_logits):
// the counted ones where their count is read, every row (counted ones first) under CUDA graph capture, where it
// is not. The forward and the backward find the same order from the same targets, so that the backward reads the
// forward's rows whichever of the two was captured (rows it finds beyond those the forward computed have no
// gradient, and softmax_grad writes them exact zeros).
CountedRows kept_rows(const Problem& p, const CountedRows& rows) {
  if (rows.known() || !rows.order.defined()) return rows;
  CountedRows all = rows;
  all.counted = p.N;
  return all;
}

Problem kept_run(const Problem& p, const CountedRows& rows, const CountedRows& kept) {
  if (p.N == 0 || (rows.known() && rows.counted == p.N)) return p;  // every row, in order
  return p.select_rows(kept.counted_index());
}

// The ops' per-row outputs: the lse shaped like the target, the entropy (0 at ignored rows) and the argmax (-1
// there) where asked for, else empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs(const Problem& p, const RowStats& s, at::IntArrayRef shape) {
  if (!s.entropy.defined() && !s.argmax.defined())
    return {s.lse.reshape(shape), at::empty({0}, s.lse.options()), at::empty({0}, p.target.options())};
  const at::Tensor counted = p.target.ge(0);  // (only then: an ATen kernel, whose first launch costs milliseconds)
  const at::Tensor entropy = s.entropy.defined()
                                 ? at::where(counted, s.entropy, at::zeros({}, s.entropy.options())).reshape(shape)
                                 : at::empty({0}, s.lse.options());
  const at::Tensor argmax = s.argmax.defined()
                                ? at::where(counted, s.argmax, at::full({}, -1, s.argmax.options())).reshape(shape)
                                : at::empty({0}, p.target.options());
  return {s.lse.reshape(shape), entropy, argmax};
}

// The kernels' own ATen calls (GEMMs, reductions) run in the dtypes they are given: under autocast, nested
// calls would otherwise round, say, the logits of a float32 GEMM to bfloat16. Autocast is the ops' own
// (ops.cpp: it casts the linear's operands, like F.linear).
using NoAutocast = c10::impl::ExcludeDispatchKeyGuard;

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_LOSS_OPTIONS)) {
  const auto [loss, lse, entropy, argmax] = linear_cross_entropy_all(
      input, linear_weight, target, linear_bias,
      weight FUSED_CE_ARGS(FUSED_CE_LOSS_OPTIONS) FUSED_CE_DEFAULTS(FUSED_CE_OUTPUT_OPTIONS)
          FUSED_CE_DEFAULTS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_DEFAULTS(FUSED_CE_CALLER_OPTIONS));
  return {loss, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_all(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const CountedRows rows = prepare_targets(p, o, uses_row_kernels(p), /*check=*/true, nullptr);
  const Plan plan = make_plan(p, o, Pass::Forward, rows.counted);
  const Problem run = rows_to_run(p, plan, rows);
  const Problem shard = vocab_shard(run, o);
  RowStats s = forward_stats(shard, o, plan);
  if (o.vocab_parallel()) combine_vocab_shards(shard, s, o);
  const at::Tensor loss = flag_bad_targets(p, shaped_loss(run, o, plan, s, rows, p.N, target.sizes()));
  if (plan.counted_rows_only) s = every_row(p, o, rows, s);
  const auto [lse, entropy, argmax] = outputs(p, s, target.sizes());
  return {loss, lse, entropy, argmax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input, const at::Tensor& linear_weight,
    const at::Tensor& target, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  // the forward checked these targets; the count is read all the same
  const CountedRows rows = prepare_targets(p, o, uses_row_kernels(p), /*check=*/false, nullptr);
  GradCoefficients c = grad_coefficients(p, o, grad_loss, grad_lse, grad_entropy, entropy ? *entropy : at::Tensor());
  c.lse = lse.reshape({p.N}).to(loss_dtype(p)).contiguous();
  // Ignored rows have no gradient unless their lse has one.
  const bool lse_grad = grad_lse && grad_lse->defined();
  const Plan plan = make_plan(p, o, Pass::Backward, lse_grad ? -1 : rows.counted);
  const Problem run = rows_to_run(p, plan, rows);
  if (plan.counted_rows_only) c = c.select_rows(rows.counted_index());
  return shaped_grads(p, recomputed_grads(vocab_shard(run, o), o, plan, c, output_mask), input, linear_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_keeping_logits(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  TORCH_CHECK_VALUE(keeps_logits(input, linear_weight, target, o),
                    "fused_ce::_linear_cross_entropy_keeping_logits: these logits are not kept (a per-token loss on "
                    "CUDA whose logits fit in workspace_bytes: fused_ce.plan(...).keeps_logits)");
  const int64_t capacity = kept_logit_rows(input, linear_weight, target, o).guard_int(__FILE__, __LINE__);
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const CountedRows rows =
      prepare_targets(p, o, uses_row_kernels(p), /*check=*/true, nullptr, /*order_under_capture=*/true);
  const CountedRows kept = kept_rows(p, rows);
  const Problem run = kept_run(p, rows, kept);
  const Plan plan = make_plan(run, o, Pass::ForwardKeepingLogits);
  const Problem shard = vocab_shard(run, o);
  const int64_t kept_n = std::min(capacity, run.N);  // the first rows of the run's order
  RowStats s;
  at::Tensor logits;
  if (kept_n == run.N) {
    logits = at::empty({capacity, shard.V}, p.x.options());
    s = forward_stats(shard, o, plan, logits);
  } else {
    // the other rows first, in blocks of their own workspace, freed before the kept logits take its place
    const Problem rest = shard.row_range(kept_n, run.N);
    const RowStats rest_stats = forward_stats(rest, o, make_plan(rest, o, Pass::Forward));
    logits = at::empty({capacity, shard.V}, p.x.options());
    const Problem kept_part = shard.row_range(0, kept_n);
    const RowStats kept_stats =
        forward_stats(kept_part, o, make_plan(kept_part, o, Pass::ForwardKeepingLogits), logits);
    s = RowStats::allocate(shard, {o.smoothing(), o.return_entropy, o.return_argmax});
    s.rows(0, kept_n).copy_(kept_stats);
    s.rows(kept_n, run.N).copy_(rest_stats);
  }
  if (o.vocab_parallel()) combine_vocab_shards(shard, s, o);
  const at::Tensor loss = flag_bad_targets(p, shaped_loss(run, o, plan, s, kept, p.N, target.sizes()));
  if (plan.counted_rows_only) s = every_row(p, o, kept, s);
  const auto [lse, entropy, argmax] = outputs(p, s, target.sizes());
  return {loss, lse, entropy, argmax, logits};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward_from_logits(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, at::Tensor& logits, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const CountedRows rows =
      prepare_targets(p, o, uses_row_kernels(p), /*check=*/false, nullptr, /*order_under_capture=*/true);
  if (grad_lse && grad_lse->defined() && !(rows.known() && rows.counted == p.N)) {
    // the lse of ignored rows has a gradient, and their logits may not have been kept: computed again
    return linear_cross_entropy_backward(grad_loss, grad_lse, grad_entropy, input, linear_weight, target, linear_bias,
                                         weight, lse, entropy, output_mask FUSED_CE_ARGS(FUSED_CE_ALL_OPTIONS));
  }
  GradCoefficients c = grad_coefficients(p, o, grad_loss, grad_lse, grad_entropy, entropy ? *entropy : at::Tensor());
  c.lse = lse.reshape({p.N}).to(loss_dtype(p)).contiguous();
  const CountedRows kept = kept_rows(p, rows);
  const Problem run = kept_run(p, rows, kept);
  const Plan plan = make_plan(run, o, Pass::BackwardFromLogits, -1, logits.size(0));
  if (run.row_index.defined()) c = c.select_rows(kept.counted_index());
  return shaped_grads(p, grads_from_kept_logits(vocab_shard(run, o), o, plan, c, output_mask, logits), input,
                      linear_weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_cross_entropy_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                               const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                               std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const NoAutocast no_autocast(c10::autocast_dispatch_keyset);
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  TORCH_CHECK_VALUE(o.scalar(), "fused_ce::linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum'");
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  GradCoefficients unit;
  const CountedRows rows = prepare_targets(p, o, uses_row_kernels(p), /*check=*/true, &unit);
  const Plan plan = make_plan(p, o, Pass::ForwardWithGrad, rows.counted);
  const Problem run = rows_to_run(p, plan, rows);
  if (plan.counted_rows_only) unit = unit.select_rows(rows.counted_index());
  CoefficientSource source;
  source.fixed = unit;
  auto [s, g] = forward_with_grad(vocab_shard(run, o), o, plan, source, output_mask);
  // float16's come back in float32 (loss.h): at unit scale, before the upstream gradient, float16 would
  // lose them to underflow.
  const auto [gx, gw, gb] = shaped_grads(p, g, input, linear_weight, input.scalar_type() == at::kHalf);
  const at::Tensor loss = flag_bad_targets(p, shaped_loss(run, o, plan, s, rows, p.N, target.sizes()));
  if (plan.counted_rows_only) s = every_row(p, o, rows, s);
  const auto [lse, entropy, argmax] = outputs(p, s, target.sizes());
  return {loss, lse, entropy, argmax, gx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_policy_loss_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs, const std::optional<at::Tensor>& linear_bias,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
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
  Problem p = make_problem(input, linear_weight, target, linear_bias, std::nullopt, o);
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
  const CountedRows rows = prepare_targets(p, o, uses_row_kernels(p), /*check=*/true, nullptr);
  const Plan plan = make_plan(p, o, Pass::ForwardWithGrad, rows.counted);
  const Problem run = rows_to_run(p, plan, rows);
  const auto selected = [&](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    if (!t || !t->defined()) return std::nullopt;
    const at::Tensor flat = t->reshape({p.N});
    return plan.counted_rows_only ? flat.index_select(0, rows.counted_index()) : flat;
  };
  PolicyOptions options{clip_low, clip_high, kl_coef, entropy_coef, kl_times_ratio, return_stats};
  const PolicyRows policy(run, options, *selected(advantages), selected(token_weights), selected(old_log_probs),
                          selected(ref_log_probs));
  CoefficientSource source;
  source.from_stats = [&policy](int64_t begin, int64_t end, const RowStats& s) {
    return policy.coefficients(begin, end, s);
  };
  const auto [s, g] = forward_with_grad(vocab_shard(run, o), o, plan, source, output_mask);
  const auto [gx, gw, gb] = shaped_grads(p, g, input, linear_weight, input.scalar_type() == at::kHalf);
  return {flag_bad_targets(p, policy.loss()), policy.stats(), gx, gw, gb};
}

void plan_of(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, n);
  const at::Tensor input = args[0].toTensor(), linear_weight = args[1].toTensor(), target = args[2].toTensor();
  const Pass pass = parse_pass(args[3].toStringView());
  const auto linear_bias = args[4].toOptional<at::Tensor>(), weight = args[5].toOptional<at::Tensor>();
  const LossOptions o = LossOptions::from_ivalues(args.slice(6));
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o);
  const CountedRows rows = prepare_targets(p, o, uses_row_kernels(p), /*check=*/false, nullptr);
  // (the backward from kept logits: the rows the forward's kept tensor would have)
  const int64_t kept = pass == Pass::BackwardFromLogits
                           ? kept_logit_rows(input, linear_weight, target, o).guard_int(__FILE__, __LINE__)
                           : -1;
  const Plan plan = make_plan(p, o, pass, rows.counted, kept);
  torch::jit::drop(*stack, n);
  for (auto& [name, value] : plan_fields(plan)) stack->push_back(std::move(value));
}

std::string plan_schema() {
  std::string schema =
      "_plan(Tensor input, Tensor linear_weight, Tensor target, str pass_, Tensor? linear_bias=None, "
      "Tensor? weight=None" FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) ") -> (";
  const char* separator = "";
  for (const auto& [name, value] : plan_fields(Plan{})) {
    const char* type = value.isString() ? "str" : value.isBool() ? "bool" : value.isInt() ? "int" : "float";
    schema += std::string(separator) + type + " " + name;
    separator = ", ";
  }
  return schema + ")";
}

}  // namespace fused_ce
