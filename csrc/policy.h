// The policy-gradient objective (fused_ce::linear_policy_loss): per counted token i, with logp_i its action's
// log-prob and H_i the entropy of its distribution,
//   ratio_i = exp(logp_i - old_i)                       (old_i = logp_i, detached, without old log-probs)
//   pg_i    = -min(ratio_i * A_i, clamp(ratio_i, 1 - clip_low, 1 + clip_high) * A_i)
//   kl_i    = exp(ref_i - logp_i) - (ref_i - logp_i) - 1 (the k3 estimator; with reference log-probs), times
//             ratio_i with kl_times_ratio (the importance-sampling correction TRL calls use_bias_correction_kl)
//   loss    = sum_i w_i * (pg_i + kl_coef * kl_i - entropy_coef * H_i)
// Its gradient coefficients are functions of the row stats (logp, H) and of inputs known before the call, so
// the forward forms the gradients from one evaluation of the logits (forward_with_grad, 6NDV), block by block.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "problem.h"

namespace fused_ce {

struct PolicyOptions {
  double clip_low = 0.2, clip_high = 0.2, kl_coef = 0.0, entropy_coef = 0.0;
  bool kl_times_ratio = false;
  bool stats = false;  // the statistics trainers log (PolicyRows::stats)
};

// The per-token inputs of the rows the executors run on ([N] each, in the loss dtype), and what each row
// gives: its loss term and, with stats, what is logged.
class PolicyRows {
 public:
  // `weights` undefined: 1 / (the number of counted rows), counted on the device (no host read).
  PolicyRows(const Problem& p, const PolicyOptions& options, const at::Tensor& advantages,
             const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& old_log_probs,
             const std::optional<at::Tensor>& ref_log_probs);

  // The gradient coefficients of rows [begin, end) from their row stats (lse, target_gap, log_sum, entropy
  // and argmax where asked for), for an upstream gradient of 1; records their loss terms and stats.
  GradCoefficients coefficients(int64_t begin, int64_t end, const RowStats& s) const;

  // The loss (0-dim) and, with stats, each row's [ratio, clipped low, clipped high, KL, entropy, action is the
  // argmax] ([6, N], 0 where not counted; else empty): their means over the counted rows are what trainers log
  // (fused_ce.PolicyStats), their means over each sequence TRL's per-sequence clip extremes.
  at::Tensor loss() const;
  at::Tensor stats() const;

 private:
  PolicyOptions options_;
  at::Tensor target_, advantages_, weights_, old_, ref_;  // [N]
  at::Tensor terms_;                                      // [N] each row's w * (pg + kl_coef * kl - entropy_coef * H)
  at::Tensor logged_;                                     // [6, N] each row's stats (0 where not counted)
};

}  // namespace fused_ce
