// Opt-in gradient filtering (LossOptions::grad_filter_eps, Cut Cross-Entropy's filter_eps): in the forward with
// gradient's row blocks, the products of a block's logit gradient with W (dX) and with its rows of x (dW) skip
// each tile of it (the plan's filter tile, ArchConstants: rows of the block x classes) whose entries other than
// the rows' targets are all below the threshold, eps times the row's coefficient of the probability (times the
// stages' logit scale): p < eps for a plain loss. The targets' entries of skipped tiles are added on their own,
// so only entries below the threshold are dropped. CUDA: a tile mask from the kernel grad_tile_mask, products over
// the live tiles (sparse_grad_input, sparse_grad_weight); elsewhere the same tiles zeroed before ATen's products.
#pragma once

#include <ATen/ATen.h>

#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// The filtered products of one row block pr (its rows of x, the weight, its targets: -1 where none) of gradient
// `block` ([rows, V] in the plan's logits dtype, coefficients `c` with the rows' lse): gx (dX's rows in their dtype;
// undefined: not asked for) = input_alpha * block @ w, and gw (dW [V, D] in the plan's dW dtype; undefined: not asked
// for) += weight_alpha * block.T @ x over the live tiles (`accumulate_weight` false: the first block, written).
// `mask`: the block's tile mask where softmax_grad marked it (filter_tile_mask), else undefined (formed here).
void filtered_block_grads(const Problem& pr, const Plan& plan, const GradCoefficients& c, double eps,
                          const at::Tensor& block, const at::Tensor& mask, const at::Tensor& gx, double input_alpha,
                          const at::Tensor& gw, bool accumulate_weight, double weight_alpha);

// A zeroed tile mask for softmax_grad to mark a block of `rows` rows with (cuda_softmax_grad), where it can (CUDA's
// stored logits; a plain gradient: no softcap, smoothing or entropy term); else undefined.
at::Tensor filter_tile_mask(const Problem& pr, const Plan& plan, const GradCoefficients& c, bool smoothing,
                            int64_t rows);

}  // namespace fused_ce
