"""transformers' ForCausalLMLoss through fused_ce: the labels shifted as transformers shifts them, 'mean' or a sum over
``num_items_in_batch``, the token accuracy from the loss's own pass."""

import torch
from torch import nn

from ...functional import linear_cross_entropy


def ForCausalLMLoss(  # noqa: N802  (the name transformers' loss hook and kernel mapping use)
    hidden_states,
    lm_head_weight,
    labels,
    hidden_size=None,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    final_logit_softcapping=None,
    lm_head_bias=None,
    logit_scale=1.0,
    return_token_accuracy=False,
    label_smoothing=0.0,
    lm_head_low_rank=None,
    grad_filter_eps=0.0,
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` from the hidden states and the lm_head weight (the signature of the
    fused-linear loss that transformers' kernel mapping for ``ForCausalLMLoss`` calls).

    ``hidden_states [..., T, D]`` and ``labels [..., T]``: position t predicts label t + 1 unless
    ``shift_labels`` is given. 'mean' over the counted tokens, or their sum divided by ``num_items_in_batch``.
    The logits are ``softcap(logit_scale * (hidden @ W.T + b))``. ``label_smoothing`` as torch's (the Trainer's
    ``label_smoothing_factor``: its LabelSmoother's loss). With ``return_token_accuracy``,
    ``(loss, accuracy)``: the fraction of counted tokens whose label is the most likely token (float32, no
    gradient; from the loss's own pass, no host read). ``lm_head_low_rank``: a low-rank term of the logits,
    ``(input [..., T, r], weight [V, r])`` (LoRA on the head with dropout: :func:`fused_ce.linear_cross_entropy`'s
    ``low_rank_input`` and ``low_rank_weight``). ``grad_filter_eps``: :func:`fused_ce.linear_cross_entropy`'s
    opt-in gradient filtering (for fine-tuning, not pretraining: docs/usage.md).
    """
    hidden = hidden_states.reshape(-1, lm_head_weight.shape[1])
    target = _shifted(labels, shift_labels, ignore_index).reshape(-1).to(hidden.device)
    low_rank = {}
    if lm_head_low_rank is not None:
        low_rank_input, low_rank_weight = lm_head_low_rank
        low_rank = dict(low_rank_input=low_rank_input.reshape(hidden.shape[0], -1), low_rank_weight=low_rank_weight)
    reduction = "mean" if num_items_in_batch is None else "sum"
    out = linear_cross_entropy(
        hidden,
        lm_head_weight,
        target,
        linear_bias=lm_head_bias,
        reduction=reduction,
        ignore_index=ignore_index,
        softcap=final_logit_softcapping,
        logit_scale=logit_scale,
        label_smoothing=label_smoothing,
        return_argmax=return_token_accuracy,
        grad_filter_eps=grad_filter_eps,
        **low_rank,
    )
    loss, argmax = out if return_token_accuracy else (out, None)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    if not return_token_accuracy:
        return loss
    return loss, _accuracy(argmax, target, ignore_index)


def _shifted(labels, shift_labels, ignore_index):
    """The label each position predicts: ``shift_labels``, or the next position's label (the last position's
    ignored), as transformers' loss shifts them."""
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _accuracy(predicted, target, ignore_index):
    """The fraction of counted targets predicted (float32, no gradient: 0 where none is counted)."""
    counted = target != ignore_index
    return ((predicted == target) & counted).sum().float() / counted.sum().clamp(min=1).float()
