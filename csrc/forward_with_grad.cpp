// Pass::ForwardWithGrad: the row stats and the gradients of a scalar loss from
// one evaluation of the logits where the strategy allows (6NDV flops, not 8NDV).
#include <algorithm>
#include <tuple>

#include "aten_stages.h"
#include "cuda_stages.h"
#include "executors.h"
#include "filtered_grads.h"
#include "loss_terms.h"
#include "plan.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

// x.T @ gamma over the rows whose gamma is not 0, a block of rows at a time: a row left out (an ignored
// one) must not bring in a NaN or inf of its own (0 * NaN is NaN).
at::Tensor counted_rows_t_times(const Problem& p, const at::Tensor& gamma, int64_t block_rows, at::ScalarType dtype) {
  at::Tensor sum = at::zeros({p.D}, p.x.options().dtype(at::kFloat));
  for (int64_t r0 = 0; r0 < p.N; r0 += block_rows) {
    const int64_t r1 = std::min(p.N, r0 + block_rows);
    const at::Tensor g = gamma.narrow(0, r0, r1 - r0);
    const at::Tensor xr = p.block(r0, r1).x.to(dtype).masked_fill(g.eq(0).unsqueeze(1), 0);
    sum.add_(at::mv(xr.t(), g.to(dtype)));
  }
  return sum.to(dtype);
}

// Blocks of whole vocabulary rows (StoredLogits, AtenChunks): each row's
// gradient is final once its block is done, so dX is written once; dW
// accumulates over blocks in the plan's dtype.
std::pair<RowStats, Grads> row_blocks(const Problem& p, const LossOptions& o, const Plan& plan,
                                      const CoefficientSource& c, GradMask need) {
  const bool stored_logits = plan.strategy == Strategy::StoredLogits;
  const auto gemm_dtype = plan.logits_dtype;
  const double unscale = 1.0 / plan.grad_scale;  // the gradient blocks' scale, divided out by the GEMMs
  // dW's own scale (float16's, Plan::grad_weight_scale; 0: none yet, unit scale) applied by its GEMMs
  const double weight_alpha = plan.grad_weight_scale > 0 ? plan.grad_weight_scale * unscale : unscale;
  Grads g = allocate_grads(p, plan, need);
  // With rank-one smoothing the kernel leaves out its terms:
  // dX -= logit_scale * gamma (x) u, dW -= logit_scale * cw (x) (x.T @ gamma),
  // db -= logit_scale * cw * sum(gamma), and the weighted logit sums come from u.
  const bool rank_one = plan.rank_one_smoothing;
  const bool smoothing_in_kernel = o.smoothing() && !rank_one;
  const StatsRequest request = stats_request(o, plan);
  RowStats s = RowStats::allocate(p, request);
  const at::Tensor& w = p.w;  // (never converted whole: gemm_into converts slices where dtypes differ)
  at::Tensor u, neg_gamma;
  if (rank_one) {  // (rank-one smoothing: the cross-entropy's fixed coefficients)
    u = class_weighted_w(p);
    neg_gamma = c.fixed.gamma * -p.logit_scale;  // [N] float32
    s.weighted_z_sum = weighted_z_sum(p, u);
    if (need[1]) {
      g.weight.copy_(
          at::outer(p.class_weight.to(gemm_dtype), counted_rows_t_times(p, neg_gamma, plan.block_rows, gemm_dtype)));
    }
    if (need[2]) g.bias.add_(p.class_weight * neg_gamma.sum());
  }
  // grad_filter_eps: the products over the gradient's live tiles (filtered_grads.h)
  const bool filter = plan.filters_grads;
  const int64_t rows = plan.block_rows;
  at::Tensor logits_buffer = stored_logits ? at::empty({rows, p.V}, p.x.options().dtype(gemm_dtype)) : at::Tensor();
  at::Tensor gx_buffer, ones;
  const Problem stored = reading_stored_logits(p, plan);
  for (int64_t r0 = 0; r0 < p.N; r0 += rows) {
    const int64_t r1 = std::min(p.N, r0 + rows);
    const Problem pr = stored.block(r0, r1);
    const RowStats block_stats = s.block(r0, r1);
    at::Tensor block, filter_mask;
    GradCoefficients cr;  // (the block's, with its lse)
    if (stored_logits) {
      block = logits_buffer.narrow(0, 0, r1 - r0);
      logits_into(pr, block, plan.logits_scale);
      cuda_stats_from_logits(pr, block, block_stats);
      if (o.vocab_parallel()) combine_vocab_shards(pr, block_stats, o);
      cr = c.block(r0, r1, block_stats);
      // (grad_filter_eps: the tile mask marked in the same pass, where the kernel can)
      filter_mask = filter ? filter_tile_mask(pr, plan, cr, smoothing_in_kernel, r1 - r0) : at::Tensor();
      cuda_softmax_grad(pr, cr, block_stats.lse, block, smoothing_in_kernel, filter_mask, o.grad_filter_eps);
    } else if (o.vocab_parallel() || c.needs_stats()) {  // the stats (over all shards) before the gradient: the
                                                         // logits twice (CPU)
      const RowStats part = aten_row_stats(pr, request, r1 - r0, plan.logits_product_dtype);
      block_stats.copy_(part);
      if (o.vocab_parallel()) combine_vocab_shards(pr, block_stats, o);
      cr = c.block(r0, r1, block_stats);
      cr.lse = block_stats.lse;
      block = aten_logit_grad(pr, cr, 0, p.V, plan.logits_product_dtype).to(gemm_dtype);
    } else {
      RowStats part;
      cr = c.fixed.block(r0, r1);
      std::tie(part, block) = aten_stats_and_logit_grad(pr, cr, request, plan.logits_product_dtype);
      block = block.to(gemm_dtype);
      block_stats.copy_(part);
    }
    cr.lse = block_stats.lse;
    at::Tensor gx = need[0] ? input_grad_rows(p, g.input, gx_buffer, r0, r1) : at::Tensor();
    if (filter) {
      filtered_block_grads(pr, plan, cr, o.grad_filter_eps, block, filter_mask, gx, unscale,
                           need[1] ? g.weight : at::Tensor(), r0 > 0, weight_alpha);
    } else {
      if (need[0] && rank_one) {
        at::addmm_out(gx, at::outer(neg_gamma.narrow(0, r0, r1 - r0).to(gemm_dtype), u), block, w);
      } else if (need[0]) {
        gemm_into(gx, block, w, /*accumulate=*/false, unscale);
      }
      if (need[1]) gemm_into(g.weight, block.t(), pr.x.to(gemm_dtype), r0 > 0 || rank_one, weight_alpha);
    }
    if (need[0]) scatter_input_grad(p, g.input, gx, r0);
    if (need[2]) add_column_sums(g.bias, block, ones, unscale);
    add_low_rank_grads(p, g, pr, block, r0, 0, unscale);
  }
  return {s, g};
}

