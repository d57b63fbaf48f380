// The stages as embedded Triton kernels (fused_ce/kernels/, one file each),
// launched on torch's current stream (cuda_driver.h). A StatsRequest (or the
// RowStats given) says which optional row statistics a stage computes; `smoothing`
// whether a gradient stage has label smoothing's gamma term.
#pragma once

#include <ATen/ATen.h>

#include "options.h"
#include "problem.h"

namespace fused_ce {

// Prologue (prepare_rows.py): from the raw int64 class indices `target` ([N],
// contiguous), sets p.target (ignored rows -1), p.target_weight and p.totals,
// with `unit` the gradient coefficients of a scalar loss (mean or sum) for an
// upstream gradient of 1, and with `order` the rows in the executors' order (the
// counted ones, then the ignored ones: targets.h). Returns its counts
// (PrepareRowsArgs::Counts: the class indices outside [0, V) that are not
// ignore_index, the counted rows; int32 on the device; reading it syncs).
at::Tensor cuda_prepare_rows(Problem& p, const at::Tensor& target, const LossOptions& o, GradCoefficients* unit,
                             at::Tensor* order);
// Epilogue (assemble_loss.py): the loss from the row stats of a problem that
// cuda_prepare_rows prepared: [N] for 'none', [1] otherwise.
at::Tensor cuda_assemble_loss(const Problem& p, const RowStats& s, const LossOptions& o);

// Row stats from tl.dot logit tiles reduced in registers (row_stats.py).
RowStats cuda_row_stats(const Problem& p, const StatsRequest& request);
// Writes g (in the input dtype) for all rows of `p` and columns [v_begin, v_end)
// into `out` ([N, >= v_end - v_begin], unit column stride), recomputing the
// logits with tl.dot (logit_grad.py).
void cuda_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                     const at::Tensor& out);

// Over stored logits: `logits` holds the raw logits x @ w.T + b of all rows of
// `p` ([N, V], input dtype, unit column stride).
// cuda_stats_from_logits writes their row stats into `out` (contiguous [N]
// float32 views, the optional ones where defined) and leaves the logits as they
// are: logit_partials.py, then combine_partials.py.
void cuda_stats_from_logits(const Problem& p, const at::Tensor& logits, const RowStats& out);
// cuda_softmax_grad overwrites them with g, given the rows' lse (c.lse unused);
// `p` may be a vocabulary slice (Problem::cols) of the rows (softmax_grad.py). With `filter_mask` (zeros, as
// cuda_grad_tile_mask's `mask`; not with the softcap, smoothing or the entropy's term) it also marks the tiles
// cuda_grad_tile_mask would at grad_filter_eps `filter_eps`, while the gradient is on chip (the flavor filter).
void cuda_softmax_grad(const Problem& p, const GradCoefficients& c, const at::Tensor& lse, const at::Tensor& logits,
                       bool smoothing, const at::Tensor& filter_mask = at::Tensor(), double filter_eps = 0.0);

// linear_distillation_loss's block (distillation_cuda.cpp): the raw logits of p's student head and of its
// teacher's ([k, V] in the input dtype; zt undefined with the teacher's top k), the kernel's row values
// (stats [9, k] float32: the log-sum-exps as maxes and log sums, the divergence's and entropy's sums), each row's
// gradient coefficients (coef [2, k] float32: the divergence's and the label's) and this shard's column of its
// label (target [k] int64, -1 where none here).
struct DistillBlock {
  at::Tensor zs, zt, stats, coef, target;
};
enum class DistillSweep { LogSumExps = 0, Sums = 1, Gradient = 2 };
// One sweep of distill_rows.py over the block: the log-sum-exps, the divergence's and entropy's sums, or the
// gradient of each row's loss in place of zs.
void cuda_distill_rows(DistillSweep sweep, const Problem& p, const LossOptions& o, const DistillBlock& b);

// grad_filter_eps (filtered_grads.h) on a block's gradient g ([N, V], its stored logits turned into it, unit column
// stride) in tiles of tile_rows x tile_cols (cuda_grad_tiles.cpp). cuda_grad_tile_mask writes `mask` ([cdiv(N,
// tile_rows), cdiv(V, tile_cols)] int32, contiguous): 1 where a tile has an entry other than its row's target
// (`target` [N] int64, -1: none) with |g| >= the row's `threshold` ([N] float32), else 0.
void cuda_grad_tile_mask(const at::Tensor& g, const at::Tensor& threshold, const at::Tensor& target,
                         const at::Tensor& mask, int64_t tile_rows, int64_t tile_cols);
// Per row of a tile mask (or of its transpose): the indices of its live tiles first (int32 [rows, tiles]) and how
// many there are (int32 [rows]).
struct LiveTiles {
  at::Tensor index, count;
};
// out ([N, D] float32) = alpha * g @ w over the tiles of g live in its row tiles' lists (w [V, D]); its row tiles are
// cuda_sparse_grad_input_rows(g, D) rows (a multiple of the mask's: their lists joined, join_row_tiles).
int64_t cuda_sparse_grad_input_rows(const at::Tensor& g, int64_t D);
void cuda_sparse_grad_input(const at::Tensor& g, const at::Tensor& w, const at::Tensor& out, const LiveTiles& live,
                            double alpha);
// dw ([V, D] float32 or g's dtype) += alpha * g.T @ x over the tiles of g live in its vocabulary tiles' lists
// (x [N, D]); `accumulate` false: written instead (tiles with no live tile zeroed).
void cuda_sparse_grad_weight(const at::Tensor& g, const at::Tensor& x, const at::Tensor& dw, const LiveTiles& live,
                             double alpha, bool accumulate);

// grad *= scale ([] float32 on grad's device) in place by the scale kernel (scale.py), which reads scale on the
// device and returns at once when it is 1; false where it does not apply (no cubin, a non-contiguous grad).
bool cuda_scale_(const at::Tensor& grad, const at::Tensor& scale);

}  // namespace fused_ce
