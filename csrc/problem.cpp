#include "problem.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "format.h"

namespace fused_ce {

namespace {

at::Tensor slice(const at::Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.narrow(0, begin, end - begin) : t;
}

at::Tensor select(const at::Tensor& t, const at::Tensor& index) {
  return t.defined() ? t.index_select(0, index) : t;
}

}  // namespace

Problem Problem::block(int64_t begin, int64_t end, const at::Tensor& gathered) const {
  Problem p = *this;
  if (!row_index.defined()) {
    p.x = x.narrow(0, begin, end - begin);
  } else if (gathered.defined()) {
    p.x = gathered.narrow(0, 0, end - begin);
    at::index_select_out(p.x, x, 0, row_index.narrow(0, begin, end - begin));
  } else {
    p.x = x.index_select(0, row_index.narrow(0, begin, end - begin));
  }
  if (teacher.x.defined()) {
    p.teacher.x = row_index.defined() ? teacher.x.index_select(0, row_index.narrow(0, begin, end - begin))
                                      : teacher.x.narrow(0, begin, end - begin);
  }
  if (low_rank.defined()) {
    p.low_rank.input = row_index.defined() ? low_rank.input.index_select(0, row_index.narrow(0, begin, end - begin))
                                           : low_rank.input.narrow(0, begin, end - begin);
  }
  p.teacher.top_indices = slice(teacher.top_indices, begin, end);
  p.teacher.top_log_probs = slice(teacher.top_log_probs, begin, end);
  p.row_index = at::Tensor();
  p.target = target.narrow(0, begin, end - begin);
  p.target_weight = slice(target_weight, begin, end);
  p.N = end - begin;
  return p;
}

Problem Problem::row_range(int64_t begin, int64_t end) const {
  if (!row_index.defined()) return block(begin, end);
  Problem p = *this;
  p.row_index = row_index.narrow(0, begin, end - begin);
  p.teacher.top_indices = slice(teacher.top_indices, begin, end);
  p.teacher.top_log_probs = slice(teacher.top_log_probs, begin, end);
  p.target = target.narrow(0, begin, end - begin);
  p.target_weight = slice(target_weight, begin, end);
  p.N = end - begin;
  return p;
}

Problem Problem::select_rows(const at::Tensor& index) const {
  Problem p = *this;
  p.row_index = row_index.defined() ? row_index.index_select(0, index) : index;
  p.teacher.top_indices = select(teacher.top_indices, index);  // ([N, k]: small, selected now)
  p.teacher.top_log_probs = select(teacher.top_log_probs, index);
  p.target = target.index_select(0, index);
  p.target_weight = select(target_weight, index);
  p.N = index.numel();
  return p;
}

Problem vocab_shard(const Problem& p, const LossOptions& o) {
  if (!o.vocab_parallel()) return p;
  Problem s = p;
  const int64_t rows = p.w.size(0);
  s.V = rows;
  s.class_weight = slice(p.class_weight, o.vocab_start, o.vocab_start + rows);
  const at::Tensor local = p.target - o.vocab_start;
  s.target = at::where(local.ge(0).logical_and_(local.lt(rows)), local, -1).contiguous();
  return s;
}

Problem Problem::cols(int64_t begin, int64_t end) const {
  Problem p = *this;
  p.w = slice(w, begin, end);
  p.bias = slice(bias, begin, end);
  p.low_rank.weight = slice(low_rank.weight, begin, end);
  p.class_weight = slice(class_weight, begin, end);
  p.V = end - begin;
  p.col_offset = col_offset + begin;
  return p;
}

GradCoefficients GradCoefficients::block(int64_t begin, int64_t end) const {
  return {slice(lse, begin, end),  slice(alpha, begin, end), slice(alpha_lse, begin, end),
          slice(beta, begin, end), slice(gamma, begin, end), slice(alpha_z, begin, end)};
}

GradCoefficients GradCoefficients::select_rows(const at::Tensor& index) const {
  return {select(lse, index),  select(alpha, index), select(alpha_lse, index),
          select(beta, index), select(gamma, index), select(alpha_z, index)};
}

GradCoefficients GradCoefficients::scaled(double s) const {
  const auto times = [s](const at::Tensor& t) { return t.defined() ? t * s : t; };
  return {lse, times(alpha), times(alpha_lse), times(beta), times(gamma), times(alpha_z)};
}

RowStats RowStats::block(int64_t begin, int64_t end) const {
  return {slice(lse, begin, end),     slice(target_gap, begin, end),
          slice(log_sum, begin, end), slice(weighted_z_sum, begin, end),
          slice(entropy, begin, end), slice(argmax, begin, end)};
}

void RowStats::copy_(const RowStats& part) const {
  lse.copy_(part.lse);
  target_gap.copy_(part.target_gap);
  log_sum.copy_(part.log_sum);
  for (const auto& [to, from] : {std::pair{weighted_z_sum, part.weighted_z_sum}, std::pair{entropy, part.entropy},
                                 std::pair{argmax, part.argmax}}) {
    if (to.defined() && from.defined()) to.copy_(from);
  }
}

StatsRequest RowStats::request() const {
  return {weighted_z_sum.defined(), entropy.defined(), argmax.defined()};
}

RowStats RowStats::allocate(const Problem& p, const StatsRequest& request) {
  const auto opts = p.x.options().dtype(loss_dtype(p));
  const auto maybe = [&](bool wanted, const at::TensorOptions& o) {
    return wanted ? at::empty({p.N}, o) : at::Tensor();
  };
  return {at::empty({p.N}, opts),       at::empty({p.N}, opts),
          at::empty({p.N}, opts),       maybe(request.weighted_sums, opts),
          maybe(request.entropy, opts), maybe(request.argmax, opts.dtype(at::kLong))};
}

at::ScalarType loss_dtype(const Problem& p) {
  return p.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void linear_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, double scale) {
  const auto dtype = out.scalar_type();
  const int64_t V = w.size(0), D = w.size(1);
  const at::Tensor x_wide = x.to(dtype);
  const int64_t elem = c10::elementSize(x.scalar_type()), wide = c10::elementSize(dtype);
  const int64_t classes =
      std::clamp<int64_t>(out.numel() * elem / std::max<int64_t>(D * wide, 1), 1, std::max<int64_t>(V, 1));
  for (int64_t v0 = 0; v0 < V; v0 += classes) {
    const int64_t n = std::min(classes, V - v0);
    at::Tensor part = out.narrow(1, v0, n);
    const at::Tensor w_wide = w.narrow(0, v0, n).to(dtype);
    if (bias.defined()) {
      at::addmm_out(part, bias.narrow(0, v0, n).to(dtype), x_wide, w_wide.t(), /*beta=*/scale, /*alpha=*/scale);
    } else {
      at::addmm_out(part, part, x_wide, w_wide.t(), /*beta=*/0, /*alpha=*/scale);  // beta 0: part is not read
    }
  }
}

void logits_into(const Problem& p, at::Tensor& out, double scale) {
  const auto dtype = out.scalar_type();
  if (dtype != p.x.scalar_type()) {
    linear_into(out, p.x, p.w, p.bias, scale);
  } else if (p.bias.defined()) {
    at::addmm_out(out, p.bias, p.x, p.w.t(), /*beta=*/scale, /*alpha=*/scale);
  } else if (scale != 1.0) {
    at::addmm_out(out, out, p.x, p.w.t(), /*beta=*/0, /*alpha=*/scale);  // beta 0: out's contents are not read
  } else {
    at::mm_out(out, p.x, p.w.t());
  }
  if (p.low_rank.defined()) {  // (.to: no copy where out has the input dtype)
    at::addmm_out(out, out, p.low_rank.input.to(dtype), p.low_rank.weight.to(dtype).t(), /*beta=*/1, scale);
  }
}

Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o) {
  const std::string& op = o.caller;  // the function called: errors name it and its argument
  TORCH_CHECK_VALUE(input.dim() >= 1, op, ": input must have at least one dimension [..., D]");
  TORCH_CHECK(linear_weight.dim() == 2, op,
              ": linear_weight must be 2-D [V, D] (K-dimensional losses with linear_weight "
              "[C, d1, ..., D] are not supported), got shape ",
              shape(linear_weight.sizes()));
  const int64_t D = input.size(-1);
  const int64_t rows = linear_weight.size(0);  // classes of this shard (all of them unless vocabulary parallel)
  const int64_t V = o.vocab_parallel() ? o.vocab_size : rows;
  TORCH_CHECK(linear_weight.size(1) == D, op, ": linear_weight ", shape(linear_weight.sizes()), " has ",
              num(linear_weight.size(1)), " features but input has ", num(D),
              "; linear_weight is laid out [V, D] (one row per class, as nn.Linear's weight)",
              linear_weight.size(0) == D ? ": pass it untransposed" : "");
  TORCH_CHECK(rows > 0, op, ": linear_weight must have at least one class (row)");
  TORCH_CHECK_VALUE(o.vocab_start + rows <= V, op, ": the vocabulary shard [", num(o.vocab_start), ", ",
                    num(o.vocab_start + rows), ") of linear_weight does not fit in vocab_size ", num(V));
  const auto dtype = input.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype) && dtype != at::kFloat8_e4m3fn, op,
              ": input must be a floating-point tensor, got ", name(dtype));
  TORCH_CHECK(linear_weight.scalar_type() == dtype, op, ": linear_weight dtype ", name(linear_weight.scalar_type()),
              " does not match input dtype ", name(dtype),
              ": cast one to the other's dtype, or call it under torch.autocast, which casts both");
  TORCH_CHECK(linear_weight.device() == input.device(), op, ": linear_weight is on ", linear_weight.device().str(),
              " but input is on ", input.device().str(), ": move them to one device");
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()), op,
              ": target must hold class indices (an integer tensor); class-probability targets "
              "are not supported");
  const auto tdtype = target.scalar_type();
  TORCH_CHECK(
      tdtype == at::kLong || tdtype == at::kInt || tdtype == at::kShort || tdtype == at::kByte || tdtype == at::kChar,
      op, ": target must be an integer tensor of class indices, got ", name(tdtype));
  TORCH_CHECK(target.device() == input.device(), op, ": target is on ", target.device().str(), " but input is on ",
              input.device().str(), ": move them to one device");
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  // A target shaped like the logits would be class probabilities in torch, which raises RuntimeError for an
  // integer one; so does this.
  std::vector<int64_t> logits_shape(batch.begin(), batch.end());
  logits_shape.push_back(V);
  TORCH_CHECK(target.sizes() != at::IntArrayRef(logits_shape), op, ": target has the shape of the logits ",
              shape(target.sizes()),
              ", which means class probabilities; those must be floating point and are not supported (class "
              "indices have the input's shape without its last dimension)");
  TORCH_CHECK_VALUE(target.sizes() == batch, op, ": target shape ", shape(target.sizes()),
                    " must equal input shape without its last dimension ", shape(batch));

  Problem p;
  p.N = D == 0 ? target.numel() : input.numel() / D;
  p.V = V;
  p.D = D;
  p.x = input.reshape({p.N, D});
  p.w = linear_weight;
  p.logit_scale = o.logit_scale;
  p.softcap = o.softcap;
  if (linear_bias && linear_bias->defined()) {
    const at::Tensor& b = *linear_bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == rows, op, ": linear_bias must have shape [", num(rows),
                "] (one per row of linear_weight), got ", shape(b.sizes()));
    TORCH_CHECK(b.scalar_type() == dtype, op, ": linear_bias dtype ", name(b.scalar_type()),
                " does not match input dtype ", name(dtype),
                ": cast one to the other's dtype, or call it under torch.autocast, which casts both");
    TORCH_CHECK(b.device() == input.device(), op, ": linear_bias is on ", b.device().str(), " but input is on ",
                input.device().str(), ": move them to one device");
    p.bias = b.contiguous();
  }
  if (weight && weight->defined()) {
    const at::Tensor& cw = *weight;
    TORCH_CHECK(cw.dim() == 1 && cw.size(0) == V, op, ": weight (class weights) must have shape [", num(V), "], got ",
                shape(cw.sizes()));
    TORCH_CHECK(at::isFloatingType(cw.scalar_type()), op, ": weight (class weights) must be floating point, got ",
                name(cw.scalar_type()));
    TORCH_CHECK(cw.device() == input.device(), op, ": weight (class weights) is on ", cw.device().str(),
                " but input is on ", input.device().str(), ": move them to one device");
    p.class_weight = cw.to(loss_dtype(p)).contiguous();
  }
  p.target = target.reshape({p.N}).to(at::kLong).contiguous();
  return p;
}

