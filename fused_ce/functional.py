"""The functional front: a drop-in for ``torch.nn.functional.linear_cross_entropy``, and the plan of a call.

The ops' options are declared once, in C++ (csrc/options.h); each call's option arguments come from the op's
schema (fused_ce/_options.py), which fails at import when an option of a schema has no keyword in its front.
"""

import math
from typing import Literal, NamedTuple, overload

import torch
from torch import Tensor
from typing_extensions import TypedDict, Unpack

from ._options import _DEFAULT_OPTIONS, _PUBLIC_LOSS_OPTIONS, _check_front, _option_arguments


def _call(input, linear_weight, target, linear_bias, weight, options, low_rank):
    """(loss, lse, entropy, argmax): the public op where its options suffice (the op saved graphs hold), else
    the op with every option; ``low_rank``: the logits' low-rank term's arguments (_low_rank)."""
    public = all(options[n] == value for n, value in _DEFAULT_OPTIONS.items() if n not in _PUBLIC_LOSS_OPTIONS)
    if public:
        loss, lse = torch.ops.fused_ce.linear_cross_entropy(
            input, linear_weight, target, linear_bias, weight, **{n: options[n] for n in _PUBLIC_LOSS_OPTIONS},
            **low_rank,
        )  # fmt: skip
        return loss, lse, None, None
    return torch.ops.fused_ce._linear_cross_entropy(
        input, linear_weight, target, linear_bias, weight, **options, **low_rank
    )


def _low_rank(low_rank_input, low_rank_weight):
    """The logits' low-rank term as the ops take it, by name ({} without one; the op checks that both come)."""
    given = dict(low_rank_input=low_rank_input, low_rank_weight=low_rank_weight)
    return {name: t for name, t in given.items() if t is not None}


def _vocab_parallel(input, linear_weight, target, linear_bias, weight, process_group, vocab_start,
                    caller="linear_cross_entropy"):  # fmt: skip
    """The arguments as the op takes them, and the shard (None unless vocabulary parallel)."""
    from . import distributed  # only for distributed calls

    if process_group is None and not distributed.uses_dtensors(input, linear_weight, target, linear_bias, weight):
        if vocab_start is not None:
            raise ValueError(f"{caller}: vocab_start needs a process_group (or a DTensor linear_weight)")
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
    grad_filter_eps: float
    process_group: object
    vocab_start: int | None
    low_rank_input: Tensor | None
    low_rank_weight: Tensor | None
    options: object


@overload
def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    return_lse: Literal[False] = False,
    return_argmax: Literal[False] = False,
    **keywords: Unpack[LossKeywords],
) -> Tensor: ...


@overload
def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    return_lse: Literal[True],
    return_argmax: Literal[False] = False,
    **keywords: Unpack[LossKeywords],
) -> tuple[Tensor, Tensor]: ...


