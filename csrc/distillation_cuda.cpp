// linear_distillation_loss's rows on the embedded kernels (executors.h, Strategy::StoredLogits): cuBLAS's
// products store a block's raw logits of both heads in the input dtype, the distill_rows kernel sweeps them three
// times (cuda_distill_rows: the log-sum-exps, the divergence's sums, the gradient in place of the student's
// logits), the vocabulary shards combined between the sweeps, and cuBLAS multiplies the gradient back through the
// student's head and input. Each block's logits are formed once.
#include <ATen/core/grad_mode.h>

#include <tuple>
#include <utility>

#include "cuda_stages.h"
#include "distillation_problem.h"
#include "executors.h"
#include "vocab_parallel.h"

namespace fused_ce {

DistillationRows distillation_rows_from_kernels(const Problem& p, const LossOptions& o, const Plan& plan,
                                                const std::optional<RowScale>& scale, GradMask need) {
  const bool with_grad = scale && (need[0] || need[1] || need[2]);
  const bool teacher = p.teacher.x.defined(), hard = o.hard_label_weight > 0.0;
  const auto f32 = p.x.options().dtype(at::kFloat);
  DistillationRows out;
  out.loss = at::empty({p.N}, f32);
  if (o.return_entropy) out.entropy = at::empty({p.N}, f32);
  if (with_grad) out.grads = allocate_grads(p, plan, need);
  Grads& g = out.grads;
  at::Tensor gx_buffer;
  // a scalar loss's factor in the products (alpha), not in the gradient blocks
  const double alpha = with_grad && !scale->per_row.defined() ? scale->uniform : 1.0;
  at::Tensor ones;  // (the bias's column sums)
  const at::NoGradGuard no_grad;
  for (int64_t begin = 0; begin < p.N; begin += plan.block_rows) {
    const int64_t end = std::min(p.N, begin + plan.block_rows), k = end - begin;
    const Problem pr = p.block(begin, end);
    DistillBlock b;
    b.zs = pr.bias.defined() ? at::addmm(pr.bias, pr.x, pr.w.t()) : at::mm(pr.x, pr.w.t());
    if (teacher) {
      const Teacher& t = pr.teacher;
      b.zt = t.bias.defined() ? at::addmm(t.bias, t.x, t.w.t()) : at::mm(t.x, t.w.t());
    }
    // the kernel's row values (distill_rows.py): the log-sum-exps of the student at T, the teacher at T and the
    // student at T = 1 as their maxes (0..2) and log sum exp(z - max) (3..5); the divergence's and entropy's sums
    b.stats = at::zeros({9, k}, f32);
    cuda_distill_rows(DistillSweep::LogSumExps, pr, o, b);
    const at::Tensor maxes = b.stats.slice(0, 0, 3), log_sums = b.stats.slice(0, 3, 6);
    if (o.vocab_parallel()) {  // over the shards: M = max_r m_r, log sum = log sum_r exp(m_r - M + log sum_r)
      at::Tensor top = maxes.clone();
      all_reduce_(top, "max", o.process_group);
      at::Tensor mass = (maxes - top).add_(log_sums).exp_();
      all_reduce_(mass, "sum", o.process_group);
      maxes.copy_(top);
      log_sums.copy_(mass.log_());
    }
    cuda_distill_rows(DistillSweep::Sums, pr, o, b);
    if (o.vocab_parallel()) b.stats.slice(0, 6, 9).copy_(summed_over_shards(o, b.stats.slice(0, 6, 9).clone()));
    // the student's log-probability at T of logits z1: (z1 / T - max) - log sum
    const auto log_prob_s = [&](const at::Tensor& z1) {
      return (z1 / o.temperature - b.stats[0].unsqueeze(1)) - b.stats[3].unsqueeze(1);
    };
    at::Tensor divergence = p.teacher.divergence == Divergence::JSD ? o.beta * b.stats[6] + (1.0 - o.beta) * b.stats[7]
                                                                    : b.stats[6].clone();
    // top k: this shard's columns of the k classes (0 where another shard holds one), q, the student's logits there
    // and the transform's derivative (0 where not held)
    at::Tensor top_local, q, q_mass, top_z1, top_chain;
    if (p.teacher.divergence == Divergence::TopK) {
      const TopKTeacher teacher_k = top_k_teacher(pr.teacher.top_log_probs);
      q = teacher_k.q;
      q_mass = teacher_k.mass.squeeze(1);
      at::Tensor owned, chain;
      std::tie(top_local, owned) = local_classes(pr.teacher.top_indices, o, p.V);
      top_z1 = transformed(b.zs.gather(1, top_local).to(at::kFloat), o.logit_scale, o.softcap, &chain);
      const at::Tensor zero = at::zeros({}, f32);
      divergence = teacher_k.neg_entropy - summed_over_shards(o, at::where(owned, q * log_prob_s(top_z1), zero).sum(1));
      top_chain = chain.defined() ? at::where(owned, chain, zero) : owned.to(at::kFloat) * o.logit_scale;
    }
    at::Tensor loss = divergence * (1.0 - o.hard_label_weight);
    // this shard's column of each row's label (the shard's target), -1 where another shard holds it
    const at::Tensor local_target = pr.target;
    if (hard) {
      const at::Tensor owned = local_target.ge(0).unsqueeze(1);
      const at::Tensor z1 =
          transformed(b.zs.gather(1, local_target.clamp_min(0).unsqueeze(1)).to(at::kFloat), o.logit_scale, o.softcap);
      const at::Tensor label_logit = summed_over_shards(o, at::where(owned, z1, at::zeros({}, f32)).squeeze(1));
      loss = loss + o.hard_label_weight * ((b.stats[2] - label_logit) + b.stats[5]);
    }
    out.loss.slice(0, begin, end).copy_(loss);
    if (o.return_entropy) out.entropy.slice(0, begin, end).copy_(-b.stats[8]);
    if (!with_grad) continue;
    const at::Tensor row_scale = scale->per_row.defined() ? scale->per_row.slice(0, begin, end) : at::ones({k}, f32);
    // (a top-k row of -inf only has no teacher distribution: no divergence, no gradient from it)
    const at::Tensor c_divergence = row_scale * ((1.0 - o.hard_label_weight) / o.temperature);
    b.coef = at::stack({q_mass.defined() ? c_divergence * q_mass : c_divergence, row_scale * o.hard_label_weight});
    b.target = hard ? local_target : at::full({k}, -1, local_target.options());
    at::Tensor top_grad;  // the gradient at the k classes, exactly (not sharded: each is a column here)
    if (q.defined() && !o.vocab_parallel()) {
      const at::Tensor c_div = b.coef[0].unsqueeze(1), c_ce = b.coef[1].unsqueeze(1);
      top_grad = c_div * (log_prob_s(top_z1).exp() - q);
      if (hard) {
        const at::Tensor label = top_local.eq(b.target.unsqueeze(1)).to(at::kFloat);
        const at::Tensor log_p1 = (top_z1 - b.stats[2].unsqueeze(1)) - b.stats[5].unsqueeze(1);
        top_grad = top_grad + c_ce * (log_p1.exp() - label);
      }
      top_grad = top_grad * top_chain;
    }
    cuda_distill_rows(DistillSweep::Gradient, pr, o, b);  // b.zs: each row's loss's gradient times its scale
    if (top_grad.defined()) {  // minus q at the teacher's k classes: their values rounded once
      b.zs.scatter_(1, top_local, top_grad.to(b.zs.scalar_type()));
    } else if (q.defined()) {  // (shards: minus q through the transform where this shard holds the class)
      b.zs.scatter_add_(1, top_local, (-q * top_chain * b.coef[0].unsqueeze(1)).to(b.zs.scalar_type()));
    }
    if (g.input.defined()) {
      const at::Tensor gx_b = input_grad_rows(p, g.input, gx_buffer, begin, end);
      gemm_into(gx_b, b.zs, pr.w, /*accumulate=*/false, alpha);
      scatter_input_grad(p, g.input, gx_b, begin);
    }
    if (g.weight.defined()) gemm_into(g.weight, b.zs.t(), pr.x, /*accumulate=*/begin > 0, alpha);
    if (g.bias.defined()) add_column_sums(g.bias, b.zs, ones, alpha);
  }
  return out;
}

}  // namespace fused_ce
