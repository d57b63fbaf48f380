// The stages in ATen: the CPU implementation, and the CUDA fallback where no
// embedded cubin fits the device.
#include <algorithm>

#include "stages.h"

namespace fused_ce {

Problem Problem::rows(int64_t begin, int64_t end) const {
  Problem p = *this;
  p.x = x.narrow(0, begin, end - begin);
  p.target = target.narrow(0, begin, end - begin);
  p.N = end - begin;
  return p;
}

GradCoefficients GradCoefficients::rows(int64_t begin, int64_t end) const {
  return {lse.narrow(0, begin, end - begin), alpha.narrow(0, begin, end - begin),
          beta.narrow(0, begin, end - begin), gamma.narrow(0, begin, end - begin)};
}

namespace {

at::ScalarType compute_dtype(const Problem& p) {
  return p.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Transformed logits z for all rows of p and columns [v_begin, v_end), in the
// compute dtype.
at::Tensor logits(const Problem& p, int64_t v_begin, int64_t v_end) {
  const auto dtype = compute_dtype(p);
  at::Tensor w = p.w.narrow(0, v_begin, v_end - v_begin).to(dtype);
  at::Tensor z = p.x.to(dtype).matmul(w.t());
  if (p.bias.defined()) z.add_(p.bias.narrow(0, v_begin, v_end - v_begin).to(dtype));
  if (p.logit_scale != 1.0) z.mul_(p.logit_scale);
  if (p.softcap) z.div_(*p.softcap).tanh_().mul_(*p.softcap);
  return z;
}

}  // namespace

RowStats aten_row_stats(const Problem& p, bool need_weighted_z_sum, int64_t max_rows) {
  const auto opts = p.x.options().dtype(compute_dtype(p));
  RowStats s{at::empty({p.N}, opts), at::empty({p.N}, opts),
             need_weighted_z_sum ? at::empty({p.N}, opts) : at::Tensor()};
  const at::Tensor valid = p.target.ge(0);
  const at::Tensor safe_target = at::where(valid, p.target, 0).unsqueeze(1);
  for (int64_t r0 = 0; r0 < p.N; r0 += max_rows) {
    const int64_t r1 = std::min(p.N, r0 + max_rows);
    const Problem chunk = p.rows(r0, r1);
    const at::Tensor z = logits(chunk, 0, p.V);
    s.lse.narrow(0, r0, r1 - r0).copy_(at::logsumexp(z, 1));
    const at::Tensor zt = z.gather(1, safe_target.narrow(0, r0, r1 - r0)).squeeze(1);
    s.target_logit.narrow(0, r0, r1 - r0).copy_(zt * valid.narrow(0, r0, r1 - r0));
    if (need_weighted_z_sum) {
      const at::Tensor wz = p.class_weight.defined() ? z.matmul(p.class_weight.to(z.scalar_type())) : z.sum(1);
      s.weighted_z_sum.narrow(0, r0, r1 - r0).copy_(wz);
    }
  }
  return s;
}

at::Tensor aten_logit_grad(const Problem& p, const GradCoefficients& c, int64_t v_begin, int64_t v_end) {
  at::Tensor z = logits(p, v_begin, v_end);
  const auto dtype = z.scalar_type();
  at::Tensor g = (z - c.lse.to(dtype).unsqueeze(1)).exp_().mul_(c.alpha.to(dtype).unsqueeze(1));
  // one-hot term: only rows whose target falls in this column block
  const at::Tensor local = p.target - v_begin;
  const at::Tensor hit = local.ge(0).logical_and_(local.lt(v_end - v_begin));
  g.scatter_add_(1, at::where(hit, local, 0).unsqueeze(1),
                 (-c.beta.to(dtype) * hit).unsqueeze(1));
  if (p.class_weight.defined()) {
    g.sub_(c.gamma.to(dtype).unsqueeze(1) * p.class_weight.narrow(0, v_begin, v_end - v_begin).to(dtype));
  } else {
    g.sub_(c.gamma.to(dtype).unsqueeze(1));
  }
  if (p.softcap) {
    const at::Tensor t = z.div_(*p.softcap);
    g.mul_(1 - t * t);
  }
  if (p.logit_scale != 1.0) g.mul_(p.logit_scale);
  return g;
}

}  // namespace fused_ce
