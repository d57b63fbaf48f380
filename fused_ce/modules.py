"""The module front: a drop-in for ``torch.nn.LinearCrossEntropyLoss`` (torch 2.13)."""

import inspect
import math

from torch import Tensor, nn
from typing_extensions import Unpack

from ._options import _OPTIONS, _real
from .functional import LossKeywords, linear_cross_entropy

# The keywords of fused_ce's own (those torch's module does not take), kept as attributes too, with
# linear_cross_entropy's defaults: a new option of the functional front reaches the module by itself.
_TORCH_KEYWORDS = {"linear_bias", "weight", "reduction", "ignore_index", "label_smoothing", "options", "return_lse"}
_EXTRA_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(linear_cross_entropy).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in _TORCH_KEYWORDS
}
_FLOAT_KEYWORDS = {name for name, kind, _ in _OPTIONS["_linear_cross_entropy"] if kind == "float"}


class LinearCrossEntropyLoss(nn.Module):
    """A linear layer (``.linear``, weight ``[num_classes, in_features]``) followed by cross entropy.

    Constructor arguments and attributes are those of ``torch.nn.LinearCrossEntropyLoss`` (``num_classes``,
    ``out_features``, ``reduction``, ``weight`` as a buffer, ``ignore_index``, ``label_smoothing``,
    ``options``, accepted and ignored: this loss is always chunked), validated at construction as torch
    does, plus fused_ce's own keywords (``z_loss``, ``softcap``, ``logit_scale``, ``workspace_bytes``,
    ``grad_filter_eps``, ``return_lse``, ``process_group`` and ``vocab_start``: then ``num_classes`` is this rank's
    vocabulary shard, see :mod:`fused_ce.distributed`). ``forward(input, target)`` returns the loss of
    ``.linear(input)`` against ``target`` without materialising the logits. With ``out_features=(d1, ...)``
    the loss is K-dimensional, as torch's: ``.linear`` has ``num_classes * d1 * ...`` outputs, viewed as
    ``[num_classes, d1, ..., in_features]``, and ``target`` is ``[N, d1, ...]``.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        out_features: tuple[int, ...] = (),
        bias: bool = False,
        device=None,
        dtype=None,
        weight: Tensor | None = None,
        return_lse: bool = False,
        **keywords: Unpack[LossKeywords],
    ):
        super().__init__()
        # with a process_group, num_classes is this rank's shard and the class weights are global
        if weight is not None and tuple(weight.shape) != (num_classes,) and keywords.get("process_group") is None:
            raise RuntimeError(f"expected weight shape to be {(num_classes,)}, got {tuple(weight.shape)}")
        for name in _FLOAT_KEYWORDS & set(keywords):  # (a str is refused here, not at the first forward)
            if keywords[name] is not None:
                _real("LinearCrossEntropyLoss", name, keywords[name])
        label_smoothing = keywords.get("label_smoothing", 0.0)
        if label_smoothing < 0 or label_smoothing > 1.0:
            raise RuntimeError(f"expected label_smoothing to be in range [0, 1], got {label_smoothing}")
        unknown = set(keywords) - {"reduction", "ignore_index", "label_smoothing", "options", *_EXTRA_DEFAULTS}
        if unknown:
            raise TypeError(f"LinearCrossEntropyLoss got unexpected keyword arguments {sorted(unknown)}")
        self.num_classes = num_classes
        self.out_features = tuple(out_features)
        outputs = math.prod(self.out_features, start=num_classes)
        self.linear = nn.Linear(in_features, outputs, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction = keywords.get("reduction", "mean")
        self.ignore_index = keywords.get("ignore_index")  # None means -100, as in torch
        self.label_smoothing = label_smoothing
        self.options = keywords.get("options")
        self.return_lse = return_lse
        for name, default in _EXTRA_DEFAULTS.items():
            setattr(self, name, keywords.get(name, default))

    def forward(self, input: Tensor, target: Tensor):
        weight, bias = self.linear.weight, self.linear.bias
        if self.out_features:  # torch's layout of a K-dimensional loss
            weight = weight.reshape(self.num_classes, *self.out_features, self.linear.in_features)
            bias = None if bias is None else bias.reshape(self.num_classes, *self.out_features)
        return linear_cross_entropy(
            input,
            weight,
            target,
            linear_bias=bias,
            weight=self.weight,
            reduction=self.reduction,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            return_lse=self.return_lse,
            **{name: getattr(self, name) for name in _EXTRA_DEFAULTS},
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
            f"out_features={self.out_features}, bias={self.linear.bias is not None}, reduction={self.reduction}, "
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}"
        )
