"""Hugging Face transformers: a causal LM's loss through fused_ce, its ``[batch, seq, V]`` logits never built.

    from fused_ce.integrations.transformers import apply
    model = apply(AutoModelForCausalLM.from_pretrained(...))   # or apply(LlamaForCausalLM), apply("llama")

When ``labels`` (or ``shift_labels``) are given, the patched forward runs the base model, takes its last hidden
states and computes the loss from them and the lm_head weight (and bias) with fused_ce; the output's ``logits``
is then None. Without labels (generation, evaluation of logits) the forward is the model's own.

Semantics the Trainer relies on, as transformers' ``ForCausalLMLoss``: labels shifted by one (or
``shift_labels`` as given), ``ignore_index=-100``, ``num_items_in_batch`` (the sum of token losses divided by it,
so gradient accumulation matches one large batch), ``logits_to_keep`` (the positions whose hidden states are
used), Gemma's ``config.final_logit_softcapping`` (fused_ce's ``softcap``), tied embeddings (the lm_head weight
is the embedding, its gradient accumulates there).

Supported: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 by family name, and any model with the
common layout, detected on the instance or class: a ``*ForCausalLM`` whose ``model`` attribute is the base model
(returning ``last_hidden_state``) and whose ``lm_head`` is an ``nn.Linear``. transformers is imported lazily.
"""

import functools
import inspect
import types

import torch
from torch import nn

from ..functional import linear_cross_entropy

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Arguments of a *ForCausalLM forward that belong to the loss, not to the base model.
_LOSS_ARGUMENTS = ("labels", "logits_to_keep", "num_logits_to_keep")


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
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` from the hidden states and the lm_head weight (the signature of the
    fused-linear loss that transformers' kernel mapping for ``ForCausalLMLoss`` calls).

    ``hidden_states [..., T, D]`` and ``labels [..., T]``: position t predicts label t + 1 unless
    ``shift_labels`` is given. 'mean' over the counted tokens, or their sum divided by ``num_items_in_batch``.
    """
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, lm_head_weight.shape[1])
    target = shift_labels.reshape(-1).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(
        hidden,
        lm_head_weight,
        target,
        linear_bias=lm_head_bias,
        reduction=reduction,
        ignore_index=ignore_index,
        softcap=final_logit_softcapping,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _model_class(family):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)} (or pass a model or its class)")
    return getattr(transformers, FAMILIES[family])


def _check_layout(model_or_class):
    name = model_or_class.__name__ if isinstance(model_or_class, type) else type(model_or_class).__name__
    if not name.endswith("ForCausalLM"):
        raise TypeError(f"fused_ce: {name} is not a *ForCausalLM model")
    if isinstance(model_or_class, type):
        return
    base, head = getattr(model_or_class, "model", None), getattr(model_or_class, "lm_head", None)
    if not isinstance(base, nn.Module) or not isinstance(head, nn.Linear):
        raise TypeError(
            f"fused_ce: {name} does not have the common causal-LM layout (a `model` base module and an `lm_head` "
            "nn.Linear); its loss cannot be computed from hidden states"
        )


def _fused_forward(original):
    """The forward of a *ForCausalLM, with the loss from hidden states when there are labels."""
    signature = inspect.signature(original)
    var_keyword = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if kwargs.get("labels") is None and kwargs.get("shift_labels") is None and not _has_positional_labels(args):
            return original(self, *args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        arguments = signature.bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
        labels = arguments.pop("labels", None)
        logits_to_keep = arguments.pop("logits_to_keep", None) or arguments.pop("num_logits_to_keep", None) or 0
        for name in _LOSS_ARGUMENTS:
            arguments.pop(name, None)
        return_dict = arguments.pop("return_dict", None)
        loss_kwargs = {k: extra.pop(k) for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in extra}
        outputs = self.model(**arguments, **extra)
        hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        loss = ForCausalLMLoss(
            hidden[:, keep, :],
            self.lm_head.weight,
            labels,
            final_logit_softcapping=getattr(self.config, "final_logit_softcapping", None),
            lm_head_bias=self.lm_head.bias,
            **loss_kwargs,
        )
        fields = CausalLMOutputWithPast.__dataclass_fields__
        passed = {f: getattr(outputs, f, None) for f in fields if f not in ("loss", "logits")}
        out = CausalLMOutputWithPast(loss=loss, logits=None, **passed)
        return out.to_tuple() if return_dict is False else out

    def _has_positional_labels(args):
        names = [n for n in signature.parameters if n != "self"]
        return "labels" in names[: len(args)] and args[names.index("labels")] is not None

    forward._fused_ce_original = original
    return forward


def apply(model):
    """Switch a causal LM to fused_ce's loss, in place, and return it.

    ``model``: an instance (only it is switched), a class (every instance), or a family name from ``FAMILIES``.
    """
    if isinstance(model, str):
        model = _model_class(model)
    _check_layout(model)
    cls = model if isinstance(model, type) else type(model)
    current = model.forward if not isinstance(model, type) else cls.forward
    if getattr(current, "_fused_ce_original", None) is not None:
        return model  # already switched
    original = cls.forward
    if isinstance(model, type):
        cls.forward = _fused_forward(original)
    else:
        model.forward = types.MethodType(_fused_forward(original), model)
    return model
