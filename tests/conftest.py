import os

import torch

# The Triton kernels' own tests (test_kernels.py) run them through triton's
# interpreter on CPU tensors where there is no GPU (CI). Triton reads the flag
# when it is first imported, so it is set here, before anything imports it; on
# a GPU machine those tests JIT-compile the kernels for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# cuBLAS is deterministic only with a fixed workspace; torch requires this under
# torch.use_deterministic_algorithms(True) (test_features.py).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # The `cuda` marker (registered in pyproject.toml): such tests skip, and only they, without a CUDA device.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