@overload
def linear_cross_entropy(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    return_lse: bool = False,
    return_argmax: Literal[True],
    **keywords: Unpack[LossKeywords],
) -> tuple[Tensor, ...]: ...


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
    return_argmax: bool = False,
    workspace_bytes: int | None = None,
    grad_filter_eps: float = 0.0,
    process_group=None,
    vocab_start: int | None = None,
    low_rank_input: Tensor | None = None,
    low_rank_weight: Tensor | None = None,
    options=None,
) -> Tensor | tuple[Tensor, ...]:
    r"""Cross entropy of ``input @ linear_weight.T (+ linear_bias)`` against ``target``, without the logits.

    The arguments and semantics of :func:`torch.nn.functional.linear_cross_entropy` (class-index targets),
    i.e. ``F.cross_entropy(F.linear(input, linear_weight, linear_bias).float(), target, weight=weight,
    ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)``, but the ``[N, V]``
    logits are never held: memory beyond inputs and gradients is bounded by ``workspace_bytes``. Beyond
    torch's: ``input`` may have any number of leading dimensions (``[..., D]``; torch's takes ``[D]`` or
    ``[N, D]``), targets any integer dtype, and the keywords ``z_loss`` to ``vocab_start`` below.

    Rows whose target is ``ignore_index`` cost no gradient work: their logits are neither computed nor
    multiplied back (fused_ce.plan(...).counted_rows_only says where that applies).

    Args:
        input: ``[..., D]`` float32, bfloat16 or float16 (float64 too, for checks: a float64 loss).
        linear_weight: ``[V, D]``, same dtype as ``input``; or ``[V, d1, ..., dK, D]`` for a K-dimensional loss
            (as torch's: ``input`` ``[N, D]``, ``target`` ``[N, d1, ..., dK]``, a softmax over the V classes at
            each of the ``d1 * ... * dK`` positions).
        target: ``[...]`` class indices (any integer dtype) in ``[0, V)`` or ``ignore_index``.
        linear_bias: optional ``[V]`` (``[V, d1, ..., dK]``) bias.
        weight: optional ``[V]`` class weights ('mean' divides by the summed weights of the counted targets).
        reduction: 'mean' | 'sum' | 'none'. 'none' returns a loss per target element (0 where ignored).
        ignore_index: target value that is not counted (``None`` means -100, as in torch).
        label_smoothing: in ``[0, 1]``, torch semantics (also with ``weight``).
        z_loss: ``c >= 0``; adds ``c * lse**2`` per counted row ('mean' divides this term by the number of
            counted rows).
        softcap: ``s > 0`` or None; logits become ``s * tanh(logits / s)`` before the softmax.
        logit_scale: logits become ``logit_scale * (input @ linear_weight.T + linear_bias)``, before the softcap.
        return_lse: also return the float32 log-sum-exp of the (scaled, capped) logits, shaped like ``target``.
            It is computed for every row, ignored rows included (their lse costs a forward-only pass over
            them, not gradient work), and carries a gradient.
        return_argmax: also return each row's most likely class (int64, shaped like ``target``; the lowest index
            on ties, -1 at ignored rows), from the same pass as the loss: token accuracy without logits
            (``(argmax == target).sum() / (target != ignore_index).sum()``).
        workspace_bytes: bound on the blocks of logits held at once (default 504 MiB on CUDA, 32 MiB on CPU);
            larger blocks run closer to the GEMM rate, smaller ones save memory. At least one row of logits
            is held (``V`` float32 values on CPU). With ``reduction='none'`` and a gradient on CUDA, the
            forward keeps the logits of as many rows as the budget holds for the backward (held in between);
            a budget with room for every row's keeps them all: 6NDV flops instead of 8NDV
            (``plan(...).keeps_logits``, ``plan(...).kept_rows``). Past 2 row blocks (4 in float16) dW is summed
            in float32: on CUDA the blocks grow to 2 (4) where they fit in the budget plus a float32 ``V x D`` dW sum's
            bytes, else that sum is held beside the budget; an explicit budget under that sum's size bounds memory
            instead, dW then from vocabulary slices (8NDV, slower; docs/usage.md). :func:`plan` shows what a budget
            buys.
        grad_filter_eps: opt-in gradient filtering for a scalar loss ('mean' or 'sum'; 0, the default, is exact):
            the products of the logits' gradient with ``linear_weight`` (dX) and ``input`` (dW) skip each tile of
            it (64 rows of a row block x 128 classes) whose entries are all below ``grad_filter_eps`` times the
            row's coefficient of the probability (``p < grad_filter_eps`` for a plain loss), the targets' entries
            always kept. The loss is exact. Cut Cross-Entropy's ``filter_eps`` (2**-12 for bfloat16); for
            fine-tuning trained models, whose softmax is peaked, not for training from scratch (docs/usage.md).
            Applies where the gradients come with the forward (``plan(...).filters_grads``); not with
            ``label_smoothing``. Its first CUDA kernels are slower than the exact path (docs/usage.md).
        process_group: a ``torch.distributed`` group over which the vocabulary is split (tensor parallel):
            ``linear_weight`` and ``linear_bias`` are this rank's contiguous shard of the classes (shards may
            differ in size), ``input`` is the same on every rank, targets and class weights are global. Every
            rank gets the same loss (and lse), the full input gradient and its own shards' gradients. A
            DTensor ``linear_weight`` placed ``Shard(0)`` with a DTensor ``input`` needs no argument.
            See :mod:`fused_ce.distributed`.
        vocab_start: this rank's first class, where the shards are not in rank order.
        low_rank_input, low_rank_weight: a low-rank term of the logits, which become ``input @ linear_weight.T +
            low_rank_input @ low_rank_weight.T (+ linear_bias)``: ``low_rank_input`` ``[..., r]`` (input's leading
            dimensions), ``low_rank_weight`` ``[V, r]``, both in input's dtype and both differentiable. LoRA on
            the head: ``low_rank_input = scaling * lora_A(dropout(input))`` and ``low_rank_weight =
            lora_B.weight``, dropout included, with no ``V x D`` sum ``W + scaling * B @ A`` formed. Such a call
            takes the plan it would take without the term (on the ATen stages where that is ``dot_tiles``) and
            is not vocabulary parallel.
        options: accepted for compatibility with torch's signature and ignored: this loss is always chunked.

    Returns:
        The loss (float32; float64 for float64 inputs), or ``(loss, lse)`` with ``return_lse=True``, with
        ``argmax`` appended to either with ``return_argmax=True``.

    For 'mean' and 'sum' the gradients are computed in the forward and held by the autograd graph until the
    backward: they are results, not saved activations, so ``torch.autograd.graph.saved_tensors_hooks``
    (activation offloading) does not see them.
    """
    low_rank = _low_rank(low_rank_input, low_rank_weight)
    if linear_weight.dim() > 2:
        if return_argmax:
            raise ValueError("linear_cross_entropy: return_argmax is not supported for a K-dimensional loss")
        if low_rank:
            raise ValueError("linear_cross_entropy: a low-rank term is not supported for a K-dimensional loss")
        if grad_filter_eps:
            raise ValueError("linear_cross_entropy: grad_filter_eps is not supported for a K-dimensional loss")
        return _k_dimensional(
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=weight,
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            logit_scale=logit_scale,
            return_lse=return_lse,
            workspace_bytes=workspace_bytes,
            process_group=process_group,
        )
    input, linear_weight, target, linear_bias, weight, shard = _vocab_parallel(
        input, linear_weight, target, linear_bias, weight, process_group, vocab_start
    )
    options = _option_arguments(
        "_linear_cross_entropy", "linear_cross_entropy", shard=shard, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, logit_scale=logit_scale,
        workspace_bytes=workspace_bytes, lse_of_ignored_rows=return_lse, return_argmax=return_argmax,
        grad_filter_eps=grad_filter_eps,
    )  # fmt: skip
    loss, lse, _, argmax = _call(input, linear_weight, target, linear_bias, weight, options, low_rank)
    outputs = (loss,) + ((lse,) if return_lse else ()) + ((argmax,) if return_argmax else ())
    return outputs[0] if len(outputs) == 1 else outputs


