// linear_distillation_loss (distillation.h): the arguments checked, the row-block pipeline.
#include "distillation.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "distillation_call.h"
#include "format.h"
#include "strategies.h"
#include "vocab_parallel.h"

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

at::Tensor counted_rows(const Distillation& d, const at::Tensor& t) {
  return !t.defined() || d.counted.numel() == d.N ? t : t.index_select(0, d.counted);
}

at::Tensor transformed(at::Tensor z, const Transform& f, at::Tensor* chain) {
  if (f.scale != 1.0) z = z * f.scale;
  if (!f.softcap) return z;
  const double c = *f.softcap;
  z = z.div(c).tanh_();
  if (chain) *chain = (1.0 - z * z) * f.scale;
  return z.mul_(c);
}

std::pair<at::Tensor, at::Tensor> local_classes(const Distillation& d, const at::Tensor& idx) {
  const at::Tensor local = idx - d.o.vocab_start;
  const at::Tensor owned = local.ge(0).logical_and(local.lt(d.V));
  return {at::where(owned, local, at::zeros({}, local.options())), owned};
}

at::Tensor summed_over_shards(const Distillation& d, at::Tensor t) {
  if (d.o.sharded()) all_reduce_(t, "sum", d.o.group);
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

namespace {

// Over the classes of every shard: each row's sum of t [k, V_shard].
at::Tensor row_sum(const Distillation& d, const at::Tensor& t) {
  return summed_over_shards(d, t.sum(1));
}

// Each row's log-sum-exp as (max, log sum exp(z - max)), [k, 1] each, over every shard's classes. A
// log-probability is (z - max) - log sum: never z - (max + log sum), which rounds the log-sum-exp to the max's
// precision (float32 at logits of 1e4 would lose the divergence's digits).
std::pair<at::Tensor, at::Tensor> lse_parts(const Distillation& d, const at::Tensor& z) {
  at::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));
  if (d.o.sharded()) all_reduce_(m, "max", d.o.group);
  return {m, summed_over_shards(d, (z - m).exp_().sum(1, true)).log_()};
}

at::Tensor log_probs(const Distillation& d, const at::Tensor& z) {
  const auto [m, log_sum] = lse_parts(d, z);
  return (z - m).sub_(log_sum);
}

// The logits of rows x of a head in acc (a product in the input dtype: torch's F.linear rounding), after the
// head's transform; with `chain`, d logits / d product (undefined where it is the constant logit_scale).
at::Tensor logits_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const Transform& f,
                     at::ScalarType acc, at::Tensor* chain = nullptr) {
  return transformed((b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t())).to(acc), f, chain);
}

struct Block {
  at::Tensor loss, entropy;  // [k], acc
  at::Tensor grad;           // [k, V], acc: d loss_row / d student product (where asked for)
};

