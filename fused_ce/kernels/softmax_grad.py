"""Forward-with-gradient stage: a block of stored logits becomes its gradient, in place.

Used when the gradients are computed during the forward (scalar reductions): a
GEMM has written raw logits ``x @ w.T + b`` for a chunk of rows; one program per
row then
  1. reads the row once, transforming it (logit_scale, softcap), and keeps an
     online max / sum of exp, the target's logit and the class-weighted sum;
  2. reads it again (mostly from L2) and overwrites it with
     ``dL/dlogit = logit_scale * softcap'(z) * (p * alpha - beta * onehot - gamma * cw)``
     where ``alpha = alpha0 + alpha_lse * lse`` (the z-loss term needs the lse).
The row statistics are written out for the loss. With ``write_grad`` 0 it
stops after step 1: the loss-only forward from cuBLAS logits.
"""
import triton
import triton.language as tl

from .tile import softcap_tanh


@triton.jit
def _load_logits(row_ptr, cols, mask, logit_scale, softcap, inv_softcap, has_softcap, FAST_TANH: tl.constexpr):
    z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
    if has_softcap:
        z = softcap * softcap_tanh(z * inv_softcap, FAST_TANH)
    return z


@triton.jit
def softmax_grad_kernel(
    logits_ptr, cw_ptr, tgt_ptr,
    alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr,
    lse_ptr, zt_ptr, wz_ptr,
    V, stride_ln,
    logit_scale, softcap,
    has_class_weight, has_softcap, has_smoothing, write_grad,
    BLOCK: tl.constexpr, FAST_TANH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    tgt = tl.load(tgt_ptr + row)
    offs = tl.arange(0, BLOCK)

    inv_softcap = 1.0 / softcap
    # running max over the row so far (a scalar: one exp per element), lane-wise sums
    m = float("-inf")
    s = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    wz = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        mask = cols < V
        z = _load_logits(row_ptr, cols, mask, logit_scale, softcap, inv_softcap, has_softcap, FAST_TANH)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
        zt += tl.where(cols == tgt, z, 0.0)
        if has_smoothing:
            zc = tl.where(mask, z, 0.0)
            if has_class_weight:
                zc = zc * tl.load(cw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            wz += zc
    lse = m + tl.log(tl.sum(s, axis=0))
    tl.store(lse_ptr + row, lse)
    tl.store(zt_ptr + row, tl.sum(zt, axis=0))
    if has_smoothing:
        tl.store(wz_ptr + row, tl.sum(wz, axis=0))

    if write_grad:  # else: the loss-only forward, which needs the row stats alone
        _write_grad(row_ptr, cw_ptr, tgt, lse, alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr, row, V, logit_scale,
                    softcap, inv_softcap, has_class_weight, has_softcap, has_smoothing, BLOCK, FAST_TANH)


@triton.jit
def _write_grad(row_ptr, cw_ptr, tgt, lse, alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr, row, V, logit_scale,
                softcap, inv_softcap, has_class_weight, has_softcap, has_smoothing, BLOCK: tl.constexpr,
                FAST_TANH: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    alpha = tl.load(alpha_ptr + row) + tl.load(alpha_lse_ptr + row) * lse
    beta = tl.load(beta_ptr + row)
    gamma = tl.load(gamma_ptr + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        mask = cols < V
        z = _load_logits(row_ptr, cols, mask, logit_scale, softcap, inv_softcap, has_softcap, FAST_TANH)
        g = tl.exp(z - lse) * alpha - tl.where(cols == tgt, beta, 0.0)
        if has_smoothing:  # gamma is zero without label smoothing: skip its loads
            if has_class_weight:
                g -= gamma * tl.load(cw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                g -= gamma
        if has_softcap:
            t = z * inv_softcap  # tanh of the pre-cap logit
            g = g * (1.0 - t * t)
        g = g * logit_scale
        tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=mask)
