// The pipeline of the distillation ops (distillation.h): the arguments checked once into a Distillation, the
// row blocks run over the counted rows, the outputs shaped. distillation.cpp defines it, distillation_ops.cpp
// calls it.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "distillation.h"
#include "options.h"

namespace fused_ce {
namespace distillation {

constexpr const char* kCaller = "linear_distillation_loss";

enum class Divergence { ForwardKL, ReverseKL, JSD, TopK };

// A head's logit transform: z -> softcap tanh(scale z / softcap), or scale z without a softcap.
struct Transform {
  double scale = 1.0;
  std::optional<double> softcap;
};

struct Options {
  Divergence divergence = Divergence::ForwardKL;
  double beta = 0.0, temperature = 1.0, hard_label_weight = 0.0;
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  int64_t workspace_bytes = 0;
  bool entropy = false;
  Transform student, teacher;
  std::string group;  // vocabulary parallel: the process group's name ("" if not sharded)
  int64_t vocab_start = 0, max_shard_rows = 0;
  bool sharded() const { return !group.empty(); }
};

// The arguments as the pipeline takes them: rows flattened ([N, ...]), the counted rows' indices.
struct Distillation {
  at::Tensor x, w, bias;                  // the student: [N, D], [V, D], [V] or undefined
  at::Tensor xt, wt, teacher_bias;        // the teacher's head: [N, Dt], [V, Dt], [V] (undefined with top-k)
  at::Tensor top_indices, top_log_probs;  // offline: [N, k] int64 (global classes), float32
  at::Tensor target;                      // [N] int64 or undefined
  std::vector<int64_t> rows_shape;        // input's leading dimensions
  int64_t N = 0, V = 0;                   // V: this shard's classes
  at::Tensor counted;                     // [K] int64: the rows that count
  at::ScalarType acc = at::kFloat;        // the logits' and the loss's dtype (float64 for float64 inputs)
  Options o;
};

// The counted rows' losses and entropies ([K], acc) and the student's gradients (gx [N, D] in the input dtype, 0 at
// rows not counted; gw, gb in acc or the input dtype; undefined where not asked for).
struct Rows {
  at::Tensor loss, entropy, gx, gw, gb;
};

// The factor of each counted row's gradient: `rows` ([K] acc: a 'none' loss's upstream gradient), else `uniform`
// for every row (a scalar loss's 1 or 1 / K, applied to the products rather than to the half-precision gradient
// blocks, which it could take below float16's range).
struct RowScale {
  at::Tensor rows;
  double uniform = 1.0;
};

Distillation make(FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS));

// Block by block within the workspace; the gradients (mask: input, weight, bias) only with a scale.
Rows run_blocks(const Distillation& d, const std::optional<RowScale>& scale, std::array<bool, 3> mask);

// The counted rows [begin, end) of t ([N, ...]): a view where every row counts, else gathered (a block at a time:
// never a copy of every counted row's hidden states).
at::Tensor block_rows(const Distillation& d, const at::Tensor& t, int64_t begin, int64_t end);
// dX's rows (gx [N, D]) for the counted rows [begin, end): a view where every row counts, else a buffer that
// store_input_grad then writes to them.
at::Tensor input_grad_rows(const Distillation& d, const at::Tensor& gx, int64_t begin, int64_t end);
void store_input_grad(const Distillation& d, at::Tensor gx, const at::Tensor& rows, int64_t begin);

// On CUDA with the embedded kernels (distillation_cuda.cpp): whether they run this call, and run_blocks there.
bool uses_kernels(const Distillation& d);
Rows run_blocks_cuda(const Distillation& d, const std::optional<RowScale>& scale, std::array<bool, 3> mask);

// t's counted rows (t itself where every row counts).
at::Tensor counted_rows(const Distillation& d, const at::Tensor& t);
// A head's products z (in acc) after its transform: the logits at T = 1; with `chain`, d logits / d z (left
// undefined where it is the constant logit_scale).
at::Tensor transformed(at::Tensor z, const Transform& f, at::Tensor* chain = nullptr);
// Class indices idx (global) as this shard's columns (0 where another shard holds the class), and the mask of
// those it holds.
std::pair<at::Tensor, at::Tensor> local_classes(const Distillation& d, const at::Tensor& idx);
// t summed over the group's ranks in place (t as it is when not sharded).
at::Tensor summed_over_shards(const Distillation& d, at::Tensor t);

// The teacher's top k as a distribution: q [k, top] renormalised over them (a -inf log-probability is probability 0,
// as padding lists), each row's sum q log q [k] (0 log 0 = 0), and mass [k, 1]: 1, or 0 for a row of -inf only
// (no teacher distribution: its divergence and gradient 0).
struct TopKTeacher {
  at::Tensor q, neg_entropy, mass;
};
TopKTeacher top_k_teacher(const at::Tensor& log_probs);

// Counted rows' values [K] placed in input's rows (0 elsewhere).
at::Tensor per_row(const Distillation& d, const at::Tensor& counted_values);

// The loss as the reduction asks.
at::Tensor reduced(const Distillation& d, const at::Tensor& losses);

}  // namespace distillation
}  // namespace fused_ce
