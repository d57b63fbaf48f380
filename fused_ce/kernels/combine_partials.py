"""Forward stage 2 of 3 over stored logits: the row statistics from the partials.

Per row: the max ``m``, ``log_sum = log(sum_s ps[s] * exp(pm[s] - m))`` over the
segments' partials (logit_partials.py), ``lse = m + log_sum``, the target's gap
``m - z_target`` (one gathered load from the stored logits; 0 where the row is
ignored), for label smoothing the sum of the segments' weighted sums, for the
entropy ``log_sum - T / S`` with ``S`` and ``T`` the rows' sums of ``exp(z - m)``
and ``exp(z - m) * (z - m)``, and for the argmax the first segment's column of
the row max. The loss takes ``gap + log_sum``: no cancellation between large
numbers. The segments are combined in a fixed order, so the result is deterministic.
"""
import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import load_logits

SPEC = KernelSpec(
    "combine_partials",
    params=(
        ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"), ("pe_ptr", "*fp32"), ("pa_ptr", "*i64"),
        ("logits_ptr", "*T"), ("tgt_ptr", "*i64"),
        ("lse_ptr", "*fp32"), ("gap_ptr", "*fp32"), ("ls_ptr", "*fp32"), ("wz_ptr", "*fp32"), ("ent_ptr", "*fp32"),
        ("am_ptr", "*i64"),
        ("N", "i64"), ("stride_ln", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_softcap", "i32"), ("has_smoothing", "i32"), ("has_entropy", "i32"), ("has_argmax", "i32"),
    ),
    family="combine",
    grid="cdiv(N, ROWS)",
    layouts=("general",),  # one gathered load per row: nothing to gain from aligned accesses
    flavors=(("extras", (("EXTRAS", True), ("BLOCK_R", 8))),),  # the entropy and the argmax, half the rows
)


@triton.jit
def combine_partials_kernel(
    pm_ptr, ps_ptr, pw_ptr, pe_ptr, pa_ptr, logits_ptr, tgt_ptr, lse_ptr, gap_ptr, ls_ptr, wz_ptr, ent_ptr, am_ptr,
    N, stride_ln, segments,
    logit_scale, softcap,
    has_softcap, has_smoothing, has_entropy, has_argmax,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, FAST_TANH: tl.constexpr, EXTRAS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    wz = tl.zeros((BLOCK_R,), tl.float32)
    t = tl.zeros((BLOCK_R,), tl.float32)  # sum of exp(z - m) * (z - m), for the entropy
    am = tl.zeros((BLOCK_R,), tl.int64)
    for s0 in range(0, segments, BLOCK):
        seg = s0 + offs
        mask = row_mask[:, None] & (seg < segments)[None, :]
        idx = rows[:, None] * segments + seg[None, :]
        pm = tl.load(pm_ptr + idx, mask=mask, other=float("-inf"))
        ps = tl.load(ps_ptr + idx, mask=mask, other=0.0)
        chunk_max = tl.max(pm, axis=1)
        m_new = tl.maximum(m, chunk_max)
        m_new = tl.where(row_mask, m_new, 0.0)  # rows past the block: finite, never stored
        if EXTRAS and has_entropy:  # rescaled to the new max: e^(m - m') * (t + (m - m') * s), per segment and so far
            shift = tl.where(m > float("-inf"), m - m_new, 0.0)
            seg_shift = tl.where(pm > float("-inf"), pm - m_new[:, None], 0.0)
            pe = tl.load(pe_ptr + idx, mask=mask, other=0.0)
            moved = tl.where(ps > 0.0, tl.exp(seg_shift) * (pe + seg_shift * ps), 0.0)
            t = tl.exp(shift) * (t + shift * s) + tl.sum(moved, axis=1)
        if EXTRAS and has_argmax:  # the first segment holding the max, then its first column
            pa = tl.load(pa_ptr + idx, mask=mask, other=0)
            seg_first = tl.min(tl.where(mask & (pm == chunk_max[:, None]), seg[None, :], segments), axis=1)
            chunk_arg = tl.sum(tl.where(seg[None, :] == seg_first[:, None], pa, 0), axis=1)
            am = tl.where(chunk_max > m, chunk_arg, am)
        s = s * tl.exp(m - m_new) + tl.sum(ps * tl.exp(pm - m_new[:, None]), axis=1)
        m = m_new
        if has_smoothing:
            wz += tl.sum(tl.load(pw_ptr + idx, mask=mask, other=0.0), axis=1)
    log_sum = tl.log(tl.where(row_mask, s, 1.0))
    # a row holding +inf: the lse +inf (as logsumexp), the loss NaN (as torch's log_softmax) through log_sum
    lse = tl.where(m == float("inf"), float("inf"), m + log_sum)
    log_sum = tl.where(m == float("inf"), float("nan"), log_sum)
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(ls_ptr + rows, log_sum, mask=row_mask)
    if has_smoothing:
        tl.store(wz_ptr + rows, wz, mask=row_mask)
    if EXTRAS and has_entropy:
        tl.store(ent_ptr + rows, log_sum - t / tl.where(row_mask, s, 1.0), mask=row_mask)
    if EXTRAS and has_argmax:
        tl.store(am_ptr + rows, am, mask=row_mask)
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    valid = tgt >= 0
    zt = load_logits(logits_ptr + rows * stride_ln + tl.maximum(tgt, 0), row_mask & valid, logit_scale, softcap,
                     has_softcap, FAST_TANH)
    tl.store(gap_ptr + rows, tl.where(valid, m - zt, 0.0), mask=row_mask)
