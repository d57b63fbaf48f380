// The block helpers the executors (executors.h) share: the optional row stats, the gradients' storage and
// their rows, the logits of a block, stats from stored logits, GEMMs into an output and column sums.
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "options.h"
#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// Gradients of the 2-D problem ([N, D], [V, D], [V]), in the plan's
// accumulation dtypes; undefined where not asked for. With a low-rank term (Problem::low_rank, whose `grads`
// asks for both), its input's and weight's ([N, r], [V, r]) in the loss dtype, summed over the blocks.
struct Grads {
  at::Tensor input, weight, bias;
  at::Tensor low_rank_input, low_rank_weight;
};
// Which gradients are asked for: input, linear_weight, linear_bias (only with a bias).
using GradMask = std::array<bool, 3>;

// The optional row stats a call computes: label smoothing's weighted sums where
// the kernels take them (not with rank-one smoothing), the entropy and argmax where asked for.
StatsRequest stats_request(const LossOptions& o, const Plan& plan);
// The gradients asked for (the bias's only with a bias), uninitialised but for
// those that accumulate from zero; dX of selected rows (Problem::row_index) has
// every row of x, zeros where no selected row writes.
Grads allocate_grads(const Problem& p, const Plan& plan, GradMask need);
// dX's rows [r0, r1) of the problem: a view of grad_input, or, for selected rows,
// of `buffer` (allocated on first use), which scatter_input_grad then copies to
// their rows of grad_input.
at::Tensor input_grad_rows(const Problem& p, const at::Tensor& grad_input, at::Tensor& buffer, int64_t r0, int64_t r1);
void scatter_input_grad(const Problem& p, const at::Tensor& grad_input, const at::Tensor& rows, int64_t r0);
// The low-rank term's gradients from the gradient block of p's rows [r0, r0 + block rows) and the classes of pt
// (the block's problem, its classes from v0 of p's): d input += alpha * block @ weight, d weight += alpha *
// block.T @ input (selected rows: scattered to their rows). Nothing without a low-rank term.
void add_low_rank_grads(const Problem& p, const Grads& g, const Problem& pt, const at::Tensor& block, int64_t r0,
                        int64_t v0, double alpha = 1.0);
// p as the kernels over logits stored at plan.logits_scale see it (logit_scale / logits_scale).
Problem reading_stored_logits(const Problem& p, const Plan& plan);
// Row stats from blocks of `block_rows` rows of stored logits (StoredLogits, and VocabTiles' stats pass), the
// blocks in `kept` where given (forward_stats).
RowStats stats_from_stored_logits(const Problem& p, const LossOptions& o, const Plan& plan, int64_t block_rows,
                                  const at::Tensor& kept = {});
// out (+)= alpha * a @ b, accumulating in out's dtype (a float32 out from float16 or bfloat16 a and b: cuBLAS's
// float32 output where torch has it).
void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate, double alpha = 1.0);
// out += alpha * the column sums of block (the bias's gradient), `ones` a row of ones kept between calls.
void add_column_sums(at::Tensor out, const at::Tensor& block, at::Tensor& ones, double alpha = 1.0);
// float16's dW as linear_cross_entropy_with_grad returns it: (dW times a power of two in float16, that power
// ([] float32 on dW's device)) from the executors' dW, held times Plan::grad_weight_scale (`scale` > 0: in float16
// already, or in float32, then rounded once) or at unit scale in float32 (0: the power from its largest element,
// 2^14 over it rounded down).
std::pair<at::Tensor, at::Tensor> float16_weight_grad(const at::Tensor& grad_weight, double scale);

}  // namespace fused_ce