def _k_dimensional(
    input, linear_weight, target, *, linear_bias, weight, reduction, ignore_index, return_lse, process_group, **keywords
):
    """torch's K-dimensional loss: ``linear_weight`` ``[V, d1, ..., dK, D]``, one softmax over the V classes at
    each position of ``d1 x ... x dK``, so one 2-D problem per position (a strided view of the weight)."""
    V, positions, D = linear_weight.shape[0], tuple(linear_weight.shape[1:-1]), linear_weight.shape[-1]
    if input.dim() != 2:
        raise RuntimeError(
            f"K-dimensional loss defined by linear_weight shape {tuple(linear_weight.shape)} requires batched input, "
            f"(N, {D}), got input with shape {tuple(input.shape)}"
        )
    N = input.shape[0]
    if tuple(target.shape) != (N, *positions):
        raise ValueError(
            f"linear_cross_entropy: target shape {tuple(target.shape)} must be {(N, *positions)} for linear_weight "
            f"of shape {tuple(linear_weight.shape)}"
        )
    if linear_bias is not None and tuple(linear_bias.shape) != (V, *positions):
        raise RuntimeError(f"expected linear_bias shape {(V, *positions)}, got {tuple(linear_bias.shape)}")
    if process_group is not None:
        raise ValueError("linear_cross_entropy: a K-dimensional loss is not vocabulary parallel (process_group)")
    if reduction == "mean" and weight is not None and keywords["z_loss"]:
        raise ValueError(
            "linear_cross_entropy: a K-dimensional 'mean' with class weights and z_loss is not supported (the two "
            "terms divide by different counts)"
        )
    K = math.prod(positions)
    w = linear_weight.reshape(V, K, D)
    b = None if linear_bias is None else linear_bias.reshape(V, K)
    t = target.reshape(N, K)
    per_position = "sum" if reduction == "mean" else reduction
    losses, lses = [], []
    for k in range(K):
        loss, lse = linear_cross_entropy(
            input,
            w[:, k],
            t[:, k],
            linear_bias=None if b is None else b[:, k],
            weight=weight,
            reduction=per_position,
            ignore_index=ignore_index,
            return_lse=True,
            **keywords,
        )
        losses.append(loss)
        lses.append(lse)
    if reduction == "none":
        loss = torch.stack(losses, 1).reshape(N, *positions)
    else:
        loss = torch.stack(losses).sum()
        if reduction == "mean":  # torch's: divided by the summed weights of every counted target
            counted = t != (-100 if ignore_index is None else ignore_index)  # (checked by the calls above)
            if weight is None:
                total = counted.sum().to(loss.dtype)
            else:
                total = torch.where(counted, weight.to(loss.dtype)[t.clamp(0, V - 1).long()], 0).sum()
            # nothing counted: NaN as torch's, with zero gradients as torch's (the 2-D op's too), not 0 * inf
            counts = total != 0
            loss = torch.where(counts, loss / torch.where(counts, total, 1), math.nan)
    if return_lse:
        return loss, torch.stack(lses, 1).reshape(N, *positions)
    return loss


