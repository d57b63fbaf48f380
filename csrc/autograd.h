// The ops' autograd kernels (autograd.cpp), and the loss op called below autograd.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "options.h"

namespace fused_ce {

using AllOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using PolicyOutputs = std::tuple<at::Tensor, at::Tensor>;

// _linear_cross_entropy through the dispatcher, below autograd: (loss, lse, entropy, argmax).
AllOutputs call_loss_op(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        const LossOptions& o, const std::optional<at::Tensor>& low_rank_input = std::nullopt,
                        const std::optional<at::Tensor>& low_rank_weight = std::nullopt);

// fused_ce::_scale_grad_: grad *= scale in place, for gradients computed in the forward; on CUDA a kernel
// (cuda_scale_) that reads scale on the device, so `loss.backward()` costs no pass and no synchronisation;
// elsewhere a multiply.
void _scale_grad_(const at::Tensor& grad, const at::Tensor& scale);

// The Autograd kernels of _linear_cross_entropy (linear_cross_entropy's: public_loss, loss.h) and
// linear_policy_loss.
AllOutputs _linear_cross_entropy_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                          const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                          const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                              FUSED_CE_LOW_RANK_PARAMS);
PolicyOutputs linear_policy_loss_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS);
// linear_policy_loss's CPU and CUDA kernel: its forward with gradient asked for none.
PolicyOutputs linear_policy_loss(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                 const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                                 const std::optional<at::Tensor>& old_log_probs,
                                 const std::optional<at::Tensor>& ref_log_probs,
                                 const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                     FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS);

}  // namespace fused_ce
