"""The functional front: a drop-in for ``torch.nn.functional.linear_cross_entropy``."""
from typing import Optional

import torch
from torch import Tensor


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    reduction: str = "mean",
    ignore_index: Optional[int] = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    return_lse: bool = False,
    workspace_bytes: Optional[int] = None,
    options=None,
):
    r"""Cross entropy of ``input @ linear_weight.T (+ linear_bias)`` against ``target``, without the logits.

    Same arguments and semantics as :func:`torch.nn.functional.linear_cross_entropy`
    (class-index targets), i.e. ``F.cross_entropy(F.linear(input, linear_weight,
    linear_bias).float(), target, weight=weight, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing)``, but the ``[N, V]``
    logits are never held: memory beyond inputs and gradients is bounded by
    ``workspace_bytes``.

    Args:
        input: ``[..., D]`` float32, bfloat16 or float16.
        linear_weight: ``[V, D]``, same dtype as ``input``.
        target: ``[...]`` class indices (int64 or int32) in ``[0, V)`` or ``ignore_index``.
        linear_bias: optional ``[V]`` bias.
        weight: optional ``[V]`` class weights ('mean' divides by the summed weights of the counted targets).
        reduction: 'mean' | 'sum' | 'none'. 'none' returns a loss per target element (0 where ignored).
        ignore_index: target value that is not counted (``None`` means -100, as in torch).
        label_smoothing: in ``[0, 1]``, torch semantics (also with ``weight``).
        z_loss: ``c >= 0``; adds ``c * lse**2`` per counted row ('mean' divides this term by the number of
            counted rows).
        softcap: ``s > 0`` or None; logits become ``s * tanh(logits / s)`` before the softmax.
        logit_scale: logits become ``logit_scale * (input @ linear_weight.T + linear_bias)``, before the softcap.
        return_lse: also return the float32 log-sum-exp of the (scaled, capped) logits, shaped like ``target``.
            It is computed for every row, ignored rows included, and carries a gradient.
        workspace_bytes: bound on the blocks of logits held at once (default 504 MiB on CUDA, 32 MiB on CPU);
            larger blocks run closer to the GEMM rate, smaller ones save memory.
        options: accepted for compatibility with torch's signature and ignored: this loss is always chunked.

    Returns:
        The loss (float32; float64 for float64 inputs), or ``(loss, lse)`` with ``return_lse=True``.
    """
    if ignore_index is None:
        ignore_index = -100
    loss, lse = torch.ops.fused_ce.linear_cross_entropy(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
        float(label_smoothing), float(z_loss), None if softcap is None else float(softcap), float(logit_scale),
        workspace_bytes,
    )
    if return_lse:
        return loss, lse
    return loss
