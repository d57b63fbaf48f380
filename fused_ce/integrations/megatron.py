"""Megatron-Core: fused_ce as the LM loss of a ``GPTModel``, the logits never formed.

    from fused_ce.integrations.megatron import apply

    model = apply(model)  # a GPTModel, a wrapper of one (DDP, Float16Module), or the list of model chunks

With labels, the main head's and every multi-token-prediction depth's loss comes from the output layer's input (the
final hidden states ``[s, b, h]``) and its weight shard (``[V / tp, h]``, the embedding's where the weights are tied)
through :func:`fused_ce.linear_cross_entropy`, vocabulary parallel over the model's tensor-parallel group, per token
as Megatron returns it (``[b, s]``, unreduced, float32): Megatron's own code around it (the loss mask, MTP's scaling
and logging, MuP's output multiplier) runs as before. Without labels the model is unchanged.

``GPTModel._postprocess`` calls ``self.output_layer(...)`` and then ``self.compute_language_model_loss(labels,
logits)`` for each MTP depth and (before 0.18) for the main head. ``apply`` patches those two on the instance (and
the model's ``forward``, to know whether labels came): with labels the output layer returns its input and weight
instead of logits (``HeadInputs``), and the loss takes them. From 0.18 on the main head goes through the hook
Megatron offers for it, ``forward(..., output_processor=...)``, which the patched ``forward`` passes where labels
come and the caller passed none. From 0.19 on Megatron counts MTP's accepted tokens from the MTP logits: the counts
come from the loss's own argmax (``return_argmax``) instead. The output layer's input is gathered along the sequence
where it is sequence parallel, as the layer itself would; fused_ce returns the input gradient summed over the group,
so the gather's backward takes this rank's slice (where Megatron's layer reduce-scatters its partial gradient), and
no copy to the tensor-parallel region is made (its backward all-reduce is the op's own).

Refused, with an error naming the setting: Megatron-Core versions other than those tested,
``gradient_accumulation_fusion`` (weight gradients written into ``main_grad`` by Megatron's own kernel),
``defer_embedding_wgrad_compute``, the config logger (it records the logits).
"""

import functools
import inspect

import torch

import fused_ce

# megatron-core versions whose _postprocess is the one described above (tested: tests/test_megatron.py)
_SUPPORTED = ("0.16.", "0.17.", "0.18.", "0.19.")
_STATE = "_fused_ce_megatron"  # the instance attribute apply leaves (idempotence, the labels flag)


class HeadInputs:
    """What the patched output layer returns in place of logits: its input (gathered along the sequence where it is
    sequence parallel), its weight shard, its bias (None without one) and the logits' multiplier (MuP's output
    multiplier, Megatron's ``_scale_logits``: ``head * m``); after the loss, the argmax per token ``[s, b]``."""

    def __init__(self, hidden, weight, bias, scale=1.0):
        self.hidden, self.weight, self.bias, self.scale = hidden, weight, bias, scale
        self.argmax = None

    def __mul__(self, factor):
        return HeadInputs(self.hidden, self.weight, self.bias, self.scale * float(factor))


def apply(model):
    """fused_ce's loss for a Megatron-Core GPTModel (or a wrapper of one, or a list of model chunks); returns
    ``model``. Calling it again changes nothing."""
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(_SUPPORTED):
        raise NotImplementedError(
            f"fused_ce.integrations.megatron.apply: megatron-core {version} is not supported (tested: "
            f"{', '.join(v + 'x' for v in _SUPPORTED)})"
        )
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        _apply_to(_gpt_model(chunk))
    return model


def _gpt_model(module):
    from megatron.core.models.gpt import GPTModel

    seen = module
    while not isinstance(seen, GPTModel):
        if not hasattr(seen, "module"):
            raise TypeError(
                f"fused_ce.integrations.megatron.apply: model must be a megatron GPTModel (or a wrapper of one, or a "
                f"list of them), got {type(module).__name__}"
            )
        seen = seen.module
    return seen


def _refuse_unsupported(gpt):
    from megatron.core.config_logger import has_config_logger_enabled

    config = gpt.config
    for setting in ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute"):
        if getattr(config, setting, False):
            raise NotImplementedError(
                f"fused_ce.integrations.megatron.apply: {setting}=True is not supported yet (the output layer's "
                "weight gradient would be expected in main_grad from Megatron's own kernel); set it to False"
            )
    if has_config_logger_enabled(config):
        raise NotImplementedError(
            "fused_ce.integrations.megatron.apply: the config logger (config_logger_dir) records the logits, which "
            "fused_ce never forms; unset it"
        )


