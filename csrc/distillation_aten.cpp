// linear_distillation_loss's rows on ATen's stages (executors.h): the CPU path, and CUDA without the kernels.
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "distillation_problem.h"
#include "executors.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

// Over the classes of every shard: each row's sum of t [k, V_shard].
at::Tensor row_sum(const LossOptions& o, const at::Tensor& t) {
  return summed_over_shards(o, t.sum(1));
}

// Each row's log-sum-exp as (max, log sum exp(z - max)), [k, 1] each, over every shard's classes. A
// log-probability is (z - max) - log sum: never z - (max + log sum), which rounds the log-sum-exp to the max's
// precision (float32 at logits of 1e4 would lose the divergence's digits).
std::pair<at::Tensor, at::Tensor> lse_parts(const LossOptions& o, const at::Tensor& z) {
  at::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));
  if (o.vocab_parallel()) all_reduce_(m, "max", o.process_group);
  return {m, summed_over_shards(o, (z - m).exp_().sum(1, true)).log_()};
}

at::Tensor log_probs(const LossOptions& o, const at::Tensor& z) {
  const auto [m, log_sum] = lse_parts(o, z);
  return (z - m).sub_(log_sum);
}

// The logits of rows x of a head in acc (a product in the input dtype, torch's F.linear rounding, or in float32:
// Plan::logits_product_dtype), after the head's transform; with `chain`, d logits / d product (undefined where
// it is the constant logit_scale).
at::Tensor logits_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double scale,
                     const std::optional<double>& softcap, at::ScalarType acc, at::ScalarType product_dtype,
                     at::Tensor* chain = nullptr) {
  at::Tensor product;
  if (product_dtype != x.scalar_type()) {
    product = at::empty({x.size(0), w.size(0)}, x.options().dtype(product_dtype));
    linear_into(product, x, w, b);
  } else {
    product = b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
  }
  return transformed(product.to(acc), scale, softcap, chain);
}

struct Block {
  at::Tensor loss, entropy;  // [k], acc
  at::Tensor grad;           // [k, V], acc: d loss_row / d student product (where asked for)
};

// One block of rows (pr: the block's problem, its rows gathered).
Block distill_block(const Problem& pr, const LossOptions& o, bool with_grad, at::ScalarType product_dtype) {
  const double T = o.temperature, w = o.hard_label_weight, b = o.beta;
  const Teacher& teacher = pr.teacher;
  const at::ScalarType acc = loss_dtype(pr);
  at::Tensor chain;
  const at::Tensor z1 =
      logits_of(pr.x, pr.w, pr.bias, o.logit_scale, o.softcap, acc, product_dtype, with_grad ? &chain : nullptr);
  const at::Tensor s = log_probs(o, z1 / T);
  const at::Tensor ps = s.exp();
  at::Tensor divergence, grad;  // grad: of the divergence with respect to the student's logits / T
  if (teacher.divergence == Divergence::TopK) {
    const TopKTeacher q = top_k_teacher(teacher.top_log_probs);
    auto [local, owned] = local_classes(teacher.top_indices, o, pr.V);
    const at::Tensor q_owned = at::where(owned, q.q, at::zeros({}, q.q.options()));
    divergence = q.neg_entropy - row_sum(o, q_owned * s.gather(1, local));
    if (with_grad) grad = (ps * q.mass).scatter_add_(1, local, -q_owned);
  } else {
    const at::Tensor t = log_probs(
        o, logits_of(teacher.x, teacher.w, teacher.bias, teacher.logit_scale, teacher.softcap, acc,
                     teacher.x.scalar_type() == pr.x.scalar_type() ? product_dtype : teacher.x.scalar_type()) /
               T);
    const at::Tensor pt = t.exp();
    switch (teacher.divergence) {
      case Divergence::ForwardKL:  // sum p_t (t - s): gradient p_s - p_t
        divergence = row_sum(o, pt * (t - s));
        if (with_grad) grad = ps - pt;
        break;
      case Divergence::ReverseKL: {  // sum p_s (s - t): gradient p_s ((s - t) - KL)
        const at::Tensor gap = s - t;
        divergence = row_sum(o, ps * gap);
        if (with_grad) grad = ps * (gap - divergence.unsqueeze(1));
        break;
      }
      default: {  // log m from the log-probs; gradient (1 - beta) p_s ((s - log m) - sum p_s (s - log m))
        const at::Tensor log_m = at::logaddexp(s + std::log1p(-b), t + std::log(b));
        const at::Tensor student_gap = s - log_m;
        const at::Tensor student_kl = row_sum(o, ps * student_gap);
        divergence = b * row_sum(o, pt * (t - log_m)) + (1.0 - b) * student_kl;
        if (with_grad) grad = (1.0 - b) * ps * (student_gap - student_kl.unsqueeze(1));
        break;
      }
    }
  }
  Block out{divergence * (1.0 - w), o.return_entropy ? -row_sum(o, ps * s) : at::Tensor(),
            with_grad ? grad * ((1.0 - w) / T) : at::Tensor()};
  if (w > 0.0) {  // the cross-entropy of the student's own logits (at T = 1) on the label
    const auto [m, log_sum] = lse_parts(o, z1);
    // this shard's column of each row's label (the shard's target: -1 where another shard holds it)
    const at::Tensor owned = pr.target.ge(0).unsqueeze(1), local = pr.target.clamp_min(0).unsqueeze(1);
    const at::Tensor zero = at::zeros({}, z1.options());
    // -log p at the label: (max - z_label) + log sum, the label's logit from the shard holding it
    const at::Tensor label_logit = row_sum(o, at::where(owned, z1.gather(1, local), zero));
    out.loss = out.loss + w * ((m.squeeze(1) - label_logit) + log_sum.squeeze(1));
    if (with_grad) {
      at::Tensor ce_grad = (z1 - m).sub_(log_sum).exp_();
      ce_grad.scatter_add_(1, local, at::where(owned, -1.0, zero).to(acc));
      out.grad = out.grad + w * ce_grad;
    }
  }
  if (with_grad) out.grad = chain.defined() ? out.grad * chain : out.grad * o.logit_scale;
  return out;
}

}  // namespace

