// The stages in ATen: the CPU implementation, and the CUDA fallback where no
// embedded cubin fits the device.
#include "aten_stages.h"

#include <algorithm>
#include <cmath>

namespace fused_ce {

namespace {

// Transformed logits z for all rows of p and columns [v_begin, v_end), in the loss dtype: the product (and
// the bias) in `product_dtype` (Plan::logits_product_dtype: the input dtype, as torch's F.linear, so that the
// weight is never converted whole, or float32: logits_into); float16's at kFloat16LogitsScale, finite beyond
// float16's range.
at::Tensor logits(const Problem& p, int64_t v_begin, int64_t v_end, at::ScalarType product_dtype) {
  const Problem slice = p.cols(v_begin, v_end);
  const double scale = p.x.scalar_type() == at::kHalf ? kFloat16LogitsScale : 1.0;
  at::Tensor product = at::empty({p.N, slice.V}, p.x.options().dtype(product_dtype));
  logits_into(slice, product, scale);
  at::Tensor z = product.to(loss_dtype(p));
  if (p.logit_scale / scale != 1.0) z.mul_(p.logit_scale / scale);
  if (p.softcap) z.div_(*p.softcap).tanh_().mul_(*p.softcap);
  return z;
}

// The row stats read off the logits z (over the whole vocabulary) before the softmax: the target's logit
// (target_gap until the max is known), the class-weighted sum, the argmax (torch's: the first on ties).
RowStats linear_stats_of(const Problem& p, const at::Tensor& z, const StatsRequest& request) {
  RowStats s;
  s.target_gap = z.gather(1, p.target.clamp_min(0).unsqueeze(1)).squeeze(1);
  if (request.weighted_sums) {
    s.weighted_z_sum = p.class_weight.defined() ? z.matmul(p.class_weight.to(z.scalar_type())) : z.sum(1);
  }
  if (request.argmax) s.argmax = z.argmax(1);
  return s;
}

// -sum p log p from e = exp(z - m) (e * log e is 0 where e is 0) and log_sum = log sum e.
at::Tensor entropy_of(const at::Tensor& e, const at::Tensor& log_sum) {
  return log_sum - at::special_xlogy(e, e).sum(1) / e.sum(1);
}

// The row max as logsumexp takes it: 0 where it is infinite.
at::Tensor row_max(const at::Tensor& z) {
  at::Tensor m = std::get<0>(z.max(1, /*keepdim=*/true));
  return m.masked_fill_(m.abs() == INFINITY, 0);
}

// Completes linear_stats_of's `s` from the rows' max m (row_max's) and log sum of exp(z - m). A row holding
// +inf has the lse +inf (as logsumexp) and a NaN loss (as torch's log_softmax): its log_sum is NaN.
void finish_stats(RowStats& s, const Problem& p, const at::Tensor& m, const at::Tensor& log_sum) {
  s.lse = m + log_sum;
  s.log_sum = log_sum.masked_fill(s.lse == INFINITY, NAN);
  s.target_gap = at::where(p.target.ge(0), m - s.target_gap, at::zeros({}, m.options()));
}

// Row stats of the rows of p from their logits over the whole vocabulary.
RowStats stats_of(const Problem& p, const at::Tensor& z, const StatsRequest& request) {
  RowStats s = linear_stats_of(p, z, request);
  const at::Tensor m = row_max(z);
  const at::Tensor e = z.sub_(m).exp_();  // (in place: z is read no more)
  const at::Tensor log_sum = e.sum(1).log_();
  if (request.entropy) s.entropy = entropy_of(e, log_sum);
  finish_stats(s, p, m.squeeze(1), log_sum);
  return s;
}

// The softcap's slope at z, 1 - (z / s)^2, kept before z turns into g.
at::Tensor softcap_slope(const Problem& p, const at::Tensor& z) {
  return p.softcap ? z.div(*p.softcap).square_().neg_().add_(1) : at::Tensor();  // (one block-sized temporary)
}

// The rest of g once g holds p * alpha for columns [v_begin, v_end): the
// one-hot and smoothing terms, the softcap's slope and the logit scale.
at::Tensor finish_grad(at::Tensor g, const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                       const at::Tensor& dcap) {
  const auto dtype = g.scalar_type();
  // one-hot term: only rows whose target falls in this column block (of p's vocabulary slice: Problem::cols)
  const at::Tensor local = p.target - (p.col_offset + v_begin);
  const at::Tensor hit = local.ge(0).logical_and_(local.lt(v_end - v_begin));
  g.scatter_add_(1, at::where(hit, local, 0).unsqueeze(1), (-c.beta.to(dtype) * hit).unsqueeze(1));
  if (c.gamma.defined()) {           // label smoothing's term (only then: 0 * an infinite class weight would be NaN)
    if (p.class_weight.defined()) {  // (an outer product added in place: no block-sized temporary)
      g.addr_(c.gamma.to(dtype), p.class_weight.narrow(0, v_begin, v_end - v_begin).to(dtype), 1, -1);
    } else {
      g.sub_(c.gamma.to(dtype).unsqueeze(1));
    }
  }
  if (dcap.defined()) g.mul_(dcap);
  if (p.logit_scale != 1.0) g.mul_(p.logit_scale);
  // Rows with no coefficient (ignored ones) get exactly 0, also where their logits are NaN or inf.
  at::Tensor inactive = c.alpha.eq(0).logical_and_(c.alpha_lse.eq(0)).logical_and_(c.beta.eq(0));
  if (c.gamma.defined()) inactive.logical_and_(c.gamma.eq(0));
  if (c.alpha_z.defined()) inactive.logical_and_(c.alpha_z.eq(0));
  g.masked_fill_(inactive.unsqueeze(1), 0);
  return g;
}

// g from the logits z of columns [v_begin, v_end) (consumed: g is built in its
// storage), with c.lse set.
at::Tensor grad_from_logits(at::Tensor z, const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end) {
  const auto dtype = z.scalar_type();
  const at::Tensor lse = c.lse.to(dtype);
  const at::Tensor alpha = c.alpha.to(dtype) + c.alpha_lse.to(dtype) * lse;
  const at::Tensor dcap = softcap_slope(p, z);
  z.sub_(lse.unsqueeze(1));   // log p
  if (c.alpha_z.defined()) {  // p * (alpha + alpha_z * log p)
    // (p log p is 0 where p is: -inf logits must not make 0 * -inf)
    const at::Tensor factor =
        z.mul(c.alpha_z.to(dtype).unsqueeze(1)).add_(alpha.unsqueeze(1)).masked_fill_(z == -INFINITY, 0);
    z.exp_().mul_(factor);
  } else {
    z.exp_().mul_(alpha.unsqueeze(1));
  }
  return finish_grad(std::move(z), p, c, v_begin, v_end, dcap);
}

}  // namespace

RowStats aten_row_stats(const Problem& p, const StatsRequest& request, int64_t block_rows,
                        at::ScalarType product_dtype) {
  const RowStats s = RowStats::allocate(p, request);
  for (int64_t r0 = 0; r0 < p.N; r0 += block_rows) {
    const int64_t r1 = std::min(p.N, r0 + block_rows);
    const Problem chunk = p.block(r0, r1);
    s.block(r0, r1).copy_(stats_of(chunk, logits(chunk, 0, p.V, product_dtype), request));
  }
  return s;
}

at::Tensor aten_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end,
                           at::ScalarType product_dtype) {
  return grad_from_logits(logits(p, v_begin, v_end, product_dtype), p, c, v_begin, v_end);
}

