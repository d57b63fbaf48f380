"""A causal LM's forward rewritten once per class from its source: its head call yields HeadLogits, the logit
transforms it applies are recorded, and its ``self.loss_function(logits, labels, ...)`` becomes fused_ce's loss
(``_fce_*``: the calls the rewritten source makes); a forward it cannot reproduce is Refused, naming the line."""

import ast
import functools
import inspect
import sys
import textwrap
import types

import torch

from .._head import _LOSS_KEYWORD
from .heads import HeadLogits, Refused, _head_of, _lora_of, _lora_terms, _loss_module
from .loss import ForCausalLMLoss
from .state import _ACCURACY_ATTRIBUTE, _GRAD_FILTER_EPS, _TRAINER_LOSS


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
