// The strategies of each pass (plan.h): the ATen path's row blocks, and the embedded kernels' blocks and tiles.
#include "strategies.h"

#include <algorithm>
#include <cmath>

#include "float16_scales.h"

namespace fused_ce {
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
  const int64_t x_row = p.D * static_cast<int64_t>(c10::elementSize(p.x.scalar_type()));
  return pass == Pass::Forward ? x_row : 2 * x_row;
}

// Device memory per row of a block of stored logits: the logits and logit_partials' partials (3 floats each).
int64_t logits_row_bytes(const Problem& p, const DeviceFacts& device) {
  const int64_t partials = device.partials_block_v > 0 ? cdiv(p.V, device.partials_block_v) : 0;
  return p.V * static_cast<int64_t>(c10::elementSize(p.x.scalar_type())) + 3 * int64_t{sizeof(float)} * partials;
}

// Rows of stored logits (and their gathered rows) that fit in the budget.
int64_t stored_logits_rows(const Problem& p, const DeviceFacts& device, int64_t budget, int64_t gathered_bytes) {
  return std::clamp<int64_t>(budget / (logits_row_bytes(p, device) + gathered_bytes), 1, std::max<int64_t>(p.N, 1));
}

// Blocks of whole vocabulary rows re-read and re-write dW once per block beyond the first. Where that traffic
// would cost more than one more GEMM pass over N x D x V, as in lean workspaces, the gradients come from 2-D tiles
// instead (Strategy::VocabTiles). Returns the tiles' width, 0 for row blocks. Measured at 64 MiB (benchmarks/LOG.md,
// step 14): tiles win at B (128-row blocks) by a third, lose at A and C (256-row blocks) by ~3%; not tuned yet.
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

bool lean_request(const Problem& p, const LossOptions& o) {
  return o.workspace_bytes.has_value() && *o.workspace_bytes < p.V * p.D * int64_t{4};
}

// The dtype dW accumulates in across `blocks` row blocks: the input dtype (each block's sum rounded once
// more) where sums_weight_grad_in_input_dtype allows it, float32 beyond (a V x D float32 accumulator, 2 GiB at
// V = 128256, D = 4096, held while the gradient is computed, outside workspace_bytes) so that its error stays
// within 1.5x of one rounding at any N (benchmarks/LOG.md, step 18). An explicit workspace_bytes smaller
// than that accumulator is a lean request: the row blocks keep the input dtype, and dW comes from vocabulary
// slices of its own instead (weight_grad_slice_classes).
at::ScalarType grad_weight_dtype(const Problem& p, const LossOptions& o, at::ScalarType dtype, int64_t blocks) {
  return !sums_weight_grad_in_input_dtype(dtype, blocks) && !lean_request(p, o) ? at::promote_types(dtype, at::kFloat)
                                                                                : dtype;
}

// Where the row blocks would sum bfloat16's or float16's dW in that dtype (grad_weight_dtype, as planned) over
// more than input_dtype_accumulations blocks: dW from vocabulary slices of half the budget's worth of float32 rows
// instead (Plan::weight_grad_slice_classes; at least kMinWeightGradSliceClasses, beyond a budget smaller than
// that, as one row of logits is the CPU path's floor). Not the policy loss's, whose coefficients come from each
// block's stats, nor a vocabulary shard's.
void slice_weight_grad_if_inexact(Plan& plan, const Problem& p, const LossOptions& o, int64_t blocks) {
  const at::ScalarType dtype = p.x.scalar_type();
  if ((dtype != at::kBFloat16 && dtype != at::kHalf) || plan.grad_weight_dtype != dtype || o.policy_loss ||
      o.vocab_parallel() || sums_weight_grad_in_input_dtype(dtype, blocks)) {
    return;
  }
  plan.weight_grad_slice_classes = std::clamp<int64_t>(plan.budget_bytes / 2 / (p.D * int64_t{sizeof(float)}),
                                                       std::min(p.V, kMinWeightGradSliceClasses), p.V);
}

}  // namespace

