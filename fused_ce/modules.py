"""The module front: a drop-in for ``torch.nn.LinearCrossEntropyLoss``."""
from typing import Optional

from torch import Tensor, nn

from .functional import linear_cross_entropy


class LinearCrossEntropyLoss(nn.Module):
    """A linear layer (``.linear``, weight ``[num_classes, in_features]``) followed by cross entropy.

    ``forward(input, target)`` returns the loss of ``.linear(input)`` against ``target`` without
    materialising the logits. The keywords are those of :func:`fused_ce.linear_cross_entropy`.
    """

    def __init__(self, in_features: int, num_classes: int, *, bias: bool = False, device=None, dtype=None,
                 reduction: str = "mean", weight: Optional[Tensor] = None, ignore_index: Optional[int] = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                 logit_scale: float = 1.0, return_lse: bool = False, workspace_bytes: Optional[int] = None):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = -100 if ignore_index is None else ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.return_lse = return_lse
        self.workspace_bytes = workspace_bytes

    def forward(self, input: Tensor, target: Tensor):
        return linear_cross_entropy(
            input, self.linear.weight, target, linear_bias=self.linear.bias, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            z_loss=self.z_loss, softcap=self.softcap, logit_scale=self.logit_scale, return_lse=self.return_lse,
            workspace_bytes=self.workspace_bytes,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.linear.in_features}, num_classes={self.linear.out_features}, "
                f"bias={self.linear.bias is not None}, reduction={self.reduction!r}")
