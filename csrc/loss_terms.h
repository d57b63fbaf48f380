// The loss arithmetic on top of the row stats: the loss itself (torch's
// semantics for class weights, label smoothing and reductions), the gradient
// coefficients, and the rank-one terms of class-weighted label smoothing.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "options.h"
#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// The loss from the row stats: one kernel where the plan keeps the rows on the
// device (cuda_assemble_loss), ATen otherwise; shaped like the target for 'none'.
at::Tensor assemble_loss(const Problem& p, const LossOptions& o, const Plan& plan, const RowStats& s,
                         at::IntArrayRef target_shape);

// The coefficients of the logit gradient (problem.h) for an upstream gradient
// `grad_loss` (0-dim for 'mean'/'sum', [N] for 'none') and optionally ones on
// the lse and on the entropy (the rows' `entropy` [N] then given); `lse` is left for the caller.
GradCoefficients grad_coefficients(const Problem& p, const LossOptions& o, const at::Tensor& grad_loss,
                                   const std::optional<at::Tensor>& grad_lse,
                                   const std::optional<at::Tensor>& grad_entropy, const at::Tensor& entropy);
// Those of a scalar loss for an upstream gradient of 1.
GradCoefficients unit_grad_coefficients(const Problem& p, const LossOptions& o);

// Plan::rank_one_smoothing: sum_c cw_c z_c = logit_scale * (x @ u + b . cw)
// with u = w.T @ cw ([D], in w's dtype); the gradient's matching term
// -gamma * cw is rank one too.
at::Tensor class_weighted_w(const Problem& p);
at::Tensor weighted_z_sum(const Problem& p, const at::Tensor& u);  // [N] float32

}  // namespace fused_ce
