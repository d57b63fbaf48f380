// Opt-in gradient filtering (filtered_grads.h).
#include "filtered_grads.h"

#include <cmath>

#include "blocks.h"
#include "cuda_stages.h"

namespace fused_ce {
namespace {

// Each row's threshold: eps times its coefficient of the probability (alpha + alpha_lse * lse) times the logit
// scale the stages multiply the gradient by.
at::Tensor thresholds(const Problem& pr, const GradCoefficients& c, double eps) {
  at::Tensor alpha = c.alpha.to(at::kFloat);
  if (c.alpha_lse.defined()) alpha = alpha + c.alpha_lse.to(at::kFloat) * c.lse.to(at::kFloat);
  return alpha.abs().mul_(eps * std::fabs(pr.logit_scale)).contiguous();
}

// grad_tile_mask's answer by ATen: 1 where a tile has a nonzero entry other than its row's target at or above its
// row's threshold.
at::Tensor aten_tile_mask(const at::Tensor& block, const at::Tensor& threshold, const at::Tensor& target,
                          int64_t tile_rows, int64_t tile_cols) {
  const int64_t n = block.size(0), v = block.size(1);
  const at::Tensor magnitude = block.abs().to(at::kFloat);
  at::Tensor above = magnitude.ge(threshold.unsqueeze(1)).logical_and_(magnitude.gt(0));
  const at::Tensor col = target.clamp_min(0).unsqueeze(1);
  above.scatter_(1, col, above.gather(1, col).logical_and(target.lt(0).unsqueeze(1)));
  const int64_t row_tiles = (n + tile_rows - 1) / tile_rows, col_tiles = (v + tile_cols - 1) / tile_cols;
  const at::Tensor padded =
      at::constant_pad_nd(above.to(at::kInt), {0, col_tiles * tile_cols - v, 0, row_tiles * tile_rows - n}, 0);
  return padded.view({row_tiles, tile_rows, col_tiles, tile_cols}).amax({1, 3}).contiguous();
}

// Each target's sum of the rows of x (the block's, [n, D]) times `entry` over the rows whose target it is, at that
// target's last row in target order (the others zero), and the targets in that order: added to dW in its dtype, each
// target's rows round once (not once per row, as an index_add_ of every row in that dtype would), with no host sync
// and no atomics in the sums (a float64 running sum, differenced per target: deterministic). x is only read: its
// rows are gathered into a tensor of this function's own before they are scaled. Holds n x D x (4 + 8 + 8) bytes
// at most (the scaled rows, the running sum and its values before each target's first row).
std::pair<at::Tensor, at::Tensor> sums_by_target(const at::Tensor& target, const at::Tensor& x,
                                                 const at::Tensor& entry) {
  const auto [sorted, order] = target.sort(/*stable=*/std::optional<bool>(true), 0, /*descending=*/false);
  const int64_t n = target.size(0);
  at::Tensor in_order = x.index_select(0, order).to(at::kFloat);  // (a new tensor: index_select copies)
  in_order.mul_(entry.index_select(0, order).unsqueeze(1));
  at::Tensor running = in_order.cumsum(0, at::kDouble);
  in_order.reset();
  const at::Tensor position = at::arange(n, target.options());
  const at::Tensor first = sorted.ne(at::constant_pad_nd(sorted, {1, 0}, -1).narrow(0, 0, n));
  const at::Tensor last = sorted.ne(at::constant_pad_nd(sorted, {0, 1}, -1).narrow(0, 1, n));
  const at::Tensor segment_start = std::get<0>(at::where(first, position, at::zeros_like(position)).cummax(0));
  // the running sum before each row's target's first row: at the row before it (none: 0)
  running.sub_(running.index_select(0, (segment_start - 1).clamp_min_(0)).mul_(segment_start.gt(0).unsqueeze(1)));
  return {running.mul_(last.unsqueeze(1)).to(at::kFloat), sorted};
}

// A tile mask whose row tiles are `factor` of mask's (their tiles live where any of them is): the live lists of a
// product over larger row tiles.
at::Tensor join_row_tiles(const at::Tensor& mask, int64_t factor) {
  if (factor == 1) return mask;
  const int64_t rows = (mask.size(0) + factor - 1) / factor;
  return at::constant_pad_nd(mask, {0, 0, 0, rows * factor - mask.size(0)}, 0)
      .view({rows, factor, mask.size(1)})
      .amax(1)
      .contiguous();
}

// Each row's target entry of the block where `mask` (in tiles of tile_rows x tile_cols) skips its tile, else 0: the
// term added apart from that product.
at::Tensor skipped_target_entries(const Problem& pr, const at::Tensor& block, const at::Tensor& mask, int64_t tile_rows,
                                  int64_t tile_cols) {
  const int64_t n = block.size(0);
  const at::Tensor target = pr.target.clamp_min(0);
  const at::Tensor tile =
      at::arange(n, pr.target.options()).floor_divide_(tile_rows).mul_(mask.size(1)) + target.floor_divide(tile_cols);
  const at::Tensor skipped = pr.target.ge(0).logical_and_(mask.reshape({-1}).index_select(0, tile).eq(0));
  return at::where(skipped, block.gather(1, target.unsqueeze(1)).squeeze(1).to(at::kFloat),
                   at::zeros({}, block.options().dtype(at::kFloat)));
}

// An int32 tile mask of a block of `rows` rows, zeroed: [row tiles, class tiles] of the plan's filter tile.
at::Tensor zero_tile_mask(const Problem& pr, const Plan& plan, int64_t rows) {
  const int64_t tile_rows = plan.device.constants.filter_tile_rows, tile_cols = plan.device.constants.filter_tile_cols;
  return at::zeros({(rows + tile_rows - 1) / tile_rows, (pr.V + tile_cols - 1) / tile_cols},
                   pr.x.options().dtype(at::kInt));
}

// The live tiles of each row of `mask` first, and their count.
LiveTiles live_tiles(const at::Tensor& mask) {
  return {std::get<1>(mask.sort(/*stable=*/true, 1, /*descending=*/true)).to(at::kInt).contiguous(),
          mask.sum(1, /*keepdim=*/false, at::kInt)};
}

}  // namespace

at::Tensor filter_tile_mask(const Problem& pr, const Plan& plan, const GradCoefficients& c, bool smoothing,
                            int64_t rows) {
  if (plan.strategy != Strategy::StoredLogits || pr.softcap.has_value() || smoothing || c.alpha_z.defined()) {
    return at::Tensor();
  }
  return zero_tile_mask(pr, plan, rows);
}

void filtered_block_grads(const Problem& pr, const Plan& plan, const GradCoefficients& c, double eps,
                          const at::Tensor& block, const at::Tensor& marked, const at::Tensor& gx, double input_alpha,
                          const at::Tensor& gw, bool accumulate_weight, double weight_alpha) {
  const int64_t tile_rows = plan.device.constants.filter_tile_rows, tile_cols = plan.device.constants.filter_tile_cols;
  const int64_t n = block.size(0);
  const bool kernels = plan.strategy == Strategy::StoredLogits;
  at::Tensor mask = marked;
  if (!mask.defined() && kernels) {
    mask = zero_tile_mask(pr, plan, n);
    cuda_grad_tile_mask(block, thresholds(pr, c, eps), pr.target, mask, tile_rows, tile_cols);
  } else if (!mask.defined()) {
    mask = aten_tile_mask(block, thresholds(pr, c, eps), pr.target, tile_rows, tile_cols);
  }
  // (the rows' targets, whose entries in the tiles a product skips are added apart: skipped_target_entries)
  const at::Tensor target = pr.target.clamp_min(0);
  const at::Tensor x = pr.x.to(block.scalar_type());
  at::Tensor kept;  // (ATen: the block with its skipped tiles zeroed, targets included)
  if (!kernels) {
    kept = block * mask.repeat_interleave(tile_rows, 0)
                       .repeat_interleave(tile_cols, 1)
                       .narrow(0, 0, n)
                       .narrow(1, 0, pr.V)
                       .to(block.scalar_type());
  }
  if (gx.defined()) {
    at::Tensor sum = at::empty({n, pr.D}, block.options().dtype(at::kFloat));
    // (CUDA: dX's row tiles join several of the mask's, so that a tile of W read once serves more rows)
    const int64_t rows = kernels ? cuda_sparse_grad_input_rows(block, pr.D) : tile_rows;
    const at::Tensor input_mask = join_row_tiles(mask, rows / tile_rows);
    if (kernels) {
      cuda_sparse_grad_input(block, pr.w, sum, live_tiles(input_mask), input_alpha);
    } else {
      gemm_into(sum, kept, pr.w, /*accumulate=*/false, input_alpha);
    }
    const at::Tensor target_entry = skipped_target_entries(pr, block, input_mask, rows, tile_cols);
    sum.add_(pr.w.index_select(0, target).to(at::kFloat).mul_(target_entry.unsqueeze(1)), input_alpha);
    gx.copy_(sum);
  }
  if (gw.defined()) {
    if (kernels) {
      cuda_sparse_grad_weight(block, x, gw, live_tiles(mask.t()), weight_alpha, accumulate_weight);
    } else {
      gemm_into(gw, kept.t(), x, accumulate_weight, weight_alpha);
    }
    const at::Tensor target_entry = skipped_target_entries(pr, block, mask, tile_rows, tile_cols);
    const auto [sums, targets] = sums_by_target(target, x, target_entry);
    gw.index_add_(0, targets, sums.mul_(weight_alpha).to(gw.scalar_type()));
  }
}

}  // namespace fused_ce
