// What plan.cpp and strategies.cpp share: the budgets and constants of the plan, and the strategies of each
// pass (plan_types.h says what a plan is).
#pragma once

#include <cstdint>

#include "options.h"
#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// 2048 rows of logits at V = 128256 (1024 at V = 256000) in bf16, so that the
// whole workspace stays under 0.5 GiB.
constexpr int64_t kDefaultCudaWorkspace = int64_t{504} << 20;
constexpr int64_t kDefaultCpuWorkspace = int64_t{32} << 20;
// Row blocks whose dW sums may be added in the input dtype. Each addition rounds a class's running sum at its full
// size, and how that error compares with torch's single rounding depends on how a class's sum builds up across the
// blocks, which no count of rows or classes bounds: 6 bf16 additions left dW at 1.26-1.74x torch eager's error on
// uniform, Zipf 1.0 (text's frequencies), unigram-prior and std-2 logits, 8 at the Llama-3-8B shape 1.41x
// (benchmarks/LOG.md, step 63). bf16 adds 2 blocks at most (the first block's sum rounded once more: 1.03-1.21x on
// those distributions, within the 1.5x the float32 sum keeps); float16, whose mantissa has 3 more bits and
// whose torch eager error is its underflowing logit gradient's, 4 (1.33x after 3 additions, 1.57x after 6:
// benchmarks/results/2026-12-01/accuracy_per_token_s10_first.md).
inline int64_t input_dtype_accumulations(at::ScalarType dtype) {
  return dtype == at::kHalf ? 4 : 2;
}
inline bool sums_weight_grad_in_input_dtype(at::ScalarType dtype, int64_t blocks) {
  return blocks <= input_dtype_accumulations(dtype);
}
// Vocabulary slices of the backward (backward_tiles): at most this many, their dX summed in float32.
constexpr int64_t kMaxSlices = 8;
// A per-token loss keeps some rows' logits (kept_logit_rows) only where at least this many fit: fewer save
// less than their block's GEMMs lose to their few rows.
constexpr int64_t kMinKeptRows = 512;
// logit_partials' partials per row at its smallest segments (3 floats per 1024 columns)
constexpr int64_t kPartialBytesPer1024Columns = 3 * sizeof(float);

inline int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The plan's strategy, blocks, dtypes and workspace: the ATen path's (CPU, and CUDA devices without a fitting
// cubin), and the embedded kernels'.
void plan_aten_chunks(Plan& plan, const Problem& p, const LossOptions& o, bool selected);
void plan_kernels(Plan& plan, const Problem& p, const LossOptions& o, bool selected);
// A distillation's (Problem::distills) blocks (distillation_strategy.cpp): the distill_rows kernel's over stored
// logits of both heads (StoredLogits) where the device has the kernels and the heads share a dtype, else ATen's
// (AtenChunks).
void plan_distillation(Plan& plan, const Problem& p, const LossOptions& o);
// The fewest classes of Plan::weight_grad_slice_classes (where the vocabulary has them).
constexpr int64_t kMinWeightGradSliceClasses = 16;

}  // namespace fused_ce