DistillationRows distillation_rows(const Problem& p, const LossOptions& o, const Plan& plan,
                                   const std::optional<RowScale>& scale, GradMask need) {
  const bool with_grad = scale && (need[0] || need[1] || need[2]);
  const auto acc = p.x.options().dtype(loss_dtype(p));
  DistillationRows out;
  out.loss = at::empty({p.N}, acc);
  if (o.return_entropy) out.entropy = at::empty({p.N}, acc);
  if (with_grad) out.grads = allocate_grads(p, plan, need);
  Grads& g = out.grads;
  at::Tensor gx_buffer;
  const at::NoGradGuard no_grad;
  for (int64_t begin = 0; begin < p.N; begin += plan.block_rows) {
    const int64_t end = std::min(p.N, begin + plan.block_rows);
    const Problem pr = p.block(begin, end);
    Block r = distill_block(pr, o, with_grad, plan.logits_product_dtype);
    out.loss.slice(0, begin, end).copy_(r.loss);
    if (o.return_entropy) out.entropy.slice(0, begin, end).copy_(r.entropy);
    if (!with_grad) continue;
    at::Tensor& grad = r.grad;  // (the block's own: scaled in place)
    if (scale->per_row.defined()) {
      grad.mul_(scale->per_row.slice(0, begin, end).unsqueeze(1));
    } else if (scale->uniform != 1.0) {
      grad.mul_(scale->uniform);
    }
    // the products in the forward's dtype: the input dtype, or float32 (gemm_into converts the weight's slices)
    const at::ScalarType product_dtype = plan.logits_product_dtype;
    const at::Tensor g_in = grad.to(product_dtype);
    if (g.input.defined()) {
      at::Tensor gx_b = input_grad_rows(p, g.input, gx_buffer, begin, end);
      gemm_into(gx_b, g_in, pr.w, /*accumulate=*/false);
      scatter_input_grad(p, g.input, gx_b, begin);
    }
    if (g.weight.defined()) {  // in place: never a [V, D] product beside dW (g: the float32 gradient, unrounded)
      gemm_into(g.weight, g.weight.scalar_type() == g_in.scalar_type() ? g_in.t() : grad.t(), pr.x.to(product_dtype),
                begin > 0);
    }
    if (g.bias.defined()) g.bias.add_(grad.sum(0));
  }
  return out;
}

}  // namespace fused_ce