// ATen: whole vocabulary rows, as many rows as fit (at least one: a budget below one row of logits gets one row).
// The products run in the input dtype, as torch's F.linear (the weight is never converted whole: V x D beside
// it would dwarf any budget), the softmax in the loss dtype; a block holds its rows' logits in the loss dtype,
// the product's (or the gradient's) copy in the input dtype beside them, and one more loss-dtype temporary where
// the softcap's slope or the entropy needs one (aten_stages.cpp). On a CPU without dot-product instructions in
// bfloat16 or float16 (DeviceFacts::float32_products) every product runs in float32 instead: the input-dtype
// copy's place holds a vocabulary slice of the weight converted to float32 (gemm_into, logits_into), and each row
// adds its x and dX in float32; the gradients keep the input dtype's plan. dW of bfloat16 or float16 sums its row
// blocks in its own dtype up to input_dtype_accumulations blocks, beyond in a float32 accumulator where that fits
// in half the budget (the blocks take the rest), else dW comes from vocabulary slices (weight_grad_slice_classes):
// everything within workspace_bytes. float16's gradients at unit scale (the forward with gradient: ops/cross_entropy.h)
// stay float32 through their products, the weight converted a slice at a time (gemm_into): float16 would lose them to
// underflow.
void plan_aten_chunks(Plan& plan, const Problem& p, const LossOptions& o, bool selected) {
  plan.strategy = Strategy::AtenChunks;
  const at::ScalarType dtype = p.x.scalar_type(), math = loss_dtype(p);
  const bool unit_float16 = dtype == at::kHalf && plan.pass == Pass::ForwardWithGrad;
  const bool float32_products = plan.device.float32_products;
  plan.logits_dtype = unit_float16 || float32_products ? math : dtype;  // the dtype of the products' operands
  if (float32_products) plan.logits_product_dtype = math;
  if (returns_scaled_float16_weight_grad(p, o, plan.pass)) plan.grad_weight_scale = 0.0;  // (from dW's largest element)
  const int64_t math_bytes = c10::elementSize(math), elem = c10::elementSize(dtype);
  const bool temporary = p.softcap.has_value() || o.return_entropy;
  const int64_t float32_rows = float32_products ? p.D * math_bytes * (plan.pass == Pass::Forward ? 1 : 2) : 0;
  const int64_t row_bytes = p.V * (math_bytes + (elem < math_bytes ? elem : 0) + (temporary ? math_bytes : 0)) +
                            float32_rows + gathered_row_bytes(p, plan.pass, selected);
  const auto rows_within = [&](int64_t bytes) {
    return std::clamp<int64_t>(bytes / row_bytes, 1, std::max<int64_t>(p.N, 1));
  };
  plan.block_rows = rows_within(plan.budget_bytes);
  plan.tile_cols = p.V;
  int64_t accumulator_bytes = 0;
  if (plan.pass != Pass::Forward) {
    // each row's dX from one product over its whole vocabulary row
    plan.grad_input_dtype = plan.grad_weight_dtype = unit_float16 ? math : dtype;
    const int64_t float32_dw = p.V * p.D * int64_t{sizeof(float)};
    if (elem < math_bytes && !unit_float16 && !sums_weight_grad_in_input_dtype(dtype, cdiv(p.N, plan.block_rows)) &&
        float32_dw <= plan.budget_bytes / 2) {
      plan.grad_weight_dtype = at::kFloat;
      accumulator_bytes = float32_dw;
      plan.block_rows = rows_within(plan.budget_bytes - accumulator_bytes);
    }
    slice_weight_grad_if_inexact(plan, p, o, cdiv(p.N, plan.block_rows));
    // no row at all (every target ignored): zero gradients, made in the input dtype (float16's in float32, as
    // its forward with gradient always returns them: ops/cross_entropy.h)
    if (p.N == 0)
      plan.grad_input_dtype = plan.grad_weight_dtype = p.x.scalar_type() == at::kHalf ? at::kFloat : p.x.scalar_type();
  }
  plan.workspace_bytes = std::min(plan.block_rows, p.N) * row_bytes + accumulator_bytes;
}

namespace {

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

// What every pass's kernel plan reads: the architecture's constants and the budget's stored-logits rows.
struct KernelContext {
  const Problem& p;
  const LossOptions& o;
  bool selected;
  const ArchConstants& arch;
  bool half;          // float16: its logits and gradient blocks at scales
  int64_t gathered;   // bytes a row of selected rows adds (gathered_row_bytes)
  int64_t capacity;   // rows of stored logits within the budget
  int64_t row_bytes;  // a stored row's bytes
  bool stored;        // room for cuBLAS-sized blocks (or all rows)
  bool rank_one;      // label smoothing's rank-one terms (not to float16's scaled blocks, nor a low-rank term)

  KernelContext(const Plan& plan, const Problem& problem, const LossOptions& options, bool selected_rows)
      : p(problem),
        o(options),
        selected(selected_rows),
        arch(plan.device.constants),
        half(problem.x.scalar_type() == at::kHalf),
        gathered(gathered_row_bytes(problem, plan.pass, selected_rows)),
        capacity(stored_logits_rows(problem, plan.device, plan.budget_bytes, gathered)),
        row_bytes(logits_row_bytes(problem, plan.device) + gathered),
        stored(capacity >= arch.min_stored_rows || capacity == problem.N),
        rank_one(options.smoothing() && problem.class_weight.defined() && !problem.softcap.has_value() && !half &&
                 !problem.low_rank.defined()) {}

  int64_t balanced(int64_t rows, int64_t cap) const { return balanced_block_rows(rows, cap, arch.gemm_tile_rows); }

