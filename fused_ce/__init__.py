"""fused_ce: fused linear + cross-entropy loss that never materialises the logits.

``import fused_ce`` loads the compiled library (which defines
``torch.ops.fused_ce.linear_cross_entropy`` and its CPU, CUDA and autograd
kernels) and registers the fake kernels used by torch.compile. It never imports
triton: the CUDA kernels are embedded cubins.
"""

import torch

from . import (
    _C,  # noqa: F401  (registers the ops)
    _fake,  # noqa: F401  (fake kernels for FakeTensor / torch.compile)
)
from ._version import __version__
from .functional import Plan, linear_cross_entropy, plan
from .modules import LinearCrossEntropyLoss

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "plan", "Plan", "cuda_archs", "__version__"]


def cuda_archs() -> list[int]:
    """Compute capabilities (e.g. ``[80, 86, 89, 90, 100, 120]``) this build has kernels for."""
    return list(torch.ops.fused_ce._embedded_archs())
