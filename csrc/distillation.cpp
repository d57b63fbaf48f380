// linear_distillation_loss (distillation.h): the row-block pipeline (its arguments: distillation_args.cpp).
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
