"""Fake (meta) kernels: output shapes and dtypes without computing anything.

The options after ``reduction`` (csrc/options.h) do not change any shape, so they pass as ``*options``.
"""

import torch


def _loss_dtype(input):
    return torch.float64 if input.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fused_ce::linear_cross_entropy")
def _linear_cross_entropy_fake(
    input, linear_weight, target, linear_bias=None, weight=None, reduction="mean", *options, **keyword_options
):
    torch._check(input.dim() >= 1, lambda: "linear_cross_entropy: input must have at least one dimension")
    torch._check(linear_weight.dim() == 2, lambda: "linear_cross_entropy: linear_weight must be 2-D [V, D]")
    torch._check(
        linear_weight.shape[1] == input.shape[-1], lambda: "linear_cross_entropy: linear_weight and input disagree on D"
    )
    torch._check(
        reduction in ("mean", "sum", "none"),
        lambda: f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got '{reduction}'",
    )
    lse = input.new_empty(target.shape, dtype=_loss_dtype(input))
    loss = lse.new_empty(target.shape) if reduction == "none" else lse.new_empty(())
    return loss, lse


torch.library.register_fake("fused_ce::vocab_parallel_linear_cross_entropy")(_linear_cross_entropy_fake)


def _grads(input, linear_weight, linear_bias, output_mask):
    def grad(t, needed):
        return t.new_empty(t.shape) if needed and t is not None else input.new_empty((0,))

    return grad(input, output_mask[0]), grad(linear_weight, output_mask[1]), grad(linear_bias, output_mask[2])


@torch.library.register_fake("fused_ce::linear_cross_entropy_backward")
def _linear_cross_entropy_backward_fake(
    grad_loss,
    grad_lse,
    input,
    linear_weight,
    target,
    linear_bias,
    weight,
    lse,
    output_mask,
    *options,
    **keyword_options,
):
    return _grads(input, linear_weight, linear_bias, output_mask)


@torch.library.register_fake("fused_ce::linear_cross_entropy_with_grad")
def _linear_cross_entropy_with_grad_fake(
    input, linear_weight, target, linear_bias, weight, output_mask, reduction="mean", *options, **keyword_options
):
    torch._check(
        reduction in ("mean", "sum"), lambda: "linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum'"
    )
    loss, lse = _linear_cross_entropy_fake(input, linear_weight, target, linear_bias, weight, reduction)
    grads = _grads(input, linear_weight, linear_bias, output_mask)
    if input.dtype == torch.float16:  # float32 until the backward scales them (csrc/loss.h)
        grads = tuple(g.new_empty(g.shape, dtype=torch.float32) for g in grads)
    return (loss, lse, *grads)


@torch.library.register_fake("fused_ce::_scale_grad_")
def _scale_grad_fake(grad, scale):
    torch._check(scale.numel() == 1, lambda: "fused_ce::_scale_grad_: scale must hold one value")