class LogProbs(NamedTuple):
    """What :func:`linear_log_probs` returns with ``return_entropy`` or ``return_argmax``: None where not asked."""

    log_probs: Tensor
    entropy: Tensor | None
    argmax: Tensor | None


def linear_log_probs(
    input: Tensor,
    linear_weight: Tensor,
    target: Tensor,
    *,
    linear_bias: Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int | None = -100,
    return_entropy: bool = False,
    return_argmax: bool = False,
    process_group=None,
    workspace_bytes: int | None = None,
    low_rank_input: Tensor | None = None,
    low_rank_weight: Tensor | None = None,
) -> Tensor | LogProbs:
    r"""Per-token log-probabilities of ``target`` under ``softmax(softcap(input @ linear_weight.T + linear_bias) /
    temperature)``, without the logits: what policy-gradient RL (GRPO, PPO, DAPO, ...) needs of the lm_head.

    Args:
        input: ``[..., D]`` hidden states, float32, bfloat16 or float16.
        linear_weight: ``[V, D]`` (this rank's vocabulary shard with ``process_group``).
        target: ``[...]`` the sampled tokens (any integer dtype), ``ignore_index`` where not counted.
        linear_bias: optional ``[V]``.
        temperature: ``T > 0``: the logits (after the softcap) are divided by it, as a sampler's temperature.
        softcap: ``s > 0`` or None: ``s * tanh(z / s)`` before the temperature.
        logit_scale: the logits are multiplied by it before the softcap (Granite, Cohere, ...).
        return_entropy: also the entropy ``-sum p log p`` of each row's distribution (float32, differentiable:
            its gradient ``-p (log p + H) / T`` through the logits).
        return_argmax: also the most likely token (int64; the lowest index on ties): token accuracy without
            logits.
        process_group: vocabulary parallel, as in :func:`linear_cross_entropy` (the entropy and argmax are
            combined over the shards); DTensors need none.
        workspace_bytes: as in :func:`linear_cross_entropy`. On CUDA, room for every row's logits
            (``N x V`` in the input dtype) keeps them from the forward for the backward: 6NDV flops in all
            instead of 8NDV, that memory held in between.
        low_rank_input, low_rank_weight: a low-rank term of the logits (LoRA on the head, its dropout included),
            as in :func:`linear_cross_entropy`.

    Returns:
        The float32 log-probabilities shaped like ``target`` (0 at ignored rows, differentiable for any upstream
        gradient: the backward recomputes the logits, 8NDV flops in all, unless they were kept), or, with
        ``return_entropy`` or ``return_argmax``, ``LogProbs(log_probs, entropy, argmax)``: the entropy 0 and the
        argmax -1 at ignored rows, None where not asked for. Rows whose target is ``ignore_index`` are not
        computed at all.
    """
    input, linear_weight, target, linear_bias, _, shard = _vocab_parallel(
        input, linear_weight, target, linear_bias, None, process_group, None
    )
    options = _option_arguments(
        "linear_log_probs", "linear_log_probs", shard=shard, temperature=temperature,
        softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index, return_entropy=return_entropy,
        return_argmax=return_argmax, workspace_bytes=workspace_bytes,
    )  # fmt: skip
    low_rank = _low_rank(low_rank_input, low_rank_weight)
    log_probs, entropy, argmax = torch.ops.fused_ce.linear_log_probs(
        input, linear_weight, target, linear_bias, **options, **low_rank
    )
    if not (return_entropy or return_argmax):
        return log_probs
    return LogProbs(log_probs, entropy if return_entropy else None, argmax if return_argmax else None)


