// The problem a call solves, as 2-D tensors, with the per-row values every stage
// reads. Built once per op call (make_problem: argument checks, no device work);
// its targets are prepared once the plan is known (prepare_targets).
//
// Every stage works on the logits z = softcap(logit_scale * (x @ w.T + b)).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "options.h"

namespace fused_ce {

struct Plan;

struct Problem {
  at::Tensor x;             // [N, D], any strides
  at::Tensor w;             // [V, D], any strides
  at::Tensor bias;          // [V] or undefined
  at::Tensor class_weight;  // [V] float32 (float64 for float64 inputs) contiguous, or undefined
  at::Tensor target;        // [N] int64 contiguous; ignored rows hold -1 (prepare_targets)
  // Set where the rows were prepared on the device (cuda_prepare_rows), else undefined:
  at::Tensor target_weight;  // [N] float32: the target's class weight (1 without), 0 where ignored
  at::Tensor totals;         // [3] float32: sum of target_weight, rows counted, sum of the class weights
  // Under CUDA graph capture: the count of bad class indices ([1] int32 on the device), not read by the host;
  // the loss is made NaN where it is not 0 (loss.cpp). Undefined otherwise.
  at::Tensor unreported_bad_targets;
  double logit_scale = 1.0;
  std::optional<double> softcap;
  // V: the classes of the loss (targets, class weights, label smoothing). The
  // executors see a vocab_shard(), whose V is linear_weight's rows.
  int64_t N = 0, V = 0, D = 0;
  int64_t col_offset = 0;  // first class of w (a vocabulary slice); targets stay absolute class indices

  Problem rows(int64_t begin, int64_t end) const;  // same problem on rows [begin, end)
  Problem cols(int64_t begin, int64_t end) const;  // on classes [begin, end) of this problem's w
};

// The loss's cross-entropy term per row is target_gap + log_sum: no cancellation between large numbers
// (lse - z_target would lose everything below the lse's rounding, e.g. 2.0 instead of log 8 at logits of 2^24).
struct RowStats {
  at::Tensor lse;                                   // [N] float32: max + log_sum
  at::Tensor target_gap;                            // [N] float32: max - z[r, target] (0 where the target is ignored)
  at::Tensor log_sum;                               // [N] float32: log sum_c exp(z[r, c] - max), in [0, log V]
  at::Tensor weighted_z_sum;                        // [N] float32, with label smoothing only: sum_c cw[c] * z[r, c]
  RowStats rows(int64_t begin, int64_t end) const;  // views of rows [begin, end)
  void copy_(const RowStats& part) const;           // part's values into these (same rows)
  // Uninitialised stats of p's rows in the loss dtype; weighted_z_sum only with `weighted_sums`.
  static RowStats allocate(const Problem& p, bool weighted_sums);
};

// Per-row coefficients of the logit gradient:
//   g = logit_scale * softcap'(z) * (p * (alpha + alpha_lse * lse) - beta * onehot(target) - gamma * class_weight)
// (the z-loss term is proportional to the lse, which the fused forward only
// knows inside the kernel). `lse` may be undefined where the stage computes it.
struct GradCoefficients {
  at::Tensor lse, alpha, alpha_lse, beta, gamma;  // [N] float32 contiguous
  GradCoefficients rows(int64_t begin, int64_t end) const;
  GradCoefficients scaled(double s) const;  // the gradient times s (lse as it is)
};

// The dtype of the loss and of the ATen stages' arithmetic: float64 for float64 inputs, else float32.
at::ScalarType loss_dtype(const Problem& p);

// Checks the arguments (shapes, dtypes, devices; errors name the argument) and
// builds the 2-D problem with the raw class indices as int64. No device work.
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o);

// The problem of this rank's classes [o.vocab_start, o.vocab_start + w rows):
// V = w's rows, the class weights of those classes, targets relative to the
// first one and -1 where another shard holds them (or the row is ignored).
// Without vocabulary parallelism, p itself.
Problem vocab_shard(const Problem& p, const LossOptions& o);

// Marks ignored rows (-1) and, where the plan runs the per-row bookkeeping on
// the device, sets target_weight and totals in one launch (cuda_prepare_rows).
// With `check`, a class index outside [0, V) that is not ignore_index is an
// error: one host read; under CUDA graph capture none (check_on_device in problem.cpp). With `unit`, also the gradient
// coefficients of the scalar loss for an upstream gradient of 1.
void prepare_targets(Problem& p, const LossOptions& o, const Plan& plan, bool check, GradCoefficients* unit);

}  // namespace fused_ce
