#include "plan.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "cuda_driver.h"
#include "cuda_stages.h"
#include "format.h"
#include "kernel_table.h"

namespace fused_ce {
namespace {

// 2048 rows of logits at V = 128256 (1024 at V = 256000) in bf16, so that the
// whole workspace stays under 0.5 GiB.
constexpr int64_t kDefaultCudaWorkspace = int64_t{504} << 20;
constexpr int64_t kDefaultCpuWorkspace = int64_t{32} << 20;
// Row blocks whose dW sums may be added in the input dtype: at D = 4096, V = 128256
// in bf16, 8 such additions leave dW's error 1.35x torch's single rounding, 16 leave 2x;
// float16's grow faster (1.33x after 3 additions, 1.57x after 6: benchmarks/results/2026-12-01/
// accuracy_per_token_s10_first.md), so it adds 4 at most.
int64_t input_dtype_accumulations(at::ScalarType dtype) {
  return dtype == at::kHalf ? 4 : 8;
}
// Vocabulary slices of the backward (backward_tiles): at most this many, their dX summed in float32.
constexpr int64_t kMaxSlices = 8;
// A per-token loss keeps some rows' logits (kept_logit_rows) only where at least this many fit: fewer save
// less than their block's GEMMs lose to their few rows.
constexpr int64_t kMinKeptRows = 512;
// logit_partials' partials per row at its smallest segments (3 floats per 1024 columns)
constexpr int64_t kPartialBytesPer1024Columns = 3 * sizeof(float);

int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The plan's per-architecture constants (configs.py, ARCH_CONSTANTS, embedded
// by the build): the device's entry, else the default (arch 0).
const ArchConstants& arch_constants(int arch) {
  const ArchConstants* fallback = nullptr;
  for (int i = 0; i < kNumArchConstants; ++i) {
    if (kArchConstants[i].arch == arch) return kArchConstants[i];
    if (kArchConstants[i].arch == 0) fallback = &kArchConstants[i];
  }
  TORCH_CHECK(fallback != nullptr, "fused_ce: the build embedded no plan constants");
  return *fallback;
}

}  // namespace

bool uses_row_kernels(const Problem& p) {
  if (!p.x.is_cuda() || p.N == 0) return false;
  if (cuda_kernels_available(p)) return true;
  const auto dtype = p.x.scalar_type();
  const bool kernel_dtype = dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat;
  if (kernel_dtype && !cuda_kernels_disabled()) {
    TORCH_WARN_ONCE("fused_ce: this build has no kernel for sm_", num(device_arch(p.x.device().index())),
                    "; using the slower chunked ATen path on CUDA. Rebuild with this architecture in "
                    "FUSED_CE_CUDA_ARCHS (see fused_ce.cuda_archs()).");
  }
  return false;
}

namespace {

// The rows per block actually used: at most `capacity`, balanced so that the last block is not a short tail
// (a thin block runs its GEMMs below their rate), in whole GEMM tiles where that takes no more blocks (each
// block more re-reads dW), else in 16s.
int64_t balanced_block_rows(int64_t N, int64_t capacity, int64_t tile_rows) {
  if (capacity >= N) return std::max<int64_t>(N, 1);
  const int64_t rows = cdiv(N, cdiv(N, capacity));
  for (const int64_t quantum : {tile_rows, int64_t{16}}) {
    if (capacity >= quantum && cdiv(rows, quantum) * quantum <= capacity) return cdiv(rows, quantum) * quantum;
  }
  if (capacity >= tile_rows) {  // whole tiles, one block more
    const int64_t limit = capacity / tile_rows * tile_rows;
    return cdiv(cdiv(N, cdiv(N, limit)), tile_rows) * tile_rows;
  }
  return rows;
}

// Bytes per row of the buffers a block of selected rows adds (Plan::counted_rows_only): its rows of x
// gathered and, with gradients, its rows of dX before they are scattered.
int64_t gathered_row_bytes(const Problem& p, Pass pass, bool selected) {
  if (!selected) return 0;
  const int64_t x_row = p.D * int64_t{c10::elementSize(p.x.scalar_type())};
  return pass == Pass::Forward ? x_row : 2 * x_row;
}

// Rows of stored logits (and their gathered rows) that fit in the budget.
int64_t stored_logits_rows(const Problem& p, int64_t budget, int64_t gathered_bytes) {
  return std::clamp<int64_t>(budget / (cuda_logits_row_bytes(p) + gathered_bytes), 1, std::max<int64_t>(p.N, 1));
}

// Plan::grad_scale for float16 gradient blocks: a power of two s with s * |g| < 65504 for every logit
// gradient g of a scalar loss at unit scale. |g| <= c * (1 + 2 z |lse|) plus smoothing's smaller term,
// where the row's coefficient c is at most 1 for 'mean' (its class weight over the sum of all counted
// rows' ones) and for 'sum' without class weights; 2^14 leaves room for the z-loss term up to |lse| = 100.
// 'sum' with class weights has c = the weight itself, unbounded: unit scale; so has the policy loss (its
// advantages have no bound).
double float16_grad_scale(const Problem& p, const LossOptions& o) {
  if ((o.reduction_kind == Reduction::Sum && p.class_weight.defined()) || o.policy_loss) return 1.0;
  return std::ldexp(1.0, 14 - static_cast<int>(std::ceil(std::log2(1.0 + 200.0 * o.z_loss))));
}

// Blocks of whole vocabulary rows re-read and re-write dW once per block beyond
// the first. Where that traffic would cost more than one more GEMM pass over
// N x D x V, as in lean workspaces, the gradients come from 2-D tiles instead
// (Strategy::VocabTiles). Returns the tiles' width, 0 for row blocks.
// Measured at 64 MiB (benchmarks/LOG.md, step 14): tiles win at B (128-row
// blocks) by a third, lose at A and C (256-row blocks) by ~3%; the threshold
// is not tuned yet.
int64_t vocab_tile_cols(const Problem& p, const ArchConstants& arch, int64_t budget, int64_t block_rows) {
  const int64_t elem = c10::elementSize(p.x.scalar_type());
  const int64_t blocks = cdiv(p.N, block_rows);
  const double dw_traffic_s = static_cast<double>(blocks - 1) * 2.0 * p.V * p.D * elem / arch.memory_bytes_per_s;
  const double gemm_pass_s = 2.0 * p.N * p.D * p.V / arch.gemm_flops_per_s;
  if (dw_traffic_s <= gemm_pass_s) return 0;
  const int64_t cols =
      budget / (std::min<int64_t>(p.N, arch.vocab_tile_rows) * elem) / arch.gemm_tile_rows * arch.gemm_tile_rows;
  return cols >= 4 * arch.gemm_tile_rows && cols < p.V ? cols : 0;
}

at::ScalarType accumulate_dtype(at::ScalarType dtype, int64_t blocks) {
  return blocks > 1 ? at::promote_types(dtype, at::kFloat) : dtype;
}

// The dtype dW accumulates in across `blocks` row blocks: the input dtype (each block's sum rounded once
// more) up to input_dtype_accumulations blocks, float32 beyond (a V x D float32 accumulator, 2 GiB at
// V = 128256, D = 4096, held while the gradient is computed, outside workspace_bytes) so that its error stays
// within 1.5x of one rounding at any N (benchmarks/LOG.md, step 18). An explicit workspace_bytes smaller
// than that accumulator is a lean request: it keeps the input dtype, trading dW's accuracy for memory.
at::ScalarType grad_weight_dtype(const Problem& p, const LossOptions& o, at::ScalarType dtype, int64_t blocks) {
  const int64_t accumulator_bytes = p.V * p.D * int64_t{4};
  const bool lean = o.workspace_bytes.has_value() && *o.workspace_bytes < accumulator_bytes;
  return blocks > input_dtype_accumulations(dtype) && !lean ? at::promote_types(dtype, at::kFloat) : dtype;
}

// ATen: whole vocabulary rows, as many rows as fit (at least one: a budget below one row of logits gets one row).
// The products run in the input dtype, as torch's F.linear (the weight is never converted: V x D beside it
// would dwarf any budget), the softmax in the loss dtype; a block holds its rows' logits in the loss dtype, the
// product's (or the gradient's) copy in the input dtype beside them, and one more loss-dtype temporary where
// the softcap's slope or the entropy needs one (aten_stages.cpp). dW of bfloat16 or float16 sums its row blocks
// in its own dtype up to input_dtype_accumulations blocks, beyond in a float32 accumulator where that fits in
// half the budget (the blocks take the rest), else in its own dtype: everything within workspace_bytes.
// float16's gradients at unit scale (the forward with gradient: loss.h) stay float32 through their products,
// the weight converted a slice at a time (gemm_into): float16 would lose them to underflow.
void plan_aten_chunks(Plan& plan, const Problem& p, const LossOptions& o, bool selected) {
  plan.strategy = Strategy::AtenChunks;
  const at::ScalarType dtype = p.x.scalar_type(), math = loss_dtype(p);
  const bool unit_float16 = dtype == at::kHalf && plan.pass == Pass::ForwardWithGrad;
  plan.logits_dtype = unit_float16 ? math : dtype;  // the dtype of the products' operands
  const int64_t math_bytes = c10::elementSize(math), elem = c10::elementSize(dtype);
  const bool temporary = p.softcap.has_value() || o.return_entropy;
  const int64_t row_bytes = p.V * (math_bytes + (elem < math_bytes ? elem : 0) + (temporary ? math_bytes : 0)) +
                            gathered_row_bytes(p, plan.pass, selected);
  const auto rows_within = [&](int64_t bytes) {
    return std::clamp<int64_t>(bytes / row_bytes, 1, std::max<int64_t>(p.N, 1));
  };
  plan.block_rows = rows_within(plan.budget_bytes);
  plan.tile_cols = p.V;
  int64_t accumulator_bytes = 0;
  if (plan.pass != Pass::Forward) {
    // each row's dX from one product over its whole vocabulary row
    plan.grad_input_dtype = plan.grad_weight_dtype = plan.logits_dtype;
    const int64_t float32_dw = p.V * p.D * int64_t{sizeof(float)};
    if (elem < math_bytes && !unit_float16 && cdiv(p.N, plan.block_rows) > input_dtype_accumulations(dtype) &&
        float32_dw <= plan.budget_bytes / 2) {
      plan.grad_weight_dtype = at::kFloat;
      accumulator_bytes = float32_dw;
      plan.block_rows = rows_within(plan.budget_bytes - accumulator_bytes);
    }
    // no row at all (every target ignored): zero gradients, made in the input dtype (float16's in float32, as
    // its forward with gradient always returns them: loss.h)
    if (p.N == 0)
      plan.grad_input_dtype = plan.grad_weight_dtype = p.x.scalar_type() == at::kHalf ? at::kFloat : p.x.scalar_type();
  }
  plan.workspace_bytes = std::min(plan.block_rows, p.N) * row_bytes + accumulator_bytes;
}

// tl.dot gradient blocks of the recomputing backward: all rows at once and a
// slice of the vocabulary per block where the budget allows, so that each
// slice's weight gradient is one exact GEMM over every row.
void plan_dot_tile_grads(Plan& plan, const Problem& p) {
  const int64_t elem = c10::elementSize(p.x.scalar_type());
  constexpr int64_t quantum = 256;
  const int64_t cols =
      std::max<int64_t>(quantum, plan.budget_bytes / std::max<int64_t>(1, p.N * elem) / quantum * quantum);
  plan.tile_cols = std::min(cols, p.V);
  plan.block_rows = std::clamp<int64_t>(plan.budget_bytes / (plan.tile_cols * elem), 1, p.N);
  plan.grad_input_dtype = accumulate_dtype(plan.logits_dtype, cdiv(p.V, plan.tile_cols));
  plan.grad_weight_dtype = accumulate_dtype(plan.logits_dtype, cdiv(p.N, plan.block_rows));
  const int64_t ld = cdiv(plan.tile_cols, 64) * 64;  // aligned rows for the kernel's stores and for cuBLAS
  plan.workspace_bytes = plan.block_rows * ld * elem;
}

// Pass::Backward's tiles of stored logits: `rows` rows x `cols` columns of the vocabulary (cols = V: row blocks
// of whole rows). The lse is known, so a tile needs no other columns of its rows. Row blocks re-read and
// re-write dW (V x D) once per block beyond the first; vocabulary slices re-read and re-write their rows' dX
// once per slice beyond the first, summed in a float32 buffer of the block's rows (in bf16 5 slices' sums
// left dX's error 1.6-1.8x torch's single rounding: accuracy_per_token_s10_first.md); a block of selected
// rows also holds its gathered x. Where V x D is the larger (large vocabularies), slices move less. Up to
// kMaxSlices slices, the count that moves the fewest bytes; `row_block_rows`: the row blocks' rows.
struct Tiles {
  int64_t rows = 0, cols = 0;
};

int64_t slice_row_bytes(const Problem& p, int64_t cols, bool selected) {
  const int64_t elem = c10::elementSize(p.x.scalar_type());
  return cols * elem + (selected ? p.D * elem : 0) + p.D * int64_t{sizeof(float)};
}

Tiles backward_tiles(const Problem& p, const LossOptions& o, const ArchConstants& arch, int64_t budget, bool selected,
                     int64_t row_block_rows) {
  const at::ScalarType dtype = p.x.scalar_type();
  const auto moved_bytes = [&](int64_t rows, int64_t slices) {
    const int64_t blocks = cdiv(p.N, rows);
    const double dw = (blocks - 1) * 2.0 * p.V * p.D * c10::elementSize(grad_weight_dtype(p, o, dtype, blocks));
    return dw + (slices - 1) * 2.0 * p.N * p.D * sizeof(float);
  };
  Tiles best{row_block_rows, p.V};
  double best_bytes = moved_bytes(row_block_rows, 1);
  for (int64_t slices = 2; slices <= kMaxSlices; ++slices) {
    const int64_t cols = cdiv(cdiv(p.V, slices), 16) * 16;  // aligned rows for the kernels and cuBLAS
    if (cdiv(p.V, cols) != slices || cols < 4 * arch.gemm_tile_rows) continue;
    const int64_t capacity = std::min<int64_t>(p.N, budget / slice_row_bytes(p, cols, selected));
    if (capacity < arch.min_stored_rows && capacity < p.N) continue;  // GEMMs of few rows run below their rate
    const int64_t rows = balanced_block_rows(p.N, capacity, arch.gemm_tile_rows);
    const double bytes = moved_bytes(rows, slices);
    if (bytes < best_bytes) {
      best = {rows, cols};
      best_bytes = bytes;
    }
  }
  return best;
}

void plan_kernels(Plan& plan, const Problem& p, const LossOptions& o, bool selected) {
  const ArchConstants& arch = arch_constants(device_arch(p.x.device().index()));
  const bool half = p.x.scalar_type() == at::kHalf;
  plan.rows_on_device = true;
  plan.logits_dtype = p.x.scalar_type();
  const int64_t gathered = gathered_row_bytes(p, plan.pass, selected);
  const int64_t capacity = stored_logits_rows(p, plan.budget_bytes, gathered);
  const int64_t row_bytes = cuda_logits_row_bytes(p) + gathered;
  // Stored cuBLAS logits where the budget has room for blocks of at least min_stored_rows rows (or all).
  const bool stored = capacity >= arch.min_stored_rows || capacity == p.N;
  // (Its rank-one gradient terms are added at unit scale: not to float16's scaled gradient blocks.)
  const bool rank_one = o.smoothing() && p.class_weight.defined() && !p.softcap.has_value() && !half;
  const auto stored_logits = [&](int64_t rows) {
    plan.strategy = Strategy::StoredLogits;
    plan.logits_scale = half ? kFloat16LogitsScale : 1.0;
    plan.block_rows = rows;
    plan.tile_cols = p.V;
    plan.workspace_bytes = rows * row_bytes;
  };
  if (plan.pass == Pass::ForwardKeepingLogits && plan.kept_rows < p.N) {
    // some rows kept: the others first, in Pass::Forward's blocks (their buffer freed), then the kept rows in one
    const int64_t forward_gathered = gathered_row_bytes(p, Pass::Forward, selected);
    Problem rest = p;
    rest.N = p.N - plan.kept_rows;
    const int64_t rest_capacity = stored_logits_rows(rest, plan.budget_bytes, forward_gathered);
    stored_logits(balanced_block_rows(rest.N, rest_capacity, arch.gemm_tile_rows));
    plan.workspace_bytes =
        std::max(plan.block_rows * (cuda_logits_row_bytes(p) + forward_gathered), plan.kept_rows * row_bytes);
    return;
  }
  if (plan.pass == Pass::ForwardKeepingLogits || (plan.pass == Pass::BackwardFromLogits && plan.kept_rows >= p.N)) {
    // the kept rows' logits in one block, kept from the forward for the backward (kept_logit_rows); where
    // they are every row, the backward's GEMMs run over all rows at once, dW in one product (one rounding)
    stored_logits(std::max<int64_t>(p.N, 1));
    if (plan.pass == Pass::BackwardFromLogits) {
      plan.grad_input_dtype = plan.grad_weight_dtype = plan.logits_dtype;
      plan.workspace_bytes = p.N * gathered;  // the logits are the forward's
    }
    return;
  }
  if (plan.pass == Pass::BackwardFromLogits) {
    // Some rows kept: their block first (whole rows: their dX in one product, dW's first write), then the
    // other rows' tiles of recomputed logits as Pass::Backward's, within the kept tensor's bytes, which the
    // kept block no longer needs by then (one more row block for dW's accumulation).
    Problem rest = p;
    rest.N = p.N - plan.kept_rows;
    const int64_t kept_bytes = plan.kept_rows * p.V * int64_t{c10::elementSize(plan.logits_dtype)};
    const int64_t rest_capacity = stored_logits_rows(rest, kept_bytes, gathered);
    const Tiles tiles = backward_tiles(rest, o, arch, kept_bytes, selected,
                                       balanced_block_rows(rest.N, rest_capacity, arch.gemm_tile_rows));
    stored_logits(tiles.rows);
    if (tiles.cols < p.V) {
      plan.strategy = Strategy::VocabTiles;
      plan.tile_cols = tiles.cols;
    }
    plan.grad_input_dtype = plan.logits_dtype;
    plan.grad_weight_dtype = grad_weight_dtype(p, o, plan.logits_dtype, 1 + cdiv(rest.N, tiles.rows));
    plan.workspace_bytes = plan.kept_rows * gathered;  // beside the kept tensor: the kept block's x and dX rows
    return;
  }
  if (plan.pass == Pass::Backward) {
    if (stored) {  // the gradient tiles from cuBLAS logits: row blocks (each row's dX written once) or slices
      const Tiles tiles = backward_tiles(p, o, arch, plan.budget_bytes, selected,
                                         balanced_block_rows(p.N, capacity, arch.gemm_tile_rows));
      stored_logits(tiles.rows);
      if (tiles.cols < p.V) {
        plan.strategy = Strategy::VocabTiles;
        plan.tile_cols = tiles.cols;
        plan.workspace_bytes = tiles.rows * slice_row_bytes(p, tiles.cols, selected);
      }
      plan.grad_input_dtype = plan.logits_dtype;
      plan.grad_weight_dtype = grad_weight_dtype(p, o, plan.logits_dtype, cdiv(p.N, plan.block_rows));
    } else {
      plan.strategy = Strategy::DotTiles;
      plan_dot_tile_grads(plan, p);
    }
    return;
  }
  if (plan.pass == Pass::Forward) {
    if (stored) {
      stored_logits(balanced_block_rows(p.N, capacity, arch.gemm_tile_rows));
      plan.rank_one_smoothing = rank_one;
    } else {  // no room for cuBLAS-sized blocks: tl.dot tiles reduced in registers
      plan.strategy = Strategy::DotTiles;
      plan.block_rows = p.N;
      plan.tile_cols = p.V;
    }
    return;
  }
  const int64_t rows = balanced_block_rows(p.N, capacity, arch.gemm_tile_rows);
  // (2-D tiles are not taught float16's scales, nor selected rows.)
  const int64_t cols = half || selected ? 0 : vocab_tile_cols(p, arch, plan.budget_bytes, rows);
  plan.rank_one_smoothing = rank_one;
  // Each row's dX is written once; dW accumulates across row blocks (grad_weight_dtype).
  plan.grad_input_dtype = plan.logits_dtype;
  if (cols > 0) {
    plan.strategy = Strategy::VocabTiles;
    plan.stats_block_rows = rows;
    plan.block_rows = balanced_block_rows(p.N, std::min<int64_t>(p.N, arch.vocab_tile_rows), arch.gemm_tile_rows);
    plan.tile_cols = cols;
    plan.workspace_bytes =
        std::max(rows * row_bytes, plan.block_rows * cols * int64_t{c10::elementSize(p.x.scalar_type())});
  } else {
    stored_logits(rows);
  }
  plan.grad_weight_dtype = grad_weight_dtype(p, o, plan.logits_dtype, cdiv(p.N, plan.block_rows));
  if (half) {  // gradient blocks at a scale, float32 gradients (Plan::grad_scale)
    plan.grad_scale = float16_grad_scale(p, o);
    plan.grad_input_dtype = plan.grad_weight_dtype = at::kFloat;
  }
}

// The plan of problem p's N rows, all of them or (`selected`) rows gathered from a larger x; `kept_rows`: the
// kept-logits passes' kept rows (-1: the forward's every row).
Plan plan_rows(const Problem& p, const LossOptions& o, Pass pass, bool selected, int64_t kept_rows = -1) {
  Plan plan;
  plan.pass = pass;
  plan.rows = p.N;
  if (pass == Pass::ForwardKeepingLogits) plan.kept_rows = kept_rows >= 0 ? std::min(kept_rows, p.N) : p.N;
  if (pass == Pass::BackwardFromLogits) plan.kept_rows = std::clamp<int64_t>(kept_rows, 0, p.N);
  plan.counted_rows_only = selected;
  plan.budget_bytes = o.workspace_bytes.value_or(p.x.is_cuda() ? kDefaultCudaWorkspace : kDefaultCpuWorkspace);
  const bool kept = pass == Pass::ForwardKeepingLogits || pass == Pass::BackwardFromLogits;
  if (uses_row_kernels(p)) {
    plan_kernels(plan, p, o, selected);
  } else {
    TORCH_CHECK(!kept || p.N == 0, "fused_ce: the kept-logits passes need the CUDA row kernels (keeps_logits)");
    plan_aten_chunks(plan, p, o, selected);
  }
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
  const ArchConstants& arch = arch_constants(p.x.is_cuda() ? device_arch(p.x.device().index()) : 0);
  return estimated_seconds(counted, p, arch) < estimated_seconds(all, p, arch);
}

}  // namespace

Plan make_plan(const Problem& p, const LossOptions& o, Pass pass, int64_t counted, int64_t kept) {
  TORCH_CHECK_VALUE(pass != Pass::ForwardWithGrad || o.scalar(),
                    "linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum' (a scalar loss)");
  if (o.vocab_parallel() && p.V != o.max_shard_rows) {
    // Every rank plans for the largest shard, so that all take the same row blocks (and so the same
    // collectives: vocab_parallel.h); the targets, and so the counted rows, are the same on every rank.
    Problem largest = p;
    largest.V = o.max_shard_rows;
    return make_plan(largest, o, pass, counted, kept);
  }
  const bool kept_pass = pass == Pass::ForwardKeepingLogits || pass == Pass::BackwardFromLogits;
  TORCH_CHECK(pass != Pass::BackwardFromLogits || kept >= 0, "fused_ce: Pass::BackwardFromLogits needs the kept rows");
  // (of the problem's own rows: a selection of rows is planned for a call that has decided)
  const bool keeps = (pass == Pass::Forward || pass == Pass::ForwardKeepingLogits) && !p.row_index.defined() &&
                     keeps_logits(p.x, p.w, p.target, o);
  const int64_t kept_rows = keeps ? kept_logit_rows(p.x, p.w, p.target, o).guard_int(__FILE__, __LINE__) : 0;
  // the kept rows the passes plan for: the caller's (the kept tensor's) for the backward, the problem's own for
  // its forward (a selection of rows: the one being kept, all of them)
  if (pass == Pass::ForwardKeepingLogits) kept = keeps ? kept_rows : -1;
  const auto with_keeps = [&](Plan plan) {
    plan.keeps_logits = kept_pass || keeps;
    if (pass == Pass::Forward) plan.kept_rows = std::min(kept_rows, plan.rows);
    return plan;
  };
  if (p.row_index.defined()) return with_keeps(plan_rows(p, o, pass, /*selected=*/true, kept));  // a selection
  const Plan all = plan_rows(p, o, pass, /*selected=*/false, kept);
  if (counted < 0 || counted >= p.N) return with_keeps(all);
  Problem counted_rows = p;
  counted_rows.N = counted;
  const Plan selected = plan_rows(counted_rows, o, pass, /*selected=*/true, kept);
  // the kept-logits passes always run on the counted rows (linear_cross_entropy_keeping_logits)
  return with_keeps(kept_pass || counted_rows_pay(selected, all, p) ? selected : all);
}

namespace {

// kept_logit_rows, or nullopt where none are kept.
std::optional<c10::SymInt> kept_rows_if_any(const at::Tensor& input, const at::Tensor& linear_weight,
                                            const at::Tensor& target, const LossOptions& o) {
  if (o.scalar() || !cuda_kernels_embedded(input.device(), input.scalar_type())) return std::nullopt;
  // every rank of a vocabulary-parallel group decides alike, for the largest shard (the same collectives)
  const c10::SymInt V = o.vocab_parallel() ? c10::SymInt(o.max_shard_rows) : linear_weight.sym_size(0);
  const int64_t elem = c10::elementSize(input.scalar_type());
  // the logits and, at most, the partials of logit_partials' smallest segments
  const c10::SymInt row_bytes = V * elem + (V + 1023) / 1024 * kPartialBytesPer1024Columns;
  const int64_t budget = o.workspace_bytes.value_or(kDefaultCudaWorkspace);
  if (target.sym_numel() * row_bytes <= budget) return target.sym_numel();  // (guards on symbolic sizes)
  // some rows: each with its gathered x and dX rows (counted rows selected) beside its logits
  const c10::SymInt rows = budget / (row_bytes + 2 * input.sym_size(-1) * elem);
  if (rows >= kMinKeptRows) return rows;
  return std::nullopt;
}

}  // namespace

c10::SymInt kept_logit_rows(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                            const LossOptions& o) {
  return kept_rows_if_any(input, linear_weight, target, o).value_or(c10::SymInt(0));
}

bool keeps_logits(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                  const LossOptions& o) {
  return kept_rows_if_any(input, linear_weight, target, o).has_value();
}

std::vector<int64_t> kept_logit_rows_constants() {
  return {kDefaultCudaWorkspace, kMinKeptRows, kPartialBytesPer1024Columns};
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
      {"logits_scale", plan.logits_scale},
      {"grad_input_dtype", dtype(plan.grad_input_dtype)},
      {"grad_weight_dtype", dtype(plan.grad_weight_dtype)},
      {"grad_scale", plan.grad_scale},
      {"rank_one_smoothing", plan.rank_one_smoothing},
      {"rows_on_device", plan.rows_on_device},
      {"budget_bytes", plan.budget_bytes},
      {"workspace_bytes", plan.workspace_bytes},
      {"keeps_logits", plan.keeps_logits},
      {"kept_rows", plan.kept_rows},
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
