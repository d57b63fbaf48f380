"""Hugging Face transformers: a causal LM's loss through fused_ce, its ``[batch, seq, V]`` logits never built.

    from fused_ce.integrations.transformers import apply
    model = apply(AutoModelForCausalLM.from_pretrained(...))   # or apply(LlamaForCausalLM), apply("llama")

The model's own forward runs, rewritten once per class: its head call ``logits = self.lm_head(hidden)`` yields
the hidden states and the head instead of logits, what the forward then does to its logits (divide or multiply
by a constant, a tanh softcap, a vocabulary slice, ``.float()``) is recorded, and its
``self.loss_function(logits, labels, ...)`` is fused_ce's loss of the same meaning (transformers'
``ForCausalLMLoss``: shifted labels or ``shift_labels``, ``ignore_index``, ``num_items_in_batch``). Everything
else is the model's own code: the base model, ``logits_to_keep`` (int or tensor), a MoE router's auxiliary loss
added to the loss, ``return_dict=False``, the outputs. Only the output's ``logits`` is None, in training; a model
that is not training returns its logits with its own loss, as unpatched (``apply(..., logits="never")`` builds none
there either: see ``apply``).

The loss is computed inside the head module's own call (``lm_head(hidden, _fused_ce_loss=...)``), so an engine
that manages its weight (FSDP2 however it wraps, DeepSpeed ZeRO-3, DDP) gathers, reshards and reduces it as for
the head's forward. A PEFT model is switched inside; LoRA adapters on the lm_head are the loss's low-rank term
(``s * A(dropout(x))`` and ``B``: ``fused_ce.linear_cross_entropy``'s ``low_rank_input`` and ``low_rank_weight``).

A forward that uses its logits any other way (a learned scale, a head module with a forward of its own, a
second softcap, a loss of its own) is refused when ``apply`` is called, naming the line; so is a head that
is not an ``nn.Linear`` (at the first call, for a class). Without labels (generation) the forward is the
model's own. ``import fused_ce`` never imports transformers. Compiling a model, ``keep_causal_sdpa_when_compiled()``
keeps SDPA's causal kernel where transformers would give it an explicit mask.
"""

from .._head import _HeadForward as _HeadForward  # (a switched head's forward pickles by this module's name)
from .forward import FAMILIES as FAMILIES
from .forward import _fused_forward, _model_class, _unwrapped, check
from .forward import _ModelForward as _ModelForward  # (a switched model's forward pickles by this name)
from .heads import HeadLogits as HeadLogits
from .heads import Refused as Refused
from .heads import _lora_of as _lora_of  # (integrations.trl's)
from .heads import _lora_terms as _lora_terms
from .heads import _loss_module
from .loss import ForCausalLMLoss as ForCausalLMLoss
from .sdpa import keep_causal_sdpa_when_compiled as keep_causal_sdpa_when_compiled
from .state import _ASKS_ACCURACY, _GRAD_FILTER_EPS, _LOGITS_POLICY, LOGITS_POLICIES
from .trainer import _install_trainer_hook


def apply(model, *, token_accuracy=False, logits="eval", grad_filter_eps=0.0):
    """Switch a causal LM to fused_ce's loss, in place, and return it.

    ``model``: an instance (only it is switched), a class (every instance), or a family name from ``FAMILIES``;
    a PEFT model (``get_peft_model``) is switched inside (LoRA adapters anywhere, the lm_head's included).
    ``token_accuracy``: a call with labels also returns ``outputs.token_accuracy``, the fraction of counted
    tokens whose label is the most likely token (what trainers log as ``mean_token_accuracy``; float32, on the
    device, from the loss's own pass: the logits are still never built). Per call, so per rank and micro-batch.
    ``logits``: what a call with labels returns as ``outputs.logits``. Training never builds them. "eval" (the
    default): a model that is not training (``model.eval()``: evaluation, ``Trainer.evaluate`` and its
    ``compute_metrics``) runs its own forward and returns its logits and its own loss, as unpatched; "never": the
    fused loss and no logits in evaluation too (``logits`` None). A call's ``skip_logits=True`` (transformers'
    keyword; the Trainer passes it for a ``prediction_loss_only`` evaluation, see ``_install_trainer_hook``) builds
    none, ``skip_logits=False`` builds them.
    ``grad_filter_eps``: the training loss's opt-in gradient filtering (:func:`fused_ce.linear_cross_entropy`'s; 0,
    the default: exact gradients). For fine-tuning a trained model, not for pretraining from scratch
    (docs/usage.md); it does not combine with the Trainer's ``label_smoothing_factor``.
    Raises ``Refused`` (a TypeError) naming what the model's forward does that fused_ce cannot reproduce.
    """
    if logits not in LOGITS_POLICIES:
        raise ValueError(
            f"fused_ce.integrations.transformers.apply: logits must be one of {LOGITS_POLICIES}, got {logits!r}"
        )
    number = isinstance(grad_filter_eps, (int, float)) and not isinstance(grad_filter_eps, bool)
    if not number or not 0 <= grad_filter_eps < 1:
        raise ValueError(
            "fused_ce.integrations.transformers.apply: grad_filter_eps must be a number in [0, 1), got "
            f"{grad_filter_eps!r}"
        )
    if isinstance(model, str):
        model = _model_class(model)
    base = _unwrapped(model)
    if base is not model:  # a PEFT model: its causal LM is switched (LoRA on the lm_head too)
        apply(base, token_accuracy=token_accuracy, logits=logits, grad_filter_eps=grad_filter_eps)
        return model
    head = check(model)
    _install_trainer_hook()
    setattr(model, _ASKS_ACCURACY, bool(token_accuracy))
    setattr(model, _LOGITS_POLICY, logits)
    setattr(model, _GRAD_FILTER_EPS, float(grad_filter_eps))
    cls = model if isinstance(model, type) else type(model)
    if not isinstance(model, type):
        # now, not at the first call: a forward compiled before any eager call then finds the head switched
        _loss_module(getattr(model, head))
    current = cls.forward if isinstance(model, type) else model.forward
    if getattr(current, "_fused_ce_original", None) is not None:
        return model  # already switched
    if isinstance(model, type):
        cls.forward = _fused_forward(cls)
    else:
        model.forward = _ModelForward(model)
    return model
