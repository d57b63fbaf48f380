// Pass::Backward: the gradients from blocks of recomputed logits (StoredLogits, VocabTiles:
// cuBLAS logits turned into their gradient in place; AtenChunks: ATen in the loss
// dtype; DotTiles: the logit_grad kernel), multiplied back through w and x by GEMMs.
#include <algorithm>

#include "aten_stages.h"
#include "cuda_stages.h"
#include "executors.h"

namespace fused_ce {

namespace {

// cuBLAS accumulating a bf16/fp16 product straight into a float32 out
// (addmm.dtype_out with out as self): torch accepts a float32 self there from
// some version on; probed once per process, else a float32 product is added.
bool float32_accumulating_addmm(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  static const bool supported = [&] {
    try {
      at::Tensor acc = at::zeros({1, 1}, out.options());
      at::addmm_out(acc, acc, at::ones({1, 1}, a.options()), at::ones({1, 1}, b.options()), at::kFloat);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return supported;
}

}  // namespace

void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate, double alpha) {
  if (out.scalar_type() == a.scalar_type()) {
    if (accumulate) {
      out.addmm_(a, b, /*beta=*/1, alpha);
    } else if (alpha == 1) {
      at::mm_out(out, a, b);
    } else {
      at::addmm_out(out, out, a, b, /*beta=*/0, alpha);  // beta 0: out's contents are not read
    }
  } else if (out.is_cuda() && out.scalar_type() == at::kFloat && float32_accumulating_addmm(out, a, b)) {
    at::addmm_out(out, out, a, b, at::kFloat, /*beta=*/accumulate ? 1 : 0, alpha);
  } else {
    // a product in out's dtype: float16's, of gradient blocks at Plan::grad_scale, could overflow
    const at::Tensor product = at::mm(a.to(out.scalar_type()), b.to(out.scalar_type()));
    if (accumulate) {
      out.add_(product, alpha);
    } else {
      at::mul_out(out, product, alpha);
    }
  }
}

void add_column_sums(at::Tensor out, const at::Tensor& block, at::Tensor& ones, double alpha) {
  if (!block.is_cuda()) {  // (ATen's pairwise sums: float32 blocks' sums as accurate as torch's)
    out.add_(block.sum(0, false, out.scalar_type()), alpha);
    return;
  }
  // on CUDA a product with a row of ones (cuBLAS, in out's dtype): ATen's column reduction of a large block
  // allocated a staging buffer of about the block's size (measured: 26 MiB for a 1.5k-row tile, beyond the budget)
  if (!ones.defined() || ones.size(1) < block.size(0)) ones = at::ones({1, block.size(0)}, block.options());
  gemm_into(out.view({1, -1}), ones.narrow(1, 0, block.size(0)), block, /*accumulate=*/true, alpha);
}

Grads allocate_grads(const Problem& p, const Plan& plan, GradMask need) {
  const auto opts = p.x.options();
  Grads g;
  if (need[0]) {
    g.input = p.row_index.defined() ? at::zeros({p.x.size(0), p.D}, opts.dtype(plan.grad_input_dtype))
                                    : at::empty({p.N, p.D}, opts.dtype(plan.grad_input_dtype));
  }
  if (need[1]) {  // zeros where no row will add to it
    g.weight = p.N == 0 ? at::zeros({p.V, p.D}, opts.dtype(plan.grad_weight_dtype))
                        : at::empty({p.V, p.D}, opts.dtype(plan.grad_weight_dtype));
  }
  if (need[2] && p.bias.defined()) g.bias = at::zeros({p.V}, opts.dtype(loss_dtype(p)));
  return g;
}

at::Tensor input_grad_rows(const Problem& p, const at::Tensor& grad_input, at::Tensor& buffer, int64_t r0, int64_t r1) {
  if (!p.row_index.defined()) return grad_input.narrow(0, r0, r1 - r0);
  if (!buffer.defined()) buffer = at::empty({std::min<int64_t>(p.N, r1 - r0), p.D}, grad_input.options());
  return buffer.narrow(0, 0, r1 - r0);
}

void scatter_input_grad(const Problem& p, const at::Tensor& grad_input, const at::Tensor& rows, int64_t r0) {
  if (p.row_index.defined()) grad_input.index_copy_(0, p.row_index.narrow(0, r0, rows.size(0)), rows);
}

namespace {

// Tensors carved from one buffer whose contents are no longer needed (the kept logits once their own rows'
// gradient has been multiplied back: later kernels on the stream come after those GEMMs), else allocated.
class Workspace {
 public:
  explicit Workspace(const at::Tensor& storage)
      : bytes_(storage.defined() ? storage.view({-1}).view(at::kByte) : at::Tensor()) {}

