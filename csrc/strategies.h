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
// Row blocks whose dW sums may be added in the input dtype: at D = 4096, V = 128256
// in bf16, 8 such additions leave dW's error 1.35x torch's single rounding, 16 leave 2x;
// float16's grow faster (1.33x after 3 additions, 1.57x after 6: benchmarks/results/2026-12-01/
// accuracy_per_token_s10_first.md), so it adds 4 at most.
inline int64_t input_dtype_accumulations(at::ScalarType dtype) {
  return dtype == at::kHalf ? 4 : 8;
}
// Whether dW may sum over `blocks` row blocks of `rows` rows in all in the input dtype. bf16's error grows with the
// rows summed against the classes as well as with the blocks: a row adds its target's x to its class's dW row, so
// where each class holds several targets its running sum is rounded, at full size, once per block (one H100/H200:
// 8 blocks at 0.128 rows a class 1.35x torch's single rounding; 4 at 0.255 1.56x, 8 at 0.255 1.69x; emulated at
// V = 32000: 4 blocks at 1.02 rows a class 1.56x, 8 at 2.05 2.0x; benchmarks/LOG.md, step 62). So bf16 sums in
// bf16 over 2 blocks at most (~1.2x), or up to input_dtype_accumulations where rows <= kInputDtypeRowsPerClass x
// classes; float16 up to its input_dtype_accumulations.
constexpr double kInputDtypeRowsPerClass = 0.13;
inline bool sums_weight_grad_in_input_dtype(at::ScalarType dtype, int64_t blocks, int64_t rows, int64_t classes) {
  if (blocks > input_dtype_accumulations(dtype)) return false;
  return dtype == at::kHalf || blocks <= 2 || static_cast<double>(rows) <= kInputDtypeRowsPerClass * classes;
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
