// The block helpers the executors share (blocks.h).
#include "blocks.h"

#include <algorithm>

#include "cuda_stages.h"
#include "loss_terms.h"

namespace fused_ce {

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
    const Problem pr = stored.block(r0, r1);
    logits_into(pr, logits, plan.logits_scale);
    cuda_stats_from_logits(pr, logits, s.block(r0, r1));
  }
  return s;
}

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

// out (+)= alpha * a @ b formed in `wide` (float32) and rounded once into out's narrower dtype: the CPU's
// float32 products of bfloat16 and float16 inputs (Plan::logits_product_dtype). Each converted slice is no
// larger than an input-dtype copy of a (the gradient block, whose place the plan holds for it): where b is to be
// converted (the weight), slices of the inner dimension summed into a float32 copy of out (a row block's dX);
// else slices of out's rows (dW's classes).
void wide_product_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate, double alpha,
                       at::ScalarType wide) {
  const int64_t places = a.numel() * static_cast<int64_t>(c10::elementSize(out.scalar_type())) /
                         static_cast<int64_t>(c10::elementSize(wide));  // wide elements in that place
  const at::Tensor a_wide = a.to(wide);
  if (b.scalar_type() != wide) {
    const int64_t k = a.size(1);
    const int64_t step = std::clamp<int64_t>(places / std::max<int64_t>(b.size(1), 1), 1, std::max<int64_t>(k, 1));
    // (what out held, where accumulating, converted into the sum: out.add_(sum) would convert both operands)
    at::Tensor sum = accumulate ? out.to(wide) : at::zeros(out.sizes(), out.options().dtype(wide));
    for (int64_t k0 = 0; k0 < k; k0 += step) {
      const int64_t n = std::min(step, k - k0);
      sum.addmm_(a_wide.narrow(1, k0, n), b.narrow(0, k0, n).to(wide), /*beta=*/1, alpha);
    }
    out.copy_(sum);
    return;
  }
  const int64_t m = out.size(0);
  const int64_t step = std::clamp<int64_t>(places / std::max<int64_t>(out.size(1), 1), 1, std::max<int64_t>(m, 1));
  for (int64_t m0 = 0; m0 < m; m0 += step) {
    const int64_t n = std::min(step, m - m0);
    at::Tensor rows = out.narrow(0, m0, n);
    at::Tensor part = accumulate ? rows.to(wide) : at::empty({n, out.size(1)}, out.options().dtype(wide));
    at::addmm_out(part, part, a_wide.narrow(0, m0, n), b, /*beta=*/accumulate ? 1 : 0, alpha);
    rows.copy_(part);
  }
}

}  // namespace

void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate, double alpha) {
  const auto dtype = out.scalar_type();
  const auto wide = at::promote_types(a.scalar_type(), b.scalar_type());
  if (!out.is_cuda() && wide != dtype && at::promote_types(wide, dtype) == wide) {
    wide_product_into(std::move(out), a, b, accumulate, alpha, wide);
  } else if (a.scalar_type() == dtype && b.scalar_type() == dtype) {
    if (accumulate) {
      out.addmm_(a, b, /*beta=*/1, alpha);
    } else if (alpha == 1) {
      at::mm_out(out, a, b);
    } else {
      at::addmm_out(out, out, a, b, /*beta=*/0, alpha);  // beta 0: out's contents are not read
    }
  } else if (out.is_cuda() && dtype == at::kFloat && a.scalar_type() == b.scalar_type() &&
             float32_accumulating_addmm(out, a, b)) {
    at::addmm_out(out, out, a, b, at::kFloat, /*beta=*/accumulate ? 1 : 0, alpha);
  } else {
    // a product in out's dtype (float16's, of gradient blocks at Plan::grad_scale or unit scale, could
    // overflow or underflow in its own), the operands converted a slice of the inner dimension at a time, each
    // slice of b no larger than a: never a converted copy of the weight (V x D) beside it
    const int64_t k = a.size(1);
    const int64_t step = std::clamp<int64_t>(b.size(1) > 0 ? a.numel() / b.size(1) : k, 1, std::max<int64_t>(k, 1));
    for (int64_t k0 = 0; k0 < k; k0 += step) {
      const int64_t n = std::min(step, k - k0);
      // (into out itself: no out-sized product beside it; beta 0 leaves out's contents unread)
      at::addmm_out(out, out, a.narrow(1, k0, n).to(dtype), b.narrow(0, k0, n).to(dtype),
                    /*beta=*/accumulate || k0 > 0 ? 1 : 0, alpha);
    }
    if (k == 0 && !accumulate) out.zero_();
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

std::pair<at::Tensor, at::Tensor> float16_weight_grad(const at::Tensor& grad_weight, double scale) {
  if (scale > 0) {
    const at::Tensor half = grad_weight.scalar_type() == at::kHalf ? grad_weight : grad_weight.to(at::kHalf);
    return {half, at::full({}, scale, grad_weight.options().dtype(at::kFloat))};
  }
  const auto [lo, hi] = at::aminmax(grad_weight);
  const at::Tensor largest = at::maximum(hi, lo.neg()).to(at::kFloat);
  const at::Tensor power =
      at::exp2(at::clamp(at::floor(at::log2(largest.reciprocal() * Plan::kFloat16WeightGradBound)), -64, 64));
  at::Tensor half = at::empty(grad_weight.sizes(), grad_weight.options().dtype(at::kHalf));
  at::mul_out(half, grad_weight, power);  // rounded once, no float32 temporary
  return {half, power};
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
  if (p.low_rank.defined() && p.low_rank.grads) {
    g.low_rank_input = at::zeros(p.low_rank.input.sizes(), opts.dtype(loss_dtype(p)));
    g.low_rank_weight = at::zeros(p.low_rank.weight.sizes(), opts.dtype(loss_dtype(p)));
  }
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

void add_low_rank_grads(const Problem& p, const Grads& g, const Problem& pt, const at::Tensor& block, int64_t r0,
                        int64_t v0, double alpha) {
  if (!g.low_rank_input.defined()) return;
  // In the block's dtype (the rank-r operands converted: small), each product then added to the accumulators: a
  // mixed-dtype product would convert the block instead (gemm_into), beyond the budget.
  const auto as_block = [&](const at::Tensor& t) { return t.to(block.scalar_type()); };
  const at::Tensor input_part = at::mm(block, as_block(pt.low_rank.weight));
  const int64_t rows = block.size(0);
  if (p.row_index.defined()) {
    g.low_rank_input.index_add_(0, p.row_index.narrow(0, r0, rows), input_part.to(g.low_rank_input.scalar_type()),
                                alpha);
  } else {
    g.low_rank_input.narrow(0, r0, rows).add_(input_part, alpha);
  }
  g.low_rank_weight.narrow(0, v0, block.size(1)).add_(at::mm(block.t(), as_block(pt.low_rank.input)), alpha);
}

}  // namespace fused_ce