void with_low_rank(Problem& p, const at::Tensor& input, const std::optional<at::Tensor>& low_rank_input,
                   const std::optional<at::Tensor>& low_rank_weight, const LossOptions& o) {
  const std::string& op = o.caller;
  const bool has_input = low_rank_input && low_rank_input->defined();
  const bool has_weight = low_rank_weight && low_rank_weight->defined();
  TORCH_CHECK_VALUE(has_input == has_weight, op, ": low_rank_input and low_rank_weight go together (the logits' term ",
                    "low_rank_input @ low_rank_weight.T): ", has_input ? "low_rank_weight" : "low_rank_input",
                    " is missing");
  if (!has_input) return;
  const at::Tensor &u = *low_rank_input, &b = *low_rank_weight;
  TORCH_CHECK_VALUE(!o.vocab_parallel(), op, ": low_rank_input with a process_group (vocabulary parallel) is not ",
                    "supported");
  TORCH_CHECK_VALUE(b.dim() == 2 && b.size(0) == p.w.size(0), op, ": low_rank_weight must be [", num(p.w.size(0)),
                    ", r] (one row per row of linear_weight), got ", shape(b.sizes()));
  const int64_t r = b.size(1);
  std::vector<int64_t> expected(input.sizes().begin(), input.sizes().end() - 1);
  expected.push_back(r);
  TORCH_CHECK_VALUE(u.sizes() == at::IntArrayRef(expected), op, ": low_rank_input must be the input's shape with ",
                    "low_rank_weight's rank r = ", num(r), " as its last dimension ", shape(expected), ", got ",
                    shape(u.sizes()));
  for (const auto& [arg, t] :
       {std::pair<const char*, const at::Tensor&>{"low_rank_input", u}, {"low_rank_weight", b}}) {
    TORCH_CHECK(t.scalar_type() == input.scalar_type(), op, ": ", arg, " dtype ", name(t.scalar_type()),
                " does not match input dtype ", name(input.scalar_type()),
                ": cast one to the other's dtype, or call it under torch.autocast, which casts both");
    TORCH_CHECK(t.device() == input.device(), op, ": ", arg, " is on ", t.device().str(), " but input is on ",
                input.device().str(), ": move them to one device");
  }
  p.low_rank.input = u.reshape({p.N, r});
  p.low_rank.weight = b;
}

