"""The switched forward of a model or class: the rewritten one with labels (the logits built in evaluation where
asked), the model's own without; which classes are causal or image-text LMs; ``check``."""

import ast
import dataclasses
import functools
import inspect
import textwrap

from torch import nn

from .heads import Refused, _head_of
from .loss import _accuracy, _shifted
from .rewrite import _rewritten
from .state import _ACCURACY_ATTRIBUTE, _ASKS_ACCURACY, _LOGITS_POLICY

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
