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

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import types

import torch
from torch import nn

from ..functional import linear_cross_entropy
from ._head import _LOSS_KEYWORD, _HeadForward, _route_through  # noqa: F401  (_HeadForward: pickles by this name)

# Names for apply("llama") etc.: any causal LM class works, these are shortcuts.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


# The state apply leaves on a model (or class), read by the loss, the forward and the Trainer's patches.
# apply(token_accuracy=True) sets the first on the model (or class); a call with labels then holds a list in the
# second while it runs, into which the loss puts the call's token accuracy.
_ASKS_ACCURACY = "_fused_ce_token_accuracy"
_ACCURACY_ATTRIBUTE = "_fused_ce_token_accuracies"
# apply(logits=...) on the model (or class): "eval" or "never"
_LOGITS_POLICY = "_fused_ce_logits"
# While the Trainer's compute_loss runs a label-smoothed step through the fused loss: the loss keywords that give its
# LabelSmoother's loss (label_smoothing, and shift_labels / num_items_in_batch where the smoother's differ)
_TRAINER_LOSS = "_fused_ce_trainer_loss"
# apply(grad_filter_eps=...) on the model (or class)
_GRAD_FILTER_EPS = "_fused_ce_grad_filter_eps"
LOGITS_POLICIES = ("eval", "never")


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


# The rewritten forward calls these (the names the rewriter gives them).
def _fce_head(model, name, hidden):
    return HeadLogits(_head_of(model, name), hidden)


def _fce_div(logits, divisor):
    return logits.scaled(1.0 / divisor) if isinstance(logits, HeadLogits) else logits / divisor


def _fce_mul(logits, factor):
    return logits.scaled(factor) if isinstance(logits, HeadLogits) else logits * factor


def _fce_tanh(logits):
    return logits.tanh_() if isinstance(logits, HeadLogits) else torch.tanh(logits)


def _fce_vocab_slice(logits, stop):
    return logits.sliced(stop) if isinstance(logits, HeadLogits) else logits[..., :stop]


def _fce_device(logits):
    return logits.hidden.device if isinstance(logits, HeadLogits) else logits.device


def _fce_vocab_size(logits):
    return logits.vocab_size if isinstance(logits, HeadLogits) else logits.shape[-1]


