// The loss and its gradients, device-generic (CPU, CUDA) on top of stages.h.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace fused_ce {

// fused_ce::linear_cross_entropy: (loss, lse).
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes);

// fused_ce::linear_cross_entropy_backward: (grad_input, grad_linear_weight,
// grad_linear_bias), recomputing the logits; empty tensors where output_mask is false.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, c10::string_view reduction, int64_t ignore_index,
    double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes, std::array<bool, 3> output_mask);

// fused_ce::linear_cross_entropy_with_grad: (loss, lse, grad_input,
// grad_linear_weight, grad_linear_bias) for a scalar reduction, the gradients
// being those of the loss itself (upstream gradient 1), computed from the same
// logits as the loss: 6NDV flops instead of 8NDV.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes, std::array<bool, 3> output_mask);

// fused_ce::_scale_grad_: grad *= scale in place, for gradients computed in the
// forward; on CUDA a kernel that reads scale on the device and returns at once
// when it is 1, so `loss.backward()` costs no pass and no synchronisation.
void scale_grad_(const at::Tensor& grad, const at::Tensor& scale);

}  // namespace fused_ce
