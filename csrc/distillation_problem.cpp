// linear_distillation_loss's problem (distillation_problem.h).
#include "distillation_problem.h"

#include <cmath>
#include <string>

#include "format.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

constexpr const char* kCaller = "linear_distillation_loss";

void check_device(const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK(t.device() == input.device(), kCaller, ": ", name, " is on ", t.device().str(), " but input is on ",
              input.device().str(), ": move them to one device");
}

// The rows of `t` as given ([..., k] -> [N, k]), checked against input's rows.
at::Tensor top_k_rows(const char* name, const at::Tensor& t, c10::IntArrayRef rows, const at::Tensor& input) {
  check_device(name, t, input);
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(rows.size()) + 1 && t.sizes().slice(0, rows.size()) == rows,
                    kCaller, ": ", name, " must be [..., k] with input's rows ", shape(rows), ", got shape ",
                    shape(t.sizes()));
  TORCH_CHECK_VALUE(t.size(-1) > 0, kCaller, ": ", name, " must hold at least one class per row (k >= 1), got shape ",
                    shape(t.sizes()));
  return t.reshape({-1, t.size(-1)});
}

}  // namespace

Problem make_distillation_problem(const DistillationInputs& in, const LossOptions& o) {
  const at::Tensor& input = in.input;
  const at::Tensor& linear_weight = in.linear_weight;
  const double beta = o.beta;
  Problem p;
  TORCH_CHECK_VALUE(input.dim() >= 1, kCaller, ": input must have at least one dimension, got a scalar");
  TORCH_CHECK_VALUE(linear_weight.dim() == 2, kCaller, ": linear_weight must be 2-D [V, D], got shape ",
                    shape(linear_weight.sizes()));
  TORCH_CHECK_VALUE(linear_weight.size(1) == input.size(-1), kCaller, ": linear_weight ", shape(linear_weight.sizes()),
                    " has ", num(linear_weight.size(1)), " features but input has ", num(input.size(-1)),
                    "; linear_weight is laid out [V, D] (one row per class, as nn.Linear's)");
  TORCH_CHECK(at::isFloatingType(input.scalar_type()) && input.scalar_type() == linear_weight.scalar_type(), kCaller,
              ": linear_weight dtype ", name(linear_weight.scalar_type()), " does not match input dtype ",
              name(input.scalar_type()), "; cast one of them, or run under torch.autocast");
  check_device("linear_weight", linear_weight, input);
  const int64_t shard_classes = linear_weight.size(0);
  TORCH_CHECK_VALUE(shard_classes > 0, kCaller, ": linear_weight has no classes");
  p.V = o.vocab_parallel() ? o.vocab_size : shard_classes;
  TORCH_CHECK_VALUE(o.vocab_start + shard_classes <= p.V, kCaller, ": the vocabulary shard [", num(o.vocab_start), ", ",
                    num(o.vocab_start + shard_classes), ") of linear_weight does not fit in vocab_size ", num(p.V));
  const auto rows = input.sizes().slice(0, input.dim() - 1);
  p.x = input.reshape({-1, input.size(-1)});
  p.w = linear_weight;
  p.N = p.x.size(0);
  p.D = p.x.size(1);
  p.logit_scale = o.logit_scale;
  p.softcap = o.softcap;
  const auto bias_of = [&](const char* argument, const std::optional<at::Tensor>& b, const at::Tensor& like,
                           const char* like_name) {
    if (!b || !b->defined()) return at::Tensor();
    check_device(argument, *b, input);
    TORCH_CHECK_VALUE(b->dim() == 1 && b->size(0) == shard_classes, kCaller, ": ", argument, " must be [V] = [",
                      num(shard_classes), "], got shape ", shape(b->sizes()));
    TORCH_CHECK(b->scalar_type() == like.scalar_type(), kCaller, ": ", argument, " dtype ", name(b->scalar_type()),
                " does not match ", like_name, " dtype ", name(like.scalar_type()),
                ": cast one to the other's dtype, or call it under torch.autocast, which casts both");
    return *b;
  };
  p.bias = bias_of("linear_bias", in.linear_bias, input, "input");

  Teacher& t = p.teacher;
  t.softcap = o.teacher_softcap;
  t.logit_scale = o.teacher_logit_scale;
  const bool has = in.teacher_input && in.teacher_input->defined();
  const bool top_k = in.teacher_top_indices && in.teacher_top_indices->defined();
  TORCH_CHECK_VALUE(top_k == (in.teacher_top_log_probs && in.teacher_top_log_probs->defined()), kCaller,
                    ": teacher_top_k needs both the indices and the log-probs");
  TORCH_CHECK_VALUE(top_k != has, kCaller,
                    top_k ? ": pass the teacher's top-k or its hidden states and head, not both"
                          : ": pass the teacher's hidden states and head (teacher_input, teacher_weight) or its "
                            "top-k (teacher_top_k)");
  if (top_k) {
    TORCH_CHECK_VALUE(beta == 0.0, kCaller, ": teacher_top_k gives the forward KL only (beta 0), got beta ", num(beta));
    TORCH_CHECK_VALUE(!in.teacher_weight || !in.teacher_weight->defined(), kCaller,
                      ": teacher_weight is given without teacher_input");
    t.divergence = Divergence::TopK;
    t.top_indices = top_k_rows("teacher_top_k indices", *in.teacher_top_indices, rows, input);
    t.top_log_probs = top_k_rows("teacher_top_k log_probs", *in.teacher_top_log_probs, rows, input);
    TORCH_CHECK_VALUE(t.top_indices.sizes() == t.top_log_probs.sizes(), kCaller, ": teacher_top_k's indices ",
                      shape(in.teacher_top_indices->sizes()), " and log_probs ",
                      shape(in.teacher_top_log_probs->sizes()), " differ in shape");
    TORCH_CHECK(!at::isFloatingType(t.top_indices.scalar_type()) && t.top_indices.scalar_type() != at::kBool, kCaller,
                ": teacher_top_k's indices must hold class indices (an integer dtype), got ",
                name(t.top_indices.scalar_type()));
    TORCH_CHECK(at::isFloatingType(t.top_log_probs.scalar_type()), kCaller,
                ": teacher_top_k's log_probs must be floating point, got ", name(t.top_log_probs.scalar_type()));
    t.top_indices = t.top_indices.to(at::kLong);
    t.top_log_probs = t.top_log_probs.to(loss_dtype(p));
  } else {
    TORCH_CHECK_VALUE(in.teacher_weight && in.teacher_weight->defined(), kCaller,
                      ": teacher_input is given without teacher_weight");
    const at::Tensor& ti = *in.teacher_input;
    const at::Tensor& tw = *in.teacher_weight;
    TORCH_CHECK_VALUE(tw.dim() == 2, kCaller, ": teacher_weight must be 2-D [V, D_teacher], got shape ",
                      shape(tw.sizes()));
    TORCH_CHECK_VALUE(ti.dim() >= 1 && tw.size(1) == ti.size(-1), kCaller, ": teacher_weight ", shape(tw.sizes()),
                      " has ", num(tw.size(1)), " features but teacher_input has shape ", shape(ti.sizes()));
    TORCH_CHECK_VALUE(tw.size(0) == shard_classes, kCaller, ": teacher_weight has ", num(tw.size(0)),
                      " classes but linear_weight has ", num(shard_classes), ": both heads must share the vocabulary",
                      o.vocab_parallel() ? " (and its shard)" : "");
    TORCH_CHECK_VALUE(ti.sizes().slice(0, ti.dim() - 1) == rows, kCaller, ": teacher_input's rows ", shape(ti.sizes()),
                      " differ from input's ", shape(input.sizes()));
    TORCH_CHECK(at::isFloatingType(ti.scalar_type()) && ti.scalar_type() == tw.scalar_type(), kCaller,
                ": teacher_weight dtype ", name(tw.scalar_type()), " does not match teacher_input dtype ",
                name(ti.scalar_type()), "; cast one of them, or run under torch.autocast");
    check_device("teacher_input", ti, input);
    check_device("teacher_weight", tw, input);
    t.divergence = beta == 0.0 ? Divergence::ForwardKL : beta == 1.0 ? Divergence::ReverseKL : Divergence::JSD;
    t.x = ti.reshape({-1, ti.size(-1)});
    t.w = tw;
    t.bias = bias_of("teacher_bias", in.teacher_bias, ti, "teacher_input");
  }
  TORCH_CHECK_VALUE(top_k || !in.teacher_bias || !in.teacher_bias->defined() || has, kCaller,
                    ": teacher_bias is given without the teacher's head");

  const bool labelled = in.target && in.target->defined();
  TORCH_CHECK_VALUE(o.hard_label_weight == 0.0 || labelled, kCaller, ": hard_label_weight > 0 needs a target");
  if (labelled) {
    const at::Tensor& target = *in.target;
    check_device("target", target, input);
    TORCH_CHECK_VALUE(target.sizes() == rows, kCaller, ": target must have input's rows ", shape(rows), ", got ",
                      shape(target.sizes()));
    TORCH_CHECK(!at::isFloatingType(target.scalar_type()) && target.scalar_type() != at::kBool, kCaller,
                ": target must hold class indices (an integer dtype), got ", name(target.scalar_type()));
    p.target = target.reshape({-1}).to(at::kLong).contiguous();
  } else {
    p.target = at::zeros({p.N}, p.x.options().dtype(at::kLong));
  }
  return p;
}