RowStats combine_row_stat_splits(const at::Tensor& partial, const at::Tensor& argmax_partial, const at::Tensor& target,
                                 const StatsRequest& request) {
  const at::Tensor m = partial[0];
  const at::Tensor m_max = std::get<0>(m.max(0));
  const at::Tensor scale = (m - m_max).exp();  // [splits, N]: each split's sums to the row max
  const at::Tensor sum = (partial[1] * scale).sum(0);
  const at::Tensor log_sum = sum.log();
  // a row holding +inf: the lse +inf (as logsumexp), the loss NaN (as torch's log_softmax) through log_sum
  const at::Tensor holds_inf = m_max == INFINITY;
  RowStats s;
  s.lse = (m_max + log_sum).masked_fill_(holds_inf, INFINITY);
  s.log_sum = log_sum.masked_fill(holds_inf, NAN);
  s.target_gap = at::where(target.ge(0), m_max - partial[2].sum(0), at::zeros({}, m_max.options()));
  if (request.weighted_sums) s.weighted_z_sum = partial[3].sum(0);
  if (request.entropy) {  // log S - T / S, each split's T moved to the row max: e^(m - M) * (t + (m - M) * s)
    const at::Tensor shift = (m - m_max).nan_to_num_(0.0, 0.0, 0.0);
    s.entropy = log_sum - (scale * (partial[4] + shift * partial[1])).sum(0) / sum;
  }
  if (request.argmax) {  // the first split holding the row max (splits are in column order)
    const at::Tensor first = m.eq(m_max).to(at::kInt).argmax(0, /*keepdim=*/true);
    s.argmax = argmax_partial.gather(0, first).squeeze(0);
  }
  return s;
}

}  // namespace fused_ce
