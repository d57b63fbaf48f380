// The executors: one per strategy of each pass (plan.h). Each carries out its
// plan (block sizes, dtypes, where the smoothing terms come from) and decides
// nothing of its own; the ops (csrc/ops/) pick one by plan.strategy.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <optional>
#include <utility>

#include "blocks.h"
#include "options.h"
#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// forward.cpp: the row stats of every row (Pass::Forward); for Pass::ForwardKeepingLogits, the logits
// left in `kept` ([>= N, V] in the plan's logits dtype, at plan.logits_scale: row r of p in row r).
RowStats forward_stats(const Problem& p, const LossOptions& o, const Plan& plan, const at::Tensor& kept = {});

// backward.cpp: the gradients, recomputing the logits, for coefficients `c`
// with c.lse set (Pass::Backward; StoredLogits, VocabTiles, AtenChunks, DotTiles); for Pass::BackwardFromLogits, from
// the logits the forward kept (forward_stats), turned into their gradient in place.
Grads recomputed_grads(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c,
                       GradMask need);
Grads grads_from_kept_logits(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c,
                             GradMask need, const at::Tensor& kept);

// dW ([V, D] in the input dtype; float16's forward with gradient's at Plan::grad_weight_scale) by the plan's
// vocabulary slices (Plan::weight_grad_slice_classes), each slice's summed over every row in float32, recomputing
// the logits, for coefficients `c` with c.lse set.
at::Tensor weight_grad_by_slices(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c);

// Where a block's gradient coefficients come from: fixed ones, known before the logits (the cross-entropy's), or
// a function of the block's row stats (the policy loss's, which need each row's log-prob and entropy), called
// once per block after its stats (combined over vocabulary shards) and before its gradient.
struct CoefficientSource {
  GradCoefficients fixed;
  std::function<GradCoefficients(int64_t begin, int64_t end, const RowStats& block)> from_stats;

  bool needs_stats() const { return static_cast<bool>(from_stats); }
  GradCoefficients block(int64_t begin, int64_t end, const RowStats& block_stats) const {
    return from_stats ? from_stats(begin, end, block_stats) : fixed.block(begin, end);
  }
};

// forward_with_grad.cpp: the row stats and the gradients of a scalar loss for an upstream gradient of 1,
// from the same logits (Pass::ForwardWithGrad).
std::pair<RowStats, Grads> forward_with_grad(const Problem& p, const LossOptions& o, const Plan& plan,
                                             const CoefficientSource& unit, GradMask need);

// linear_distillation_loss's rows (a problem with a teacher: Problem::distills; p the vocabulary shard of the
// rows run): each row's loss and student entropy ([p.N] in the loss dtype; the entropy where asked for) and, with
// a scale, the student's gradients `need` asks for, of each row's loss times its scale: `per_row` ([p.N] in the loss
// dtype: a 'none' loss's upstream gradient, 0 at ignored rows run under CUDA graph capture), else `uniform` (a
// scalar loss's 1 or 1 / K, applied to the products rather than to the half-precision gradient blocks, which it
// could take below float16's range).
struct RowScale {
  at::Tensor per_row;
  double uniform = 1.0;
};
struct DistillationRows {
  at::Tensor loss, entropy;
  Grads grads;
};
// distillation_aten.cpp: Strategy::AtenChunks, each block's logits of both heads in the loss dtype.
DistillationRows distillation_rows(const Problem& p, const LossOptions& o, const Plan& plan,
                                   const std::optional<RowScale>& scale, GradMask need);
// distillation_cuda.cpp: Strategy::StoredLogits, each block's raw logits in the input dtype, swept by the
// distill_rows kernel (cuda_distill_rows).
DistillationRows distillation_rows_from_kernels(const Problem& p, const LossOptions& o, const Plan& plan,
                                                const std::optional<RowScale>& scale, GradMask need);

}  // namespace fused_ce