def _fce_loss(model, *args, **kwargs):
    """The model's self.loss_function(logits, labels, vocab_size, **kwargs), fused: transformers' ForCausalLMLoss."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    if model.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        raise Refused(
            f"fused_ce: {type(model).__name__}'s loss_function is not transformers' ForCausalLMLoss; fused_ce "
            "reproduces that one only: use the model unpatched"
        )
    names = ("logits", "labels", "vocab_size")
    bound = dict(zip(names, args), **kwargs)
    logits, labels = bound.pop("logits"), bound.pop("labels")
    bound.pop("vocab_size", None)

    accuracy = getattr(model, _ACCURACY_ATTRIBUTE, None)  # a list where apply(token_accuracy=True) asked
    bound.update(getattr(model, _TRAINER_LOSS, None) or {})  # the Trainer's label smoother's (_install_trainer_hook)
    bound["grad_filter_eps"] = getattr(model, _GRAD_FILTER_EPS, 0.0)

    def loss(head, hidden):  # inside the head's call: its weight whole
        if _lora_of(head) is not None:
            weight, bias, low_rank = _lora_terms(head, hidden)
        else:
            weight, bias, low_rank = head.weight, head.bias, None
        weight, bias, softcap, logit_scale, low_rank = logits.loss_arguments(weight, bias, low_rank)
        out = ForCausalLMLoss(
            hidden, weight, labels, final_logit_softcapping=softcap, lm_head_bias=bias, logit_scale=logit_scale,
            return_token_accuracy=accuracy is not None, lm_head_low_rank=low_rank, **bound,
        )  # fmt: skip
        if accuracy is None:
            return out
        accuracy.append(out[1])  # (the head's call returns tensors only: engines' hooks see its output)
        return out[0]

    return _loss_module(logits.head)(logits.hidden, **{_LOSS_KEYWORD: loss})


class _Rewriter(ast.NodeTransformer):
    """Rewrites a causal LM's forward (see the module's docstring). ``logits`` names hold HeadLogits."""

    def __init__(self, source_name):
        self.source_name = source_name
        self.lazy = set()  # names holding the head's logits
        self.head = None  # the head attribute's name

    def refuse(self, node, why):
        line = ast.unparse(node).splitlines()[0]
        raise Refused(f"fused_ce: {self.source_name} {why}: `{line}`; use the model unpatched")

    # -- which expressions hold logits
    def is_lazy(self, node):
        return any(isinstance(n, ast.Name) and n.id in self.lazy for n in ast.walk(node)) or any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "_fce_head"
            for n in ast.walk(node)
        )

    @staticmethod
    def call(name, *args):
        return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])

    def head_call(self, node):
        """self.<attr>(hidden) -> _fce_head(self, "<attr>", hidden), or None if node is no head call."""
        f = node.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
            return None
        if self.head is not None and f.attr != self.head:
            return None
        if len(node.args) != 1 or node.keywords or f.attr in ("model", "transformer", "loss_function"):
            return None
        return f.attr

    # -- statements
    def visit_Assign(self, node):
        if self.head is None and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = self.find_head(node.value)
            if value is not None:
                self.lazy.add(node.targets[0].id)
                node.value = value
                return node
        if self.head is None:
            return node
        node.value = self.expression(node.value)
        if self.holds_logits(node.value):
            for target in node.targets:
                if not isinstance(target, ast.Name):
                    self.refuse(node, "stores its logits where fused_ce cannot follow them")
                self.lazy.add(target.id)
        return node

    def find_head(self, value):
        """The head call at the root of `value` (through .float(), .contiguous(), * constant), rewritten."""
        if isinstance(value, ast.Call):
            attr = self.head_call(value)
            if attr is not None and isinstance(value.args[0], ast.expr):
                self.head = attr
                return self.call("_fce_head", ast.Name(id="self", ctx=ast.Load()), ast.Constant(attr), value.args[0])
            if isinstance(value.func, ast.Attribute) and value.func.attr in ("float", "contiguous"):
                inner = self.find_head(value.func.value)
                if inner is not None:
                    return inner
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
            inner = self.find_head(value.left)
            if inner is not None:
                return self.call("_fce_mul" if isinstance(value.op, ast.Mult) else "_fce_div", inner, value.right)
        return None

    def generic_statement(self, node):
        if self.head is not None:
            for field in ("value", "test", "iter"):
                if getattr(node, field, None) is not None:
                    setattr(node, field, self.expression(getattr(node, field)))
        return self.generic_visit(node)

    visit_Return = visit_Expr = visit_If = visit_AugAssign = visit_AnnAssign = generic_statement

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args:
            self.refuse(node, "calls super() without arguments, which a rewritten copy cannot")
        return self.generic_visit(node)

    # -- expressions holding logits
    def expression(self, node):
        if not self.is_lazy(node):
            return node
        if isinstance(node, ast.Name):
            return node
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id.startswith("_fce_"):
                return node
            if isinstance(f, ast.Attribute) and f.attr == "loss_function":
                args = [self.lazy_value(a) for a in node.args]
                keywords = [ast.keyword(arg=k.arg, value=self.lazy_value(k.value)) for k in node.keywords]
                return ast.Call(func=ast.Name(id="_fce_loss", ctx=ast.Load()), args=[f.value, *args], keywords=keywords)
            if isinstance(f, ast.Attribute) and f.attr in ("float", "contiguous", "to") and self.is_lazy(f.value):
                return self.expression(f.value)
            if isinstance(f, ast.Attribute) and f.attr == "tanh" and len(node.args) == 1 and not node.keywords:
                return self.call("_fce_tanh", self.expression(node.args[0]))
            if isinstance(f, ast.Attribute) and f.attr == "tanh" and not node.args and self.is_lazy(f.value):
                return self.call("_fce_tanh", self.expression(f.value))
            if any(k.arg == "logits" for k in node.keywords) or self.outputs_call(node):
                # the output's constructor: logits=None, every other field as the model gives it
                for k in node.keywords:
                    if k.arg == "logits" and self.holds_logits(k.value):
                        k.value = ast.Constant(None)
                    elif self.is_lazy(k.value):
                        if self.holds_logits(k.value):
                            self.refuse(node, f"passes its logits as {k.arg}")
                        k.value = self.expression(k.value)
                if any(self.is_lazy(a) for a in node.args):
                    self.refuse(node, "passes its logits to a call")
                return node
            # any other call: values read off the logits (their device, vocabulary size) may be its arguments
            if self.is_lazy(f):
                self.refuse(node, "calls a method of its logits")
            node.args = [self.lazy_value(a) for a in node.args]
            node.keywords = [ast.keyword(arg=k.arg, value=self.lazy_value(k.value)) for k in node.keywords]
            if any(self.holds_logits(a) for a in node.args) or any(self.holds_logits(k.value) for k in node.keywords):
                self.refuse(node, "passes its logits to a call")
            return node
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
            left, right = self.is_lazy(node.left), self.is_lazy(node.right)
            if left and not right:
                name = "_fce_mul" if isinstance(node.op, ast.Mult) else "_fce_div"
                return self.call(name, self.expression(node.left), node.right)
            if right and not left and isinstance(node.op, ast.Mult):
                return self.call("_fce_mul", self.expression(node.right), node.left)
        if isinstance(node, ast.Subscript) and self.is_lazy(node.value):
            # logits.shape[-1] (the vocabulary), logits[..., :n] (a vocabulary slice)
            if isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
                if isinstance(node.slice, ast.UnaryOp) and ast.unparse(node.slice) == "-1":
                    return self.call("_fce_vocab_size", self.expression(node.value.value))
            s = node.slice
            if (
                isinstance(s, ast.Tuple)
                and len(s.elts) == 2
                and isinstance(s.elts[0], ast.Constant)
                and s.elts[0].value is Ellipsis
                and isinstance(s.elts[1], ast.Slice)
                and s.elts[1].lower is None
                and s.elts[1].step is None
                and s.elts[1].upper is not None
            ):
                return self.call("_fce_vocab_slice", self.expression(node.value), s.elts[1].upper)
        if isinstance(node, ast.Attribute) and node.attr == "device" and self.holds_logits(self.expression(node.value)):
            return self.call("_fce_device", self.expression(node.value))
        if isinstance(node, (ast.Compare, ast.BoolOp, ast.BinOp, ast.Tuple, ast.UnaryOp)):
            # a combination of values read off the logits (their vocabulary size, device) is fine; the logits
            # themselves in one are not (a return tuple's logits are None)
            for field, value in ast.iter_fields(node):
                if isinstance(value, ast.expr):
                    rewritten = self.expression(value)
                    if self.holds_logits(rewritten):
                        self.refuse(node, "uses its logits in a way fused_ce cannot reproduce without them")
                    setattr(node, field, rewritten)
                elif isinstance(value, list):
                    items = []
                    for item in value:
                        if isinstance(item, ast.expr):
                            if isinstance(node, ast.Tuple) and self.holds_logits(item):
                                item = ast.Constant(None)
                            item = self.expression(item)
                            if self.holds_logits(item):
                                self.refuse(node, "uses its logits in a way fused_ce cannot reproduce without them")
                        items.append(item)
                    setattr(node, field, items)
            return node
        if isinstance(node, ast.IfExp):
            node.test, node.body, node.orelse = (self.expression(n) for n in (node.test, node.body, node.orelse))
            return node
        self.refuse(node, "uses its logits in a way fused_ce cannot reproduce without them")

    _PRODUCERS = ("_fce_head", "_fce_div", "_fce_mul", "_fce_tanh", "_fce_vocab_slice")

    def holds_logits(self, node):
        """A rewritten expression's value is the head's logits (not a loss or a size read off them)."""
        if isinstance(node, ast.Name):
            return node.id in self.lazy
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return node.func.id in self._PRODUCERS
        if isinstance(node, ast.IfExp):
            return self.holds_logits(node.body) or self.holds_logits(node.orelse)
        return False

    def lazy_value(self, node):
        return self.expression(node) if self.is_lazy(node) else node

    @staticmethod
    def outputs_call(node):
        return (
            isinstance(node.func, ast.Name)
            and node.func.id.endswith("Output")
            or (isinstance(node.func, ast.Name) and "OutputWith" in node.func.id)
        )


def _defining_function(cls):
    for klass in cls.__mro__:
        if "forward" in klass.__dict__:
            return klass, klass.__dict__["forward"]
    raise Refused(f"fused_ce: {cls.__name__} has no forward")


@functools.cache
def _rewritten(cls):
    """The class's forward with its loss through fused_ce (or Refused, saying why)."""
    klass, forward = _defining_function(cls)
    original = inspect.unwrap(forward)
    try:
        source = textwrap.dedent(inspect.getsource(original))
    except (OSError, TypeError) as exc:
        raise Refused(f"fused_ce: the source of {klass.__name__}.forward is not available ({exc})") from exc
    tree = ast.parse(source)
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        raise Refused(f"fused_ce: {klass.__name__}.forward is not a plain function")
    rewriter = _Rewriter(f"{klass.__name__}.forward")
    function.body = [rewriter.visit(statement) for statement in function.body]
    # the decorators stay (return_dict=False, renamed keywords), but for documentation ones, which read sources
    function.decorator_list = [d for d in function.decorator_list if "docstring" not in ast.unparse(d)]
    if rewriter.head is None:
        raise Refused(
            f"fused_ce: {klass.__name__}.forward has no `logits = self.<head>(hidden_states)` that fused_ce "
            "recognises; use the model unpatched"
        )
    if not any(isinstance(n, ast.Name) and n.id == "_fce_loss" for n in ast.walk(function)):
        raise Refused(
            f"fused_ce: {klass.__name__}.forward computes its loss other than with self.loss_function(logits, "
            "labels, ...); use the model unpatched"
        )
    ast.fix_missing_locations(tree)
    # A module of its own (importable by name, as torch.compile's guards want): the model module's names and
    # the helpers the rewrite calls.
    source_module = sys.modules[klass.__module__]
    module = types.ModuleType(f"{source_module.__name__}._fused_ce_{klass.__name__}")
    module.__dict__.update({k: v for k, v in vars(source_module).items() if not k.startswith("__")})
    module.__dict__.update({name: value for name, value in globals().items() if name.startswith("_fce_")})
    sys.modules[module.__name__] = module
    exec(compile(tree, f"<fused_ce rewrite of {klass.__module__}.{klass.__name__}.forward>", "exec"), module.__dict__)
    return module.__dict__[function.name], rewriter.head, forward


