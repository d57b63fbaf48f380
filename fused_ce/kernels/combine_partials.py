"""Forward stage 2 of 3 over stored logits: the row statistics from the partials.

Per row: the max ``m``, ``log_sum = log(sum_s ps[s] * exp(pm[s] - m))`` over the
segments' partials (logit_partials.py), ``lse = m + log_sum``, the target's gap
``m - z_target`` (one gathered load from the stored logits; 0 where the row is
ignored) and, for label smoothing, the sum of the segments' weighted sums. The
loss takes ``gap + log_sum``: no cancellation between large numbers. The segments are combined in a fixed order, so the
result is deterministic.
"""
import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import load_logits

SPEC = KernelSpec(
    "combine_partials",
    params=(
        ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"), ("logits_ptr", "*T"), ("tgt_ptr", "*i64"),
        ("lse_ptr", "*fp32"), ("gap_ptr", "*fp32"), ("ls_ptr", "*fp32"), ("wz_ptr", "*fp32"),
        ("N", "i64"), ("stride_ln", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ),
    family="combine",
    layouts=("general",),  # one gathered load per row: nothing to gain from aligned accesses
)


@triton.jit
def combine_partials_kernel(
    pm_ptr, ps_ptr, pw_ptr, logits_ptr, tgt_ptr, lse_ptr, gap_ptr, ls_ptr, wz_ptr,
    N, stride_ln, segments,
    logit_scale, softcap,
    has_softcap, has_smoothing,
    BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, FAST_TANH: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    wz = tl.zeros((BLOCK_R,), tl.float32)
    for s0 in range(0, segments, BLOCK):
        seg = s0 + offs
        mask = row_mask[:, None] & (seg < segments)[None, :]
        idx = rows[:, None] * segments + seg[None, :]
        pm = tl.load(pm_ptr + idx, mask=mask, other=float("-inf"))
        ps = tl.load(ps_ptr + idx, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=1))
        m_new = tl.where(row_mask, m_new, 0.0)  # rows past the block: finite, never stored
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
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
    valid = tgt >= 0
    zt = load_logits(logits_ptr + rows * stride_ln + tl.maximum(tgt, 0), row_mask & valid, logit_scale, softcap,
                     has_softcap, FAST_TANH)
    tl.store(gap_ptr + rows, tl.where(valid, m - zt, 0.0), mask=row_mask)
