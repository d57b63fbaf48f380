"""Forward stage: per-row log-sum-exp partials without materialising logits.

Each program owns BLOCK_N rows and one contiguous split of the vocabulary. It
computes logits tiles with ``tl.dot`` and folds them into an online softmax
(running max ``m`` and sum ``s`` of exp(z - m)), and also collects the target's
logit, for label smoothing the class-weighted sum of logits, for the entropy the
sum of exp(z - m) * (z - m), and for the argmax the first column of the max. The splits'
partials (``[num_splits, N]`` each) are combined by the caller:
``lse = logsumexp_k(m_k + log s_k)``.
"""
import triton
import triton.language as tl

from .spec import XW_DIVISIBLE_BY_16, XW_PARAMS, XW_UNIT_STRIDE, KernelSpec
from .tile import logits_tile, tile_coords, transform_logits

SPEC = KernelSpec(
    "row_stats",
    params=XW_PARAMS + (
        ("m_ptr", "*fp32"), ("s_ptr", "*fp32"), ("zt_ptr", "*fp32"), ("wz_ptr", "*fp32"), ("t_ptr", "*fp32"),
        ("am_ptr", "*i64"),
        ("N", "i64"), ("V", "i64"), ("D", "i64"),
        ("stride_xn", "i64"), ("stride_xd", "i64"), ("stride_wv", "i64"), ("stride_wd", "i64"),
        ("cols_per_split", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
        ("has_entropy", "i32"), ("has_argmax", "i32"),
    ),
    family="dot_tiles",
    grid="cdiv(N, ROWS) * cdiv(V, cols_per_split)",
    divisible_by_16=XW_DIVISIBLE_BY_16,
    unit_stride=XW_UNIT_STRIDE,
)


@triton.jit
def row_stats_kernel(
    x_ptr, w_ptr, b_ptr, cw_ptr, tgt_ptr,
    m_ptr, s_ptr, zt_ptr, wz_ptr, t_ptr, am_ptr,
    N, V, D,
    stride_xn, stride_xd, stride_wv, stride_wd,
    cols_per_split,
    logit_scale, softcap,
    has_bias, has_class_weight, has_softcap, has_smoothing, has_entropy, has_argmax,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    num_splits = tl.cdiv(V, cols_per_split)
    pid_n, pid_s = tile_coords(tl.program_id(0), num_n, num_splits, GROUP_N)

    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_in = tl.where(row_mask, rows, 0)
    tgt = tl.load(tgt_ptr + rows_in, mask=row_mask, other=-1)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    wz = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    am = tl.zeros((BLOCK_N,), tl.int64)
    v_begin = pid_s.to(tl.int64) * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        cols_in = tl.where(col_mask, cols, v_begin)
        acc = logits_tile(x_ptr, w_ptr, rows_in, cols_in, D, stride_xn, stride_xd, stride_wv, stride_wd,
                          BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)
        z = transform_logits(acc, b_ptr, cols_in, logit_scale, softcap, has_bias, has_softcap)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        tile_max = tl.max(z, axis=1)
        m_new = tl.maximum(m, tile_max)
        e = tl.exp(z - m_new[:, None])
        if has_entropy:  # rescaled to the new max: e^(m - m') * (t + (m - m') * s)
            shift = tl.where(m > float("-inf"), m - m_new, 0.0)
            t = tl.exp(shift) * (t + shift * s) + tl.sum(tl.where(e > 0.0, e * (z - m_new[:, None]), 0.0), axis=1)
        if has_argmax:  # the first column of the max
            first = tl.min(tl.where(col_mask[None, :] & (z == tile_max[:, None]), cols[None, :], V), axis=1)
            am = tl.where(tile_max > m, first, am)
        s = s * tl.exp(m - m_new) + tl.sum(e, axis=1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        if has_smoothing:
            zc = tl.where(col_mask[None, :], z, 0.0)
            if has_class_weight:
                zc = zc * tl.load(cw_ptr + cols_in, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            wz += tl.sum(zc, axis=1)

    out = pid_s.to(tl.int64) * N + rows_in
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(zt_ptr + out, zt, mask=row_mask)
    if has_smoothing:
        tl.store(wz_ptr + out, wz, mask=row_mask)
    if has_entropy:
        tl.store(t_ptr + out, t, mask=row_mask)
    if has_argmax:
        tl.store(am_ptr + out, am, mask=row_mask)