  // Blocks of `rows` rows of stored cuBLAS logits (whole vocabulary rows).
  void stored_logits(Plan& plan, int64_t rows) const {
    plan.strategy = Strategy::StoredLogits;
    plan.logits_scale = half ? kFloat16LogitsScale : 1.0;
    plan.block_rows = rows;
    plan.tile_cols = p.V;
    plan.workspace_bytes = rows * row_bytes;
  }

  // Pass::Backward's tiles of stored logits (backward_tiles), vocabulary slices where they move fewer bytes.
  void backward_tiles_of(Plan& plan, const Problem& rows, int64_t budget, int64_t row_block_rows) const {
    const Tiles tiles = backward_tiles(rows, o, arch, budget, selected, row_block_rows);
    stored_logits(plan, tiles.rows);
    if (tiles.cols < p.V) {
      plan.strategy = Strategy::VocabTiles;
      plan.tile_cols = tiles.cols;
      plan.workspace_bytes = tiles.rows * slice_row_bytes(p, tiles.cols, selected);
    }
  }
};

void plan_forward(Plan& plan, const KernelContext& k) {
  if (k.stored) {
    k.stored_logits(plan, k.balanced(k.p.N, k.capacity));
    plan.rank_one_smoothing = k.rank_one;
  } else {  // no room for cuBLAS-sized blocks: tl.dot tiles reduced in registers
    plan.strategy = Strategy::DotTiles;
    plan.block_rows = k.p.N;
    plan.tile_cols = k.p.V;
  }
}

void plan_forward_keeping_logits(Plan& plan, const KernelContext& k) {
  if (plan.kept_rows >= k.p.N) {  // every row's logits in one block, kept from the forward for the backward
    k.stored_logits(plan, std::max<int64_t>(k.p.N, 1));
    return;
  }
  // some rows kept: the others first, in Pass::Forward's blocks (their buffer freed), then the kept rows in one
  const int64_t forward_gathered = gathered_row_bytes(k.p, Pass::Forward, k.selected);
  Problem rest = k.p;
  rest.N = k.p.N - plan.kept_rows;
  k.stored_logits(plan, k.balanced(rest.N, stored_logits_rows(rest, plan.device, plan.budget_bytes, forward_gathered)));
  plan.workspace_bytes =
      std::max(plan.block_rows * (logits_row_bytes(k.p, plan.device) + forward_gathered), plan.kept_rows * k.row_bytes);
}

void plan_backward_from_logits(Plan& plan, const KernelContext& k) {
  plan.grad_input_dtype = plan.grad_weight_dtype = plan.logits_dtype;
  if (plan.kept_rows >= k.p.N) {  // every row kept: the GEMMs over all rows at once, dW in one product
    k.stored_logits(plan, std::max<int64_t>(k.p.N, 1));
    plan.workspace_bytes = k.p.N * k.gathered;  // the logits are the forward's
    return;
  }
  // Some rows kept: their block first (whole rows: their dX in one product, dW's first write), then the other
  // rows' tiles of recomputed logits as Pass::Backward's, within the kept tensor's bytes, which the kept block
  // no longer needs by then (one more row block for dW's accumulation).
  Problem rest = k.p;
  rest.N = k.p.N - plan.kept_rows;
  const int64_t kept_bytes = plan.kept_rows * k.p.V * static_cast<int64_t>(c10::elementSize(plan.logits_dtype));
  k.backward_tiles_of(plan, rest, kept_bytes,
                      k.balanced(rest.N, stored_logits_rows(rest, plan.device, kept_bytes, k.gathered)));
  const int64_t blocks = 1 + cdiv(rest.N, plan.block_rows);
  plan.grad_weight_dtype = grad_weight_dtype(k.p, k.o, plan.logits_dtype, blocks);
  slice_weight_grad_if_inexact(plan, k.p, k.o, blocks);
  plan.workspace_bytes = plan.kept_rows * k.gathered;  // beside the kept tensor: the kept block's x and dX rows
}

// The row blocks of the forward with gradient and of the backward where they can sum dW in the input dtype (bf16;
// float16 at its dW scale). More blocks than input_dtype_accumulations sum dW in a float32 V x D accumulator beside
// the budget (4·V·D bytes; a float32 read-modify-write of dW per block, ~0.5 ms a 2048-row block at the Llama-3-8B
// shape, and a rounding pass). Instead the blocks grow to that many where they fit in the budget plus the
// accumulator's bytes: never more memory than the accumulator's plan, fewer and larger GEMMs, dW within its bound
// in the input dtype (strategies.h: bf16 2 blocks, float16 4, whose error is ~1/8 of torch eager's float16 error,
// where the logit gradient underflows). Not for a lean request (no accumulator to trade), nor where dW sums in
// float32 whatever the blocks (float16 without a dW scale). Returns `rows` where it does not apply.
int64_t rows_summing_dw_in_input_dtype(const Plan& plan, const KernelContext& k, int64_t rows) {
  const Problem& p = k.p;
  const at::ScalarType dtype = p.x.scalar_type();
  const bool float16_scaled =
      returns_scaled_float16_weight_grad(p, k.o, plan.pass) && float16_grad_weight_scale(p, k.o) > 0.0;
  const int64_t limit = input_dtype_accumulations(dtype);
  if (cdiv(p.N, rows) <= limit || lean_request(p, k.o) || !(dtype == at::kBFloat16 || float16_scaled)) return rows;
  // (a capacity in whole GEMM tiles, so that balancing does not add a block)
  const int64_t grown = k.balanced(p.N, cdiv(cdiv(p.N, limit), k.arch.gemm_tile_rows) * k.arch.gemm_tile_rows);
  const bool fits = grown * k.row_bytes <= plan.budget_bytes + p.V * p.D * int64_t{sizeof(float)};
  return fits && cdiv(p.N, grown) <= limit ? grown : rows;
}

void plan_backward(Plan& plan, const KernelContext& k) {
  if (!k.stored) {
    plan.strategy = Strategy::DotTiles;
    plan_dot_tile_grads(plan, k.p);
    return;
  }
  // the gradient tiles from cuBLAS logits: row blocks (each row's dX written once) or slices
  k.backward_tiles_of(plan, k.p, plan.budget_bytes,
                      rows_summing_dw_in_input_dtype(plan, k, k.balanced(k.p.N, k.capacity)));
  plan.grad_input_dtype = plan.logits_dtype;
  const int64_t blocks = cdiv(k.p.N, plan.block_rows);
  plan.grad_weight_dtype = grad_weight_dtype(k.p, k.o, plan.logits_dtype, blocks);
  slice_weight_grad_if_inexact(plan, k.p, k.o, blocks);
}

void plan_forward_with_grad(Plan& plan, const KernelContext& k) {
  const Problem& p = k.p;
  const int64_t rows = rows_summing_dw_in_input_dtype(plan, k, k.balanced(p.N, k.capacity));
  // (2-D tiles are not taught float16's scales, nor selected rows.)
  const int64_t cols = k.half || k.selected ? 0 : vocab_tile_cols(p, k.arch, plan.budget_bytes, rows);
  plan.rank_one_smoothing = k.rank_one;
  // Each row's dX is written once; dW accumulates across row blocks (grad_weight_dtype).
  plan.grad_input_dtype = plan.logits_dtype;
  if (cols > 0) {
    plan.strategy = Strategy::VocabTiles;
    plan.stats_block_rows = rows;
    plan.block_rows = k.balanced(p.N, std::min<int64_t>(p.N, k.arch.vocab_tile_rows));
    plan.tile_cols = cols;
    plan.workspace_bytes = std::max(rows * k.row_bytes,
                                    plan.block_rows * cols * static_cast<int64_t>(c10::elementSize(p.x.scalar_type())));
  } else {
    k.stored_logits(plan, rows);
  }
  const int64_t blocks = cdiv(p.N, plan.block_rows);
  plan.grad_weight_dtype = grad_weight_dtype(p, k.o, plan.logits_dtype, blocks);
  if (k.half) {  // gradient blocks at a scale (Plan::grad_scale), dX in float32, dW at grad_weight_scale
    plan.grad_scale = float16_grad_scale(p, k.o);
    plan.grad_input_dtype = plan.grad_weight_dtype = at::kFloat;
    // (not the policy loss: its coefficients have no bound, its dW stays float32)
    if (returns_scaled_float16_weight_grad(p, k.o, plan.pass)) {
      plan.grad_weight_scale = float16_grad_weight_scale(p, k.o);
      const bool in_float16 = blocks <= input_dtype_accumulations(at::kHalf) || lean_request(p, k.o);
      if (plan.grad_weight_scale > 0 && in_float16) plan.grad_weight_dtype = at::kHalf;
    }
  }
  slice_weight_grad_if_inexact(plan, p, k.o, blocks);
}

}  // namespace

void plan_kernels(Plan& plan, const Problem& p, const LossOptions& o, bool selected) {
  plan.rows_on_device = true;
  plan.logits_dtype = p.x.scalar_type();
  const KernelContext k(plan, p, o, selected);
  switch (plan.pass) {
    case Pass::Forward: return plan_forward(plan, k);
    case Pass::ForwardKeepingLogits: return plan_forward_keeping_logits(plan, k);
    case Pass::BackwardFromLogits: return plan_backward_from_logits(plan, k);
    case Pass::Backward: return plan_backward(plan, k);
    case Pass::ForwardWithGrad: return plan_forward_with_grad(plan, k);
  }
}

}  // namespace fused_ce
