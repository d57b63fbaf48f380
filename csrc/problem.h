// The problem a call solves, as 2-D tensors, with the per-row values every stage
// reads. Built once per op call (make_problem: argument checks, no device work);
// its targets are prepared next (prepare_targets, targets.h), and the executors may
// run on its counted rows only (select_rows).
//
// Every stage works on the logits z = softcap(logit_scale * (x @ w.T + b)).
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <optional>

#include "options.h"

namespace fused_ce {

// A distillation's divergence (linear_distillation_loss: ops/distillation.cpp says what each is).
enum class Divergence { None, ForwardKL, ReverseKL, JSD, TopK };

// The teacher of a distillation (make_distillation_problem): its head's rows beside the problem's own (selected
// with them), or its top k classes' log-probabilities. Divergence::None (no teacher) in every other op's problem.
struct Teacher {
  Divergence divergence = Divergence::None;
  at::Tensor x;                           // [N, D_teacher] (the rows of the problem's own x: row_index too)
  at::Tensor w, bias;                     // [V, D_teacher], [V] or undefined
  at::Tensor top_indices, top_log_probs;  // offline, instead: [N, k] int64 (global classes), [N, k] loss dtype
  std::optional<double> softcap;          // its logits' transform
  double logit_scale = 1.0;
};

// A low-rank term of the logits: z = x @ w.T + input @ weight.T (+ b). LoRA's on the head, its dropout and scale
// already in `input` (s * dropout(x) @ A.T, formed by autograd outside the op), so that no V x D sum W + s B A is
// ever formed. Its gradients (d input = G weight, d weight = G.T input) come beside dX and dW.
struct LowRank {
  at::Tensor input;   // [N, r], rows as x's (row_index selects them too); undefined: no low-rank term
  at::Tensor weight;  // [V, r]
  bool grads = true;  // whether the executors form its gradients (not weight_grad_by_slices' passes, dW's alone)
  bool defined() const { return input.defined(); }
};

struct Problem {
  // [N, D], any strides; where rows are selected (row_index), the source rows [N_source, D]
  at::Tensor x;
  at::Tensor w;             // [V, D], any strides
  at::Tensor bias;          // [V] or undefined
  at::Tensor class_weight;  // [V] in the loss dtype (loss_dtype) contiguous, or undefined
  at::Tensor target;        // [N] int64 contiguous; ignored rows hold -1 (prepare_targets)
  // The rows of x this problem is about ([N] int64, ascending), where they are a selection (select_rows):
  // block() gathers them; undefined where x holds the rows themselves.
  at::Tensor row_index;
  // Set where the rows were prepared on the device (cuda_prepare_rows), else undefined:
  at::Tensor target_weight;  // [N] float32: the target's class weight (1 without), 0 where ignored
  at::Tensor totals;  // float32 prepare_rows' totals (PrepareRowsArgs::Totals: target weights, counted, class weights)
  // Under CUDA graph capture: the count of bad class indices ([1] int32 on the device), not read by the host;
  // the loss is made NaN where it is not 0 (ops/cross_entropy.cpp). Undefined otherwise.
  at::Tensor unreported_bad_targets;
  // The largest |x| over every row, read with the targets' count where asked for (prepare_targets: float16's
  // forward with gradient, whose dW scale it bounds, Plan::grad_weight_scale); NaN where not read.
  double input_abs_max = std::numeric_limits<double>::quiet_NaN();
  // A class-weighted mean's row coefficients, read with input_abs_max: bounds on a counted row's |logit gradient|
  // over float16_logit_grad_bound, the largest row's and their sum over the rows (1 and 1 for an unweighted mean),
  // from the class weights and prepare_rows' totals; float16's scales take them (strategies.cpp). NaN where not
  // read (under CUDA graph capture the scales take 1 and 1, which class weights of both signs summing near 0, or
  // smoothing over counted rows whose weights are far below the classes', can exceed).
  double coefficient_max = std::numeric_limits<double>::quiet_NaN();
  double coefficient_sum = std::numeric_limits<double>::quiet_NaN();
  double logit_scale = 1.0;
  std::optional<double> softcap;
  // V: the classes of the loss (targets, class weights, label smoothing). The
  // executors see a vocab_shard(), whose V is linear_weight's rows.
  int64_t N = 0, V = 0, D = 0;
  int64_t col_offset = 0;  // first class of w (a vocabulary slice); targets stay absolute class indices
  Teacher teacher;         // a distillation's (linear_distillation_loss)
  LowRank low_rank;        // the cross-entropy ops' low_rank_input and low_rank_weight (with_low_rank)

  bool distills() const { return teacher.divergence != Divergence::None; }

