"""The distillation loss's passes over a block of both heads' stored logits, one row per program.

A block's raw logits (the products, bias included, in the input dtype: F.linear's rounding) are stored by cuBLAS,
the student's in ``zs`` and the teacher's in ``zt`` (``has_teacher`` 0: the teacher's top k, no ``zt``). Each
head's logits are transformed as its model does, ``softcap * tanh(scale * z / softcap)`` (or ``scale * z``), then
divided by the temperature (``inv_t``). Three stages, each a sweep of the row (csrc/cuda_stages.cpp launches them
for csrc/distillation_cuda.cpp, which combines vocabulary shards between them):

- stage 0, the log-sum-exps, each as its row's max (stats[0..2]) and the log of the sum of exp(z - max)
  (stats[3..5]), of the student at T, of the teacher at T, of the student at T = 1 (with ``hard``, the hard
  label's cross-entropy): a log-probability is then ``(z - max) - log_sum``, never rounded to the max's precision
  (float32 at logits of 1e4 would lose the divergence's digits to ``z - (max + log_sum)``);
- stage 1, the divergence's sums with those: ``divergence`` 0 (forward KL) stats[6] = sum p_t (t - s); 1 (reverse
  KL) stats[6] = sum p_s (s - t); 2 (generalised JSD) stats[6] = sum p_t (t - log m), stats[7] = sum p_s (s - log
  m), ``log m = logaddexp(s + log(1 - beta), t + log(beta))``; 3 (top k) none; and stats[8] = sum p_s s (the
  student's entropy is its negative);
- stage 2, the logits become the gradient of the row's loss with respect to the student's raw logits, in place:
  ``coef[0]`` times the divergence's gradient with respect to s (forward KL p_s - p_t, reverse KL p_s (s - t -
  KL), JSD (1 - beta) p_s (s - log m - KL_s), top k p_s: the caller subtracts q at the k classes) plus ``coef[1]``
  times the hard label's (softmax at T = 1 minus one-hot at ``tgt``, a column of this shard or -1), times the
  transform's derivative. ``coef[0]`` carries 1 / T and the row's upstream gradient.
"""
import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import softcap_tanh

SPEC = KernelSpec(
    "distill_rows",
    params=(
        ("zs_ptr", "*T"), ("zt_ptr", "*T"), ("stats_ptr", "*fp32"), ("coef_ptr", "*fp32"), ("tgt_ptr", "*i64"),
        ("N", "i64"), ("V", "i64"), ("stride_s", "i64"), ("stride_t", "i64"),
        ("inv_t", "fp32"), ("s_scale", "fp32"), ("s_softcap", "fp32"), ("t_scale", "fp32"), ("t_softcap", "fp32"),
        ("log_1mb", "fp32"), ("log_b", "fp32"),
        ("stage", "i32"), ("divergence", "i32"), ("has_teacher", "i32"), ("hard", "i32"),
        ("has_s_softcap", "i32"), ("has_t_softcap", "i32"),
    ),
    family="row_sweeps",
    grid="N",
    divisible_by_16=frozenset({"zs_ptr", "zt_ptr", "stride_s", "stride_t", "V"}),
)


@triton.jit
def _transformed(ptrs, mask, scale, softcap, has_softcap, FAST_TANH: tl.constexpr):
    """Raw stored logits -> the model's logits at T = 1, float32 (masked entries -inf)."""
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale
    if has_softcap:
        z = softcap * softcap_tanh(z * (1.0 / softcap), FAST_TANH)
    return tl.where(mask, z, float("-inf"))


@triton.jit
def _online(m, s, z):
    """A running (max, sum of exp(z - max)) per lane, updated with z."""
    m_new = tl.maximum(m, z)
    s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
    return m_new, tl.where(m_new == float("-inf"), 0.0, s)


@triton.jit
def _lse(m, s):
    """The row's (max, log sum exp(z - max)) from the lanes' running values."""
    top = tl.max(m, 0)
    return top, tl.log(tl.sum(s * tl.exp(m - top), 0))


@triton.jit
def _store_lse(stats_ptr, N, row, i, m, s):
    top, log_sum = _lse(m, s)
    tl.store(stats_ptr + i * N + row, top)
    tl.store(stats_ptr + (i + 3) * N + row, log_sum)


