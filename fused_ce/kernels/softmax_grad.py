"""Forward stage 3 of 3 over stored logits: the logits become their gradient, in place.

Used when the gradients are computed during the forward (scalar reductions).
With the row's lse from combine_partials.py, each program reads one
BLOCK_R x BLOCK tile of raw logits and overwrites it with
``dL/dlogit = logit_scale * softcap'(z) * (p * (alpha + alpha_z * log p) - beta * onehot - gamma * cw)``
where ``alpha = alpha0 + alpha_lse * lse`` (the z-loss term needs the lse) and ``alpha_z`` is the
entropy's term (the flavor ALPHA_Z; the entropy's gradient is ``-p * (log p + H)``). The softcap and the
label smoothing (``gamma``) are honoured by the TRANSFORMS flavors only: their runtime branches cost the
others registers.
The block may be a vocabulary slice starting at column ``col_offset`` (lean
workspaces, Strategy::VocabTiles in csrc/plan.h): targets are absolute class indices, ``cw_ptr`` points at
the slice's first class weight. Programs run in the reverse order of
logit_partials', so the first tiles re-read are the last ones read there, still
in L2.
The flavor FILTER (grad_filter_eps, csrc/filtered_grads.h) also marks, while the gradient is on chip, the
FILTER_ROWS x FILTER_COLS tiles of ``mask`` ([cdiv(N, FILTER_ROWS), mask_cols] int32, zeroed by the caller) that
hold an entry other than its row's target whose stored value is at or above the row's coefficient of p times
``filter_scale`` (grad_filter_eps times the logit scale's magnitude): grad_tile_mask.py's answer without a second
read of the block.
"""
import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import load_logits

SPEC = KernelSpec(
    "softmax_grad",
    params=(
        ("logits_ptr", "*T"), ("cw_ptr", "*fp32"), ("tgt_ptr", "*i64"), ("lse_ptr", "*fp32"),
        ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"), ("gamma_ptr", "*fp32"),
        ("alpha_z_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("stride_ln", "i64"), ("segments", "i64"), ("col_offset", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
        ("mask_ptr", "*i32"), ("mask_cols", "i64"), ("filter_scale", "fp32"),
    ),
    family="stored_logits",
    grid="cdiv(N, ROWS) * segments",
    divisible_by_16=frozenset({"logits_ptr", "stride_ln", "V"}),  # V: see logit_partials.py
    # The entropy's gradient term (half the rows), and the softcap and label smoothing ("transforms"): the plain
    # kernel compiles both out (their registers took a third of its speed; LOG step 50)
    flavors=(
        ("transforms", (("TRANSFORMS", True),)),
        ("entropy", (("ALPHA_Z", True), ("BLOCK_R", 2))),
        ("entropy_transforms", (("ALPHA_Z", True), ("TRANSFORMS", True), ("BLOCK_R", 2))),
        ("filter", (("FILTER", True),)),
    ),
)


@triton.jit
def softmax_grad_kernel(
    logits_ptr, cw_ptr, tgt_ptr, lse_ptr,
    alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr, alpha_z_ptr,
    N, V, stride_ln, segments, col_offset,
    logit_scale, softcap,
    has_class_weight, has_softcap, has_smoothing,
    mask_ptr, mask_cols, filter_scale,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, FAST_TANH: tl.constexpr, ALPHA_Z: tl.constexpr,
    TRANSFORMS: tl.constexpr, FILTER: tl.constexpr, FILTER_ROWS: tl.constexpr, FILTER_COLS: tl.constexpr,
):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    seg = pid % segments
    rows = (pid // segments).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = seg.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    col_mask = cols < V
    mask = row_mask[:, None] & col_mask[None, :]
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    alpha0 = tl.load(alpha_ptr + rows, mask=row_mask, other=0.0)
    alpha_lse = tl.load(alpha_lse_ptr + rows, mask=row_mask, other=0.0)
    alpha = alpha0 + alpha_lse * lse
    beta = tl.load(beta_ptr + rows, mask=row_mask, other=0.0)
    # rows with no coefficient (ignored ones) get exactly 0, also where their logits are NaN or inf
    active = (alpha0 != 0.0) | (alpha_lse != 0.0) | (beta != 0.0)
    # the target's column within this tile, in 32 bits (a tile of 64-bit column indices costs registers); a target
    # elsewhere, or -1, matches none
    tgt = (tl.load(tgt_ptr + rows, mask=row_mask, other=-1) - col_offset - seg.to(tl.int64) * BLOCK).to(tl.int32)
    tgt = tl.where(tgt < 0, BLOCK, tgt)

    ptrs = logits_ptr + rows[:, None] * stride_ln + cols[None, :]
    if TRANSFORMS:
        z = load_logits(ptrs, mask, logit_scale, softcap, has_softcap, FAST_TANH)
    else:  # has_softcap and has_smoothing are 0
        z = load_logits(ptrs, mask, logit_scale, softcap, 0, FAST_TANH)
    p = tl.exp(z - lse[:, None])
    g = p * alpha[:, None] - tl.where(tl.arange(0, BLOCK)[None, :] == tgt[:, None], beta[:, None], 0.0)
    if ALPHA_Z:
        alpha_z = tl.load(alpha_z_ptr + rows, mask=row_mask, other=0.0)
        active = active | (alpha_z != 0.0)
        # alpha_z * log p (no cancellation at large z); p log p is 0 where p is (-inf logits)
        g += tl.where(p > 0.0, p * alpha_z[:, None] * (z - lse[:, None]), 0.0)
    if TRANSFORMS:  # (the smoothing and the softcap only in the _transforms flavors)
        if has_smoothing:  # gamma is zero without label smoothing: skip its loads
            gamma = tl.load(gamma_ptr + rows, mask=row_mask, other=0.0)
            active = active | (gamma != 0.0)
            if has_class_weight:
                g -= gamma[:, None] * tl.load(cw_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            else:
                g -= gamma[:, None]
        if has_softcap:
            t = z * (1.0 / softcap)  # tanh of the pre-cap logit
            g = g * (1.0 - t * t)
    g = tl.where(active[:, None], g * logit_scale, 0.0).to(logits_ptr.dtype.element_ty)
    tl.store(ptrs, g, mask=mask)
    if FILTER:  # (the stored value against grad_tile_mask.py's threshold: the same answer)
        tl.static_assert(BLOCK % FILTER_COLS == 0 and FILTER_ROWS % BLOCK_R == 0)
        threshold = tl.abs(alpha) * filter_scale
        magnitude = tl.abs(g.to(tl.float32))
        above = (magnitude >= threshold[:, None]) & (magnitude > 0.0) & (tl.arange(0, BLOCK)[None, :] != tgt[:, None])
        above = above & mask
        live = tl.max(tl.max(tl.reshape(above.to(tl.int32), (BLOCK_R, BLOCK // FILTER_COLS, FILTER_COLS)), axis=2),
                      axis=0)
        tiles = seg * (BLOCK // FILTER_COLS) + tl.arange(0, BLOCK // FILTER_COLS)
        row_tile = (pid // segments).to(tl.int64) * BLOCK_R // FILTER_ROWS
        tl.atomic_max(mask_ptr + row_tile * mask_cols + tiles, live, mask=(live > 0) & (tiles < mask_cols))
