#include "problem.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>

#include "cuda_driver.h"
#include "cuda_stages.h"
#include "format.h"
#include "loss_terms.h"
#include "plan.h"

namespace fused_ce {

Problem Problem::rows(int64_t begin, int64_t end) const {
  Problem p = *this;
  p.x = x.narrow(0, begin, end - begin);
  p.target = target.narrow(0, begin, end - begin);
  if (target_weight.defined()) p.target_weight = target_weight.narrow(0, begin, end - begin);
  p.N = end - begin;
  return p;
}

namespace {

at::Tensor slice(const at::Tensor& t, int64_t begin, int64_t end) {
  return t.defined() ? t.narrow(0, begin, end - begin) : t;
}

}  // namespace

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
  p.class_weight = slice(class_weight, begin, end);
  p.V = end - begin;
  p.col_offset = col_offset + begin;
  return p;
}

GradCoefficients GradCoefficients::rows(int64_t begin, int64_t end) const {
  return {slice(lse, begin, end), slice(alpha, begin, end), slice(alpha_lse, begin, end), slice(beta, begin, end),
          slice(gamma, begin, end)};
}

GradCoefficients GradCoefficients::scaled(double s) const {
  const auto times = [s](const at::Tensor& t) { return t.defined() ? t * s : t; };
  return {lse, times(alpha), times(alpha_lse), times(beta), times(gamma)};
}

RowStats RowStats::rows(int64_t begin, int64_t end) const {
  return {slice(lse, begin, end), slice(target_gap, begin, end), slice(log_sum, begin, end),
          slice(weighted_z_sum, begin, end)};
}

void RowStats::copy_(const RowStats& part) const {
  lse.copy_(part.lse);
  target_gap.copy_(part.target_gap);
  log_sum.copy_(part.log_sum);
  if (weighted_z_sum.defined() && part.weighted_z_sum.defined()) weighted_z_sum.copy_(part.weighted_z_sum);
}

RowStats RowStats::allocate(const Problem& p, bool weighted_sums) {
  const auto opts = p.x.options().dtype(loss_dtype(p));
  return {at::empty({p.N}, opts), at::empty({p.N}, opts), at::empty({p.N}, opts),
          weighted_sums ? at::empty({p.N}, opts) : at::Tensor()};
}

at::ScalarType loss_dtype(const Problem& p) {
  return p.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o) {
  TORCH_CHECK_VALUE(input.dim() >= 1, "linear_cross_entropy: input must have at least one dimension [..., D]");
  TORCH_CHECK(linear_weight.dim() == 2,
              "linear_cross_entropy: linear_weight must be 2-D [V, D] (K-dimensional losses with linear_weight "
              "[C, d1, ..., D] are not supported), got shape ",
              shape(linear_weight.sizes()));
  const int64_t D = input.size(-1);
  const int64_t rows = linear_weight.size(0);  // classes of this shard (all of them unless vocabulary parallel)
  const int64_t V = o.vocab_parallel() ? o.vocab_size : rows;
  TORCH_CHECK(linear_weight.size(1) == D, "linear_cross_entropy: linear_weight has ", num(linear_weight.size(1)),
              " features but input has ", num(D));
  TORCH_CHECK(rows > 0, "linear_cross_entropy: linear_weight must have at least one class (row)");
  TORCH_CHECK_VALUE(o.vocab_start + rows <= V, "linear_cross_entropy: the vocabulary shard [", num(o.vocab_start), ", ",
                    num(o.vocab_start + rows), ") of linear_weight does not fit in vocab_size ", num(V));
  const auto dtype = input.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype) && dtype != at::kFloat8_e4m3fn,
              "linear_cross_entropy: input must be a floating-point tensor, got ", name(dtype));
  TORCH_CHECK(linear_weight.scalar_type() == dtype, "linear_cross_entropy: linear_weight dtype ",
              name(linear_weight.scalar_type()), " does not match input dtype ", name(dtype));
  TORCH_CHECK(linear_weight.device() == input.device(), "linear_cross_entropy: linear_weight is on ",
              linear_weight.device().str(), " but input is on ", input.device().str());
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()),
              "linear_cross_entropy: target must hold class indices (int64 or int32); class-probability targets "
              "are not supported");
  const auto tdtype = target.scalar_type();
  TORCH_CHECK(
      tdtype == at::kLong || tdtype == at::kInt || tdtype == at::kShort || tdtype == at::kByte || tdtype == at::kChar,
      "linear_cross_entropy: target must be an integer tensor of class indices, got ", name(tdtype));
  TORCH_CHECK(target.device() == input.device(), "linear_cross_entropy: target is on ", target.device().str(),
              " but input is on ", input.device().str());
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK_VALUE(target.sizes() == batch, "linear_cross_entropy: target shape ", shape(target.sizes()),
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
    TORCH_CHECK(b.dim() == 1 && b.size(0) == rows, "linear_cross_entropy: linear_bias must have shape [", num(rows),
                "] (one per row of linear_weight), got ", shape(b.sizes()));
    TORCH_CHECK(b.scalar_type() == dtype, "linear_cross_entropy: linear_bias dtype ", name(b.scalar_type()),
                " does not match input dtype ", name(dtype));
    TORCH_CHECK(b.device() == input.device(), "linear_cross_entropy: linear_bias is on ", b.device().str(),
                " but input is on ", input.device().str());
    p.bias = b.contiguous();
  }
  if (weight && weight->defined()) {
    const at::Tensor& cw = *weight;
    TORCH_CHECK(cw.dim() == 1 && cw.size(0) == V, "linear_cross_entropy: weight (class weights) must have shape [",
                num(V), "], got ", shape(cw.sizes()));
    TORCH_CHECK(at::isFloatingType(cw.scalar_type()),
                "linear_cross_entropy: weight (class weights) must be floating point, got ", name(cw.scalar_type()));
    TORCH_CHECK(cw.device() == input.device(), "linear_cross_entropy: weight (class weights) is on ", cw.device().str(),
                " but input is on ", input.device().str());
    p.class_weight = cw.to(loss_dtype(p)).contiguous();
  }
  p.target = target.reshape({p.N}).to(at::kLong).contiguous();
  return p;
}