class PolicyStats(NamedTuple):
    """What trainers log of a policy-gradient step: means over the counted tokens (0-dim float32 tensors), or with
    ``return_stats="per_token"`` each token's values shaped like the actions (0 at ignored tokens)."""

    ratio: Tensor  # mean probability ratio against the old policy
    clip_low: Tensor  # fraction clipped below (ratio < 1 - clip_low where the advantage is negative)
    clip_high: Tensor  # fraction clipped above (ratio > 1 + clip_high where the advantage is positive)
    kl: Tensor  # mean k3 KL against the reference policy, times the ratio with kl_times_ratio (0 without ref)
    entropy: Tensor  # mean entropy
    accuracy: Tensor  # fraction of tokens whose action is the most likely token


def linear_policy_loss(
    input: Tensor,
    linear_weight: Tensor,
    actions: Tensor,
    advantages: Tensor,
    *,
    token_weights: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_times_ratio: bool = False,
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    linear_bias: Tensor | None = None,
    ignore_index: int | None = -100,
    return_stats: bool | str = False,
    process_group=None,
    workspace_bytes: int | None = None,
    low_rank_input: Tensor | None = None,
    low_rank_weight: Tensor | None = None,
) -> Tensor | tuple[Tensor, PolicyStats]:
    r"""A policy-gradient loss (PPO-clip / GRPO, with a k3 KL and an entropy bonus) from the lm_head's input, without
    the logits, its gradients formed in the forward from one evaluation of them (6·N·D·V flops).

    Per counted token i (``actions != ignore_index``), with ``logp_i = log softmax(z_i / temperature)[action_i]``
    and ``H_i`` its entropy::

        ratio_i = exp(logp_i - old_i)        # old_i = logp_i detached without old_log_probs (on-policy)
        pg_i = -min(ratio_i * A_i, clamp(ratio_i, 1 - clip_low, 1 + clip_high) * A_i)
        kl_i = exp(ref_i - logp_i) - (ref_i - logp_i) - 1  # with ref_log_probs (times ratio_i: kl_times_ratio)
        loss = sum_i w_i * (pg_i + kl_coef * kl_i - entropy_coef * H_i)

    with ``w_i = token_weights[i]`` (every aggregation in use: a token mean over the batch, per-sequence means, a
    constant normaliser as in Dr. GRPO), by default ``1 / (number of counted tokens)``. The gradient is autograd's
    of the same formula in torch (min and clamp take torch's subgradients: halved at ties, inclusive bounds).

    Args:
        input: ``[..., D]`` hidden states; ``linear_weight`` ``[V, D]`` (a vocabulary shard with
            ``process_group``); ``actions`` ``[...]`` the sampled tokens.
        advantages, token_weights, old_log_probs, ref_log_probs: ``[...]`` per token, like ``actions``, without
            gradient.
        temperature, softcap, logit_scale: the logits are ``softcap(logit_scale * z) / temperature``, as in
            :func:`linear_log_probs`.
        return_stats: also :class:`PolicyStats` (mean ratio, clip fractions, mean KL, mean entropy, token
            accuracy), computed in the same pass; ``"per_token"``: each token's (ratio, clipped below and above as
            0 or 1, KL, entropy, whether the action is the most likely token), shaped like ``actions``, for
            per-sequence figures (TRL's ``clip_ratio/low_min``: the least of the sequences' low-clipped fractions).
        low_rank_input, low_rank_weight: a low-rank term of the logits (LoRA on the head, its dropout included),
            as in :func:`linear_cross_entropy`.

    Returns:
        The float32 loss, or ``(loss, PolicyStats)``.
    """
    if return_stats not in (False, True, "per_token"):
        raise ValueError(f"linear_policy_loss: return_stats must be a bool or 'per_token', got {return_stats!r}")
    input, linear_weight, actions, linear_bias, _, shard = _vocab_parallel(
        input, linear_weight, actions, linear_bias, None, process_group, None
    )
    options = _option_arguments(
        "linear_policy_loss", "linear_policy_loss", shard=shard, clip_low=clip_low,
        clip_high=clip_high, kl_coef=kl_coef, kl_times_ratio=kl_times_ratio, entropy_coef=entropy_coef,
        temperature=temperature, softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
        return_stats=bool(return_stats), workspace_bytes=workspace_bytes,
    )  # fmt: skip
    low_rank = _low_rank(low_rank_input, low_rank_weight)
    loss, stats = torch.ops.fused_ce.linear_policy_loss(
        input, linear_weight, actions, advantages, token_weights, old_log_probs, ref_log_probs, linear_bias, **options,
        **low_rank,
    )  # fmt: skip
    if not return_stats:
        return loss
    if return_stats == "per_token":
        return loss, PolicyStats(*stats.unbind())
    counted = (actions != ignore_index).sum() if ignore_index is not None else actions.new_tensor(actions.numel())
    return loss, PolicyStats(*(stats.flatten(1).sum(1) / counted.clamp(min=1)).unbind())


