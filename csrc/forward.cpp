// Pass::Forward: the row stats by each strategy.
#include <algorithm>

#include "aten_stages.h"
#include "cuda_stages.h"
#include "executors.h"
#include "loss_terms.h"
#include "plan.h"

namespace fused_ce {

RowStats forward_stats(const Problem& p, const LossOptions& o, const Plan& plan, const at::Tensor& kept) {
  const StatsRequest request{o.smoothing(), o.return_entropy, o.return_argmax};
  TORCH_CHECK(kept.defined() == (plan.pass == Pass::ForwardKeepingLogits),
              "fused_ce: the logits are kept in Pass::ForwardKeepingLogits, and only there");
  if (p.N == 0) return RowStats::allocate(p, request);
  switch (plan.strategy) {
    case Strategy::StoredLogits: return stats_from_stored_logits(p, o, plan, plan.block_rows, kept);
    case Strategy::DotTiles: return cuda_row_stats(p.block(0, p.N), request);  // (selected rows gathered)
    case Strategy::AtenChunks: return aten_row_stats(p, request, plan.block_rows, plan.logits_product_dtype);
    case Strategy::VocabTiles: break;
  }
  TORCH_CHECK(false, "fused_ce: the forward has no executor for strategy ", strategy_name(plan.strategy));
  return {};
}

}  // namespace fused_ce