@triton.jit
def distill_rows_kernel(
    zs_ptr, zt_ptr, stats_ptr, coef_ptr, tgt_ptr,
    N, V, stride_s, stride_t,
    inv_t, s_scale, s_softcap, t_scale, t_softcap,
    log_1mb, log_b,
    stage, divergence, has_teacher, hard,
    has_s_softcap, has_t_softcap,
    BLOCK: tl.constexpr, FAST_TANH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK)
    s_row = zs_ptr + row * stride_s
    t_row = zt_ptr + row * stride_t
    if stage == 0:
        ms = tl.full((BLOCK,), float("-inf"), tl.float32)
        ss = tl.zeros((BLOCK,), tl.float32)
        mt = tl.full((BLOCK,), float("-inf"), tl.float32)
        st = tl.zeros((BLOCK,), tl.float32)
        m1 = tl.full((BLOCK,), float("-inf"), tl.float32)
        s1 = tl.zeros((BLOCK,), tl.float32)
        for c0 in range(0, V, BLOCK):
            cols = c0 + cols0
            mask = cols < V
            z1 = _transformed(s_row + cols, mask, s_scale, s_softcap, has_s_softcap, FAST_TANH)
            ms, ss = _online(ms, ss, z1 * inv_t)
            if hard:
                m1, s1 = _online(m1, s1, z1)
            if has_teacher:
                zt = _transformed(t_row + cols, mask, t_scale, t_softcap, has_t_softcap, FAST_TANH)
                mt, st = _online(mt, st, zt * inv_t)
        _store_lse(stats_ptr, N, row, 0, ms, ss)
        if has_teacher:
            _store_lse(stats_ptr, N, row, 1, mt, st)
        if hard:
            _store_lse(stats_ptr, N, row, 2, m1, s1)
    else:
        max_s = tl.load(stats_ptr + row)
        log_sum_s = tl.load(stats_ptr + 3 * N + row)
        max_t = 0.0
        log_sum_t = 0.0
        if has_teacher:
            max_t = tl.load(stats_ptr + N + row)
            log_sum_t = tl.load(stats_ptr + 4 * N + row)
        if stage == 1:
            a = tl.zeros((BLOCK,), tl.float32)  # the divergence's sums, the entropy's
            b = a
            e = a
            for c0 in range(0, V, BLOCK):
                cols = c0 + cols0
                mask = cols < V
                zs = _transformed(s_row + cols, mask, s_scale, s_softcap, has_s_softcap, FAST_TANH) * inv_t
                s = (zs - max_s) - log_sum_s
                ps = tl.exp(s)
                e += tl.where(mask, ps * s, 0.0)
                if has_teacher:
                    zt = _transformed(t_row + cols, mask, t_scale, t_softcap, has_t_softcap, FAST_TANH) * inv_t
                    t = (zt - max_t) - log_sum_t
                    pt = tl.exp(t)
                    if divergence == 0:
                        a += tl.where(mask, pt * (t - s), 0.0)
                    elif divergence == 1:
                        a += tl.where(mask, ps * (s - t), 0.0)
                    else:
                        u = s + log_1mb
                        v = t + log_b
                        top = tl.maximum(u, v)
                        log_m = top + tl.log(tl.exp(u - top) + tl.exp(v - top))
                        a += tl.where(mask, pt * (t - log_m), 0.0)
                        b += tl.where(mask, ps * (s - log_m), 0.0)
            tl.store(stats_ptr + 6 * N + row, tl.sum(a, 0))
            tl.store(stats_ptr + 7 * N + row, tl.sum(b, 0))
            tl.store(stats_ptr + 8 * N + row, tl.sum(e, 0))
        else:
            c_div = tl.load(coef_ptr + row)
            c_ce = tl.load(coef_ptr + N + row)
            kl = tl.load(stats_ptr + 6 * N + row)
            kl_s = tl.load(stats_ptr + 7 * N + row)
            max_1 = 0.0
            log_sum_1 = 0.0
            if hard:
                max_1 = tl.load(stats_ptr + 2 * N + row)
                log_sum_1 = tl.load(stats_ptr + 5 * N + row)
            tgt = tl.load(tgt_ptr + row)
            for c0 in range(0, V, BLOCK):
                cols = c0 + cols0
                mask = cols < V
                z1 = _transformed(s_row + cols, mask, s_scale, s_softcap, has_s_softcap, FAST_TANH)
                s = (z1 * inv_t - max_s) - log_sum_s
                ps = tl.exp(s)
                if has_teacher:
                    zt = _transformed(t_row + cols, mask, t_scale, t_softcap, has_t_softcap, FAST_TANH) * inv_t
                    t = (zt - max_t) - log_sum_t
                    if divergence == 0:
                        g = ps - tl.exp(t)
                    elif divergence == 1:
                        g = ps * ((s - t) - kl)
                    else:
                        u = s + log_1mb
                        v = t + log_b
                        top = tl.maximum(u, v)
                        log_m = top + tl.log(tl.exp(u - top) + tl.exp(v - top))
                        g = tl.exp(u) * ((s - log_m) - kl_s)  # (1 - beta) p_s (...)
                else:
                    g = ps
                g = g * c_div
                if hard:
                    g += c_ce * (tl.exp((z1 - max_1) - log_sum_1) - tl.where(cols == tgt, 1.0, 0.0))
                if has_s_softcap:
                    th = z1 * (1.0 / s_softcap)
                    g = g * (1.0 - th * th)
                g = g * s_scale
                tl.store(s_row + cols, g.to(zs_ptr.dtype.element_ty), mask=mask)
