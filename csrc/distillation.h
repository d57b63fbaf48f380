// fused_ce::linear_distillation_loss: a student's head distilled from a teacher's, both heads' logits formed row
// block by row block (never [N, V] at once), the student's gradients formed in the same pass from the same
// blocks. Each head's logits are transformed as its model does (logit_scale, then softcap: c tanh(z / c)).
// Per counted row, with s = log_softmax(student logits / T) and t = log_softmax(teacher logits / T):
//   beta 0: KL(t || s); beta 1: KL(s || t); in between the generalised JSD
//   beta KL(t || m) + (1 - beta) KL(s || m), m = (1 - beta) p_s + beta p_t (TRL's convention; no T^2 factor);
//   offline (teacher_top_indices / teacher_top_log_probs [..., k] instead of the teacher's head): the teacher's
//   k log-probs renormalised over those k, q, and KL(q || s) = sum_k q_k (log q_k - s[idx_k]);
// with hard_label_weight w, (1 - w) divergence + w cross-entropy of the student's logits (at T = 1) on target.
// Rows whose target is ignore_index are not counted and not computed; without target every row counts.
// 'mean' over the counted rows, 'sum', 'none' (per row, 0 at ignored rows). return_entropy: each row's student
// entropy at T (0 at ignored rows), no gradient. Vocabulary parallel (the shard options): both heads hold the
// same shard of the classes; the row statistics are combined over the group, so every rank gets the loss.
// A call of the ops is a Call (call.h) over a problem whose teacher is part of it (make_distillation_problem:
// distillation_problem.h): its targets prepared as every op's (CUDA graph capture included), its blocks planned
// (plan_distillation) and run by its executor (executors.h: ATen's stages, or cuBLAS's products swept by the
// distill_rows kernel).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "options.h"

namespace fused_ce {

// The tensor arguments of the distillation ops, in schema order.
#define FUSED_CE_DISTILLATION_TENSORS(DEFAULT)                                                           \
  "Tensor input, Tensor linear_weight, Tensor? teacher_input" DEFAULT ", Tensor? teacher_weight" DEFAULT \
  ", Tensor? target" DEFAULT ", Tensor? linear_bias" DEFAULT ", Tensor? teacher_bias" DEFAULT            \
  ", Tensor? teacher_top_indices" DEFAULT ", Tensor? teacher_top_log_probs" DEFAULT

using OptionalTensor = std::optional<at::Tensor>;
#define FUSED_CE_DISTILLATION_TENSOR_PARAMS                                                                  \
  const at::Tensor &input, const at::Tensor &linear_weight, const OptionalTensor &teacher_input,             \
      const OptionalTensor &teacher_weight, const OptionalTensor &target, const OptionalTensor &linear_bias, \
      const OptionalTensor &teacher_bias, const OptionalTensor &teacher_top_indices,                         \
      const OptionalTensor &teacher_top_log_probs
#define FUSED_CE_DISTILLATION_TENSOR_ARGS                                                                      \
  input, linear_weight, teacher_input, teacher_weight, target, linear_bias, teacher_bias, teacher_top_indices, \
      teacher_top_log_probs

// The public op's CPU and CUDA kernel (no gradient): (loss, entropy): the loss a scalar or (reduction 'none')
// shaped like the rows of input; the entropy shaped so where asked for, else empty.
std::tuple<at::Tensor, at::Tensor> linear_distillation_loss(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS));

// fused_ce::_linear_distillation_with_grad: (loss, entropy, grad_input, grad_linear_weight, grad_linear_bias) of
// the student, the gradients asked for in output_mask (else empty), formed from the same logit blocks as the
// loss, each row's gradient times row_scale (one value per row of input; None: the reduction's own, i.e. an
// upstream gradient of 1 on a 'mean' or 'sum' loss).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_distillation_with_grad(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS, const OptionalTensor& row_scale,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS));

// The public op's Autograd kernel: differentiable in input, linear_weight and linear_bias (the teacher gets no
// gradient). A scalar loss's gradients are formed in the forward and scaled in the backward; 'none' forms them
// in the backward, for its upstream gradient.
std::tuple<at::Tensor, at::Tensor> linear_distillation_loss_autograd(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS));

}  // namespace fused_ce