std::pair<RowStats, at::Tensor> aten_stats_and_logit_grad(const Problem& p, const GradCoefficients& c,
                                                          const StatsRequest& request, at::ScalarType product_dtype) {
  at::Tensor z = logits(p, 0, p.V, product_dtype);
  RowStats s = linear_stats_of(p, z, request);
  const at::Tensor dcap = softcap_slope(p, z);
  // z becomes exp(z - max) in place; its row sums give the lse, and
  // p * alpha = exp(z - max) * (alpha / sum): no logits-sized temporary and
  // two passes fewer than logsumexp followed by exp(z - lse).
  const at::Tensor m = row_max(z);
  const at::Tensor sum = z.sub_(m).exp_().sum(1, /*keepdim=*/true);
  const at::Tensor log_sum = sum.log();
  if (request.entropy) s.entropy = entropy_of(z, log_sum.squeeze(1));
  finish_stats(s, p, m.squeeze(1), log_sum.squeeze(1));
  const auto dtype = z.scalar_type();
  const at::Tensor alpha = c.alpha.to(dtype) + c.alpha_lse.to(dtype) * s.lse;
  if (c.alpha_z.defined()) {  // p * (alpha + alpha_z * log p), log p = log exp(z - max) - log sum
    at::Tensor factor = z.log().sub_(log_sum).masked_fill_(z == 0, 0);  // log p (p log p is 0 where p is)
    z.mul_(factor.mul_(c.alpha_z.to(dtype).unsqueeze(1)).add_(alpha.unsqueeze(1)).div_(sum));
  } else {
    z.mul_(alpha.unsqueeze(1) / sum);
  }
  return {s, finish_grad(std::move(z), p, c, 0, p.V, dcap)};
}

}  // namespace fused_ce
