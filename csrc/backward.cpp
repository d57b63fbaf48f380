// Pass::Backward: the gradients from blocks of recomputed logits (StoredLogits, VocabTiles:
// cuBLAS logits turned into their gradient in place; AtenChunks: ATen in the loss
// dtype; DotTiles: the logit_grad kernel), multiplied back through w and x by GEMMs.
#include <algorithm>

#include "aten_stages.h"
#include "cuda_stages.h"
#include "executors.h"
#include "format.h"
#include "plan.h"

namespace fused_ce {

namespace {

// Tensors carved from one buffer whose contents are no longer needed (the kept logits once their own rows'
// gradient has been multiplied back: later kernels on the stream come after those GEMMs), else allocated.
class Workspace {
 public:
  explicit Workspace(const at::Tensor& storage)
      : bytes_(storage.defined() ? storage.view({-1}).view(at::kByte) : at::Tensor()) {}

  at::Tensor take(at::IntArrayRef shape, const at::TensorOptions& options) {
    const int64_t numel = c10::multiply_integers(shape);
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
    const int64_t begin = (used_ + 255) / 256 * 256;  // aligned for every dtype and for cuBLAS
    if (!bytes_.defined() || begin + bytes > bytes_.numel()) return at::empty(shape, options);
    used_ = begin + bytes;
    return bytes_.narrow(0, begin, bytes).view(options.dtype().toScalarType()).view(shape);
  }

