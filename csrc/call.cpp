#include "call.h"

#include <limits>
#include <utility>

#include "loss_terms.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

// A loss computed under CUDA graph capture with bad class indices (Problem::unreported_bad_targets) is NaN.
at::Tensor flag_bad_targets(const Problem& p, const at::Tensor& loss) {
  if (!p.unreported_bad_targets.defined()) return loss;
  const at::Tensor nan = at::full({}, std::numeric_limits<double>::quiet_NaN(), loss.options());
  return at::where(p.unreported_bad_targets.gt(0).reshape({}), nan, loss);
}

// values ([K, ...]) of the rows `index` of N rows, `fill` elsewhere (index_copy_: deterministic).
at::Tensor expand_rows(const at::Tensor& values, const at::Tensor& index, int64_t N, double fill) {
  at::Tensor out = at::full({N}, fill, values.options());
  return out.index_copy_(0, index, values);
}

// The row stats of every row of p from the counted rows' (`counted`): the ignored rows' lse, where asked for
// (lse_of_ignored_rows), from a forward pass over them; their other stats 0 (the argmax -1: outputs()).
RowStats every_row(const Problem& p, const LossOptions& o, const DeviceFacts& device, const CountedRows& rows,
                   const RowStats& counted) {
  const at::Tensor index = rows.counted_index();
  const auto expand = [&](const at::Tensor& t) { return t.defined() ? expand_rows(t, index, p.N, 0.0) : t; };
  RowStats s{expand(counted.lse),     expand(counted.target_gap),
             expand(counted.log_sum), expand(counted.weighted_z_sum),
             expand(counted.entropy), expand(counted.argmax)};
  if (o.lse_of_ignored_rows && rows.counted < p.N) {
    const at::Tensor ignored_index = rows.ignored_index();
    const Problem ignored = p.select_rows(ignored_index);
    const Plan plan = make_plan(ignored, o, device, Pass::Forward);
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

// The rows a call that keeps its logits runs on, in the order of the kept rows (_linear_cross_entropy_keeping_logits):
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

}  // namespace

Call::Call(const LossInputs& in, LossOptions loss_options, Pass pass, const Targets& targets, int64_t kept,
           bool every_row)
    : options(std::move(loss_options)),
      problem(make_problem(in.input, in.linear_weight, in.target, in.linear_bias, in.weight, options)),
      target_shape_(in.target.sizes().vec()),
      input_shape_(in.input.sizes().vec()),
      input_dtype_(in.input.scalar_type()),
      weight_dtype_(in.linear_weight.scalar_type()) {
  with_low_rank(problem, in.input, in.low_rank_input, in.low_rank_weight, options);
  if (problem.low_rank.defined()) low_rank_shape_ = in.low_rank_input->sizes().vec();
  prepare(pass, targets, kept, every_row);
}

Call::Call(Problem made, LossOptions loss_options, Pass pass, const Targets& targets, at::IntArrayRef row_shape,
           const at::Tensor& input, at::ScalarType weight_dtype)
    : options(std::move(loss_options)),
      problem(std::move(made)),
      target_shape_(row_shape.vec()),
      input_shape_(input.sizes().vec()),
      input_dtype_(input.scalar_type()),
      weight_dtype_(weight_dtype) {
  prepare(pass, targets, -1, false);
}

void Call::prepare(Pass pass, const Targets& targets, int64_t kept, bool every_row) {
  const bool kept_pass = pass == Pass::ForwardKeepingLogits || pass == Pass::BackwardFromLogits;
  const DeviceFacts device = device_facts(problem.x);
  CountedRows prepared;
  if (targets.given) {
    prepared =
        prepare_targets(problem, options, device, targets.check, targets.unit,
                        /*order_under_capture=*/kept_pass, returns_scaled_float16_weight_grad(problem, options, pass));
  } else {
    prepared.counted = problem.N;
    prepared.order = at::arange(problem.N, problem.target.options());
  }
  if (problem.teacher.top_indices.defined()) check_teacher_classes(problem, options);
  if (kept_pass) {
    counted_rows = kept_rows(problem, prepared);
    run = kept_run(problem, prepared, counted_rows);
    plan = make_plan(run, options, device, pass, -1, kept);
  } else {
    counted_rows = prepared;
    plan = make_plan(problem, options, device, pass, every_row ? -1 : counted_rows.counted);
    run = plan.counted_rows_only ? problem.select_rows(counted_rows.counted_index()) : problem;
  }
}

GradCoefficients Call::of_run(const GradCoefficients& c) const {
  return run.row_index.defined() ? c.select_rows(counted_rows.counted_index()) : c;
}

std::optional<at::Tensor> Call::of_run(const std::optional<at::Tensor>& t) const {
  if (!t || !t->defined()) return std::nullopt;
  const at::Tensor flat = t->reshape({problem.N});
  return run.row_index.defined() ? flat.index_select(0, counted_rows.counted_index()) : flat;
}

at::Tensor Call::loss(const RowStats& run_stats) const {
  return flag_bad_targets(problem, shaped_loss(run, options, plan, run_stats, counted_rows, problem.N, target_shape_));
}

at::Tensor Call::flagged(const at::Tensor& loss) const {
  return flag_bad_targets(problem, loss);
}

at::Tensor Call::per_target(const at::Tensor& run_rows) const {
  std::vector<int64_t> shape{run_rows.size(0)};
  shape.insert(shape.end(), target_shape_.begin(), target_shape_.end());
  if (!plan.counted_rows_only) return run_rows.reshape(shape);
  at::Tensor all = at::zeros({run_rows.size(0), problem.N}, run_rows.options());
  return all.index_copy_(1, counted_rows.counted_index(), run_rows).reshape(shape);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Call::outputs(const RowStats& run_stats) const {
  return fused_ce::outputs(
      problem, plan.counted_rows_only ? every_row(problem, options, plan.device, counted_rows, run_stats) : run_stats,
      target_shape_);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Call::grads(const Grads& g, bool keep_dtypes) const {
  const auto to = [&](const at::Tensor& t, at::ScalarType dtype) { return keep_dtypes ? t : t.to(dtype); };
  const auto none = [&] { return at::empty({0}, problem.x.options()); };
  return {g.input.defined() ? to(g.input, input_dtype_).reshape(input_shape_) : none(),
          g.weight.defined() ? to(g.weight, weight_dtype_) : none(),
          g.bias.defined() ? to(g.bias, problem.bias.scalar_type()) : none()};
}

std::tuple<at::Tensor, at::Tensor> Call::low_rank_grads(const Grads& g, bool keep_dtypes) const {
  if (!g.low_rank_input.defined()) return {at::empty({0}, problem.x.options()), at::empty({0}, problem.x.options())};
  const auto to = [&](const at::Tensor& t) { return keep_dtypes ? t : t.to(input_dtype_); };
  return {to(g.low_rank_input).reshape(low_rank_shape_), to(g.low_rank_weight)};
}

}  // namespace fused_ce
