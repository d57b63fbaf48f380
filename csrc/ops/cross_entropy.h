// The cross-entropy ops: linear_cross_entropy (the public op), _linear_cross_entropy (every output), their backward,
// the pair that keeps a per-token loss's logits for its backward, the forward with gradient, and linear_log_probs.
// cross_entropy.cpp: their schemas, their CPU and CUDA kernels (each a Call, call.h, and its executor) and
// linear_log_probs; cross_entropy_autograd.cpp: their autograd formula. Their options are in options.h.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "options.h"

namespace fused_ce {

// fused_ce::_linear_cross_entropy, the op every front calls: (loss, lse, entropy, argmax), the last two
// shaped like the target where asked for (return_entropy, return_argmax), else empty; vocabulary parallel
// with a process_group (vocab_parallel.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS);

// fused_ce::linear_cross_entropy, the public op, as a kernel of _linear_cross_entropy's (`all`: its CPU/CUDA or
// its Autograd kernel): its options, the others at their defaults; (loss, lse).
template <auto all>
std::tuple<at::Tensor, at::Tensor> public_loss(const at::Tensor& input, const at::Tensor& linear_weight,
                                               const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                               const std::optional<at::Tensor>& weight
                                                   FUSED_CE_PARAMS(FUSED_CE_LOSS_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const auto [loss, lse, entropy, argmax] =
      all(input, linear_weight, target, linear_bias,
          weight FUSED_CE_ARGS(FUSED_CE_LOSS_OPTIONS) FUSED_CE_DEFAULTS(FUSED_CE_OUTPUT_OPTIONS)
              FUSED_CE_DEFAULTS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_DEFAULTS(FUSED_CE_CALLER_OPTIONS),
          low_rank_input, low_rank_weight);
  return {loss, lse};
}

// The cross-entropy backward ops' gradients: input, linear_weight, linear_bias (empty where output_mask is false),
// low_rank_input and low_rank_weight (both where given, else empty).
using CrossEntropyGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// fused_ce::linear_cross_entropy_backward: the gradients (CrossEntropyGrads) for upstream gradients of the loss,
// the lse and the entropy, recomputing the logits.
CrossEntropyGrads linear_cross_entropy_backward(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                                                const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input,
                                                const at::Tensor& linear_weight, const at::Tensor& target,
                                                const std::optional<at::Tensor>& linear_bias,
                                                const std::optional<at::Tensor>& weight, const at::Tensor& lse,
                                                const std::optional<at::Tensor>& entropy,
                                                std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                                    FUSED_CE_LOW_RANK_PARAMS);

// fused_ce::_linear_cross_entropy_keeping_logits: _linear_cross_entropy's outputs and the logits, kept for
// _linear_cross_entropy_backward_from_logits: [target.numel(), V] in the input dtype (times the plan's
// logits_scale), kept row r holding the logits of row order[r] (CountedRows::order, counted rows first), the
// counted rows' only where their count is read: the rows beyond are left uninitialised (the backward gives them
// no gradient and writes them zeros). None ([0, V]) where kept_logit_rows (plan.h) has no value: the autograd
// formula calls this op for every per-token loss, and the op decides, once (none with a low-rank term).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_keeping_logits(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS);

// fused_ce::_linear_cross_entropy_backward_from_logits: linear_cross_entropy_backward's gradients from the
// logits that _linear_cross_entropy_keeping_logits kept, which become their gradient in place (they are used
// up); recomputed where those logits lack rows the gradient needs (a gradient on the lse of ignored rows).
CrossEntropyGrads _linear_cross_entropy_backward_from_logits(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, at::Tensor& logits, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS);

// fused_ce::linear_cross_entropy_with_grad: (loss, lse, entropy, argmax, grad_input,
// grad_linear_weight, grad_linear_bias, grad_weight_scale, grad_low_rank_input, grad_low_rank_weight) for a
// scalar reduction, the gradients
// being those of the loss itself (upstream gradient 1), computed from the same
// logits as the loss where the plan allows: 6NDV flops instead of 8NDV. In the
// arguments' dtypes, but for float16 inputs, which at unit scale would lose them (~p / N) to underflow,
// grad_input and grad_linear_bias in float32 and grad_linear_weight in float16 times grad_weight_scale (a
// power of two, [] float32: Plan::grad_weight_scale); the backward multiplies them by the upstream gradient (a
// loss scaler's factor; over grad_weight_scale for dW, in place) and rounds dX and db once to float16.
// grad_weight_scale is empty for other dtypes. The low-rank term's gradients (empty without one) as dX's: float16's
// in float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
linear_cross_entropy_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                               const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                               std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                   FUSED_CE_LOW_RANK_PARAMS);

using AllOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// _linear_cross_entropy through the dispatcher, below autograd: (loss, lse, entropy, argmax).
AllOutputs call_loss_op(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        const LossOptions& o, const std::optional<at::Tensor>& low_rank_input = std::nullopt,
                        const std::optional<at::Tensor>& low_rank_weight = std::nullopt);

}  // namespace fused_ce
