// The ops' CPU and CUDA implementations (loss.cpp): options, problem, plan,
// executor, loss. Their schemas are in ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "options.h"

namespace fused_ce {

// fused_ce::linear_cross_entropy: (loss, lse).
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight,
                                                        const at::Tensor& target,
                                                        const std::optional<at::Tensor>& linear_bias,
                                                        const std::optional<at::Tensor>& weight,
                                                        FUSED_CE_LOSS_OPTION_PARAMS);
// fused_ce::vocab_parallel_linear_cross_entropy: the same for this rank's
// vocabulary shard (vocab_parallel.h); without a process_group, the same.
std::tuple<at::Tensor, at::Tensor> vocab_parallel_linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, FUSED_CE_OPTION_PARAMS);

// fused_ce::linear_cross_entropy_backward: (grad_input, grad_linear_weight,
// grad_linear_bias), recomputing the logits; empty tensors where output_mask is false.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, std::array<bool, 3> output_mask,
    FUSED_CE_OPTION_PARAMS);

// fused_ce::linear_cross_entropy_with_grad: (loss, lse, grad_input,
// grad_linear_weight, grad_linear_bias) for a scalar reduction, the gradients
// being those of the loss itself (upstream gradient 1), computed from the same
// logits as the loss where the plan allows: 6NDV flops instead of 8NDV. In the
// arguments' dtypes, but float32 for float16 inputs: at unit scale float16
// would lose them (~p / N) to underflow; the backward multiplies them by the
// upstream gradient (a loss scaler's factor) and rounds once to float16.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    std::array<bool, 3> output_mask, FUSED_CE_OPTION_PARAMS);

// fused_ce::_plan: the plan of one of the three ops for these arguments
// (plan.h), without running it: (pass, strategy, block_rows, tile_cols,
// stats_block_rows, logits_dtype, logits_scale, grad_input_dtype,
// grad_weight_dtype, grad_scale, rank_one_smoothing, rows_on_device,
// budget_bytes, workspace_bytes).
std::tuple<std::string, std::string, int64_t, int64_t, int64_t, std::string, double, std::string, std::string, double,
           bool, bool, int64_t, int64_t>
plan_of(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, c10::string_view pass,
        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, FUSED_CE_OPTION_PARAMS);

}  // namespace fused_ce
