// linear_distillation_loss's problem: its arguments checked once (errors name the argument) into a Problem of the
// student's head whose teacher (Problem::teacher) is the teacher's head or its top k; and the terms its two
// executors (executors.h) share: the heads' logit transforms, the teacher's top k as a distribution, the row
// sums over vocabulary shards.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "options.h"
#include "problem.h"

namespace fused_ce {

// The tensor arguments of linear_distillation_loss, in schema order.
struct DistillationInputs {
  const at::Tensor& input;
  const at::Tensor& linear_weight;
  const std::optional<at::Tensor>& teacher_input;
  const std::optional<at::Tensor>& teacher_weight;
  const std::optional<at::Tensor>& target;
  const std::optional<at::Tensor>& linear_bias;
  const std::optional<at::Tensor>& teacher_bias;
  const std::optional<at::Tensor>& teacher_top_indices;
  const std::optional<at::Tensor>& teacher_top_log_probs;
};

// The student's problem as make_problem's (V the whole vocabulary: the executors see its vocab_shard) with the
// teacher beside it; the raw class indices as int64, zeros without a target (every row counts: Call's
// Targets::given). The teacher's top-k class indices are checked with the targets (check_teacher_classes).
Problem make_distillation_problem(const DistillationInputs& in, const LossOptions& o);

// A head's products z (in the loss dtype) after its transform, softcap tanh(scale z / softcap) or scale z: the
// logits at T = 1; with `chain`, d logits / d z (left undefined where it is the constant scale).
at::Tensor transformed(at::Tensor z, double scale, const std::optional<double>& softcap, at::Tensor* chain = nullptr);
// Class indices idx (global) as this shard's columns (0 where another shard holds the class), and the mask of
// those it holds.
std::pair<at::Tensor, at::Tensor> local_classes(const at::Tensor& idx, const LossOptions& o, int64_t shard_classes);
// t summed over the group's ranks in place (t as it is when not sharded).
at::Tensor summed_over_shards(const LossOptions& o, at::Tensor t);

// The teacher's top k as a distribution: q [k, top] renormalised over them (a -inf log-probability is probability 0,
// as padding lists), each row's sum q log q [k] (0 log 0 = 0), and mass [k, 1]: 1, or 0 for a row of -inf only
// (no teacher distribution: its divergence and gradient 0).
struct TopKTeacher {
  at::Tensor q, neg_entropy, mass;
};
TopKTeacher top_k_teacher(const at::Tensor& log_probs);

}  // namespace fused_ce
