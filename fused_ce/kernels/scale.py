"""Backward stage of a scalar loss: the gradients computed in the forward, times the upstream gradient.

``g *= scale`` in place, with ``scale`` read on the device: when it is exactly 1
(``loss.backward()``) every program returns at once, so the common case costs
no pass over the gradients and no host synchronisation to find that out.
"""
import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "scale",
    params=(("g_ptr", "*T"), ("scale_ptr", "*fp32"), ("numel", "i64")),
    family="elementwise",
    grid="max(1, min(cdiv(numel, COLS), PROGRAMS))",
    divisible_by_16=frozenset({"g_ptr", "numel"}),  # numel: the mask bound (see logit_partials.py)
)


@triton.jit
def scale_kernel(g_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        offs = tl.arange(0, BLOCK)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
            idx = start + offs
            mask = idx < numel
            g = tl.load(g_ptr + idx, mask=mask)
            tl.store(g_ptr + idx, (g.to(tl.float32) * scale).to(g_ptr.dtype.element_ty), mask=mask)
