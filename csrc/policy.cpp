#include "policy.h"

namespace fused_ce {
namespace {

at::Tensor per_row(const std::optional<at::Tensor>& t, const Problem& p) {
  return t && t->defined() ? t->reshape({p.N}).to(loss_dtype(p)).contiguous() : at::Tensor();
}

}  // namespace

PolicyRows::PolicyRows(const Problem& p, const PolicyOptions& options, const at::Tensor& advantages,
                       const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& old_log_probs,
                       const std::optional<at::Tensor>& ref_log_probs)
    : options_(options),
      target_(p.target),
      advantages_(per_row(advantages, p)),
      weights_(per_row(weights, p)),
      old_(per_row(old_log_probs, p)),
      ref_(per_row(ref_log_probs, p)) {
  const auto opts = p.x.options().dtype(loss_dtype(p));
  // the token mean over the batch by default (nothing counted: 0, not NaN)
  if (!weights_.defined()) {
    const at::Tensor counted = p.target.ge(0).sum().to(loss_dtype(p));
    weights_ = (1.0 / counted.clamp_min(1.0)).expand({p.N});
  }
  terms_ = at::zeros({p.N}, opts);
  if (options_.stats) logged_ = at::zeros({6, p.N}, opts);
}

GradCoefficients PolicyRows::coefficients(int64_t begin, int64_t end, const RowStats& s) const {
  const int64_t n = end - begin;
  const auto rows = [&](const at::Tensor& t) { return t.narrow(0, begin, n); };
  const at::Tensor counted = rows(target_).ge(0);
  const at::Tensor zero = at::zeros({}, s.lse.options());
  const auto where_counted = [&](const at::Tensor& t) { return at::where(counted, t, zero); };
  const at::Tensor logp = where_counted(-(s.target_gap + s.log_sum));
  const at::Tensor A = rows(advantages_), w = rows(weights_);
  // the probability ratio against the old policy (on-policy: exactly 1, its gradient ratio * dlogp)
  const at::Tensor ratio = old_.defined() ? where_counted((logp - rows(old_)).exp()) : at::ones_like(logp);
  const double lo = 1.0 - options_.clip_low, hi = 1.0 + options_.clip_high;
  const at::Tensor unclipped = ratio * A, clipped = ratio.clamp(lo, hi) * A;
  // torch's subgradients: minimum halves the gradient at ties, clamp passes it on [lo, hi] inclusive
  const at::Tensor tie = unclipped == clipped;
  const at::Tensor to_unclipped = at::where(tie, 0.5, (unclipped < clipped).to(A.scalar_type()));
  const at::Tensor to_clipped = at::where(tie, 0.5, (clipped < unclipped).to(A.scalar_type()));
  const at::Tensor inside = ratio.ge(lo).logical_and(ratio.le(hi)).to(A.scalar_type());
  const at::Tensor dpg_dratio = -(A * to_unclipped + A * inside * to_clipped);
  at::Tensor dlogp = dpg_dratio * ratio;  // dL/dlogp per unit weight
  at::Tensor term = -at::minimum(unclipped, clipped);
  at::Tensor kl;
  if (ref_.defined() && options_.kl_coef != 0.0) {
    const at::Tensor delta = rows(ref_) - logp;
    kl = where_counted(delta.exp() - delta - 1.0);
    const at::Tensor dkl = 1.0 - delta.exp();
    if (options_.kl_times_ratio) {  // d(kl * ratio) = dkl * ratio + kl * ratio (dratio / dlogp = ratio)
      dlogp = dlogp + options_.kl_coef * (dkl + kl) * ratio;
      term = term + options_.kl_coef * kl * ratio;
    } else {
      dlogp = dlogp + options_.kl_coef * dkl;
      term = term + options_.kl_coef * kl;
    }
  }
  GradCoefficients c;
  const at::Tensor g_logp = where_counted(w * dlogp);  // the upstream gradient of each row's log-prob
  // d logp / dz = onehot - p: alpha -= g, beta = -g; d H / dz = -p (log p + H): alpha -= g_H H, alpha_z = -g_H
  c.alpha = -g_logp;
  c.beta = -g_logp;
  c.alpha_lse = at::zeros_like(g_logp);
  if (options_.entropy_coef != 0.0) {
    const at::Tensor g_h = where_counted(w * -options_.entropy_coef);
    c.alpha = c.alpha - g_h * s.entropy;
    c.alpha_z = -g_h;
    term = term - options_.entropy_coef * s.entropy;
  }
  rows(terms_).copy_(where_counted(w * term));
  if (options_.stats) {
    const at::Tensor logged = logged_.narrow(1, begin, n);
    logged[0].copy_(where_counted(ratio));
    logged[1].copy_(where_counted((ratio < lo).logical_and(A < 0).to(A.scalar_type())));
    logged[2].copy_(where_counted((ratio > hi).logical_and(A > 0).to(A.scalar_type())));
    if (ref_.defined()) {  // as the loss has it (times the ratio with kl_times_ratio), even at kl_coef 0
      const at::Tensor delta = rows(ref_) - logp;
      const at::Tensor k3 = kl.defined() ? kl : where_counted(delta.exp() - delta - 1.0);
      logged[3].copy_(options_.kl_times_ratio ? k3 * ratio : k3);
    }
    logged[4].copy_(where_counted(s.entropy));
    logged[5].copy_(where_counted((s.argmax == rows(target_)).to(A.scalar_type())));
  }
  for (at::Tensor* t : {&c.alpha, &c.beta, &c.alpha_lse, &c.alpha_z}) {
    if (t->defined()) *t = t->contiguous();
  }
  return c;
}

at::Tensor PolicyRows::loss() const {
  return terms_.sum();
}

at::Tensor PolicyRows::stats() const {
  return options_.stats ? logged_ : at::empty({0}, terms_.options());
}

}  // namespace fused_ce