 private:
  at::Tensor bytes_;
  int64_t used_ = 0;
};

// StoredLogits and VocabTiles: per tile of the plan (block_rows x tile_cols; whole rows for StoredLogits), cuBLAS
// logits turned into their gradient in place (softmax_grad, given the rows' lse), multiplied back by cuBLAS. A
// block's selected rows are gathered once for all its slices; a block's dX is one product of whole rows, or its
// slices' products summed in float32 (backward_tiles); dW accumulates over the row blocks. With logits the
// forward kept (`kept`, its first `kept_rows` rows), those rows are the first block (whole rows), and the other
// rows' tiles and buffers take the kept tensor's storage after them (Pass::BackwardFromLogits' plan).
Grads stored_logit_grads(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c,
                         GradMask need, const at::Tensor& kept = {}) {
  const bool need_x = need[0], need_w = need[1], need_b = need[2] && p.bias.defined();
  Grads g = allocate_grads(p, plan, need);
  if (p.N == 0 || !(need_x || need_w || need_b || g.low_rank_input.defined())) return g;
  // The kernel multiplies the gradient by logit_scale / logits_scale (reading_stored_logits): the
  // coefficients take logits_scale, so that the blocks hold the gradient itself.
  const GradCoefficients scaled = plan.logits_scale == 1.0 ? c : c.scaled(plan.logits_scale);
  const Problem stored = reading_stored_logits(p, plan);
  const int64_t first = kept.defined() ? std::min(plan.kept_rows, p.N) : 0;  // rows of the kept block
  at::Tensor ones;
  const auto tile_grads = [&](const Problem& pt, const GradCoefficients& cr, const at::Tensor& block,
                              const at::Tensor& gx, const at::Tensor& x, int64_t r0, int64_t v0) {
    cuda_softmax_grad(pt, cr, cr.lse, block, o.smoothing());
    if (need_x) gemm_into(gx, block, pt.w, /*accumulate=*/v0 > 0);
    if (need_w) gemm_into(g.weight.narrow(0, v0, pt.V), block.t(), x, /*accumulate=*/r0 > 0);
    if (need_b) add_column_sums(g.bias.narrow(0, v0, pt.V), block, ones);
    add_low_rank_grads(p, g, pt, block, r0, v0);
  };
  if (first > 0) {  // the kept rows: whole rows, their dX in one product
    const Problem pr = stored.block(0, first);
    at::Tensor gx_buffer;
    const at::Tensor gx = need_x ? input_grad_rows(p, g.input, gx_buffer, 0, first) : at::Tensor();
    tile_grads(pr, scaled.block(0, first), kept.narrow(0, 0, first), gx, pr.x, 0, 0);
    if (need_x) scatter_input_grad(p, g.input, gx, 0);
  }
  if (first == p.N) return g;
  const int64_t cols = plan.tile_cols, rows = std::min(plan.block_rows, p.N - first);
  const bool sliced = cols < p.V;
  Workspace workspace(kept);
  const at::Tensor buffer = workspace.take({rows * cols}, p.x.options());
  const at::Tensor gx_sums =
      need_x && sliced ? workspace.take({rows, p.D}, p.x.options().dtype(at::kFloat)) : at::Tensor();
  // selected rows: their x gathered (once per block for all its slices), their dX before its scatter
  const at::Tensor gathered = p.row_index.defined() ? workspace.take({rows, p.D}, p.x.options()) : at::Tensor();
  at::Tensor gx_buffer =
      need_x && !sliced && p.row_index.defined() ? workspace.take({rows, p.D}, p.x.options()) : at::Tensor();
  for (int64_t r0 = first; r0 < p.N; r0 += plan.block_rows) {
    const int64_t r1 = std::min(p.N, r0 + plan.block_rows);
    const Problem pr = stored.block(r0, r1, gathered);
    const GradCoefficients cr = scaled.block(r0, r1);
    const at::Tensor gx = !need_x  ? at::Tensor()
                          : sliced ? gx_sums.narrow(0, 0, r1 - r0)
                                   : input_grad_rows(p, g.input, gx_buffer, r0, r1);
    for (int64_t v0 = 0; v0 < p.V; v0 += cols) {
      const Problem pt = sliced ? pr.cols(v0, std::min(p.V, v0 + cols)) : pr;
      at::Tensor block = buffer.narrow(0, 0, pt.N * pt.V).view({pt.N, pt.V});  // contiguous
      logits_into(pt, block, plan.logits_scale);
      tile_grads(pt, cr, block, gx, pr.x, r0, v0);
    }
    if (need_x && sliced && !p.row_index.defined()) {
      g.input.narrow(0, r0, r1 - r0).copy_(gx);
    } else if (need_x) {  // (selected rows: their gathered x, read no more, takes the sums in the input dtype)
      scatter_input_grad(p, g.input, sliced ? pr.x.copy_(gx) : gx, r0);
    }
  }
  return g;
}

}  // namespace

Grads grads_from_kept_logits(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c,
                             GradMask need, const at::Tensor& kept) {
  if (p.N == 0) return allocate_grads(p, plan, need);  // zeros
  TORCH_CHECK(plan.pass == Pass::BackwardFromLogits &&
                  (plan.strategy == Strategy::StoredLogits || plan.strategy == Strategy::VocabTiles),
              "fused_ce: kept logits are read by Pass::BackwardFromLogits' stored_logits or vocab_tiles plan");
  // (where only some rows were kept, the others' tiles take its storage: contiguous)
  TORCH_CHECK(kept.dim() == 2 && kept.size(0) >= plan.kept_rows && kept.size(1) == p.V && kept.stride(1) == 1 &&
                  (plan.kept_rows >= p.N || kept.is_contiguous()) && kept.scalar_type() == plan.logits_dtype &&
                  kept.device() == p.x.device(),
              "fused_ce: the kept logits must be [>= ", num(plan.kept_rows), ", ", num(p.V), "] contiguous ",
              name(plan.logits_dtype), " rows on ", p.x.device().str(), ", got ", shape(kept.sizes()), " ",
              name(kept.scalar_type()));
  return stored_logit_grads(p, o, plan, c, need, kept);
}

at::Tensor weight_grad_by_slices(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c) {
  const int64_t classes = plan.weight_grad_slice_classes;
  TORCH_CHECK(classes > 0, "fused_ce: weight_grad_by_slices needs a plan with weight_grad_slice_classes");
  // float16's forward with gradient: its blocks at Plan::grad_scale (at unit scale they would underflow), its dW
  // returned at Plan::grad_weight_scale (ops/cross_entropy.h)
  const bool scaled = plan.pass == Pass::ForwardWithGrad && p.x.scalar_type() == at::kHalf;
  const GradCoefficients blocks = scaled ? c.scaled(plan.grad_scale) : c;
  const double out_scale = scaled ? plan.grad_weight_scale / plan.grad_scale : 1.0;
  at::Tensor gw = at::empty({p.V, p.D}, p.x.options());
  // Each slice is the backward of its classes alone, its dW summed over the row blocks in a float32 accumulator
  // of the slice (allocate_grads: [classes, D], one slice at a time), rounded once; its blocks take what that
  // leaves of the budget.
  LossOptions slice_options = o;
  slice_options.workspace_bytes =
      std::max(plan.budget_bytes - classes * p.D * int64_t{sizeof(float)}, plan.budget_bytes / 2);
  for (int64_t v0 = 0; v0 < p.V; v0 += classes) {
    Problem slice = p.cols(v0, std::min(p.V, v0 + classes));
    slice.low_rank.grads = false;  // (the row blocks form them)
    Plan slice_plan = make_plan(slice, slice_options, plan.device, Pass::Backward);
    slice_plan.weight_grad_slice_classes = 0;
    slice_plan.grad_weight_dtype = at::kFloat;
    at::Tensor sum = recomputed_grads(slice, slice_options, slice_plan, blocks, {false, true, false}).weight;
    gw.narrow(0, v0, slice.V).copy_(out_scale == 1.0 ? sum : sum.mul_(out_scale));
  }
  return gw;
}

Grads recomputed_grads(const Problem& p, const LossOptions& o, const Plan& plan, const GradCoefficients& c,
                       GradMask need) {
  if (plan.strategy == Strategy::StoredLogits || plan.strategy == Strategy::VocabTiles)
    return stored_logit_grads(p, o, plan, c, need);
  const bool dot_tiles = plan.strategy == Strategy::DotTiles;
  TORCH_CHECK(dot_tiles || plan.strategy == Strategy::AtenChunks,
              "fused_ce: the backward has no executor for strategy ", strategy_name(plan.strategy));
  const bool need_x = need[0], need_w = need[1], need_b = need[2] && p.bias.defined();
  const auto opts = p.x.options();
  const auto gemm_dtype = plan.logits_dtype;
  Grads g = allocate_grads(p, plan, need);
  if (p.N == 0) return g;  // zeros
  at::Tensor block_buffer, gx_buffer, ones;
  if (dot_tiles) {
    const int64_t ld = (plan.tile_cols + 63) / 64 * 64;  // aligned rows for the kernel's stores and for cuBLAS
    block_buffer = at::empty({plan.block_rows, ld}, opts.dtype(gemm_dtype));
  }
  for (int64_t r0 = 0; r0 < p.N && (need_x || need_w || need_b || g.low_rank_input.defined()); r0 += plan.block_rows) {
    const int64_t r1 = std::min(p.N, r0 + plan.block_rows);
    const Problem pr = p.block(r0, r1);
    const GradCoefficients cr = c.block(r0, r1);
    const at::Tensor x = pr.x.to(gemm_dtype);
    const at::Tensor gx = need_x ? input_grad_rows(p, g.input, gx_buffer, r0, r1) : at::Tensor();
    for (int64_t v0 = 0; v0 < p.V; v0 += plan.tile_cols) {
      const int64_t v1 = std::min(p.V, v0 + plan.tile_cols);
      at::Tensor block;
      if (dot_tiles) {
        block = block_buffer.narrow(0, 0, r1 - r0).narrow(1, 0, v1 - v0);
        cuda_logit_grad(pr, cr, v0, v1, block);
      } else {
        block = aten_logit_grad(pr, cr, v0, v1, plan.logits_product_dtype).to(gemm_dtype);
      }
      if (need_x) gemm_into(gx, block, p.w.narrow(0, v0, v1 - v0), v0 > 0);
      if (need_w) gemm_into(g.weight.narrow(0, v0, v1 - v0), block.t(), x, r0 > 0);
      if (need_b) add_column_sums(g.bias.narrow(0, v0, v1 - v0), block, ones);
      add_low_rank_grads(p, g, pr.cols(v0, v1), block, r0, v0);
    }
    if (need_x) scatter_input_grad(p, g.input, gx, r0);
  }
  return g;
}

}  // namespace fused_ce
