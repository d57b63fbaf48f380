#include "plan.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "format.h"
#include "strategies.h"

namespace fused_ce {
namespace {
// The plan of problem p's N rows, all of them or (`selected`) rows gathered from a larger x; `kept_rows`: the
// kept-logits passes' kept rows (-1: the forward's every row).
Plan plan_rows(const Problem& p, const LossOptions& o, const DeviceFacts& device, Pass pass, bool selected,
               int64_t kept_rows = -1) {
  const auto unplanned = [&] {
    Plan plan;
    plan.device = device;
    plan.pass = pass;
    plan.rows = p.N;
    if (pass == Pass::ForwardKeepingLogits) plan.kept_rows = kept_rows >= 0 ? std::min(kept_rows, p.N) : p.N;
    if (pass == Pass::BackwardFromLogits) plan.kept_rows = std::clamp<int64_t>(kept_rows, 0, p.N);
    plan.counted_rows_only = selected;
    plan.logits_product_dtype = p.x.scalar_type();
    plan.budget_bytes = o.workspace_bytes.value_or(device.cuda ? kDefaultCudaWorkspace : kDefaultCpuWorkspace);
    return plan;
  };
  Plan plan = unplanned();
  if (p.distills()) {
    TORCH_CHECK(pass == Pass::Forward || pass == Pass::ForwardWithGrad, "fused_ce: a distillation's passes are ",
                "the forward and the forward with gradient");
    plan_distillation(plan, p, o);
    return plan;
  }
  bool aten = !device.row_kernels(p.N);
  if (!aten) {
    plan_kernels(plan, p, o, selected);
    if (p.low_rank.defined() && plan.strategy == Strategy::DotTiles) {
      plan = unplanned();  // (the tl.dot tiles form logits of their own, without a low-rank term: the ATen stages)
      aten = true;
    }
  }
  if (aten) {
    const bool kept = pass == Pass::ForwardKeepingLogits || pass == Pass::BackwardFromLogits;
    TORCH_CHECK(!kept || p.N == 0, "fused_ce: the kept-logits passes need the CUDA row kernels (keeps_logits)");
    plan_aten_chunks(plan, p, o, selected);
  }
  plan.filters_grads = o.grad_filter_eps > 0.0 && pass == Pass::ForwardWithGrad &&
                       (plan.strategy == Strategy::StoredLogits || plan.strategy == Strategy::AtenChunks);
  return plan;
}

// A plan's GEMM time and dW re-reads across row blocks (s, from the architecture's rates): what choosing the
// counted rows weighs.
double estimated_seconds(const Plan& plan, const Problem& p, const ArchConstants& arch) {
  const bool grads = plan.pass != Pass::Forward;
  const double gemm_flops = (grads ? 6.0 : 2.0) * static_cast<double>(plan.rows) * p.D * p.V;
  const int64_t blocks = plan.block_rows > 0 ? cdiv(plan.rows, plan.block_rows) : 0;
  const int64_t slices = plan.tile_cols > 0 ? cdiv(p.V, plan.tile_cols) : 1;
  const double dw_bytes = grads && blocks > 1 && plan.grad_weight_dtype != at::ScalarType::Undefined
                              ? (blocks - 1) * 2.0 * p.V * p.D * c10::elementSize(plan.grad_weight_dtype)
                              : 0.0;
  // the backward's vocabulary slices sum dX in float32 (the forward with gradient's are not weighed here)
  const double dx_bytes =
      plan.pass == Pass::Backward && slices > 1 ? (slices - 1) * 2.0 * plan.rows * p.D * sizeof(float) : 0.0;
  return gemm_flops / arch.gemm_flops_per_s + (dw_bytes + dx_bytes) / arch.memory_bytes_per_s;
}

// Whether the counted rows' plan beats all rows': less estimated time, no larger dW accumulator, and a strategy
// that gathers rows block by block (the lean ones, dot_tiles and the forward with gradient's vocab_tiles, would
// gather every row at once; the backward's vocab_tiles gather each block's rows once for all its slices).
bool counted_rows_pay(const Plan& counted, const Plan& all, const Problem& p) {
  const bool gathers_blocks = counted.strategy == Strategy::StoredLogits || counted.strategy == Strategy::AtenChunks ||
                              (counted.strategy == Strategy::VocabTiles && counted.pass == Pass::Backward);
  if (!gathers_blocks) return false;
  if (counted.grad_weight_dtype != all.grad_weight_dtype &&
      c10::elementSize(counted.grad_weight_dtype) > c10::elementSize(all.grad_weight_dtype)) {
    return false;
  }
  const ArchConstants& arch = all.device.constants;
  return estimated_seconds(counted, p, arch) < estimated_seconds(all, p, arch);
}

}  // namespace

namespace {

// The kept rows of `rows` rows of V classes (this rank's largest shard) and D features, elements of `elem` bytes,
// within `budget`: every row where all their logits fit, else as many as fit with their gathered x and dX rows
// (counted rows selected) beside their logits, where that is at least kMinKeptRows; nullopt otherwise. Int is
// int64_t or c10::SymInt (symbolic sizes under torch.compile: the comparisons guard).
template <typename Int>
std::optional<Int> kept_rows_of(const Int& rows, const Int& V, const Int& D, int64_t elem, int64_t budget) {
  // the logits and, at most, the partials of logit_partials' smallest segments
  const Int row_bytes = V * elem + (V + 1023) / 1024 * kPartialBytesPer1024Columns;
  if (rows * row_bytes <= budget) return rows;
  const Int kept = budget / (row_bytes + 2 * D * elem);
  if (kept >= kMinKeptRows) return kept;
  return std::nullopt;
}

}  // namespace

std::optional<c10::SymInt> kept_logit_rows(const at::Tensor& input, const at::Tensor& linear_weight,
                                           const at::Tensor& target, const LossOptions& o, const DeviceFacts& device) {
  if (o.scalar() || !device.kernels) return std::nullopt;
  // every rank of a vocabulary-parallel group decides alike, for the largest shard (the same collectives)
  const c10::SymInt V = o.vocab_parallel() ? c10::SymInt(o.max_shard_rows) : linear_weight.sym_size(0);
  return kept_rows_of<c10::SymInt>(target.sym_numel(), V, input.sym_size(-1), c10::elementSize(input.scalar_type()),
                                   o.workspace_bytes.value_or(kDefaultCudaWorkspace));
}

bool gradients_in_forward(const LossOptions& o, const at::Tensor& input) {
  return o.scalar() && !(input.scalar_type() == at::kHalf && input.device().is_cpu());
}

Plan make_plan(const Problem& p, const LossOptions& o, const DeviceFacts& device, Pass pass, int64_t counted,
               int64_t kept) {
  TORCH_CHECK_VALUE(pass != Pass::ForwardWithGrad || o.scalar() || p.distills(),
                    "linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum' (a scalar loss)");
  if (o.vocab_parallel() && p.V != o.max_shard_rows) {
    // Every rank plans for the largest shard, so that all take the same row blocks (and so the same
    // collectives: vocab_parallel.h); the targets, and so the counted rows, are the same on every rank.
    Problem largest = p;
    largest.V = o.max_shard_rows;
    return make_plan(largest, o, device, pass, counted, kept);
  }
  const bool kept_pass = pass == Pass::ForwardKeepingLogits || pass == Pass::BackwardFromLogits;
  TORCH_CHECK(pass != Pass::BackwardFromLogits || kept >= 0, "fused_ce: Pass::BackwardFromLogits needs the kept rows");
  // Whether a per-token loss keeps its logits (what the forward's plan reports), decided once, of the problem's
  // own rows (a selection of rows is planned for a call that has decided); the kept passes are told how many.
  const std::optional<c10::SymInt> would_keep =
      (pass == Pass::Forward || (pass == Pass::ForwardKeepingLogits && kept < 0)) && !p.row_index.defined() &&
              !p.distills()
          ? kept_logit_rows(p.x, p.w, p.target, o, device)
          : std::nullopt;
  const bool keeps = would_keep.has_value();
  const int64_t kept_rows = keeps ? would_keep->guard_int(__FILE__, __LINE__) : 0;
  // the kept rows the passes plan for: the caller's (the forward's capacity, the backward's kept tensor), else
  // the problem's own (a selection of rows: all of them)
  if (pass == Pass::ForwardKeepingLogits && kept < 0) kept = keeps ? kept_rows : -1;
  const auto with_keeps = [&](Plan plan) {
    plan.keeps_logits = kept_pass || keeps;
    if (pass == Pass::Forward) plan.kept_rows = std::min(kept_rows, plan.rows);
    return plan;
  };
  if (p.row_index.defined()) return with_keeps(plan_rows(p, o, device, pass, /*selected=*/true, kept));  // a selection
  const Plan all = plan_rows(p, o, device, pass, /*selected=*/false, kept);
  if (counted < 0 || counted >= p.N) return with_keeps(all);
  Problem counted_rows = p;
  counted_rows.N = counted;
  const Plan selected = plan_rows(counted_rows, o, device, pass, /*selected=*/true, kept);
  // the kept-logits passes always run on the counted rows (_linear_cross_entropy_keeping_logits), and so does a
  // distillation (its rows' cost is the logits of two heads, its dW sums as the blocks go)
  return with_keeps(kept_pass || p.distills() || counted_rows_pay(selected, all, p) ? selected : all);
}

std::vector<int64_t> _kept_logit_rows_constants() {
  return {kDefaultCudaWorkspace, kMinKeptRows, kPartialBytesPer1024Columns};
}

int64_t _kept_logit_rows_of(int64_t rows, int64_t V, int64_t D, int64_t elem, std::optional<int64_t> workspace_bytes) {
  return kept_rows_of<int64_t>(rows, V, D, elem, workspace_bytes.value_or(kDefaultCudaWorkspace)).value_or(-1);
}

std::vector<std::pair<const char*, c10::IValue>> plan_fields(const Plan& plan) {
  const auto dtype = [](at::ScalarType t) {
    return std::string(t == at::ScalarType::Undefined ? "" : c10::toString(t));
  };
  const auto pass = pass_name(plan.pass);
  return {
      {"pass_", std::string(pass)},
      {"strategy", std::string(strategy_name(plan.strategy))},
      {"counted_rows_only", plan.counted_rows_only},
      {"rows", plan.rows},
      {"block_rows", plan.block_rows},
      {"tile_cols", plan.tile_cols},
      {"stats_block_rows", plan.stats_block_rows},
      {"logits_dtype", dtype(plan.logits_dtype)},
      {"logits_product_dtype", dtype(plan.logits_product_dtype)},
      {"logits_scale", plan.logits_scale},
      {"grad_input_dtype", dtype(plan.grad_input_dtype)},
      {"grad_weight_dtype", dtype(plan.grad_weight_dtype)},
      {"grad_scale", plan.grad_scale},
      {"grad_weight_scale", plan.grad_weight_scale},
      {"rank_one_smoothing", plan.rank_one_smoothing},
      {"rows_on_device", plan.rows_on_device},
      {"budget_bytes", plan.budget_bytes},
      {"workspace_bytes", plan.workspace_bytes},
      {"keeps_logits", plan.keeps_logits},
      {"kept_rows", plan.kept_rows},
      {"weight_grad_slice_classes", plan.weight_grad_slice_classes},
      {"filters_grads", plan.filters_grads},
  };
}

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::AtenChunks: return "aten_chunks";
    case Strategy::StoredLogits: return "stored_logits";
    case Strategy::DotTiles: return "dot_tiles";
    case Strategy::VocabTiles: return "vocab_tiles";
  }
  return "?";
}

namespace {
constexpr Pass kPasses[] = {Pass::Forward, Pass::Backward, Pass::ForwardWithGrad, Pass::ForwardKeepingLogits,
                            Pass::BackwardFromLogits};
}  // namespace

const char* pass_name(Pass pass) {
  switch (pass) {
    case Pass::Forward: return "forward";
    case Pass::Backward: return "backward";
    case Pass::ForwardWithGrad: return "forward_with_grad";
    case Pass::ForwardKeepingLogits: return "forward_keeping_logits";
    case Pass::BackwardFromLogits: return "backward_from_logits";
  }
  return "?";
}

Pass parse_pass(c10::string_view name) {
  std::string names;
  for (const Pass pass : kPasses) {
    if (name == pass_name(pass)) return pass;
    names += std::string(names.empty() ? "'" : ", '") + pass_name(pass) + "'";
  }
  TORCH_CHECK_VALUE(false, "fused_ce: pass must be one of ", names, ", got '", std::string(name), "'");
  return Pass::Forward;
}

}  // namespace fused_ce