def _causal_lm_classes():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _image_text_classes():
    """The vision-language models' classes (AutoModelForImageTextToText's, and AutoModelForVision2Seq's where the
    installed transformers has it): a language head over the text and image tokens, its loss the causal LM's."""
    from transformers.models.auto import modeling_auto

    names = set()
    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES"):
        names.update(getattr(modeling_auto, mapping, {}).values())
    return names


def _model_class(family):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)} (or pass a model or its class)")
    return getattr(transformers, FAMILIES[family])


def _returns_tuple(model, value):
    """Whether the forward returns a tuple, as transformers' ``can_return_tuple`` decides: ``return_dict`` where
    given, else the config's."""
    if value is not None:
        return not value
    config = getattr(model, "config", None)
    return config is not None and not config.return_dict


def _to_tuple(out):
    """A ModelOutput as transformers' ``to_tuple`` makes it, but for ``logits``, which keeps its place when None
    (transformers' own tuple holds the logits there), so that every later field stays at its position."""
    names = [f.name for f in dataclasses.fields(out)]
    kept = [getattr(out, n) for n in names if n == "logits" or getattr(out, n) is not None]
    return (*kept, *(out[k] for k in out.keys() if k not in names))  # (keys set after construction: accuracy)


@functools.cache
def _fused_forward(cls):
    """The forward of a causal LM with the loss through fused_ce when there are labels (Refused if it cannot)."""
    rewritten, head, original = _rewritten(cls)
    signature = inspect.signature(original)
    names = [n for n in signature.parameters if n != "self"]
    takes_return_dict = "return_dict" in names or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        labels = kwargs.get("labels")
        if labels is None and "labels" in names[: len(args)]:
            labels = args[names.index("labels")]
        if labels is None:  # no loss (the model's own forward computes one only from labels): unchanged
            return original(self, *args, **kwargs)
        if _builds_logits(self, skip_logits):  # evaluation: the model's own forward, its logits and its loss
            out = original(self, *args, **kwargs)
            if getattr(self, _ASKS_ACCURACY, False) and not isinstance(out, tuple):
                out["token_accuracy"] = _token_accuracy(out.logits, labels, kwargs.get("shift_labels"))
            return out
        if "return_dict" in names[: len(args)]:
            args = list(args)
            as_tuple, args[names.index("return_dict")] = _returns_tuple(self, args[names.index("return_dict")]), True
        elif takes_return_dict:
            as_tuple = _returns_tuple(self, kwargs.pop("return_dict", None))
            kwargs["return_dict"] = True  # (the tuple made below keeps the logits' place)
        else:
            as_tuple = False
        asks_accuracy = getattr(self, _ASKS_ACCURACY, False)
        if asks_accuracy:
            setattr(self, _ACCURACY_ATTRIBUTE, [])  # _fce_loss appends this call's accuracy
        try:
            out = rewritten(self, *args, **kwargs)
            accuracy = getattr(self, _ACCURACY_ATTRIBUTE, None)
        finally:
            if asks_accuracy:
                delattr(self, _ACCURACY_ATTRIBUTE)
        if accuracy:
            out["token_accuracy"] = accuracy[-1]
        return _to_tuple(out) if as_tuple and not isinstance(out, tuple) else out

    forward._fused_ce_original = original
    forward._fused_ce_head = head
    return forward


