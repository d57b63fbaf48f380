// What a call will do, decided in one place (make_plan) from the problem, the
// options, the device and the workspace budget; the executors (executors.h)
// carry it out and decide nothing. torch.ops.fused_ce._plan shows it to Python
// (fused_ce.plan), so tests and benchmarks see the path a call takes.
#pragma once

#include <ATen/ATen.h>

#include "options.h"
#include "problem.h"

namespace fused_ce {

// The three ops: the loss (and lse), the recomputing backward, and the forward
// that also returns the gradients of a scalar loss.
enum class Pass { Forward, Backward, ForwardWithGrad };

enum class Strategy {
  // ATen in float32 (float64 for float64 inputs), blocks of whole vocabulary
  // rows: the CPU path, and CUDA devices without a fitting cubin.
  AtenChunks,
  // cuBLAS writes blocks of whole vocabulary rows of logits; tile kernels reduce
  // them (logit_partials, combine_partials) and, with the gradient, turn them
  // into it in place (softmax_grad); cuBLAS multiplies that back.
  StoredLogits,
  // Logit tiles from tl.dot reduced in registers (row_stats) or turned into
  // gradient blocks (logit_grad): nothing stored in the input dtype (float16,
  // whose stored logits could overflow), or no room for cuBLAS-sized blocks.
  DotTiles,
  // Lean workspaces, forward with gradient: a stored-logits stats pass, then
  // 2-D tiles (block_rows x tile_cols) of recomputed logits turned into their
  // gradient, so dW is re-read once per block_rows rows instead of once per
  // short row block (8NDV of GEMM work instead of 6NDV).
  VocabTiles,
};

struct Plan {
  Pass pass = Pass::Forward;
  Strategy strategy = Strategy::AtenChunks;
  int64_t block_rows = 0;                    // rows of logits per block
  int64_t tile_cols = 0;                     // vocabulary columns per block (V: whole rows)
  int64_t stats_block_rows = 0;              // VocabTiles: rows per block of its stats pass; else 0
  at::ScalarType logits_dtype = at::kFloat;  // of the logit blocks and the GEMMs on them
  // Dtypes the gradients accumulate in across blocks (Undefined for the loss-only forward).
  at::ScalarType grad_input_dtype = at::ScalarType::Undefined;
  at::ScalarType grad_weight_dtype = at::ScalarType::Undefined;
  // Label smoothing with class weights and no softcap: each row's weighted logit
  // sum comes from u = w.T @ cw (two GEMVs) instead of a class-weight load per
  // logit, which costs several % at V = 128K; with the gradient in the forward
  // (StoredLogits) its gamma term is rank one too, outside the kernel.
  bool rank_one_smoothing = false;
  bool rows_on_device = false;  // per-row bookkeeping in kernels (prepare_rows, assemble_loss)
  int64_t budget_bytes = 0;     // workspace_bytes, or the device's default
  int64_t workspace_bytes = 0;  // bytes of logit blocks (and their partials) held at once
};

Plan make_plan(const Problem& p, const LossOptions& o, Pass pass);

// Whether the autograd formula computes a scalar loss's gradients in its forward
// (Pass::ForwardWithGrad, for an upstream gradient of 1, scaled in the backward)
// instead of in its backward (Pass::Backward, the upstream gradient in the
// coefficients, as torch's cross-entropy has it). Not for float16: at unit scale
// the logit gradients of a mean over N rows (~p / N) fall below float16's
// smallest subnormal (6e-8) at N = 16384, V = 128256, before a loss scaler's
// factor (torch.amp.GradScaler) could lift them, so dW's rows for all but the
// target classes would come out zero. On CUDA its forward with gradient took
// the 8NDV tl.dot path anyway, as the two passes do.
bool gradients_in_forward(at::ScalarType input_dtype, const LossOptions& o);

const char* strategy_name(Strategy s);
Pass parse_pass(c10::string_view name);

}  // namespace fused_ce
