// The stages every implementation provides, on a 2-D view of the problem, with
// z = softcap(logit_scale * (x @ w.T + b)):
//
//   row stats:    lse[r] = logsumexp_c z[r, c], the target's logit z[r, t_r] and, for
//                 label smoothing, sum_c cw[c] * z[r, c]                (forward)
//   logit grad:   g[r, c] = dL/dlogit[r, c] for a block of rows and columns,
//                 recomputing the logits                                (backward)
//   stats + grad: both from one evaluation of the logits of a row block
//                 (forward with gradient, scalar losses)
//
// loss.cpp turns row stats into the loss and multiplies g back through w and x;
// no stage holds more than one block of logits.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fused_ce {

struct Problem {
  at::Tensor x;             // [N, D], any strides
  at::Tensor w;             // [V, D], any strides
  at::Tensor bias;          // [V] or undefined
  at::Tensor class_weight;  // [V] float32 contiguous, or undefined
  at::Tensor target;        // [N] int64 contiguous; ignored rows hold -1
  // Set where the rows were prepared on the device (cuda_prepare_rows), else undefined:
  at::Tensor target_weight;  // [N] float32: the target's class weight (1 without), 0 where ignored
  at::Tensor totals;         // [3] float32: sum of target_weight, rows counted, sum of the class weights
  double logit_scale = 1.0;
  std::optional<double> softcap;
  int64_t N = 0, V = 0, D = 0;
  int64_t col_offset = 0;  // first class of w (a vocabulary slice); targets stay absolute class indices

  Problem rows(int64_t begin, int64_t end) const;  // same problem on rows [begin, end)
  Problem cols(int64_t begin, int64_t end) const;  // on classes [begin, end) of this problem's w
};

struct RowStats {
  at::Tensor lse;             // [N] float32
  at::Tensor target_logit;    // [N] float32 (0 where the target is ignored)
  at::Tensor weighted_z_sum;  // [N] float32, only when asked for
  RowStats rows(int64_t begin, int64_t end) const;  // views of rows [begin, end)
};

// Per-row coefficients of the logit gradient:
//   g = logit_scale * softcap'(z) * (p * (alpha + alpha_lse * lse) - beta * onehot(target) - gamma * class_weight)
// (the z-loss term is proportional to the lse, which the fused forward only
// knows inside the kernel). `lse` may be undefined where the stage computes it.
struct GradCoefficients {
  at::Tensor lse, alpha, alpha_lse, beta, gamma;  // [N] float32 contiguous
  GradCoefficients rows(int64_t begin, int64_t end) const;
};

// ATen implementations: any device, float32 arithmetic; the CPU path and the
// CUDA fallback. `max_rows` bounds the logits block held at once.
RowStats aten_row_stats(const Problem& p, bool need_weighted_z_sum, int64_t max_rows);
// Returns g for all rows of `p` and columns [v_begin, v_end), as float32
// (float64 for float64 inputs).
at::Tensor aten_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end);
// Forward with gradient: the row stats of all rows of `p` and g over the whole
// vocabulary, from one evaluation of the logits (c.lse unused).
std::pair<RowStats, at::Tensor> aten_stats_and_logit_grad(const Problem& p, const GradCoefficients& c,
                                                          bool need_weighted_z_sum);

// Triton kernels (CUDA). Return false where no embedded cubin fits the device,
// or where FUSED_CE_DISABLE_KERNELS is set (read once); the caller then falls
// back to the ATen stages.
bool cuda_kernels_disabled();
bool cuda_kernels_available(const Problem& p);
RowStats cuda_row_stats(const Problem& p, bool need_weighted_z_sum);
// Writes g (in the input dtype) for all rows of `p` and columns [v_begin, v_end)
// into `out` ([N, >= v_end - v_begin], unit column stride).
void cuda_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                     const at::Tensor& out);
// Forward over stored logits: `logits` holds the raw logits x @ w.T + b of all
// rows of `p` ([N, V], input dtype, unit column stride).
// cuda_stats_from_logits writes their row stats into `out` (contiguous [N]
// float32 views; weighted_z_sum only with need_weighted_z_sum) and leaves the
// logits as they are: logit_partials.py, then combine_partials.py.
void cuda_stats_from_logits(const Problem& p, const at::Tensor& logits, const RowStats& out, bool need_weighted_z_sum);
// cuda_softmax_grad then overwrites the logits with g, given the rows' lse
// (c.lse unused); `p` may be a vocabulary slice (Problem::cols) of the rows.
// With gamma_terms false the kernel leaves out the gamma term (zero without
// label smoothing; added by the caller otherwise).
void cuda_softmax_grad(const Problem& p, const GradCoefficients& c, const at::Tensor& lse, const at::Tensor& logits,
                       bool gamma_terms);
// Device memory per row of a block of stored logits: the logits and the partials.
int64_t cuda_logits_row_bytes(const Problem& p);

// Prologue (prepare_rows.py): from the raw int64 class indices `target` ([N],
// contiguous), sets p.target (ignored rows -1), p.target_weight and p.totals,
// and with `unit` the gradient coefficients of a scalar loss (mean or sum) for
// an upstream gradient of 1. Returns the count of class indices outside
// [0, V) that are not ignore_index ([1] int32 on the device; reading it syncs).
at::Tensor cuda_prepare_rows(Problem& p, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
                             double z_loss, bool mean, GradCoefficients* unit);
// Epilogue (assemble_loss.py): the loss from the row stats of a problem that
// cuda_prepare_rows prepared; reduction 0 = 'none' ([N]), 1 = 'mean', 2 = 'sum' ([1]).
at::Tensor cuda_assemble_loss(const Problem& p, const RowStats& s, double label_smoothing, double z_loss,
                              int reduction);

// grad *= scale (a one-element float32 tensor on grad's device), in place, with
// the embedded kernel that skips the pass when scale is 1. False where it does
// not apply (no cubin, non-contiguous grad, ...): the caller multiplies instead.
bool cuda_scale_(const at::Tensor& grad, const at::Tensor& scale);

}  // namespace fused_ce
