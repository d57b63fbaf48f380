// Pass::Forward: the row stats by each strategy.
#include <algorithm>

#include "aten_stages.h"
#include "cuda_stages.h"
#include "executors.h"
#include "loss_terms.h"

namespace fused_ce {

void logits_into(const Problem& p, at::Tensor& out, double scale) {
  if (p.bias.defined()) {
    at::addmm_out(out, p.bias, p.x, p.w.t(), /*beta=*/scale, /*alpha=*/scale);
  } else if (scale != 1.0) {
    at::addmm_out(out, out, p.x, p.w.t(), /*beta=*/0, /*alpha=*/scale);  // beta 0: out's contents are not read
  } else {
    at::mm_out(out, p.x, p.w.t());
  }
}

Problem reading_stored_logits(const Problem& p, const Plan& plan) {
  Problem stored = p;
  stored.logit_scale = p.logit_scale / plan.logits_scale;
  return stored;
}

StatsRequest stats_request(const LossOptions& o, const Plan& plan) {
  return {o.smoothing() && !plan.rank_one_smoothing, o.return_entropy, o.return_argmax};
}

RowStats stats_from_stored_logits(const Problem& p, const LossOptions& o, const Plan& plan, int64_t block_rows,
                                  const at::Tensor& kept) {
  RowStats s = RowStats::allocate(p, stats_request(o, plan));
  if (plan.rank_one_smoothing) s.weighted_z_sum = weighted_z_sum(p, class_weighted_w(p));
  at::Tensor buffer = kept.defined() ? kept : at::empty({block_rows, p.V}, p.x.options());
  const Problem stored = reading_stored_logits(p, plan);
  for (int64_t r0 = 0; r0 < p.N; r0 += block_rows) {
    const int64_t r1 = std::min(p.N, r0 + block_rows);
    at::Tensor logits = buffer.narrow(0, kept.defined() ? r0 : 0, r1 - r0);  // (kept: every row's place)
    const Problem pr = stored.rows(r0, r1);
    logits_into(pr, logits, plan.logits_scale);
    cuda_stats_from_logits(pr, logits, s.rows(r0, r1));
  }
  return s;
}

RowStats forward_stats(const Problem& p, const LossOptions& o, const Plan& plan, const at::Tensor& kept) {
  const StatsRequest request{o.smoothing(), o.return_entropy, o.return_argmax};
  TORCH_CHECK(kept.defined() == (plan.pass == Pass::ForwardKeepingLogits),
              "fused_ce: the logits are kept in Pass::ForwardKeepingLogits, and only there");
  if (p.N == 0) return RowStats::allocate(p, request);
  switch (plan.strategy) {
    case Strategy::StoredLogits: return stats_from_stored_logits(p, o, plan, plan.block_rows, kept);
    case Strategy::DotTiles: return cuda_row_stats(p.rows(0, p.N), request);  // (selected rows gathered)
    case Strategy::AtenChunks: return aten_row_stats(p, request, plan.block_rows);
    case Strategy::VocabTiles: break;
  }
  TORCH_CHECK(false, "fused_ce: the forward has no executor for strategy ", strategy_name(plan.strategy));
  return {};
}

}  // namespace fused_ce
