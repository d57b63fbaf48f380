// float16's gradient scales (float16_scales.h).
#include "float16_scales.h"

#include <algorithm>
#include <cmath>

#include "plan_types.h"

namespace fused_ce {
namespace {

// A bound on |g| / c for every logit gradient g of a row with coefficient c at unit scale: |logit_scale| (at
// least 1) times 1 + 2 z |lse| for |lse| up to 100 (softcap's slope and smoothing's terms at most 1).
double float16_logit_grad_bound(const Problem& p, const LossOptions& o) {
  return std::max(1.0, std::abs(p.logit_scale)) * (1.0 + 200.0 * o.z_loss);
}

// float16's scales leave 4x of float16's range beyond their bounds, so a class-weighted mean's coefficients
// (Problem::coefficient_max, coefficient_sum; 1 for an unweighted mean) take powers of two off them only past 2:
// its unit bounds within rounding (and every bound of class weights not negative without smoothing) change nothing.
double weighted_mean_factor(double coefficients) {
  return std::isnan(coefficients) || coefficients <= 2.0 ? 1.0 : coefficients;
}

}  // namespace

double float16_grad_scale(const Problem& p, const LossOptions& o) {
  if ((o.reduction_kind == Reduction::Sum && p.class_weight.defined()) || o.policy_loss) return 1.0;
  const double bound = float16_logit_grad_bound(p, o) * weighted_mean_factor(p.coefficient_max);
  if (!std::isfinite(bound)) return 1.0;
  return std::ldexp(1.0, std::max(-64, 14 - static_cast<int>(std::ceil(std::log2(bound)))));
}

double float16_grad_weight_scale(const Problem& p, const LossOptions& o) {
  const bool sum = o.reduction_kind == Reduction::Sum;
  if (!std::isfinite(p.input_abs_max) || (sum && p.class_weight.defined())) return 0.0;
  const double coefficients =
      sum ? static_cast<double>(std::max<int64_t>(p.N, 1)) : weighted_mean_factor(p.coefficient_sum);
  const double bound = p.input_abs_max * coefficients * float16_logit_grad_bound(p, o);
  if (!std::isfinite(bound)) return 0.0;
  return std::ldexp(
      1.0, static_cast<int>(std::clamp(std::floor(std::log2(Plan::kFloat16WeightGradBound / bound)), -64.0, 64.0)));
}

}  // namespace fused_ce
