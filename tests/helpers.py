"""What the test modules share besides the reference (reference.py): the devices they run on."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# The Triton kernels' own tests (test_kernels.py) JIT-compile them for the GPU where there is one, else run
# them in triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET).
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# benchmarks/device_run.sh runs CUDA tests under compute-sanitizer with this set: the profiler (CUPTI) cannot
# run there, so the tests that read kernel names from it skip.
UNDER_SANITIZER = bool(os.environ.get("FUSED_CE_UNDER_SANITIZER"))
needs_profiler = pytest.mark.skipif(UNDER_SANITIZER, reason="the profiler (CUPTI) does not run under compute-sanitizer")


def leaves(*tensors):
    """Fresh leaf copies that require grad (None stays None)."""
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