namespace {

// Bad class indices counted under CUDA graph capture, per device, for the next call outside capture to report.
// Allocated under capture, so each replay counts afresh: the tally is the latest replay's.
std::mutex captured_bad_mutex;
std::map<int, at::Tensor> captured_bad;
std::atomic<bool> captured_any{false};

// The class-index check of the device path. prepare_rows already made bad indices ignored rows (nothing is
// read out of bounds). Outside a CUDA graph capture: one host read of the count, an IndexError now (and,
// once anything was captured, one more read, of the captured calls' tally). Under capture, where a host read
// is not allowed: the count goes to the device's tally, for the next call outside capture to report, and is
// returned, to turn this call's loss NaN.
at::Tensor check_on_device(const Problem& p, const at::Tensor& bad, const std::function<void()>& error) {
  const int device = p.x.device().index();
  if (stream_capturing(p.x.device())) {
    std::lock_guard<std::mutex> lock(captured_bad_mutex);
    at::Tensor& tally = captured_bad[device];
    if (!tally.defined()) tally = at::zeros_like(bad);
    tally.add_(bad);
    captured_any = true;
    return bad;
  }
  if (captured_any) {
    std::lock_guard<std::mutex> lock(captured_bad_mutex);
    auto it = captured_bad.find(device);
    if (it != captured_bad.end() && it->second.item<int>() != 0) {
      it->second.zero_();
      TORCH_CHECK_INDEX(false, "linear_cross_entropy: a call replayed from a CUDA graph saw class indices outside [0, ",
                        num(p.V),
                        ") that are not ignore_index (its loss was NaN, those rows counted as ignored); "
                        "reported by the first call outside capture since");
    }
  }
  if (bad.item<int>() != 0) error();
  return at::Tensor();
}

}  // namespace

void prepare_targets(Problem& p, const LossOptions& o, const Plan& plan, bool check, GradCoefficients* unit) {
  const at::Tensor t = p.target;
  const auto bad_targets_error = [&] {
    TORCH_CHECK_INDEX(false, "linear_cross_entropy: target holds class indices outside [0, ", num(p.V),
                      ") that are not ignore_index (", num(o.ignore_index), ")");
  };
  if (plan.rows_on_device) {
    const at::Tensor bad = cuda_prepare_rows(p, t, o, unit);
    if (check) p.unreported_bad_targets = check_on_device(p, bad, bad_targets_error);
    return;
  }
  const at::Tensor ignored = t.eq(o.ignore_index);
  if (check && p.N > 0) {
    if (ignored.logical_not().logical_and_(t.lt(0).logical_or_(t.ge(p.V))).any().item<bool>()) bad_targets_error();
  }
  p.target = at::where(ignored, -1, t).contiguous();
  if (unit != nullptr) *unit = unit_grad_coefficients(p, o);
}

}  // namespace fused_ce
