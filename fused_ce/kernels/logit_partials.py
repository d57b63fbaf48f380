"""Forward stage 1 of 3 over stored logits: per-tile partial row statistics.

A GEMM has written raw logits ``x @ w.T + b`` for a block of rows. Each program
reads one BLOCK_R x BLOCK tile once, transforms it (logit_scale, softcap) and
writes, per row of the tile, the tile's max, its sum of ``exp(z - max)`` and,
for label smoothing, its (class-weighted) sum of z: partials[row, segment]; for the
entropy, its sum of ``exp(z - max) * (z - max)``, and for the argmax the column of
the tile's max (the first one on ties). The softcap and the smoothing's sums are the
TRANSFORMS flavors' only: their runtime branches cost the others registers.
Tiles rather than whole rows per program: no serial loop along the row, so
every program's loads are in flight at once and the pass runs at streaming
bandwidth. combine_partials.py reduces the segments.
"""
import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import load_logits

SPEC = KernelSpec(
    "logit_partials",
    params=(
        ("logits_ptr", "*T"), ("cw_ptr", "*fp32"), ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"),
        ("pe_ptr", "*fp32"), ("pa_ptr", "*i64"),
        ("N", "i64"), ("V", "i64"), ("stride_ln", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"), ("has_entropy", "i32"),
        ("has_argmax", "i32"),
    ),
    family="stored_logits",
    grid="cdiv(N, ROWS) * segments",
    # V too: a mask bound not known to be a multiple of 16 keeps every access scalar (LOG.md, step 14)
    divisible_by_16=frozenset({"logits_ptr", "stride_ln", "V"}),
    # The entropy's and argmax's partials (half the rows), and the softcap and label smoothing ("transforms"): the
    # plain kernel compiles both out (their registers took 18% of its speed and 29% of the entropy's; LOG step 50)
    flavors=(
        ("transforms", (("TRANSFORMS", True),)),
        ("extras", (("EXTRAS", True), ("BLOCK_R", 2))),
        ("extras_transforms", (("EXTRAS", True), ("TRANSFORMS", True), ("BLOCK_R", 2))),
    ),
)


@triton.jit
def logit_partials_kernel(
    logits_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr, pe_ptr, pa_ptr,
    N, V, stride_ln, segments,
    logit_scale, softcap,
    has_class_weight, has_softcap, has_smoothing, has_entropy, has_argmax,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, FAST_TANH: tl.constexpr, EXTRAS: tl.constexpr,
    TRANSFORMS: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = pid % segments
    rows = (pid // segments).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = seg.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols < V)[None, :]
    ptrs = logits_ptr + rows[:, None] * stride_ln + cols[None, :]
    if TRANSFORMS:
        z = load_logits(ptrs, mask, logit_scale, softcap, has_softcap, FAST_TANH)
    else:  # has_softcap and has_smoothing are 0
        z = load_logits(ptrs, mask, logit_scale, softcap, 0, FAST_TANH)
    m = tl.max(tl.where(mask, z, float("-inf")), axis=1)
    m = tl.where(row_mask, m, 0.0)  # rows past the block: keep them finite, they are not stored
    out = rows * segments + seg
    if EXTRAS and has_argmax:  # (the column within the tile in 32 bits: a tile of 64-bit indices costs registers)
        local = tl.arange(0, BLOCK)
        first = tl.min(tl.where(mask & (z == m[:, None]), local[None, :], BLOCK), axis=1)
        tl.store(pa_ptr + out, seg.to(tl.int64) * BLOCK + first, mask=row_mask)
    d = z - m[:, None]
    e = tl.exp(d)  # (once: the entropy's term reuses it)
    s = tl.sum(tl.where(mask, e, 0.0), axis=1)
    tl.store(pm_ptr + out, m, mask=row_mask)
    tl.store(ps_ptr + out, s, mask=row_mask)
    if EXTRAS and has_entropy:  # (where exp(z - m) is 0, z - m may be -inf or NaN: 0 is its term)
        tl.store(pe_ptr + out, tl.sum(tl.where(mask & (e > 0.0), e * d, 0.0), axis=1), mask=row_mask)
    if TRANSFORMS:  # (the smoothing only in the _transforms flavors)
        if has_smoothing:
            zc = tl.where(mask, z, 0.0)
            if has_class_weight:
                zc = zc * tl.load(cw_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
            tl.store(pw_ptr + out, tl.sum(zc, axis=1), mask=row_mask)
