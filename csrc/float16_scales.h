// float16's gradient scales (Plan::grad_scale, Plan::grad_weight_scale): powers of two from bounds on the logit
// gradients and on dW, so that float16's gradient blocks and dW neither overflow nor fall into its subnormals.
#pragma once

#include "options.h"
#include "problem.h"

namespace fused_ce {

// Plan::grad_scale for float16 gradient blocks: a power of two s with s * |g| < 65504 for every logit
// gradient g of a scalar loss at unit scale: 2^14 over float16_logit_grad_bound, the row's coefficient c being
// at most 1 for 'mean' without class weights (1 over the counted rows) and for 'sum' without class weights; with
// them, a mean's largest coefficient as read (weighted_mean_factor). 'sum' with class weights has c = the weight
// itself, unbounded: unit scale; so has the policy loss (its advantages have no bound), and a weighted mean whose
// weights sum to 0 (its gradients are NaN, as torch's).
double float16_grad_scale(const Problem& p, const LossOptions& o);
// Plan::grad_weight_scale: the largest power of two S with S * |dW| <= Plan::kFloat16WeightGradBound, from |dW[v, d]|
// <= max|x| * sum_i |g[i, v]| and |g[i, v]| <= c_i * float16_logit_grad_bound, where sum_i c_i is 1 for 'mean'
// without class weights, as read with them (weighted_mean_factor), and at most the rows for 'sum'. 0 (no bound)
// where max|x| was not read or is not finite, for 'sum' with class weights (c_i unbounded) and where the
// coefficients' sum is not finite.
double float16_grad_weight_scale(const Problem& p, const LossOptions& o);

}  // namespace fused_ce
