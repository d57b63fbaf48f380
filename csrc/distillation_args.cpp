// linear_distillation_loss's arguments checked (errors name the argument) and its problem built (make).
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>

#include "distillation_call.h"
#include "format.h"
#include "strategies.h"

namespace fused_ce {
namespace distillation {
namespace {

void check_device(const char* name, const at::Tensor& t, const at::Tensor& input) {
  TORCH_CHECK(t.device() == input.device(), kCaller, ": ", name, " is on ", t.device().str(), " but input is on ",
              input.device().str(), ": move them to one device");
}

Transform transform(const char* prefix, double logit_scale, std::optional<double> softcap) {
  TORCH_CHECK_VALUE(std::isfinite(logit_scale) && logit_scale > 0.0, kCaller, ": ", prefix,
                    "logit_scale must be positive and finite, got ", num(logit_scale));
  TORCH_CHECK_VALUE(!softcap || (std::isfinite(*softcap) && *softcap > 0.0), kCaller, ": ", prefix,
                    "softcap must be positive and finite, got ", num(softcap.value_or(0.0)));
  return {logit_scale, softcap};
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

Distillation make(FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  Distillation d;
  Options& o = d.o;
  TORCH_CHECK_VALUE(std::isfinite(beta) && beta >= 0.0 && beta <= 1.0, kCaller, ": beta must be in [0, 1], got ",
                    num(beta));
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, kCaller,
                    ": temperature must be positive and finite, got ", num(temperature));
  TORCH_CHECK_VALUE(std::isfinite(hard_label_weight) && hard_label_weight >= 0.0 && hard_label_weight <= 1.0, kCaller,
                    ": hard_label_weight must be in [0, 1], got ", num(hard_label_weight));
  const std::string r(reduction);
  TORCH_CHECK_VALUE(r == "mean" || r == "sum" || r == "none", kCaller,
                    ": reduction must be 'mean', 'sum' or 'none', got '", r, "'");
  o.reduction = r == "mean" ? Reduction::Mean : r == "sum" ? Reduction::Sum : Reduction::None;
  o.beta = beta;
  o.temperature = temperature;
  o.hard_label_weight = hard_label_weight;
  o.entropy = return_entropy;
  o.student = transform("", logit_scale, softcap);
  o.teacher = transform("teacher_", teacher_logit_scale, teacher_softcap);
  if (workspace_bytes) {
    TORCH_CHECK_VALUE(*workspace_bytes > 0, kCaller, ": workspace_bytes must be positive, got ", num(*workspace_bytes));
    o.workspace_bytes = *workspace_bytes;
  } else {
    o.workspace_bytes = input.is_cuda() ? kDefaultCudaWorkspace : kDefaultCpuWorkspace;
  }
  o.group = std::string(process_group);
  o.vocab_start = vocab_start;
  o.max_shard_rows = max_shard_rows;

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
  d.V = linear_weight.size(0);
  TORCH_CHECK_VALUE(d.V > 0, kCaller, ": linear_weight has no classes");
  const auto rows = input.sizes().slice(0, input.dim() - 1);
  d.rows_shape = rows.vec();
  d.x = input.reshape({-1, input.size(-1)});
  d.w = linear_weight;
  d.N = d.x.size(0);
  d.acc = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto bias_of = [&](const char* argument, const OptionalTensor& b, const at::Tensor& like,
                           const char* like_name) {
    if (!b || !b->defined()) return at::Tensor();
    check_device(argument, *b, input);
    TORCH_CHECK_VALUE(b->dim() == 1 && b->size(0) == d.V, kCaller, ": ", argument, " must be [V] = [", num(d.V),
                      "], got shape ", shape(b->sizes()));
    TORCH_CHECK(b->scalar_type() == like.scalar_type(), kCaller, ": ", argument, " dtype ", name(b->scalar_type()),
                " does not match ", like_name, " dtype ", name(like.scalar_type()),
                ": cast one to the other's dtype, or call it under torch.autocast, which casts both");
    return *b;
  };
  d.bias = bias_of("linear_bias", linear_bias, input, "input");

  const bool has = [](const OptionalTensor& t) { return t && t->defined(); }(teacher_input);
  const bool top_k = teacher_top_indices && teacher_top_indices->defined();
  TORCH_CHECK_VALUE(top_k == (teacher_top_log_probs && teacher_top_log_probs->defined()), kCaller,
                    ": teacher_top_k needs both the indices and the log-probs");
  TORCH_CHECK_VALUE(top_k != has, kCaller,
                    top_k ? ": pass the teacher's top-k or its hidden states and head, not both"
                          : ": pass the teacher's hidden states and head (teacher_input, teacher_weight) or its "
                            "top-k (teacher_top_k)");
  if (top_k) {
    TORCH_CHECK_VALUE(beta == 0.0, kCaller, ": teacher_top_k gives the forward KL only (beta 0), got beta ", num(beta));
    TORCH_CHECK_VALUE(!teacher_weight || !teacher_weight->defined(), kCaller,
                      ": teacher_weight is given without teacher_input");
    o.divergence = Divergence::TopK;
    d.top_indices = top_k_rows("teacher_top_k indices", *teacher_top_indices, rows, input);
    d.top_log_probs = top_k_rows("teacher_top_k log_probs", *teacher_top_log_probs, rows, input);
    TORCH_CHECK_VALUE(d.top_indices.sizes() == d.top_log_probs.sizes(), kCaller, ": teacher_top_k's indices ",
                      shape(teacher_top_indices->sizes()), " and log_probs ", shape(teacher_top_log_probs->sizes()),
                      " differ in shape");
    TORCH_CHECK(!at::isFloatingType(d.top_indices.scalar_type()) && d.top_indices.scalar_type() != at::kBool, kCaller,
                ": teacher_top_k's indices must hold class indices (an integer dtype), got ",
                name(d.top_indices.scalar_type()));
    TORCH_CHECK(at::isFloatingType(d.top_log_probs.scalar_type()), kCaller,
                ": teacher_top_k's log_probs must be floating point, got ", name(d.top_log_probs.scalar_type()));
    d.top_indices = d.top_indices.to(at::kLong);
    d.top_log_probs = d.top_log_probs.to(d.acc);
    const int64_t classes = o.sharded() ? vocab_size : d.V;
    TORCH_CHECK_INDEX(!d.top_indices.lt(0).logical_or(d.top_indices.ge(classes)).any().item<bool>(), kCaller,
                      ": teacher_top_k holds a class index outside [0, ", num(classes), ")");
  } else {
    TORCH_CHECK_VALUE(teacher_weight && teacher_weight->defined(), kCaller,
                      ": teacher_input is given without teacher_weight");
    const at::Tensor& ti = *teacher_input;
    const at::Tensor& tw = *teacher_weight;
    TORCH_CHECK_VALUE(tw.dim() == 2, kCaller, ": teacher_weight must be 2-D [V, D_teacher], got shape ",
                      shape(tw.sizes()));
    TORCH_CHECK_VALUE(ti.dim() >= 1 && tw.size(1) == ti.size(-1), kCaller, ": teacher_weight ", shape(tw.sizes()),
                      " has ", num(tw.size(1)), " features but teacher_input has shape ", shape(ti.sizes()));
    TORCH_CHECK_VALUE(tw.size(0) == d.V, kCaller, ": teacher_weight has ", num(tw.size(0)),
                      " classes but linear_weight has ", num(d.V), ": both heads must share the vocabulary",
                      o.sharded() ? " (and its shard)" : "");
    TORCH_CHECK_VALUE(ti.sizes().slice(0, ti.dim() - 1) == rows, kCaller, ": teacher_input's rows ", shape(ti.sizes()),
                      " differ from input's ", shape(input.sizes()));
    TORCH_CHECK(at::isFloatingType(ti.scalar_type()) && ti.scalar_type() == tw.scalar_type(), kCaller,
                ": teacher_weight dtype ", name(tw.scalar_type()), " does not match teacher_input dtype ",
                name(ti.scalar_type()), "; cast one of them, or run under torch.autocast");
    check_device("teacher_input", ti, input);
    check_device("teacher_weight", tw, input);
    o.divergence = beta == 0.0 ? Divergence::ForwardKL : beta == 1.0 ? Divergence::ReverseKL : Divergence::JSD;
    d.xt = ti.reshape({-1, ti.size(-1)});
    d.wt = tw;
    d.teacher_bias = bias_of("teacher_bias", teacher_bias, ti, "teacher_input");
  }
  TORCH_CHECK_VALUE(top_k || !teacher_bias || !teacher_bias->defined() || has, kCaller,
                    ": teacher_bias is given without the teacher's head");

  TORCH_CHECK_VALUE(hard_label_weight == 0.0 || (target && target->defined()), kCaller,
                    ": hard_label_weight > 0 needs a target");
  o.ignore_index = ignore_index;
  if (target && target->defined()) {
    check_device("target", *target, input);
    TORCH_CHECK_VALUE(target->sizes() == rows, kCaller, ": target must have input's rows ", shape(rows), ", got ",
                      shape(target->sizes()));
    TORCH_CHECK(!at::isFloatingType(target->scalar_type()) && target->scalar_type() != at::kBool, kCaller,
                ": target must hold class indices (an integer dtype), got ", name(target->scalar_type()));
    d.target = target->reshape({-1}).to(at::kLong);
    const int64_t classes = o.sharded() ? vocab_size : d.V;
    const at::Tensor counted = d.target.ne(ignore_index);
    const at::Tensor bad = counted.logical_and(d.target.lt(0).logical_or(d.target.ge(classes)));
    TORCH_CHECK_INDEX(!bad.any().item<bool>(), kCaller, ": target holds a class index outside [0, ", num(classes),
                      ") that is not ignore_index (", num(ignore_index), ")");
    d.counted = counted.nonzero().reshape({-1});
  } else {
    d.counted = at::arange(d.N, d.x.options().dtype(at::kLong));
  }
  return d;
}

}  // namespace distillation
}  // namespace fused_ce
