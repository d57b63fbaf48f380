// What a plan is: the passes, the strategies and the Plan's fields (plan.h makes one, strategies.h fills in its
// strategy; the executors carry it out).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "device.h"
#include "options.h"
#include "problem.h"

namespace fused_ce {

// The ops: the loss (and lse), the recomputing backward, the forward that also returns the gradients of a
// scalar loss, and the pair that keeps a per-token loss's logits from its forward for its backward (6NDV
// instead of 8NDV, for the logits' memory: Plan::keeps_logits).
enum class Pass { Forward, Backward, ForwardWithGrad, ForwardKeepingLogits, BackwardFromLogits };

enum class Strategy {
  // ATen, blocks of whole vocabulary rows, the products in the input dtype and the softmax in float32
  // (float64 for float64 inputs): the CPU path, and CUDA devices without a fitting cubin.
  AtenChunks,
  // cuBLAS writes blocks of whole vocabulary rows of logits; tile kernels reduce
  // them (logit_partials, combine_partials) and, with the gradient, turn them
  // into it in place (softmax_grad); cuBLAS multiplies that back. float16's
  // logits are stored times Plan::logits_scale, so that they do not overflow.
  StoredLogits,
  // Logit tiles from tl.dot reduced in registers (row_stats: a loss-only forward
  // with no room for cuBLAS-sized blocks) or turned into gradient blocks
  // (logit_grad: the recomputing backward).
  DotTiles,
  // 2-D tiles (block_rows x tile_cols) of cuBLAS logits turned into their
  // gradient, so dW is re-read once per block_rows rows instead of once per
  // short row block, and dX once per vocabulary slice. The backward (the lse
  // known): where that moves fewer bytes than row blocks (backward_tiles in
  // plan.cpp). Lean workspaces, forward with gradient: after a stored-logits
  // stats pass (8NDV of GEMM work instead of 6NDV).
  VocabTiles,
};

// The fields are listed once more in plan_fields (plan.cpp), which _plan's schema and fused_ce.Plan come from.
struct Plan {
  DeviceFacts device;  // what it was made for (a plan of part of its rows, by an executor, reads the same)
  Pass pass = Pass::Forward;
  Strategy strategy = Strategy::AtenChunks;
  // The executors run on the counted rows only (Problem::select_rows): each row block gathers its rows of x
  // and scatters its rows of dX (two row-sized buffers within the budget), ignored rows get exact zeros, and
  // their lse, where asked for, comes from a forward pass over them. Decided from the count the class-index
  // check reads; all rows where it is not read (CUDA graph capture) or where selecting would cost more dW
  // accumulation than it saves in rows.
  bool counted_rows_only = false;
  int64_t rows = 0;                          // rows the executors run on: the counted ones, or all
  int64_t block_rows = 0;                    // rows of logits per block
  int64_t tile_cols = 0;                     // vocabulary columns per block (V: whole rows)
  int64_t stats_block_rows = 0;              // VocabTiles: rows per block of its stats pass; else 0
  at::ScalarType logits_dtype = at::kFloat;  // of the logit blocks and the GEMMs on them (ATen: the GEMMs')
  // The dtype the logits' products are formed in: the input dtype (as torch's F.linear), but float32 on the ATen
  // path of a CPU without dot-product instructions in bfloat16 or float16 (DeviceFacts::float32_products), the
  // weight converted a vocabulary slice at a time within the workspace, and then every product of the gradient
  // in float32 too (logits_dtype), rounded once into its input-dtype result.
  at::ScalarType logits_product_dtype = at::kFloat;
  // The stored logits are the logits times this (cuBLAS's alpha): 2^-8 for float16, so that they overflow only
  // past 65504 * 2^8 = 1.7e7 instead of 65504 (relative precision unchanged; absolute error below 2^-16).
  // The kernels that read them multiply by its inverse along with logit_scale. 1 elsewhere.
  double logits_scale = 1.0;
  // Dtypes the gradients accumulate in across blocks (Undefined for the loss-only forward).
  at::ScalarType grad_input_dtype = at::ScalarType::Undefined;
  at::ScalarType grad_weight_dtype = at::ScalarType::Undefined;
  // A scalar loss's float16 gradient blocks hold the logit gradients times this power of two: at unit scale
  // (~p / N, 5e-10 at N = 16384, V = 128256) they would fall below float16's smallest subnormal before a
  // loss scaler's factor (torch.amp.GradScaler) could reach them. The coefficients are multiplied by it
  // (and by logits_scale), the dX and dW GEMMs divide it out (alpha) into float32 gradients, which the
  // backward multiplies by the upstream gradient with one rounding to float16. 1 elsewhere.
  double grad_scale = 1.0;
  // float16's scalar cross-entropy: its dW is returned in float16 times this power of two (with it, as a tensor:
  // linear_cross_entropy_with_grad), chosen from a bound on |dW| (float16_grad_weight_scale) so that it neither
  // overflows nor, at unit scale (~p / sqrt(N)), falls into float16's subnormals; the backward multiplies by the
  // upstream gradient over it in place. The dW GEMMs apply it, into float16 (grad_weight_dtype) up to
  // input_dtype_accumulations row blocks (8 left dW at 1.9x torch eager's error), else into float32 (then rounded
  // once). 0 where no bound is known (CUDA graph capture, a non-finite x, class-weighted 'sum', the ATen path): dW
  // sums at unit scale in float32, the scale then taken from its largest element. 1 elsewhere.
  double grad_weight_scale = 1.0;
  // The magnitude that scale holds float16's dW within, by the bound and by dW's largest element alike: a
  // quarter of float16's largest, room for the roundings of its partial sums.
  static constexpr double kFloat16WeightGradBound = 16384.0;
  // Label smoothing with class weights and no softcap: each row's weighted logit
  // sum comes from u = w.T @ cw (two GEMVs) instead of a class-weight load per
  // logit, which costs several % at V = 128K; with the gradient in the forward
  // (StoredLogits) its gamma term is rank one too, outside the kernel.
  bool rank_one_smoothing = false;
  bool rows_on_device = false;  // per-row bookkeeping in kernels (prepare_rows, assemble_loss)
  int64_t budget_bytes = 0;     // workspace_bytes, or the device's default
  int64_t workspace_bytes = 0;  // bytes of logit blocks (and their partials) held at once
  // Forward plans of a per-token loss: whether a differentiated call keeps its logits for the backward
  // (keeps_logits), running Pass::ForwardKeepingLogits instead; the rows kept (kept_logit_rows: of the
  // counted-first order; fewer than `rows` where only some fit), 0 where none. Pass::BackwardFromLogits:
  // the rows the kept logits hold.
  bool keeps_logits = false;
  int64_t kept_rows = 0;
  // Where the row blocks would sum bfloat16's or float16's dW in that dtype over more than
  // input_dtype_accumulations blocks (a budget without room for a float32 V x D accumulator: strategies.cpp), its
  // error growing with their square root: dW comes instead from a pass of its own over vocabulary slices of this
  // many classes (weight_grad_by_slices), each slice's summed over every row in a float32 accumulator of the slice
  // (half the budget), the row blocks forming dX (and db) alone; the logits are formed once more (8NDV, not 6NDV).
  // 0: dW from the row blocks.
  int64_t weight_grad_slice_classes = 0;
  // grad_filter_eps applies: the forward with gradient's row blocks (stored_logits, aten_chunks) multiply back
  // only their gradient's live tiles (filtered_grads.h); other plans' gradients are exact.
  bool filters_grads = false;
};

// Whether that pass returns float16's dW times a power of two (the cross-entropy's forward with gradient, not the
// policy loss's nor a distillation's: Plan::grad_weight_scale), bounded by Problem::input_abs_max, which
// prepare_targets then reads with the count.
inline bool returns_scaled_float16_weight_grad(const Problem& p, const LossOptions& o, Pass pass) {
  return pass == Pass::ForwardWithGrad && p.x.scalar_type() == at::kHalf && !o.policy_loss && !p.distills();
}

}  // namespace fused_ce