  at::Tensor take(at::IntArrayRef shape, const at::TensorOptions& options) {
    const int64_t numel = c10::multiply_integers(shape);
    const int64_t bytes = numel * int64_t{c10::elementSize(options.dtype().toScalarType())};
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
  if (p.N == 0 || !(need_x || need_w || need_b)) return g;
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
  };
  if (first > 0) {  // the kept rows: whole rows, their dX in one product
    const Problem pr = stored.rows(0, first);
    at::Tensor gx_buffer;
    const at::Tensor gx = need_x ? input_grad_rows(p, g.input, gx_buffer, 0, first) : at::Tensor();
    tile_grads(pr, scaled.rows(0, first), kept.narrow(0, 0, first), gx, pr.x, 0, 0);
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
    const Problem pr = stored.rows(r0, r1, gathered);
    const GradCoefficients cr = scaled.rows(r0, r1);
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
              "fused_ce: the kept logits must be [>= ", plan.kept_rows, ", ", p.V, "] contiguous ",
              c10::toString(plan.logits_dtype), " rows on ", p.x.device().str(), ", got ", kept.sizes(), " ",
              kept.scalar_type());
  return stored_logit_grads(p, o, plan, c, need, kept);
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
  const at::Tensor w = p.w.to(gemm_dtype);
  at::Tensor block_buffer, gx_buffer, ones;
  if (dot_tiles) {
    const int64_t ld = (plan.tile_cols + 63) / 64 * 64;  // aligned rows for the kernel's stores and for cuBLAS
    block_buffer = at::empty({plan.block_rows, ld}, opts.dtype(gemm_dtype));
  }
  for (int64_t r0 = 0; r0 < p.N && (need_x || need_w || need_b); r0 += plan.block_rows) {
    const int64_t r1 = std::min(p.N, r0 + plan.block_rows);
    const Problem pr = p.rows(r0, r1);
    const GradCoefficients cr = c.rows(r0, r1);
    const at::Tensor x = pr.x.to(gemm_dtype);
    const at::Tensor gx = need_x ? input_grad_rows(p, g.input, gx_buffer, r0, r1) : at::Tensor();
    for (int64_t v0 = 0; v0 < p.V; v0 += plan.tile_cols) {
      const int64_t v1 = std::min(p.V, v0 + plan.tile_cols);
      at::Tensor block;
      if (dot_tiles) {
        block = block_buffer.narrow(0, 0, r1 - r0).narrow(1, 0, v1 - v0);
        cuda_logit_grad(pr, cr, v0, v1, block);
      } else {
        block = aten_logit_grad(pr, cr, v0, v1).to(gemm_dtype);
      }
      if (need_x) gemm_into(gx, block, w.narrow(0, v0, v1 - v0), v0 > 0);
      if (need_w) gemm_into(g.weight.narrow(0, v0, v1 - v0), block.t(), x, r0 > 0);
      if (need_b) add_column_sums(g.bias.narrow(0, v0, v1 - v0), block, ones);
    }
    if (need_x) scatter_input_grad(p, g.input, gx, r0);
  }
  return g;
}

}  // namespace fused_ce
