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

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KERNEL_TEST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