// One block of counted rows.
Block distill_block(const Distillation& d, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& top_idx,
                    const at::Tensor& top_lp, const at::Tensor& target, bool with_grad) {
  const Options& o = d.o;
  const double T = o.temperature, w = o.hard_label_weight, b = o.beta;
  at::Tensor chain;
  const at::Tensor z1 = logits_of(xs, d.w, d.bias, o.student, d.acc, with_grad ? &chain : nullptr);
  const at::Tensor s = log_probs(d, z1 / T);
  const at::Tensor ps = s.exp();
  at::Tensor divergence, grad;  // grad: of the divergence with respect to the student's logits / T
  if (o.divergence == Divergence::TopK) {
    const TopKTeacher q = top_k_teacher(top_lp);
    auto [local, owned] = local_classes(d, top_idx);
    const at::Tensor q_owned = at::where(owned, q.q, at::zeros({}, q.q.options()));
    divergence = q.neg_entropy - row_sum(d, q_owned * s.gather(1, local));
    if (with_grad) grad = (ps * q.mass).scatter_add_(1, local, -q_owned);
  } else {
    const at::Tensor t = log_probs(d, logits_of(xt, d.wt, d.teacher_bias, o.teacher, d.acc) / T);
    const at::Tensor pt = t.exp();
    switch (o.divergence) {
      case Divergence::ForwardKL:  // sum p_t (t - s): gradient p_s - p_t
        divergence = row_sum(d, pt * (t - s));
        if (with_grad) grad = ps - pt;
        break;
      case Divergence::ReverseKL: {  // sum p_s (s - t): gradient p_s ((s - t) - KL)
        const at::Tensor gap = s - t;
        divergence = row_sum(d, ps * gap);
        if (with_grad) grad = ps * (gap - divergence.unsqueeze(1));
        break;
      }
      default: {  // log m from the log-probs; gradient (1 - beta) p_s ((s - log m) - sum p_s (s - log m))
        const at::Tensor log_m = at::logaddexp(s + std::log1p(-b), t + std::log(b));
        const at::Tensor student_gap = s - log_m;
        const at::Tensor student_kl = row_sum(d, ps * student_gap);
        divergence = b * row_sum(d, pt * (t - log_m)) + (1.0 - b) * student_kl;
        if (with_grad) grad = (1.0 - b) * ps * (student_gap - student_kl.unsqueeze(1));
        break;
      }
    }
  }
  Block out{divergence * (1.0 - w), o.entropy ? -row_sum(d, ps * s) : at::Tensor(),
            with_grad ? grad * ((1.0 - w) / T) : at::Tensor()};
  if (w > 0.0) {  // the cross-entropy of the student's own logits (at T = 1) on the label
    const auto [m, log_sum] = lse_parts(d, z1);
    auto [local, owned] = local_classes(d, target.unsqueeze(1));
    const at::Tensor zero = at::zeros({}, z1.options());
    // -log p at the label: (max - z_label) + log sum, the label's logit from the shard holding it
    const at::Tensor label_logit = row_sum(d, at::where(owned, z1.gather(1, local), zero));
    out.loss = out.loss + w * ((m.squeeze(1) - label_logit) + log_sum.squeeze(1));
    if (with_grad) {
      at::Tensor ce_grad = (z1 - m).sub_(log_sum).exp_();
      ce_grad.scatter_add_(1, local, at::where(owned, -1.0, zero).to(d.acc));
      out.grad = out.grad + w * ce_grad;
    }
  }
  if (with_grad) out.grad = chain.defined() ? out.grad * chain : out.grad * o.student.scale;
  return out;
}

}  // namespace

at::Tensor block_rows(const Distillation& d, const at::Tensor& t, int64_t begin, int64_t end) {
  if (!t.defined()) return t;
  return d.counted.numel() == d.N ? t.slice(0, begin, end) : t.index_select(0, d.counted.slice(0, begin, end));
}

at::Tensor input_grad_rows(const Distillation& d, const at::Tensor& gx, int64_t begin, int64_t end) {
  return d.counted.numel() == d.N ? gx.slice(0, begin, end) : at::empty({end - begin, gx.size(1)}, gx.options());
}

void store_input_grad(const Distillation& d, at::Tensor gx, const at::Tensor& rows, int64_t begin) {
  if (d.counted.numel() != d.N) gx.index_copy_(0, d.counted.slice(0, begin, begin + rows.size(0)), rows);
}

