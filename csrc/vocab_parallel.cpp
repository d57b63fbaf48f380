#include "vocab_parallel.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace fused_ce {

// _c10d_functional::all_reduce_ and wait_tensor, boxed: their C++ signatures
// differ across torch versions, their schemas do not.
void all_reduce_(const at::Tensor& t, const char* reduce_op, const std::string& group) {
  static const c10::OperatorHandle all_reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack stack{t, std::string(reduce_op), group};
  all_reduce.callBoxed(&stack);
  stack = {t};
  wait.callBoxed(&stack);
}

void combine_vocab_shards(const Problem& shard, const RowStats& s, const LossOptions& o) {
  if (shard.N == 0) return;  // the same tokens on every rank: all return here
  const std::string& group = o.process_group;
  // The reference L = max over ranks of their lse (>= their max logit, so every exp below is <= 1).
  const at::Tensor reference = s.lse.clone();
  all_reduce_(reference, "max", group);
  // Summed over ranks: exp(lse_r - L); the owner's lse and cross-entropy term (target_gap + log_sum, computed
  // without cancellation); the owner count (0 where the row is ignored); the weighted logit sums; for the
  // entropy, exp(lse_r - L) * (H_r + L - lse_r) (the shards' entropies mixed by their mass, no cancellation).
  const at::Tensor owned = shard.target.ge(0);
  const at::Tensor zero = at::zeros({}, s.lse.options());
  const bool smoothing = s.weighted_z_sum.defined();
  const at::Tensor mass = (s.lse - reference).exp_();
  std::vector<at::Tensor> parts{mass, at::where(owned, s.lse, zero), at::where(owned, s.target_gap + s.log_sum, zero),
                                owned.to(s.lse.scalar_type()), smoothing ? s.weighted_z_sum : zero.expand({shard.N})};
  if (s.entropy.defined()) parts.push_back(mass * (s.entropy + reference - s.lse));
  at::Tensor sums = at::stack(parts);
  all_reduce_(sums, "sum", group);
  // The argmax: the largest max logit over ranks (max = lse - log_sum), then the lowest class holding it.
  if (s.argmax.defined()) {
    const at::Tensor row_max = s.lse - s.log_sum;
    const at::Tensor best = row_max.clone();
    all_reduce_(best, "max", group);
    const at::Tensor candidate =
        at::where(row_max == best, s.argmax + o.vocab_start, at::full({}, o.vocab_size, s.argmax.options()));
    all_reduce_(candidate, "min", group);
    s.argmax.copy_(candidate);
  }
  const at::Tensor log_sum = sums[0].log();
  s.lse.copy_(reference + log_sum);
  s.log_sum.copy_(log_sum);
  // target_gap + log_sum = lse - z_target: (L - lse_owner) + (lse_owner - z_target) + log_sum - log_sum.
  s.target_gap.copy_(at::where(sums[3].gt(0), (reference - sums[1]) + sums[2], zero));
  if (smoothing) s.weighted_z_sum.copy_(sums[4]);
  // H = sum_r w_r (H_r + L' - lse_r) with w_r = exp(lse_r - L') and L' = L + log_sum
  if (s.entropy.defined()) s.entropy.copy_(sums[5] / sums[0] + log_sum);
}

}  // namespace fused_ce
