"""Forward stage: per-row log-sum-exp partials without materialising logits.

Each program owns BLOCK_N rows and one contiguous split of the vocabulary. It
computes logits tiles with ``tl.dot`` and folds them into an online softmax
(running max ``m`` and sum ``s`` of exp(z - m)), and also collects the target's
logit and, for label smoothing, the class-weighted sum of logits. The splits'
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
        ("m_ptr", "*fp32"), ("s_ptr", "*fp32"), ("zt_ptr", "*fp32"), ("wz_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("D", "i64"),
        ("stride_xn", "i64"), ("stride_xd", "i64"), ("stride_wv", "i64"), ("stride_wd", "i64"),
        ("cols_per_split", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ),
    family="dot_tiles",
    divisible_by_16=XW_DIVISIBLE_BY_16,
    unit_stride=XW_UNIT_STRIDE,
)


@triton.jit
def row_stats_kernel(
    x_ptr, w_ptr, b_ptr, cw_ptr, tgt_ptr,
    m_ptr, s_ptr, zt_ptr, wz_ptr,
    N, V, D,
    stride_xn, stride_xd, stride_wv, stride_wd,
    cols_per_split,
    logit_scale, softcap,
    has_bias, has_class_weight, has_softcap, has_smoothing,
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
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
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