at::Tensor transformed(at::Tensor z, double scale, const std::optional<double>& softcap, at::Tensor* chain) {
  if (scale != 1.0) z = z * scale;
  if (!softcap) return z;
  const double c = *softcap;
  z = z.div(c).tanh_();
  if (chain) *chain = (1.0 - z * z) * scale;
  return z.mul_(c);
}

std::pair<at::Tensor, at::Tensor> local_classes(const at::Tensor& idx, const LossOptions& o, int64_t shard_classes) {
  const at::Tensor local = idx - o.vocab_start;
  const at::Tensor owned = local.ge(0).logical_and(local.lt(shard_classes));
  return {at::where(owned, local, at::zeros({}, local.options())), owned};
}

at::Tensor summed_over_shards(const LossOptions& o, at::Tensor t) {
  if (o.vocab_parallel()) all_reduce_(t, "sum", o.process_group);
  return t;
}

TopKTeacher top_k_teacher(const at::Tensor& log_probs) {
  const at::Tensor lse = at::logsumexp(log_probs, 1, true);
  const at::Tensor zero = at::zeros({}, log_probs.options());
  const at::Tensor log_q = log_probs - lse;
  // (-inf where lse is: exp gives 0, the product 0 log 0 would be NaN)
  const at::Tensor q = at::where(log_probs.eq(-INFINITY), zero, log_q.exp());
  return {q, at::where(q.gt(0), q * log_q, zero).sum(1), lse.ne(-INFINITY).to(log_probs.scalar_type())};
}

}  // namespace fused_ce
