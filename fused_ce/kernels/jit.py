"""JIT launchers of the kernels, mirroring csrc/cuda_stages.cpp.

For tests (CPU tensors under ``TRITON_INTERPRET=1``) and kernel development on
a GPU with triton installed. The library itself never imports this module.
"""
import torch
import triton

from . import configs
from .logit_grad import logit_grad_kernel
from .row_stats import row_stats_kernel
from .scale import scale_kernel
from .softmax_grad import softmax_grad_kernel

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _config(kernel, x):
    if not x.is_cuda:
        return configs.INTERPRETER
    major, minor = torch.cuda.get_device_capability(x.device)
    return configs.tile_config(kernel, major * 10 + minor, _DTYPES[x.dtype])


def _common(x, w, target, bias, class_weight, logit_scale, softcap, cfg):
    D = x.shape[1]
    placeholder = target  # any tensor: its pointer is never read when the flag is off
    return dict(
        x_ptr=x, w_ptr=w, b_ptr=placeholder if bias is None else bias,
        cw_ptr=placeholder if class_weight is None else class_weight, tgt_ptr=target, D=D,
        stride_xn=x.stride(0), stride_xd=x.stride(1), stride_wv=w.stride(0), stride_wd=w.stride(1),
        logit_scale=float(logit_scale), softcap=float(softcap or 1.0),
        has_bias=int(bias is not None), has_class_weight=int(class_weight is not None),
        has_softcap=int(softcap is not None),
        BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
        EVEN_D=D % cfg.block_d == 0, DOT_PRECISION=configs.dot_precision(_DTYPES[x.dtype]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def row_stats(x, w, target, *, bias=None, class_weight=None, logit_scale=1.0, softcap=None, need_wz=False,
              num_splits=None, config=None):
    """(lse, target_logit, weighted_z_sum) per row; ``target`` holds -1 for ignored rows."""
    cfg = config or _config("row_stats", x)
    N, V = x.shape[0], w.shape[0]
    vocab_tiles = triton.cdiv(V, cfg.block_v)
    splits = min(num_splits or 1, vocab_tiles)
    cols_per_split = triton.cdiv(vocab_tiles, splits) * cfg.block_v
    splits = triton.cdiv(V, cols_per_split)
    partial = torch.empty(4, splits, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, cfg.block_n) * splits,)
    row_stats_kernel[grid](
        m_ptr=partial[0], s_ptr=partial[1], zt_ptr=partial[2], wz_ptr=partial[3], N=N, V=V,
        cols_per_split=cols_per_split, need_wz=int(need_wz),
        **_common(x, w, target, bias, class_weight, logit_scale, softcap, cfg))
    m = partial[0]
    m_max = m.max(0).values
    lse = m_max + (partial[1] * (m - m_max).exp()).sum(0).log()
    return lse, partial[2].sum(0), partial[3].sum(0) if need_wz else None


def logit_grad(x, w, target, lse, alpha, alpha_lse, beta, gamma, v_begin, v_end, *, bias=None,
               class_weight=None, logit_scale=1.0, softcap=None, out=None):
    """The logit gradient (see logit_grad.py) for all rows and columns [v_begin, v_end)."""
    cfg = _config("logit_grad", x)
    N = x.shape[0]
    if out is None:
        out = torch.empty(N, v_end - v_begin, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, cfg.block_n) * triton.cdiv(v_end - v_begin, cfg.block_v),)
    logit_grad_kernel[grid](
        lse_ptr=lse, alpha_ptr=alpha, alpha_lse_ptr=alpha_lse, beta_ptr=beta, gamma_ptr=gamma, g_ptr=out, N=N,
        v_begin=v_begin, v_end=v_end, stride_gn=out.stride(0),
        **_common(x, w, target, bias, class_weight, logit_scale, softcap, cfg))
    return out


def softmax_grad(logits, target, alpha, alpha_lse, beta, gamma, *, class_weight=None, logit_scale=1.0,
                 softcap=None, smoothing=False, write_grad=True, config=None):
    """Turns stored raw logits [N, V] into their gradient in place; returns (lse, target_logit, weighted_z_sum).

    With ``smoothing`` False, gamma is taken as zero and weighted_z_sum is not computed (None).
    """
    N, V = logits.shape
    if logits.is_cuda:
        major, minor = torch.cuda.get_device_capability(logits.device)
        cfg = config or configs.row_config(major * 10 + minor, _DTYPES[logits.dtype])
        fast_tanh = configs.fast_tanh(_DTYPES[logits.dtype])
    else:
        cfg, fast_tanh = config or configs.INTERPRETER_ROW, False  # the interpreter runs no inline PTX
    stats = torch.empty(3, N, dtype=torch.float32, device=logits.device)
    softmax_grad_kernel[(N,)](
        logits, target if class_weight is None else class_weight, target, alpha, alpha_lse, beta, gamma,
        stats[0], stats[1], stats[2], V, logits.stride(0), float(logit_scale), float(softcap or 1.0),
        int(class_weight is not None), int(softcap is not None), int(smoothing), int(write_grad),
        BLOCK=cfg.block, FAST_TANH=fast_tanh, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return stats[0], stats[1], stats[2] if smoothing else None


def scale_(g, scale, *, config=None, programs=None):
    """g *= scale in place (g contiguous; scale a one-element float32 tensor); nothing when scale is 1."""
    if g.is_cuda:
        major, minor = torch.cuda.get_device_capability(g.device)
        cfg = config or configs.row_config(major * 10 + minor, _DTYPES[g.dtype], "scale")
        programs = programs or 4 * torch.cuda.get_device_properties(g.device).multi_processor_count
    else:
        cfg, programs = config or configs.INTERPRETER_ROW, programs or 4
    grid = (max(1, min(triton.cdiv(g.numel(), cfg.block), programs)),)
    scale_kernel[grid](g, scale, g.numel(), BLOCK=cfg.block, num_warps=cfg.num_warps)
    return g