def linear_distillation_loss(
    input: Tensor,
    linear_weight: Tensor,
    teacher_input: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    target: Tensor | None = None,
    *,
    teacher_top_k: tuple[Tensor, Tensor] | None = None,
    beta: float = 0.0,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    linear_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    return_entropy: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    workspace_bytes: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Distillation of a student's head from a teacher's, without either's logits: both heads' logits are formed a
    block of rows at a time, and the student's gradients from the same blocks.

    Per counted row, with ``s = log_softmax(z_s / T)`` and ``t = log_softmax(z_t / T)`` (``z = input @
    linear_weight.T + linear_bias``, then each head's ``logit_scale`` and ``softcap`` as its model applies them):
    ``beta`` 0 gives KL(t || s) (forward KL), 1 gives KL(s || t) (reverse KL), in between the generalised
    Jensen-Shannon divergence ``beta KL(t || m) + (1 - beta) KL(s || m)`` with ``m = (1 - beta) p_s + beta p_t``
    (TRL's convention; no ``T**2`` factor: scale the loss if you want one). ``hard_label_weight`` ``w`` mixes in
    the cross-entropy of the student's logits (at temperature 1) on ``target``: ``(1 - w) divergence + w CE``.

    Args:
        input: ``[..., D]`` the student's hidden states; linear_weight ``[V, D]`` its head (float32, bfloat16 or
            float16, one dtype; ``torch.autocast`` casts both heads).
        teacher_input: ``[..., D_teacher]`` the teacher's hidden states, the same rows; teacher_weight ``[V,
            D_teacher]``. The teacher gets no gradient (pass them detached).
        target: ``[...]`` class indices, ``ignore_index`` at rows that are not counted (and not computed); None:
            every row counts (then ``hard_label_weight`` must be 0).
        teacher_top_k: ``(indices, log_probs)``, each ``[..., k]``, instead of ``teacher_input`` and
            ``teacher_weight``: the teacher's top k classes and their log-probabilities (from its full softmax at
            ``temperature``, e.g. precomputed offline); the loss is the forward KL from those k renormalised,
            ``sum_k q_k (log q_k - s[idx_k])`` (``beta`` 0 only). A ``-inf`` log-probability (padding) is
            probability 0 (``0 log 0 = 0``); a row of ``-inf`` only contributes 0.
        reduction: 'mean' over the counted rows, 'sum', or 'none' (each row's loss, 0 at ignored rows).
        linear_bias, teacher_bias: optional ``[V]``.
        softcap, logit_scale, teacher_softcap, teacher_logit_scale: each head's logit transform, ``softcap *
            tanh(logit_scale * z / softcap)`` (Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale``).
        return_entropy: also return each row's student entropy at ``temperature`` (0 at ignored rows, no
            gradient).
        process_group: vocabulary parallel: ``linear_weight`` and ``teacher_weight`` (and biases) are this
            rank's shard of the classes, the same shard for both (DTensors placed ``Shard(0)`` need no group);
            every rank gets the loss, the full input gradient and its shard's gradients.
        vocab_start: this rank's first class, where the shards are not in rank order.
        workspace_bytes: the bytes a block of rows may take (on CUDA both heads' logits in the input dtype and the
            block's rows; elsewhere about eight ``[rows, V]`` float32 tensors). Default: as the other ops'.

    Returns:
        The float32 loss (differentiable in ``input``, ``linear_weight`` and ``linear_bias``), and with
        ``return_entropy`` the entropies. A scalar loss's gradients are formed in the forward, from the same
        blocks (the backward only scales them); 'none' forms them in the backward for its upstream gradient.
    """
    top_indices, top_log_probs = (None, None) if teacher_top_k is None else teacher_top_k
    input, linear_weight, target, linear_bias, _, shard = _vocab_parallel(
        input, linear_weight, target, linear_bias, None, process_group, vocab_start, "linear_distillation_loss"
    )
    if shard is not None or process_group is not None:
        from . import distributed

        teacher_input, teacher_weight, teacher_bias = distributed.teacher_shard(teacher_input, teacher_weight,
                                                                                teacher_bias)  # fmt: skip
    options = _option_arguments(
        "linear_distillation_loss", "linear_distillation_loss", shard=shard, beta=beta, temperature=temperature,
        hard_label_weight=hard_label_weight, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
        logit_scale=logit_scale, teacher_softcap=teacher_softcap, teacher_logit_scale=teacher_logit_scale,
        return_entropy=return_entropy, workspace_bytes=workspace_bytes,
    )  # fmt: skip
    loss, entropy = torch.ops.fused_ce.linear_distillation_loss(
        input, linear_weight, teacher_input, teacher_weight, target, linear_bias, teacher_bias, top_indices,
        top_log_probs, **options,
    )  # fmt: skip
    return (loss, entropy) if return_entropy else loss


_check_front(linear_cross_entropy, "_linear_cross_entropy", internal=("lse_of_ignored_rows", "return_entropy"))
_check_front(linear_distillation_loss, "linear_distillation_loss")
_check_front(linear_log_probs, "linear_log_probs")
_check_front(linear_policy_loss, "linear_policy_loss")

_DTYPES = {"BFloat16": torch.bfloat16, "Half": torch.float16, "Float": torch.float32, "Double": torch.float64}

# What one op call does (csrc/plan.h, whose comments say what each field means; plan_fields lists them, and the
# _plan op's schema declares them, which this tuple's fields are read from).
Plan = NamedTuple(
    "Plan",
    [
        (
            r.name,
            torch.dtype | None
            if r.name.endswith("dtype")
            else {"str": str, "int": int, "float": float}.get(str(r.type), bool),
        )
        for r in torch.ops.fused_ce._plan.default._schema.returns
    ],
)
Plan.__doc__ = """What one op call does (csrc/plan.h): chosen from the shapes, dtypes, options, device, budget and
the number of counted rows. The fields are those of the C++ Plan; dtypes are torch dtypes (None where none)."""


def plan(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, pass_: str | None = None, **keywords: Unpack[LossKeywords]
) -> Plan:
    """The plan :func:`linear_cross_entropy` follows for these arguments (its keywords), without running it.

    ``pass_`` defaults to the op the call runs first: "forward_with_grad" where a scalar loss needs
    gradients (but float16 on the CPU, whose backward recomputes them), "forward_keeping_logits" where a
    per-row loss needs them on CUDA and the workspace holds at least a few hundred rows' logits
    (``keeps_logits``; ``kept_rows``: every counted row where they all fit, else the first of them: its
    backward, "backward_from_logits", multiplies those back instead of computing them again and computes the
    others' in their storage), else "forward"; a per-row loss or a gradient through the lse otherwise runs
    "backward" later.
    The plan depends on shapes, dtypes, strides, device and the number of counted (not ignored) targets,
    which it reads (one host read on CUDA); expanded tensors serve for the rest.
    """
    keywords.pop("options", None)
    bias, weight = keywords.pop("linear_bias", None), keywords.pop("weight", None)
    return_lse = keywords.pop("return_lse", False)
    low_rank = {n: keywords.pop(n, None) for n in ("low_rank_input", "low_rank_weight")}
    input, linear_weight, target, bias, weight, shard = _vocab_parallel(
        input,
        linear_weight,
        target,
        bias,
        weight,
        keywords.pop("process_group", None),
        keywords.pop("vocab_start", None),
    )
    options = _option_arguments(
        "_linear_cross_entropy", "linear_cross_entropy", **keywords, lse_of_ignored_rows=return_lse, shard=shard
    )
    # (None: "first", the pass the op picks, chosen in C++ as the op and its autograd formula choose it)
    fields = torch.ops.fused_ce._plan(
        input, linear_weight, target, pass_ or "first", bias, weight, **options, **low_rank
    )
    values = [(_DTYPES.get(v) if name.endswith("dtype") else v) for name, v in zip(Plan._fields, fields, strict=True)]
    return Plan(*values)
