"""Triton sources of the CUDA kernels: one file per stage.

Imported only by the AOT build, by tests (under TRITON_INTERPRET=1) and for JIT
development (``fused_ce.kernels.jit``); the runtime loads the prebuilt cubins.
"""