def _builds_logits(model, skip_logits):
    """Whether a call with labels builds its logits (apply's ``logits``): in evaluation, unless skipped."""
    if skip_logits is not None:
        return not skip_logits
    return getattr(model, _LOGITS_POLICY, "eval") == "eval" and not model.training


def _token_accuracy(logits, labels, shift_labels=None, ignore_index=-100):
    """The fraction of counted tokens whose label is the most likely one, from built logits (as the loss's own
    pass gives it in training)."""
    target = _shifted(labels, shift_labels, ignore_index).to(logits.device)
    return _accuracy(logits.argmax(-1), target, ignore_index)


class _ModelForward:
    """A switched instance's forward (its attribute ``forward``): an object, not a bound method, so that the
    model pickles, deep-copies and loads switched (a bound method pickles by name and would load the class's)."""

    def __init__(self, model):
        self.__setstate__({"model": model})

    def __setstate__(self, state):
        self.model = state["model"]
        self.function = _fused_forward(type(self.model))
        signature = inspect.signature(self.function)
        self.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])  # as bound
        self.__doc__ = self.function.__doc__
        self._fused_ce_original = self.function._fused_ce_original

    def __getstate__(self):
        return {"model": self.model}

    def __call__(self, *args, **kwargs):
        return self.function(self.model, *args, **kwargs)


