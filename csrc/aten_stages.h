// The stages in ATen, on any device, with float32 arithmetic (float64 for
// float64 inputs): the CPU path and the CUDA fallback (Strategy::AtenChunks).
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "problem.h"

namespace fused_ce {

// The logits' products are formed in `product_dtype` (Plan::logits_product_dtype).

// Row stats of all rows of `p`, `block_rows` rows of logits at a time.
RowStats aten_row_stats(const Problem& p, const StatsRequest& request, int64_t block_rows,
                        at::ScalarType product_dtype);
// g = dL/dlogit (problem.h) for all rows of `p` and columns [v_begin, v_end),
// recomputing the logits, in the compute dtype; c.lse set.
at::Tensor aten_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                           at::ScalarType product_dtype);
// The row stats of all rows of `p` and g over the whole vocabulary, from one
// evaluation of the logits (c.lse unused).
std::pair<RowStats, at::Tensor> aten_stats_and_logit_grad(const Problem& p, const GradCoefficients& c,
                                                          const StatsRequest& request, at::ScalarType product_dtype);

}  // namespace fused_ce