Rows run_blocks(const Distillation& d, const std::optional<RowScale>& scale, std::array<bool, 3> mask) {
  if (uses_kernels(d)) return run_blocks_cuda(d, scale, mask);
  const int64_t K = d.counted.numel();
  const bool with_grad = scale && (mask[0] || mask[1] || mask[2]);
  const at::Tensor target = counted_rows(d, d.target), top_idx = counted_rows(d, d.top_indices),
                   top_lp = counted_rows(d, d.top_log_probs);
  // A block's temporaries: about eight [rows, V] tensors in acc. Every rank of a group takes the same blocks
  // (its collectives must match): sized by the largest shard.
  const int64_t classes = std::max<int64_t>(d.o.sharded() ? d.o.max_shard_rows : d.V, 1);
  const int64_t row_bytes = 8 * static_cast<int64_t>(c10::elementSize(d.acc)) * classes;
  const auto rows_within = [&](int64_t bytes) {
    return std::clamp<int64_t>(bytes / row_bytes, 1, std::max<int64_t>(K, 1));
  };
  int64_t block = rows_within(d.o.workspace_bytes);
  const auto acc = d.x.options().dtype(d.acc);
  Rows out;
  out.loss = at::empty({K}, acc);
  if (d.o.entropy) out.entropy = at::empty({K}, acc);
  if (with_grad) {
    if (mask[0]) out.gx = K == d.N ? at::empty_like(d.x) : at::zeros_like(d.x);
    if (mask[1]) {
      // dW accumulated in place over the blocks: in its own dtype (float32, float64: the gradient itself), or, for
      // bfloat16 and float16 over more than one block, in a float32 accumulator where that fits in half the
      // budget (the blocks take the rest), else in the input dtype, as the cross-entropy ops (strategies.cpp)
      const int64_t float32_dw = d.V * d.x.size(1) * int64_t{sizeof(float)};
      const bool half = d.x.element_size() < 4;
      const bool float32_sum = half && cdiv(K, block) > 1 && float32_dw <= d.o.workspace_bytes / 2;
      if (float32_sum) block = rows_within(d.o.workspace_bytes - float32_dw);
      out.gw = at::zeros({d.V, d.x.size(1)}, half && !float32_sum ? d.x.options() : acc);
    }
    if (mask[2] && d.bias.defined()) out.gb = at::zeros({d.V}, acc);
  }
  const at::NoGradGuard no_grad;
  const auto rows = [](const at::Tensor& t, int64_t begin, int64_t end) {
    return t.defined() ? t.slice(0, begin, end) : t;
  };
  for (int64_t begin = 0; begin < K; begin += block) {
    const int64_t end = std::min(K, begin + block);
    const at::Tensor xs_b = block_rows(d, d.x, begin, end);
    Block r = distill_block(d, xs_b, block_rows(d, d.xt, begin, end), rows(top_idx, begin, end),
                            rows(top_lp, begin, end), rows(target, begin, end), with_grad);
    out.loss.slice(0, begin, end).copy_(r.loss);
    if (d.o.entropy) out.entropy.slice(0, begin, end).copy_(r.entropy);
    if (!with_grad) continue;
    at::Tensor& g = r.grad;  // (the block's own: scaled in place)
    if (scale->rows.defined()) {
      g.mul_(scale->rows.slice(0, begin, end).unsqueeze(1));
    } else if (scale->uniform != 1.0) {
      g.mul_(scale->uniform);
    }
    const at::Tensor g_in = g.to(d.x.scalar_type());  // the products in the input dtype, as the forward's
    if (mask[0]) {
      at::Tensor gx_b = input_grad_rows(d, out.gx, begin, end);
      at::mm_out(gx_b, g_in, d.w);
      store_input_grad(d, out.gx, gx_b, begin);
    }
    if (mask[1]) {  // in place: never a [V, D] product beside dW
      if (out.gw.scalar_type() == g_in.scalar_type()) {
        out.gw.addmm_(g_in.t(), xs_b);
      } else {
        out.gw.addmm_(g.t(), xs_b.to(out.gw.scalar_type()));  // (g: the float32 gradient, unrounded)
      }
    }
    if (out.gb.defined()) out.gb.add_(g.sum(0));
  }
  return out;
}

at::Tensor per_row(const Distillation& d, const at::Tensor& counted_values) {
  at::Tensor all = at::zeros({d.N}, counted_values.options());
  return all.index_copy_(0, d.counted, counted_values).reshape(d.rows_shape);
}

at::Tensor reduced(const Distillation& d, const at::Tensor& losses) {
  if (d.o.reduction == Reduction::None) return per_row(d, losses);
  const at::Tensor sum = losses.sum();
  if (d.o.reduction == Reduction::Sum) return sum;
  return sum / static_cast<double>(d.counted.numel());  // (no counted row: NaN, as torch's mean)
}

}  // namespace distillation
}  // namespace fused_ce
