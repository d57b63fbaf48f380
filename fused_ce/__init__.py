"""fused_ce: fused linear + cross-entropy loss that never materialises the logits.

``import fused_ce`` loads the compiled library (which defines
``torch.ops.fused_ce.linear_cross_entropy`` and its CPU, CUDA and autograd
kernels) and registers the fake kernels used by torch.compile. It never imports
triton: the CUDA kernels are embedded cubins.
"""

import torch

from ._built_with import TORCH_VERSION as _BUILT_WITH

if torch.__version__.split("+")[0] != _BUILT_WITH:
    raise ImportError(
        f"fused_ce was built against torch {_BUILT_WITH} but torch {torch.__version__} is installed: its compiled "
        f"library loads only with the torch it was built against. Install torch=={_BUILT_WITH}, or rebuild "
        "fused_ce against this torch (pip install --no-build-isolation --force-reinstall --no-deps ...)."
    )


def library_path() -> str:
    """The op library (setup.py): a plain shared library, loadable from C++ without Python too."""
    from pathlib import Path

    found = sorted(Path(__file__).parent.glob("_C*.so"))
    if not found:
        raise ImportError(f"fused_ce: the compiled library _C*.so is missing from {Path(__file__).parent}; rebuild")
    return str(found[0])


# the library only after the version check: loading it with another torch fails on undefined symbols
torch.ops.load_library(library_path())  # registers the ops


def _schemas_digest() -> str:
    """A digest of every fused_ce op's schema (names, arguments, defaults, returns)."""
    import hashlib

    schemas = sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("fused_ce::"))
    return hashlib.sha256("\n".join(schemas).encode()).hexdigest()[:16]


def _tag_compile_caches() -> None:
    # torch.compile's caches (inductor's FX graph cache, AOTAutograd's) key a graph by its code, not by the schemas of
    # the custom ops it calls: a graph cached before an upgrade that changed a schema would call the op with the old
    # arguments. The schemas' digest joins torch's cache key tag, after the user's own (TORCH_COMPILE_CACHE_KEY_TAG).
    config = torch.compiler.config
    tag = f"fused_ce:{_schemas_digest()}"
    if tag not in config.cache_key_tag.split(";"):
        config.cache_key_tag = ";".join(filter(None, (config.cache_key_tag, tag)))


_tag_compile_caches()
from . import _fake  # noqa: E402, F401  (fake kernels for FakeTensor / torch.compile)
from ._version import __version__  # noqa: E402
from .functional import (  # noqa: E402
    LogProbs,
    Plan,
    PolicyStats,
    linear_cross_entropy,
    linear_distillation_loss,
    linear_log_probs,
    linear_policy_loss,
    plan,
)
from .modules import LinearCrossEntropyLoss  # noqa: E402

__all__ = [
    "linear_cross_entropy",
    "linear_distillation_loss",
    "linear_log_probs",
    "LogProbs",
    "linear_policy_loss",
    "PolicyStats",
    "LinearCrossEntropyLoss",
    "plan",
    "Plan",
    "cuda_archs",
    "library_path",
    "__version__",
]


def cuda_archs() -> list[int]:
    """Compute capabilities (e.g. ``[80, 86, 89, 90, 100, 120]``) this build has kernels for."""
    return list(torch.ops.fused_ce._embedded_archs())
