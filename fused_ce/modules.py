"""The module front: a drop-in for ``torch.nn.LinearCrossEntropyLoss``."""

import inspect

from torch import Tensor, nn
from typing_extensions import Unpack

from .functional import LossKeywords, linear_cross_entropy

# The loss keywords a module keeps as attributes, with linear_cross_entropy's defaults; its linear layer
# supplies linear_bias, and `weight` (class weights) is a buffer.
_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(linear_cross_entropy).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in ("linear_bias", "options")
}


class LinearCrossEntropyLoss(nn.Module):
    """A linear layer (``.linear``, weight ``[num_classes, in_features]``) followed by cross entropy.

    ``forward(input, target)`` returns the loss of ``.linear(input)`` against ``target`` without
    materialising the logits. The keywords are those of :func:`fused_ce.linear_cross_entropy`, kept as
    attributes of the same names (``weight``, the class weights, as a buffer).
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
        return_lse: bool = False,
        **keywords: Unpack[LossKeywords],
    ):
        super().__init__()
        unknown = set(keywords) - set(_DEFAULTS)
        if unknown:
            raise TypeError(f"LinearCrossEntropyLoss got unexpected keyword arguments {sorted(unknown)}")
        self.linear = nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        options = {**_DEFAULTS, **keywords, "return_lse": return_lse}
        self.register_buffer("weight", options.pop("weight"))
        if options["ignore_index"] is None:
            options["ignore_index"] = -100
        for name, value in options.items():
            setattr(self, name, value)

    def forward(self, input: Tensor, target: Tensor):
        keywords = {name: getattr(self, name) for name in _DEFAULTS}
        return linear_cross_entropy(input, self.linear.weight, target, linear_bias=self.linear.bias, **keywords)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.linear.in_features}, num_classes={self.linear.out_features}, "
            f"bias={self.linear.bias is not None}, reduction={self.reduction!r}"
        )