def _tp_group(gpt):
    from megatron.core import parallel_state

    collection = getattr(gpt, "pg_collection", None)
    group = getattr(collection, "tp", None) if collection is not None else None
    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def _apply_to(gpt):
    if getattr(gpt, _STATE, None) is not None or not gpt.post_process:
        return  # (applied already; a pipeline stage without the output layer has no loss)
    _refuse_unsupported(gpt)
    group = _tp_group(gpt)  # (None where the vocabulary is not split)
    state = {"labels": False}
    setattr(gpt, _STATE, state)
    forward, layer = gpt.forward, gpt.output_layer
    layer_forward, loss = layer.forward, gpt.compute_language_model_loss
    signature = inspect.signature(type(gpt).forward)
    labels_at = signature.bind_partial  # (labels by name or by position)
    hook = "output_processor" in signature.parameters  # (0.18 on: the main head's own hook)
    # 0.19 on: MTP's accepted tokens counted from its logits in training (the loss's argmax instead)
    argmax = bool(gpt.config.mtp_num_layers) and _count_mtp_acceptance_from_argmax()

    def head_inputs(input_, weight):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        weight = layer.weight if weight is None else weight
        if layer.sequence_parallel and group is not None:
            # as the layer's own gather, but its backward a slice: fused_ce sums dX over the group
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False, group=group)
        return HeadInputs(input_, weight, None if layer.skip_bias_add else layer.bias)

    @functools.wraps(forward)
    def forward_noting_labels(*args, **kwargs):
        previous = state["labels"]
        state["labels"] = labels_at(gpt, *args, **kwargs).arguments.get("labels") is not None
        if hook and state["labels"] and kwargs.get("output_processor") is None:
            kwargs["output_processor"] = main_head_loss
        try:
            return forward(*args, **kwargs)
        finally:
            state["labels"] = previous

    def main_head_loss(*, hidden_states, output_weight, labels, scale_logits, **_):
        return fused_language_model_loss(labels, scale_logits(head_inputs(hidden_states, output_weight)))

    @functools.wraps(layer_forward)
    def output_layer_inputs(input_, weight=None, runtime_gather_output=None):
        if not state["labels"]:
            return layer_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        return head_inputs(input_, weight), (layer.bias if layer.skip_bias_add else None)

    @functools.wraps(loss)
    def fused_language_model_loss(labels, logits):
        if not isinstance(logits, HeadInputs):
            return loss(labels, logits)
        # [b s] => [s b], the loss per token (float32), [s b] => [b s]: as Megatron's
        out = fused_ce.linear_cross_entropy(
            logits.hidden,
            logits.weight,
            labels.transpose(0, 1),
            linear_bias=logits.bias,
            reduction="none",
            logit_scale=logits.scale,
            return_argmax=argmax,
            process_group=group,
        )
        if argmax:
            out, logits.argmax = out
        return out.transpose(0, 1).contiguous()

    gpt.forward = forward_noting_labels
    layer.forward = output_layer_inputs
    gpt.compute_language_model_loss = fused_language_model_loss


def _count_mtp_acceptance_from_argmax():
    """Where Megatron counts MTP's accepted tokens from the MTP logits (0.19 on: ``process_mtp_loss`` calls
    ``_compute_mtp_acceptance_counts``), has it count them from the argmax the fused loss returned for a head that
    formed none (once per process; logits are counted by Megatron's own function). Whether it does."""
    from megatron.core.transformer import multi_token_prediction as mtp

    count = getattr(mtp, "_compute_mtp_acceptance_counts", None)
    if count is None:
        return False
    if getattr(count, "_fused_ce", False):
        return True

    @functools.wraps(count)
    def acceptance_counts(mtp_logits, mtp_labels, loss_mask, *args, **kwargs):
        if not isinstance(mtp_logits, HeadInputs):
            return count(mtp_logits, mtp_labels, loss_mask, *args, **kwargs)
        with torch.no_grad():  # (as Megatron's: [b, s] => [s, b])
            valid = loss_mask.transpose(0, 1).bool()
            correct = ((mtp_logits.argmax == mtp_labels.transpose(0, 1)) & valid).sum().float()
            return correct, valid.sum().float()

    acceptance_counts._fused_ce = True
    mtp._compute_mtp_acceptance_counts = acceptance_counts
    return True