def _unwrapped(model):
    """The causal LM inside a PEFT model (get_peft_model's PeftModelForCausalLM), else model."""
    if not isinstance(model, type) and hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def check(model_or_class):
    """Raises Refused (a TypeError) saying why fused_ce cannot reproduce this causal LM's head, else returns its
    head's attribute name (e.g. "lm_head")."""
    model_or_class = _unwrapped(model_or_class)
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise Refused(f"fused_ce: {cls.__name__} is not a model (an nn.Module class) of transformers")
    name = cls.__name__
    if name not in _causal_lm_classes() and name not in _image_text_classes() and not name.endswith("ForCausalLM"):
        raise Refused(
            f"fused_ce: {name} is neither a causal LM nor a vision-language model of transformers "
            "(AutoModelForCausalLM's or AutoModelForImageTextToText's classes)"
        )
    _, head, _ = _rewritten(cls)
    if isinstance(model_or_class, type):
        _check_head_construction(cls, head)
    else:
        _head_of(model_or_class, head)
    return head


def _check_head_construction(cls, head):
    """For a class: its __init__ builds the head as an nn.Linear (`self.<head> = nn.Linear(...)`)."""
    for klass in cls.__mro__:
        if "__init__" in klass.__dict__:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(klass.__dict__["__init__"])))
            except (OSError, TypeError):
                break
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Assign)
                    and any(ast.unparse(t) == f"self.{head}" for t in node.targets)
                    and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) in ("nn.Linear", "Linear", "torch.nn.Linear")
                ):
                    return
            break
    raise Refused(
        f"fused_ce: {cls.__name__}.__init__ does not build {head} as an nn.Linear (a head module's own forward "
        "would be skipped); use the model unpatched"
    )


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


def _is_switched(model):
    model = _unwrapped(model)
    return getattr(getattr(model, "forward", None), "_fused_ce_original", None) is not None


