"""The head a rewritten forward stands in for: what it holds instead of logits (HeadLogits), the lm_head module and
the engines' copies of it, and its PEFT LoRA adapters (the loss's low-rank term)."""

import torch
from torch import nn

from .._head import _route_through


class Refused(TypeError):
    """A model whose forward fused_ce cannot reproduce without building its logits."""


class HeadLogits:
    """What a rewritten forward holds instead of its logits: the head's input and weight, and the transforms
    the forward applied since (``softcap(logit_scale * logits)`` and a vocabulary slice)."""

    def __init__(self, head, hidden):
        self.head, self.hidden = head, hidden
        self.pre_scale, self.post_scale, self.tanh, self.vocab = 1.0, 1.0, False, None

    def _copy(self, **changes):
        out = HeadLogits(self.head, self.hidden)
        out.pre_scale, out.post_scale, out.tanh, out.vocab = self.pre_scale, self.post_scale, self.tanh, self.vocab
        for name, value in changes.items():
            setattr(out, name, value)
        return out

    def scaled(self, factor):
        if torch.is_tensor(factor):
            raise Refused(
                "fused_ce: the model multiplies its logits by a tensor (a learned or runtime scale), which fused_ce "
                "cannot fuse; use the model unpatched"
            )
        factor = float(factor)
        return (
            self._copy(post_scale=self.post_scale * factor)
            if self.tanh
            else self._copy(pre_scale=self.pre_scale * factor)
        )

    def tanh_(self):
        if self.tanh:
            raise Refused("fused_ce: the model applies tanh to its logits twice; fused_ce has one softcap")
        return self._copy(tanh=True)

    def sliced(self, stop):
        stop = int(stop)
        return self._copy(vocab=stop if self.vocab is None else min(self.vocab, stop))

    @property
    def vocab_size(self):
        copies = _saved_copies(self.head)
        weight = (copies[0] if copies else self.head).weight
        rows = getattr(weight, "ds_shape", weight.shape)[0]  # (DeepSpeed ZeRO-3: a partitioned weight's own shape)
        return rows if self.vocab is None else min(rows, self.vocab)

    def loss_arguments(self, weight, bias, low_rank=None):
        """(weight, bias, softcap, logit_scale, low_rank) of fused_ce's loss from the head's (whole) weight, bias
        and low-rank term ((input, weight) or None): a * tanh(b * raw) is softcap a at scale a * b."""
        if self.vocab is not None and self.vocab < weight.shape[0]:
            weight = weight[: self.vocab]
            bias = None if bias is None else bias[: self.vocab]
            low_rank = None if low_rank is None else (low_rank[0], low_rank[1][: self.vocab])
        if not self.tanh:
            return weight, bias, None, self.pre_scale, low_rank
        return weight, bias, self.post_scale, self.post_scale * self.pre_scale, low_rank


def _is_linear(module):
    # FSDP2's fully_shard swaps a module's class for a subclass of it (FSDPLinear): still a plain nn.Linear
    return type(module) is nn.Linear or (type(module).__name__ == f"FSDP{nn.Linear.__name__}" and
                                          isinstance(module, nn.Linear))  # fmt: skip


def _lora_of(head):
    """PEFT's LoRA layer wrapping an nn.Linear head (LoRA on the lm_head), else None."""
    base = getattr(head, "base_layer", None)
    if base is None or not _is_linear(base) or not hasattr(head, "lora_A") or not hasattr(head, "scaling"):
        return None
    return head


def _saved_copies(head):
    """PEFT's ModulesToSaveWrapper (``modules_to_save=["lm_head"]``, which TRL adds where a chat template adds
    tokens): the modules its call may run, the original head and each adapter's trained copy; else None."""
    original, copies = getattr(head, "original_module", None), getattr(head, "modules_to_save", None)
    if original is None or not isinstance(copies, nn.ModuleDict):
        return None
    return [original, *copies.values()]


def _head_of(model, name):
    head = getattr(model, name)
    copies = _saved_copies(head)
    if not all(_is_linear(m) or _lora_of(m) is not None for m in (copies or [head])):
        raise Refused(
            f"fused_ce: {type(model).__name__}.{name} is a {type(head).__name__}, not an nn.Linear (nor PEFT's LoRA "
            "layer or modules_to_save copy of one): its own forward would be skipped; use the model unpatched"
        )
    return head


def _loss_module(head):
    """The module to call with the loss keyword (_head.py): the head, routed; a modules_to_save wrapper as it is, its
    copies routed: its call hands the keyword to the copy it runs (the active adapter's, or the original head with
    adapters disabled), whose weight the loss then takes and trains."""
    copies = _saved_copies(head)
    if copies is None:
        return _route_through(head)
    for copy in copies:
        _route_through(copy)
    return head


def _active_lora_adapters(head):
    """The LoRA adapters a head's call adds (none where they are disabled or merged into the base weight);
    Refused for those whose term fused_ce does not form (DoRA, an adapter bias)."""
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return []
    adapters = [adapter for adapter in head.active_adapters if adapter in head.lora_A]
    for adapter in adapters:
        if getattr(head, "use_dora", {}).get(adapter, False) or getattr(head, "lora_bias", {}).get(adapter, False):
            raise Refused(f"fused_ce: the LoRA adapter {adapter!r} on the lm_head uses DoRA or a bias: not fused")
    return adapters


def _lora_terms(head, hidden):
    """(weight, bias, low_rank) of a LoRA head's logits for its input ``hidden``: the active adapters as the loss's
    low-rank term, ``low_rank = (cat_a scale_a * A_a(dropout_a(hidden)), cat_a B_a)`` (the ranks side by side: the
    sum of the adapters' products; None without an active adapter), the dropout drawn here as the head's own call
    would draw it. No ``V x D`` sum ``W + s B A`` is formed, and a frozen base weight gets no ``V x D`` gradient to
    pass on to A and B."""
    base = head.base_layer
    inputs, weights = [], []
    for adapter in _active_lora_adapters(head):  # (in the head's order: the dropout masks its call draws)
        lora_a, lora_b = head.lora_A[adapter], head.lora_B[adapter]
        dropped = head.lora_dropout[adapter](hidden.to(lora_a.weight.dtype))
        inputs.append((lora_a(dropped) * head.scaling[adapter]).to(hidden.dtype))
        weights.append(lora_b.weight.to(hidden.dtype))
    low_rank = (torch.cat(inputs, -1), torch.cat(weights, -1)) if inputs else None
    return base.weight, base.bias, low_rank