  // The same problem on rows [begin, end): views, or, for selected rows, their x gathered (contiguous; into
  // `gathered`, [>= end - begin, D] in x's dtype, where given).
  Problem block(int64_t begin, int64_t end, const at::Tensor& gathered = {}) const;
  // Rows [begin, end) as a problem of their own, to be run in blocks: views, or the selection's range.
  Problem row_range(int64_t begin, int64_t end) const;
  Problem cols(int64_t begin, int64_t end) const;  // on classes [begin, end) of this problem's w
  // The problem of rows `index` ([K] int64 of this problem's rows, ascending): targets and target weights
  // selected now, x gathered block by block (block()).
  Problem select_rows(const at::Tensor& index) const;
};

// The loss's cross-entropy term per row is target_gap + log_sum: no cancellation between large numbers
// (lse - z_target would lose everything below the lse's rounding, e.g. 2.0 instead of log 8 at logits of 2^24).
// Which row statistics a stage computes besides the lse, the target's gap and the log-sum.
struct StatsRequest {
  bool weighted_sums = false;  // label smoothing's class-weighted logit sums
  bool entropy = false;
  bool argmax = false;
};

// All [N] in the loss dtype (loss_dtype), argmax int64; the optional ones undefined where not asked for.
struct RowStats {
  at::Tensor lse;                                    // max + log_sum
  at::Tensor target_gap;                             // max - z[r, target] (0 where the target is ignored)
  at::Tensor log_sum;                                // log sum_c exp(z[r, c] - max), in [0, log V]
  at::Tensor weighted_z_sum;                         // with label smoothing: sum_c cw[c] * z[r, c]
  at::Tensor entropy;                                // -sum_c p log p of the row's softmax
  at::Tensor argmax;                                 // the most likely class (the lowest on ties)
  RowStats block(int64_t begin, int64_t end) const;  // views of rows [begin, end)
  void copy_(const RowStats& part) const;            // part's values into these (same rows)
  StatsRequest request() const;                      // which optional ones these have
  // Uninitialised stats of p's rows, the optional ones as asked for.
  static RowStats allocate(const Problem& p, const StatsRequest& request);
};

// The row stats from the partials of vocabulary splits ([5, splits, N] float32: each split's max, sum of exp(z -
// max), target logit, class-weighted logit sum and sum of exp(z - max) (z - max); argmax_partial [splits, N]
// int64 where asked for): the row_stats kernel's splits combined (cuda_row_stats, and kernels/jit.py through
// the op _combine_row_stat_splits). target [N]: -1 at ignored rows.
RowStats combine_row_stat_splits(const at::Tensor& partial, const at::Tensor& argmax_partial, const at::Tensor& target,
                                 const StatsRequest& request);

// Per-row coefficients of the logit gradient:
//   g = logit_scale * softcap'(z) * (p * (alpha + alpha_lse * lse + alpha_z * log p) - beta * onehot(target)
//                                    - gamma * class_weight)
// (the z-loss term is proportional to the lse, which the fused forward only knows inside the kernel; the
// entropy's gradient is -p * (log p + H): alpha_z, undefined without it; gamma is undefined without label
// smoothing). `lse` may be undefined where the stage computes it.
struct GradCoefficients {
  at::Tensor lse, alpha, alpha_lse, beta, gamma, alpha_z;  // [N] in the loss dtype, contiguous
  GradCoefficients block(int64_t begin, int64_t end) const;
  GradCoefficients scaled(double s) const;  // the gradient times s (lse as it is)
  GradCoefficients select_rows(const at::Tensor& index) const;
};

// float16's logits held (stored blocks: Plan::logits_scale) or formed (the ATen stages' products) at this scale:
// logits up to 65504 / scale stay finite, beyond float16's own range.
constexpr double kFloat16LogitsScale = 1.0 / 256;

// The raw logits (x @ w.T + b) * scale of p's rows into `out` ([N, V]): in the input dtype one GEMM; in a wider
// dtype (Plan::logits_product_dtype) one GEMM per vocabulary slice of the weight converted to it, each slice no
// larger than an input-dtype copy of `out` (the place the plan holds for it).
void logits_into(const Problem& p, at::Tensor& out, double scale = 1.0);
// (x @ w.T + bias) * scale into `out` of a wider dtype than x's, w converted a vocabulary slice at a time, each
// slice no larger than an x-dtype copy of `out` (logits_into's wider case; a distillation's heads).
void linear_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, double scale = 1.0);

// The dtype of the loss and of the ATen stages' arithmetic: float64 for float64 inputs, else float32.
at::ScalarType loss_dtype(const Problem& p);

// Checks the arguments (shapes, dtypes, devices; errors name the argument) and
// builds the 2-D problem with the raw class indices as int64. No device work.
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o);

// p with the low-rank term of the logits, where both are given (low_rank_input [..., r] like input,
// low_rank_weight [V, r]): shapes, dtypes and devices checked, errors naming the argument.
void with_low_rank(Problem& p, const at::Tensor& input, const std::optional<at::Tensor>& low_rank_input,
                   const std::optional<at::Tensor>& low_rank_weight, const LossOptions& o);

// The problem of this rank's classes [o.vocab_start, o.vocab_start + w rows):
// V = w's rows, the class weights of those classes, targets relative to the
// first one and -1 where another shard holds them (or the row is ignored).
// Without vocabulary parallelism, p itself.
Problem vocab_shard(const Problem& p, const LossOptions& o);

}  // namespace fused_ce
