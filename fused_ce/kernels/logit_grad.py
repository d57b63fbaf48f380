"""Backward stage: the gradient of the loss with respect to the raw logits.

For a block of rows and a slice of the vocabulary [v_begin, v_end) this recomputes
the logits tile, and writes

    g[r, c] = logit_scale * softcap'(z) * (p[r, c] * (alpha[r] + alpha_lse[r] * lse[r] + alpha_z[r] * log p[r, c])
                                           - beta[r] * (c == target[r])
                                           - gamma[r] * class_weight[c])

with p = exp(z - lse). The per-row coefficients fold the upstream gradient, the
reduction, class weights, label smoothing, z-loss and the gradient of the
returned lse or entropy (csrc/loss_terms.cpp), so one kernel serves every loss variant.
The caller multiplies g back through w and x with GEMMs.
"""
import triton
import triton.language as tl

from .spec import XW_DIVISIBLE_BY_16, XW_PARAMS, XW_UNIT_STRIDE, KernelSpec
from .tile import logits_tile, tile_coords, transform_logits

SPEC = KernelSpec(
    "logit_grad",
    params=XW_PARAMS + (
        ("lse_ptr", "*fp32"), ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"),
        ("gamma_ptr", "*fp32"), ("alpha_z_ptr", "*fp32"), ("g_ptr", "*T"),
        ("N", "i64"), ("v_begin", "i64"), ("v_end", "i64"), ("D", "i64"),
        ("stride_xn", "i64"), ("stride_xd", "i64"), ("stride_wv", "i64"), ("stride_wd", "i64"), ("stride_gn", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
        ("has_alpha_z", "i32"),
    ),
    family="dot_tiles",
    grid="cdiv(N, ROWS) * cdiv(v_end - v_begin, COLS)",
    divisible_by_16=XW_DIVISIBLE_BY_16 | {"g_ptr", "stride_gn"},
    unit_stride=XW_UNIT_STRIDE,
)


@triton.jit
def logit_grad_kernel(
    x_ptr, w_ptr, b_ptr, cw_ptr, tgt_ptr,
    lse_ptr, alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr, alpha_z_ptr, g_ptr,
    N, v_begin, v_end, D,
    stride_xn, stride_xd, stride_wv, stride_wd, stride_gn,
    logit_scale, softcap,
    has_bias, has_class_weight, has_softcap, has_smoothing, has_alpha_z,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    num_v = tl.cdiv(v_end - v_begin, BLOCK_V)
    pid_n, pid_v = tile_coords(tl.program_id(0), num_n, num_v, GROUP_N)

    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows_in = tl.where(row_mask, rows, 0)
    cols = v_begin + pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < v_end
    cols_in = tl.where(col_mask, cols, v_begin)

    acc = logits_tile(x_ptr, w_ptr, rows_in, cols_in, D, stride_xn, stride_xd, stride_wv, stride_wd,
                      BLOCK_N, BLOCK_V, BLOCK_D, EVEN_D, DOT_PRECISION)
    z = transform_logits(acc, b_ptr, cols_in, logit_scale, softcap, has_bias, has_softcap)

    lse = tl.load(lse_ptr + rows_in)
    alpha0 = tl.load(alpha_ptr + rows_in)
    alpha_lse = tl.load(alpha_lse_ptr + rows_in)
    alpha = alpha0 + alpha_lse * lse
    beta = tl.load(beta_ptr + rows_in)
    # rows with no coefficient (ignored ones) get exactly 0, also where their logits are NaN or inf
    active = (alpha0 != 0.0) | (alpha_lse != 0.0) | (beta != 0.0)
    tgt = tl.load(tgt_ptr + rows_in)

    p = tl.exp(z - lse[:, None])
    g = p * alpha[:, None] - tl.where(cols[None, :] == tgt[:, None], beta[:, None], 0.0)
    if has_alpha_z:
        alpha_z = tl.load(alpha_z_ptr + rows_in)
        active = active | (alpha_z != 0.0)
        # alpha_z * log p (no cancellation at large z); p log p is 0 where p is (-inf logits)
        g += tl.where(p > 0.0, p * alpha_z[:, None] * (z - lse[:, None]), 0.0)
    if has_smoothing:  # gamma is zero without label smoothing: skip its loads (and 0 * an infinite class weight)
        gamma = tl.load(gamma_ptr + rows_in)
        active = active | (gamma != 0.0)
        if has_class_weight:
            g -= gamma[:, None] * tl.load(cw_ptr + cols_in).to(tl.float32)[None, :]
        else:
            g -= gamma[:, None]
    if has_softcap:
        t = z / softcap
        g = g * (1.0 - t * t)
    g = tl.where(active[:, None], g * logit_scale, 0.0)

    out = g_ptr + rows[:, None] * stride_gn + (cols - v_begin)[None, :]
    tl.store(out, g.to(g_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
