// The distillation pipeline's row blocks on CUDA (distillation_call.h): cuBLAS's products store a block's raw
// logits of both heads in the input dtype, the distill_rows kernel sweeps them three times
// (fused_ce/kernels/distill_rows.py: the log-sum-exps, the divergence's sums, the gradient in place of the
// student's logits), the vocabulary shards combined between the sweeps, and cuBLAS multiplies the gradient back
// through the student's head and input. Each block's logits are formed once.
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "blocks.h"
#include "cuda_driver.h"
#include "cuda_stages.h"
#include "device.h"
#include "distillation_call.h"
#include "format.h"
#include "strategies.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace distillation {
namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 16 == 0;
}

// The logits of both heads of one block (zt undefined with the teacher's top k), the kernel's row values.
struct Block {
  at::Tensor zs, zt, stats, coef, target;
};

enum Stage { kLogSumExps = 0, kSums = 1, kGradient = 2 };

void sweep(Stage stage, const Distillation& d, const Block& b) {
  const Options& o = d.o;
  const char* dtype = cuda_kernel_dtype(b.zs.scalar_type());
  const int arch = device_arch(b.zs.device().index());
  const bool aligned = aligned16(b.zs) && (!b.zt.defined() || aligned16(b.zt)) && d.V % 16 == 0;
  const KernelVariant* v = aligned ? find_variant("distill_rows", dtype, "aligned", arch) : nullptr;
  if (v == nullptr) v = find_variant("distill_rows", dtype, "general", arch);
  TORCH_CHECK(v != nullptr, kCaller, ": no distill_rows kernel for sm_", num(arch));
  const at::Tensor& zt = b.zt.defined() ? b.zt : b.zs;  // (not read without the teacher's head)
  KernelArgs args;
  args.ptr("zs_ptr", b.zs)
      .ptr("zt_ptr", zt)
      .ptr("stats_ptr", b.stats)
      .ptr("coef_ptr", b.coef)
      .ptr("tgt_ptr", b.target)
      .i64("N", b.zs.size(0))
      .i64("V", d.V)
      .i64("stride_s", b.zs.stride(0))
      .i64("stride_t", zt.stride(0))
      .f32("inv_t", static_cast<float>(1.0 / o.temperature))
      .f32("s_scale", static_cast<float>(o.student.scale))
      .f32("s_softcap", static_cast<float>(o.student.softcap.value_or(1.0)))
      .f32("t_scale", static_cast<float>(o.teacher.scale))
      .f32("t_softcap", static_cast<float>(o.teacher.softcap.value_or(1.0)))
      .f32("log_1mb", static_cast<float>(o.beta < 1.0 ? std::log1p(-o.beta) : 0.0))
      .f32("log_b", static_cast<float>(o.beta > 0.0 ? std::log(o.beta) : 0.0))
      .i32("stage", stage)
      .i32("divergence", static_cast<int32_t>(o.divergence))
      .i32("has_teacher", b.zt.defined())
      .i32("hard", o.hard_label_weight > 0.0)
      .i32("has_s_softcap", o.student.softcap.has_value())
      .i32("has_t_softcap", o.teacher.softcap.has_value());
  launch(*v, b.zs.device(), b.zs.size(0), args);
}

}  // namespace

bool uses_kernels(const Distillation& d) {
  return d.x.is_cuda() && d.acc == at::kFloat && (!d.xt.defined() || d.xt.scalar_type() == d.x.scalar_type()) &&
         device_facts(d.x).kernels;
}

