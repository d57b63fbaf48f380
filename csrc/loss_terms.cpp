#include "loss_terms.h"

#include "cuda_stages.h"

namespace fused_ce {
namespace {

// Per-row validity and target class weight, in the loss dtype.
std::pair<at::Tensor, at::Tensor> row_weights(const Problem& p) {
  const auto dtype = loss_dtype(p);
  const at::Tensor valid = p.target.ge(0).to(dtype);
  if (!p.class_weight.defined()) return {valid, valid};
  return {valid, p.class_weight.to(dtype).index_select(0, p.target.clamp_min(0)) * valid};
}

at::Tensor class_weight_sum(const Problem& p) {
  return p.class_weight.defined() ? p.class_weight.sum().to(loss_dtype(p))
                                  : at::scalar_tensor(static_cast<double>(p.V), p.x.options().dtype(loss_dtype(p)));
}

// 1 / sum for 'mean' as torch divides: by the signed sum of the counted rows' weights (a zero sum gives
// inf and so NaN gradients), and by nothing when no row is counted (the loss is NaN, the gradients 0).
at::Tensor mean_reciprocal(const at::Tensor& sum, const at::Tensor& counted) {
  return at::where(counted.gt(0), sum.reciprocal(), at::zeros_like(sum));
}

}  // namespace

at::Tensor assemble_loss(const Problem& p, const LossOptions& o, const Plan& plan, const RowStats& s,
                         at::IntArrayRef target_shape) {
  if (plan.rows_on_device) {
    const at::Tensor loss = cuda_assemble_loss(p, s, o);
    return o.scalar() ? loss.reshape({}) : loss.reshape(target_shape);
  }
  const auto [valid, wt] = row_weights(p);
  const double eps = o.label_smoothing;
  // An ignored row contributes exactly 0, whatever its logits (NaN or inf included), as in torch.
  const at::Tensor counted = p.target.ge(0);
  const auto where_counted = [&](const at::Tensor& t) { return at::where(counted, t, at::zeros({}, t.options())); };
  at::Tensor loss = where_counted((1.0 - eps) * wt * (s.target_gap + s.log_sum));
  // label smoothing's term kept apart until the reduction: torch divides each by the weight sum on its own
  const at::Tensor smooth =
      o.smoothing() ? where_counted((eps / p.V) * (class_weight_sum(p) * s.lse - s.weighted_z_sum)) : at::Tensor();
  const at::Tensor z_term = o.z_loss > 0.0 ? where_counted(o.z_loss * s.lse.square()) : at::Tensor();
  const auto plus = [](at::Tensor a, const at::Tensor& b) { return b.defined() ? a + b : a; };
  switch (o.reduction_kind) {
    case Reduction::None: return plus(plus(loss, smooth), z_term).reshape(target_shape);
    case Reduction::Sum:
      return plus(plus(loss.sum(), smooth.defined() ? smooth.sum() : smooth), z_term.defined() ? z_term.sum() : z_term);
    case Reduction::Mean: {  // like torch: weighted mean, NaN when nothing is counted
      const at::Tensor total = wt.sum();
      return plus(plus(loss.sum() / total, smooth.defined() ? smooth.sum() / total : smooth),
                  z_term.defined() ? z_term.sum() / valid.sum() : z_term);
    }
  }
  return loss;
}

GradCoefficients grad_coefficients(const Problem& p, const LossOptions& o, const at::Tensor& grad_loss,
                                   const std::optional<at::Tensor>& grad_lse,
                                   const std::optional<at::Tensor>& grad_entropy, const at::Tensor& entropy) {
  const auto dtype = loss_dtype(p);
  const auto [valid, wt] = row_weights(p);
  const double eps = o.label_smoothing;
  at::Tensor g_ce, g_z;
  if (o.reduction_kind == Reduction::None) {
    g_ce = g_z = grad_loss.reshape({p.N}).to(dtype);
  } else {
    const at::Tensor g = grad_loss.to(dtype).reshape({});
    const at::Tensor counted = valid.sum();
    g_ce = o.reduction_kind == Reduction::Mean ? g * mean_reciprocal(wt.sum(), counted) : g;
    g_z = o.reduction_kind == Reduction::Mean ? g * mean_reciprocal(counted, counted) : g;
  }
  // Exactly 0 where a row is not counted, whatever g_ce is (an infinite 1 / sum for weights summing to 0), and
  // the smoothing terms only with label smoothing (0 * an infinite class-weight sum would be NaN).
  const at::Tensor counted = valid.gt(0);
  const at::Tensor zero = at::zeros({}, valid.options());
  const auto per_row = [&](const at::Tensor& t) { return at::where(counted, t, zero).expand({p.N}).contiguous(); };
  at::Tensor alpha = g_ce * (1.0 - eps) * wt;
  if (eps > 0.0) alpha = alpha + g_ce * (eps / p.V) * class_weight_sum(p);
  GradCoefficients c;
  c.alpha = per_row(alpha);
  if (grad_lse && grad_lse->defined()) c.alpha = c.alpha + grad_lse->reshape({p.N}).to(dtype);
  c.alpha_lse = per_row((2.0 * o.z_loss) * g_z * valid);
  c.beta = per_row(g_ce * (1.0 - eps) * wt);
  if (eps > 0.0) c.gamma = per_row(g_ce * (eps / p.V) * valid);  // undefined without label smoothing
  if (grad_entropy && grad_entropy->defined()) {  // g_H * dH/dz = p * (-g_H * H - g_H * log p), counted rows only
    const at::Tensor g_h = grad_entropy->reshape({p.N}).to(dtype);
    c.alpha = c.alpha - per_row(g_h * entropy.reshape({p.N}).to(dtype));
    c.alpha_z = per_row(-g_h);
  }
  return c;
}

GradCoefficients unit_grad_coefficients(const Problem& p, const LossOptions& o) {
  return grad_coefficients(p, o, at::ones({}, p.x.options().dtype(loss_dtype(p))), std::nullopt, std::nullopt,
                           at::Tensor());
}

at::Tensor class_weighted_w(const Problem& p) {
  return at::mv(p.w.t(), p.class_weight.to(p.w.scalar_type()));
}

at::Tensor weighted_z_sum(const Problem& p, const at::Tensor& u) {
  at::Tensor wz = at::mv(p.x, u).to(at::kFloat);
  if (p.row_index.defined()) wz = wz.index_select(0, p.row_index);  // x holds every row: a GEMV is cheap
  if (p.bias.defined()) wz.add_((p.bias.to(at::kFloat) * p.class_weight).sum());
  return wz.mul_(p.logit_scale);
}

}  // namespace fused_ce
