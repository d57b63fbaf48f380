"""What the test modules share besides the reference (reference.py): the devices they run on."""

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
# The Triton kernels' own tests (test_kernels.py) JIT-compile them for the GPU where there is one, else run
# them in triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET).
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