Rows run_blocks_cuda(const Distillation& d, const std::optional<RowScale>& scale, std::array<bool, 3> mask) {
  const Options& o = d.o;
  const int64_t K = d.counted.numel();
  const bool with_grad = scale && (mask[0] || mask[1] || mask[2]);
  const bool teacher = d.xt.defined(), hard = o.hard_label_weight > 0.0;
  const at::Tensor target = counted_rows(d, d.target), top_idx = counted_rows(d, d.top_indices),
                   top_lp = counted_rows(d, d.top_log_probs);
  // A block: both heads' logits in the input dtype, its rows of both inputs and of dX; every rank of a group
  // takes the same blocks (its collectives must match).
  const int64_t classes = std::max<int64_t>(o.sharded() ? o.max_shard_rows : d.V, 1);
  const int64_t row_bytes = ((teacher ? 2 : 1) * classes + 2 * d.x.size(1) + (teacher ? d.xt.size(1) : 0)) *
                            static_cast<int64_t>(d.x.element_size());
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(K, o.workspace_bytes / row_bytes));
  const int64_t blocks = (K + block - 1) / block;
  const auto f32 = d.x.options().dtype(at::kFloat);
  Rows out;
  out.loss = at::empty({K}, f32);
  if (o.entropy) out.entropy = at::empty({K}, f32);
  if (with_grad) {
    if (mask[0]) out.gx = K == d.N ? at::empty_like(d.x) : at::zeros_like(d.x);
    // dW summed in the input dtype over a few blocks (as the cross-entropy ops: strategies.h), else in float32
    const bool in_input_dtype = blocks <= input_dtype_accumulations(d.x.scalar_type());
    if (mask[1]) out.gw = at::empty({d.V, d.x.size(1)}, in_input_dtype ? d.x.options() : f32);
    if (mask[2] && d.bias.defined()) out.gb = at::zeros({d.V}, f32);
  }
  // a scalar loss's factor in the products (alpha), not in the gradient blocks
  const double alpha = with_grad && !scale->rows.defined() ? scale->uniform : 1.0;
  at::Tensor ones;  // (the bias's column sums)
  const at::NoGradGuard no_grad;
  for (int64_t begin = 0; begin < K; begin += block) {
    const int64_t end = std::min(K, begin + block), k = end - begin;
    const at::Tensor xs_b = block_rows(d, d.x, begin, end);
    Block b;
    b.zs = d.bias.defined() ? at::addmm(d.bias, xs_b, d.w.t()) : at::mm(xs_b, d.w.t());
    if (teacher) {
      const at::Tensor xt_b = block_rows(d, d.xt, begin, end);
      b.zt = d.teacher_bias.defined() ? at::addmm(d.teacher_bias, xt_b, d.wt.t()) : at::mm(xt_b, d.wt.t());
    }
    // the kernel's row values (distill_rows.py): the log-sum-exps of the student at T, the teacher at T and the
    // student at T = 1 as their maxes (0..2) and log sum exp(z - max) (3..5); the divergence's and entropy's sums
    b.stats = at::zeros({9, k}, f32);
    sweep(kLogSumExps, d, b);
    const at::Tensor maxes = b.stats.slice(0, 0, 3), log_sums = b.stats.slice(0, 3, 6);
    if (o.sharded()) {  // over the shards: M = max_r m_r, log sum = log sum_r exp(m_r - M + log sum_r)
      at::Tensor top = maxes.clone();
      all_reduce_(top, "max", o.group);
      at::Tensor mass = (maxes - top).add_(log_sums).exp_();
      all_reduce_(mass, "sum", o.group);
      maxes.copy_(top);
      log_sums.copy_(mass.log_());
    }
    sweep(kSums, d, b);
    if (o.sharded()) b.stats.slice(0, 6, 9).copy_(summed_over_shards(d, b.stats.slice(0, 6, 9).clone()));
    // the student's log-probability at T of logits z1: (z1 / T - max) - log sum
    const auto log_prob_s = [&](const at::Tensor& z1) {
      return (z1 / o.temperature - b.stats[0].unsqueeze(1)) - b.stats[3].unsqueeze(1);
    };
    at::Tensor divergence =
        o.divergence == Divergence::JSD ? o.beta * b.stats[6] + (1.0 - o.beta) * b.stats[7] : b.stats[6].clone();
    // top k: this shard's columns of the k classes (0 where another shard holds one), q, the student's logits there
    // and the transform's derivative (0 where not held)
    at::Tensor top_local, q, q_mass, top_z1, top_chain;
    if (o.divergence == Divergence::TopK) {
      const TopKTeacher teacher_k = top_k_teacher(top_lp.slice(0, begin, end));
      q = teacher_k.q;
      q_mass = teacher_k.mass.squeeze(1);
      at::Tensor owned, chain;
      std::tie(top_local, owned) = local_classes(d, top_idx.slice(0, begin, end));
      top_z1 = transformed(b.zs.gather(1, top_local).to(at::kFloat), o.student, &chain);
      const at::Tensor zero = at::zeros({}, f32);
      divergence = teacher_k.neg_entropy - summed_over_shards(d, at::where(owned, q * log_prob_s(top_z1), zero).sum(1));
      top_chain = chain.defined() ? at::where(owned, chain, zero) : owned.to(at::kFloat) * o.student.scale;
    }
    at::Tensor loss = divergence * (1.0 - o.hard_label_weight);
    at::Tensor local_target;  // this shard's column of each row's label, -1 where another shard holds it
    if (hard) {
      const auto [column, owned] = local_classes(d, target.slice(0, begin, end).unsqueeze(1));
      const at::Tensor z1 = transformed(b.zs.gather(1, column).to(at::kFloat), o.student);
      const at::Tensor label_logit = summed_over_shards(d, at::where(owned, z1, at::zeros({}, f32)).squeeze(1));
      loss = loss + o.hard_label_weight * ((b.stats[2] - label_logit) + b.stats[5]);
      local_target =
          at::where(owned.squeeze(1), target.slice(0, begin, end) - o.vocab_start, at::full({}, -1, target.options()));
    }
    out.loss.slice(0, begin, end).copy_(loss);
    if (o.entropy) out.entropy.slice(0, begin, end).copy_(-b.stats[8]);
    if (!with_grad) continue;
    const at::Tensor row_scale = scale->rows.defined() ? scale->rows.slice(0, begin, end) : at::ones({k}, f32);
    // (a top-k row of -inf only has no teacher distribution: no divergence, no gradient from it)
    const at::Tensor c_divergence = row_scale * ((1.0 - o.hard_label_weight) / o.temperature);
    b.coef = at::stack({q_mass.defined() ? c_divergence * q_mass : c_divergence, row_scale * o.hard_label_weight});
    b.target = local_target.defined() ? local_target : at::full({k}, -1, d.x.options().dtype(at::kLong));
    at::Tensor top_grad;  // the gradient at the k classes, exactly (not sharded: each is a column here)
    if (q.defined() && !o.sharded()) {
      const at::Tensor c_div = b.coef[0].unsqueeze(1), c_ce = b.coef[1].unsqueeze(1);
      top_grad = c_div * (log_prob_s(top_z1).exp() - q);
      if (hard) {
        const at::Tensor label = top_local.eq(b.target.unsqueeze(1)).to(at::kFloat);
        const at::Tensor log_p1 = (top_z1 - b.stats[2].unsqueeze(1)) - b.stats[5].unsqueeze(1);
        top_grad = top_grad + c_ce * (log_p1.exp() - label);
      }
      top_grad = top_grad * top_chain;
    }
    sweep(kGradient, d, b);    // b.zs: the gradient of each row's loss times its scale
    if (top_grad.defined()) {  // minus q at the teacher's k classes: their values rounded once
      b.zs.scatter_(1, top_local, top_grad.to(b.zs.scalar_type()));
    } else if (q.defined()) {  // (shards: minus q through the transform where this shard holds the class)
      b.zs.scatter_add_(1, top_local, (-q * top_chain * b.coef[0].unsqueeze(1)).to(b.zs.scalar_type()));
    }
    if (mask[0]) {
      const at::Tensor gx_b = input_grad_rows(d, out.gx, begin, end);
      gemm_into(gx_b, b.zs, d.w, /*accumulate=*/false, alpha);
      store_input_grad(d, out.gx, gx_b, begin);
    }
    if (mask[1]) gemm_into(out.gw, b.zs.t(), xs_b, /*accumulate=*/begin > 0, alpha);
    if (out.gb.defined()) add_column_sums(out.gb, b.zs, ones, alpha);
  }
  if (with_grad && mask[1] && K == 0) out.gw.zero_();
  return out;
}

}  // namespace distillation
}  // namespace fused_ce
