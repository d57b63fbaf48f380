"""Device functions shared by the kernels: one logits tile and its transforms.

A logits tile is ``z[r, c] = softcap(logit_scale * (x[r] . w[c] + b[c]))`` for a
BLOCK_N x BLOCK_V block of rows and vocabulary entries, accumulated in float32.
"""
import triton
import triton.language as tl


@triton.jit
def logits_tile(x_ptr, w_ptr, rows, cols, D, stride_xn, stride_xd, stride_wv, stride_wd,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # rows/cols are already clamped into range, so only the D tail needs a mask.
    offs_d = tl.arange(0, BLOCK_D)
    x_ptrs = x_ptr + rows[:, None] * stride_xn + offs_d[None, :] * stride_xd
    w_ptrs = w_ptr + cols[None, :] * stride_wv + offs_d[:, None] * stride_wd
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        if EVEN_D:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(offs_d[None, :] + d0) < D, other=0.0)
            w = tl.load(w_ptrs, mask=(offs_d[:, None] + d0) < D, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_D * stride_xd
        w_ptrs += BLOCK_D * stride_wd
    return acc


@triton.jit
def tanh(u):
    # 1 - 2 / (exp(2u) + 1): exact at both infinities, no libdevice needed.
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def softcap_tanh(u, FAST: tl.constexpr):
    # FAST: the hardware's tanh.approx.f32 (one MUFU op, ~5e-4 relative error,
    # below a bf16 logit's own rounding); for half-precision inputs on the GPU only.
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tanh(u)


@triton.jit
def load_logits(ptrs, mask, logit_scale, softcap, has_softcap, FAST_TANH: tl.constexpr):
    """Stored raw logits (masked entries 0) -> z = softcap(logit_scale * logit), in float32."""
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * logit_scale
    if has_softcap:
        z = softcap * softcap_tanh(z * (1.0 / softcap), FAST_TANH)
    return z


@triton.jit
def transform_logits(acc, b_ptr, cols, logit_scale, softcap, has_bias, has_softcap):
    z = acc
    if has_bias:
        z += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    z = z * logit_scale
    if has_softcap:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def tile_coords(pid, num_n, num_v, GROUP_N: tl.constexpr):
    # Grouped order: GROUP_N row tiles sweep the vocabulary together, so the
    # programs in flight share both their x and their w tiles through L2.
    per_group = GROUP_N * num_v
    group = pid // per_group
    first_n = group * GROUP_N
    group_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_v = (pid % per_group) // group_n
    return pid_n, pid_v
