"""The functional front: a drop-in for ``torch.nn.functional.linear_cross_entropy``, and the plan of a call."""

from typing import Literal, NamedTuple, overload

import torch
from torch import Tensor
from typing_extensions import TypedDict, Unpack


def _op_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes, shard=None):
    """The op's option arguments, in schema order (csrc/options.h); `shard`: (group name, vocab_start, sizes)."""
    group, vocab_start, sizes = shard if shard is not None else ("", 0, [0])
    return (
        reduction,
        -100 if ignore_index is None else ignore_index,
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        float(logit_scale),
        workspace_bytes,
        group,
        vocab_start,
        sum(sizes),
        max(sizes),
    )


def _vocab_parallel(input, linear_weight, target, linear_bias, weight, process_group, vocab_start):
    """The arguments as the op takes them, and the shard (None unless vocabulary parallel)."""
    from . import distributed  # only for distributed calls

    if process_group is None and not distributed.uses_dtensors(input, linear_weight, target, linear_bias, weight):
        if vocab_start is not None:
            raise ValueError("linear_cross_entropy: vocab_start needs a process_group (or a DTensor linear_weight)")
        return input, linear_weight, target, linear_bias, weight, None
    return distributed.resolve(input, linear_weight, target, linear_bias, weight, process_group, vocab_start)


class LossKeywords(TypedDict, total=False):
    """The keywords of :func:`linear_cross_entropy` besides ``return_lse`` (for its overloads' types)."""

    linear_bias: Tensor | None
    weight: Tensor | None
    reduction: str
    ignore_index: int | None
    label_smoothing: float
    z_loss: float
    softcap: float | None
    logit_scale: float
    workspace_bytes: int | None
    process_group: object
    vocab_start: int | None
    options: object


@overload
def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    return_lse: Literal[False] = False,
    **keywords: Unpack[LossKeywords],
) -> Tensor: ...


@overload
def linear_cross_entropy(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, return_lse: Literal[True], **keywords: Unpack[LossKeywords]
) -> tuple[Tensor, Tensor]: ...


def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    weight: Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    return_lse: bool = False,
    workspace_bytes: int | None = None,
    process_group=None,
    vocab_start: int | None = None,
    options=None,
) -> Tensor | tuple[Tensor, Tensor]:
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
            larger blocks run closer to the GEMM rate, smaller ones save memory. :func:`plan` shows what a
            budget buys.
        process_group: a ``torch.distributed`` group over which the vocabulary is split (tensor parallel):
            ``linear_weight`` and ``linear_bias`` are this rank's contiguous shard of the classes (shards may
            differ in size), ``input`` is the same on every rank, targets and class weights are global. Every
            rank gets the same loss (and lse), the full input gradient and its own shards' gradients. A
            DTensor ``linear_weight`` placed ``Shard(0)`` with a DTensor ``input`` needs no argument.
            See :mod:`fused_ce.distributed`.
        vocab_start: this rank's first class, where the shards are not in rank order.
        options: accepted for compatibility with torch's signature and ignored: this loss is always chunked.

    Returns:
        The loss (float32; float64 for float64 inputs), or ``(loss, lse)`` with ``return_lse=True``.
    """
    input, linear_weight, target, linear_bias, weight, shard = _vocab_parallel(
        input, linear_weight, target, linear_bias, weight, process_group, vocab_start
    )
    options = _op_options(
        reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes, shard
    )
    if shard is None:  # the public op, whose schema saved graphs know (csrc/options.h)
        loss, lse = torch.ops.fused_ce.linear_cross_entropy(
            input, linear_weight, target, linear_bias, weight, *options[:7]
        )
    else:
        loss, lse = torch.ops.fused_ce.vocab_parallel_linear_cross_entropy(
            input, linear_weight, target, linear_bias, weight, *options
        )
    if return_lse:
        return loss, lse
    return loss


_DTYPES = {"BFloat16": torch.bfloat16, "Half": torch.float16, "Float": torch.float32, "Double": torch.float64}


class Plan(NamedTuple):
    """What one op call does (csrc/plan.h): chosen from the shapes, dtypes, options, device and budget."""

    pass_: str  # "forward" (loss and lse), "backward" (recomputing), "forward_with_grad" (scalar losses)
    strategy: str  # "aten_chunks", "stored_logits", "dot_tiles" or "vocab_tiles"
    block_rows: int  # rows of logits per block
    tile_cols: int  # vocabulary columns per block (V: whole rows)
    stats_block_rows: int  # "vocab_tiles": rows per block of its stats pass; else 0
    logits_dtype: torch.dtype  # of the logit blocks and the GEMMs on them
    logits_scale: float  # stored logits are the logits times this: 2^-8 for float16 (no overflow below 1.7e7)
    grad_input_dtype: torch.dtype | None  # where dX accumulates across blocks (None for "forward")
    grad_weight_dtype: torch.dtype | None  # where dW accumulates across blocks
    grad_scale: float  # float16: the gradient blocks' power-of-two scale, divided out by the GEMMs; else 1
    rank_one_smoothing: bool  # class-weighted smoothing sums from two GEMVs instead of per logit
    rows_on_device: bool  # per-row bookkeeping in kernels (prepare_rows, assemble_loss)
    budget_bytes: int  # workspace_bytes, or the device's default
    workspace_bytes: int  # bytes of logit blocks (and their partials) held at once


def plan(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, pass_: str | None = None, **keywords: Unpack[LossKeywords]
) -> Plan:
    """The plan :func:`linear_cross_entropy` follows for these arguments (its keywords), without running it.

    ``pass_`` defaults to the op the call runs first: "forward_with_grad" where a scalar loss needs
    gradients, else "forward"; a per-row loss or a gradient through the lse also runs "backward" later.
    The plan depends on shapes, dtypes, strides and device, not on values: expanded tensors serve.
    """
    keywords.pop("options", None)
    if keywords.get("ignore_index", -100) is None:
        keywords["ignore_index"] = -100
    bias, weight = keywords.pop("linear_bias", None), keywords.pop("weight", None)
    input, linear_weight, target, bias, weight, shard = _vocab_parallel(
        input,
        linear_weight,
        target,
        bias,
        weight,
        keywords.pop("process_group", None),
        keywords.pop("vocab_start", None),
    )
    keywords.update(linear_bias=bias, weight=weight)
    if shard is not None:
        keywords.update(
            process_group=shard[0], vocab_start=shard[1], vocab_size=sum(shard[2]), max_shard_rows=max(shard[2])
        )
    if pass_ is None:
        differentiable = torch.is_grad_enabled() and (
            input.requires_grad or linear_weight.requires_grad or (bias is not None and bias.requires_grad)
        )
        pass_ = "forward_with_grad" if differentiable and keywords.get("reduction", "mean") != "none" else "forward"
    fields = torch.ops.fused_ce._plan(input, linear_weight, target, pass_, **keywords)
    values = [_DTYPES.get(v) if name.endswith("dtype") else v for name, v in zip(Plan._fields, fields)]
    return Plan(*values)