def _install_trainer_hook():
    """transformers' Trainer, for a model switched to fused_ce (once; other models' calls unchanged):

    - a loss-only evaluation (``prediction_loss_only``: no ``compute_metrics``) asks a fused head for no logits with
      ``skip_logits=True``, but only Liger's; its ``prediction_step`` passes it to a switched model too; and one
      with ``compute_metrics`` on a model applied with ``logits="never"`` is an error naming the option;
    - ``label_smoothing_factor`` (the Trainer's LabelSmoother, which would take the labels from the model and smooth
      its full logits) becomes the fused loss's ``label_smoothing`` where the step builds no logits (training, or
      ``logits="never"``): the smoother's loss, its normalisation and shift included.
    """
    try:
        from transformers import Trainer
    except ImportError:
        return
    if hasattr(Trainer.prediction_step, "_fused_ce_original"):
        return
    original = Trainer.prediction_step

    @functools.wraps(original)
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if _is_switched(self.model) and not self.args.use_liger_kernel:
            if prediction_loss_only:
                inputs = {**inputs, "skip_logits": True}
            elif getattr(_unwrapped(self.model), _LOGITS_POLICY, "eval") == "never" and "labels" in inputs:
                raise ValueError(
                    "fused_ce: this Trainer evaluates with compute_metrics (or predict), which needs the model's "
                    "logits, but the model was switched with fused_ce.integrations.transformers.apply(model, "
                    'logits="never"), which builds none: apply it with logits="eval" (the default; evaluation then '
                    "returns the model's own logits and loss), or evaluate without compute_metrics"
                )
        return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    prediction_step._fused_ce_original = original
    Trainer.prediction_step = prediction_step
    original_compute_loss = Trainer.compute_loss

    @functools.wraps(original_compute_loss)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        smoother, lm = self.label_smoother, _unwrapped(self.model)
        if (
            smoother is None
            or self.compute_loss_func is not None
            or "labels" not in inputs
            or not _is_switched(lm)
            or _builds_logits(lm, inputs.get("skip_logits"))
        ):
            return original_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        loss = {"label_smoothing": smoother.epsilon}
        if lm._get_name() not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            loss["shift_labels"] = inputs["labels"]  # (the smoother shifts causal LMs' labels only)
        if "num_items_in_batch" not in inspect.signature(type(smoother).__call__).parameters:
            loss["num_items_in_batch"] = None  # (4.x's smoother: the mean over the micro-batch's counted tokens)
        elif not self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss["num_items_in_batch"] = num_items_in_batch  # (the smoother divides by it either way)
        setattr(lm, _TRAINER_LOSS, loss)
        self.label_smoother = None  # (the model's loss, from the labels it now keeps, is the smoother's)
        try:
            return original_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.label_smoother = smoother
            delattr(lm, _TRAINER_LOSS)

    compute_loss._fused_ce_original = original_compute_loss
    Trainer.compute_loss = compute_loss


def keep_causal_sdpa_when_compiled(enabled=True):
    """Let transformers skip the causal mask under ``torch.compile`` where nothing is padded, as it does in eager.

    Under compile, transformers gives SDPA an explicit ``[B, 1, T, T]`` causal mask where eager passes
    ``is_causal=True`` (4.x and 5.x up to 5.17 at least, on any torch; 5.24 on torch before 2.13, where dynamo
    reads ``torch.compiler.is_exporting()`` as true), and SDPA then runs its masked kernel: about 3x the causal
    one's time (docs/performance.md).
    Where there is no padding mask, the query and key lengths are equal and nothing is offset or windowed, the mask
    is exactly ``is_causal=True``'s, so this makes transformers' own check (``masking_utils._ignore_causal_mask_sdpa``,
    wrapped) say so while compiling; every other case, and every call outside compile, keeps its answer. Process-wide
    (every model of the process), idempotent; ``enabled=False`` restores transformers' function. Not for
    ``torch.export`` of a model that will later run with a key/value cache: the exported graph keeps ``is_causal``.
    """
    from transformers import masking_utils

    current = masking_utils._ignore_causal_mask_sdpa
    original = getattr(current, "_fused_ce_original", current)
    if not enabled:
        masking_utils._ignore_causal_mask_sdpa = original
        return
    if current is not original:
        return  # already kept
    # the arguments by position: (padding_mask, query length, key/value length, then offsets and the local window,
    # named and ordered differently across transformers' versions)
    names = list(inspect.signature(original).parameters)

    @functools.wraps(original)
    def ignore_causal_mask(*args, **kwargs):
        if torch.compiler.is_compiling():
            values = dict(zip(names, args), **kwargs)
            padding_mask, q_length, kv_length = (values.get(n) for n in names[:3])
            rest = {n: values.get(n) for n in names[3:]}
            offsets = [v for n, v in rest.items() if "offset" in n]
            if (
                padding_mask is None
                and q_length == kv_length
                and all(isinstance(v, int) and v == 0 for v in offsets if v is not None)
                and all(v is None for n, v in rest.items() if "local" in n)
            ):
                return True
        return original(*args, **kwargs)

    ignore_causal_mask._fused_ce_original = original
    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
