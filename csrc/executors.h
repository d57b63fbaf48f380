// The executors: one per strategy of each pass (plan.h). Each carries out its
// plan (block sizes, dtypes, where the smoothing terms come from) and decides
// nothing of its own; the ops (loss.cpp) pick one by plan.strategy.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
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
  GradCoefficients rows(int64_t begin, int64_t end, const RowStats& block) const {
    return from_stats ? from_stats(begin, end, block) : fixed.rows(begin, end);
  }
};

// forward_with_grad.cpp: the row stats and the gradients of a scalar loss for an upstream gradient of 1,
// from the same logits (Pass::ForwardWithGrad).
std::pair<RowStats, Grads> forward_with_grad(const Problem& p, const LossOptions& o, const Plan& plan,
                                             const CoefficientSource& unit, GradMask need);

}  // namespace fused_ce