// VocabTiles: the row stats from blocks of whole rows as in the loss-only
// forward, then per 2-D tile the logits again, their gradient in place and its
// products with W and X.
std::pair<RowStats, Grads> vocab_tiles(const Problem& p, const LossOptions& o, const Plan& plan,
                                       const CoefficientSource& c, GradMask need) {
  const RowStats s = stats_from_stored_logits(p, o, plan, plan.stats_block_rows);
  if (o.vocab_parallel()) combine_vocab_shards(p, s, o);
  const int64_t rows = plan.block_rows, cols = plan.tile_cols;
  Grads g = allocate_grads(p, plan, need);
  const at::Tensor buffer = at::empty({rows * cols}, p.x.options());
  at::Tensor ones;
  for (int64_t r0 = 0; r0 < p.N; r0 += rows) {
    const int64_t r1 = std::min(p.N, r0 + rows);
    const Problem pr = p.block(r0, r1);
    const GradCoefficients cr = c.block(r0, r1, s.block(r0, r1));
    const at::Tensor lse = s.lse.narrow(0, r0, r1 - r0);
    for (int64_t v0 = 0; v0 < p.V; v0 += cols) {
      const int64_t v1 = std::min(p.V, v0 + cols);
      const Problem pt = pr.cols(v0, v1);
      at::Tensor block = buffer.narrow(0, 0, pt.N * pt.V).view({pt.N, pt.V});  // contiguous, also the last slice
      logits_into(pt, block);
      cuda_softmax_grad(pt, cr, lse, block, o.smoothing());
      if (need[0]) gemm_into(g.input.narrow(0, r0, r1 - r0), block, pt.w, v0 > 0);
      if (need[1]) gemm_into(g.weight.narrow(0, v0, v1 - v0), block.t(), pr.x, r0 > 0);
      if (need[2]) add_column_sums(g.bias.narrow(0, v0, v1 - v0), block, ones);
      add_low_rank_grads(p, g, pt, block, r0, v0);
    }
  }
  return {s, g};
}

}  // namespace

std::pair<RowStats, Grads> forward_with_grad(const Problem& p, const LossOptions& o, const Plan& plan,
                                             const CoefficientSource& unit, GradMask need) {
  need[2] = need[2] && p.bias.defined();
  if (p.N == 0) return {RowStats::allocate(p, stats_request(o, plan)), allocate_grads(p, plan, need)};  // zeros
  // The kernels multiply the gradient by logit_scale / logits_scale (reading_stored_logits): so the
  // coefficients take grad_scale * logits_scale for gradient blocks at grad_scale.
  const double coefficient_scale = plan.grad_scale * plan.logits_scale;
  CoefficientSource c = unit;
  if (coefficient_scale != 1.0) {
    if (c.needs_stats()) {
      c.from_stats = [&unit, coefficient_scale](int64_t b, int64_t e, const RowStats& s) {
        return unit.from_stats(b, e, s).scaled(coefficient_scale);
      };
    } else {
      c.fixed = unit.fixed.scaled(coefficient_scale);
    }
  }
  switch (plan.strategy) {
    case Strategy::StoredLogits:
    case Strategy::AtenChunks: return row_blocks(p, o, plan, c, need);
    case Strategy::VocabTiles: return vocab_tiles(p, o, plan, c, need);
    case Strategy::DotTiles: break;
  }
  TORCH_CHECK(false, "fused_ce: the forward with gradient has no executor for strategy ", strategy_name(plan.strategy));
  return {};
}

}  // namespace fused_ce
