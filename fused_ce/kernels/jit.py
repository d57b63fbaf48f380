"""JIT launchers of the kernels, mirroring csrc/cuda_stages.cpp.

For tests (CPU tensors under ``TRITON_INTERPRET=1``) and kernel development on
a GPU with triton installed. The library itself never imports this module.
"""
import torch
import triton

from . import configs
from .assemble_loss import assemble_loss_kernel
from .combine_partials import combine_partials_kernel
from .logit_grad import logit_grad_kernel
from .logit_partials import logit_partials_kernel
from .prepare_rows import prepare_rows_kernel
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
                 softcap=None, smoothing=False, write_grad=True, config=None, combine_config=None):
    """Turns stored raw logits [N, V] into their gradient in place; returns (lse, target_logit, weighted_z_sum).

    The three stages of cuda_stages.cpp: logit_partials, combine_partials, then (``write_grad``) softmax_grad.
    With ``smoothing`` False, gamma is taken as zero and weighted_z_sum is not computed (None).
    ``config`` tiles both passes over the logits.
    """
    N, V = logits.shape
    if logits.is_cuda:
        major, minor = torch.cuda.get_device_capability(logits.device)
        arch, dtype = major * 10 + minor, _DTYPES[logits.dtype]
        cfg = config or configs.row_config(arch, dtype, "logit_partials")
        combine_cfg = combine_config or configs.row_config(arch, dtype, "combine_partials")
        fast_tanh = configs.fast_tanh(dtype)
    else:  # the interpreter runs no inline PTX
        cfg = config or configs.INTERPRETER_TILE
        combine_cfg, fast_tanh = combine_config or configs.INTERPRETER_COMBINE, False
    common = dict(logit_scale=float(logit_scale), softcap=float(softcap or 1.0), has_softcap=int(softcap is not None),
                  has_smoothing=int(smoothing), FAST_TANH=fast_tanh)
    cw = target if class_weight is None else class_weight  # never read without class weights
    segments = triton.cdiv(V, cfg.block)
    partials = torch.empty(3, N, segments, dtype=torch.float32, device=logits.device)
    logit_partials_kernel[(triton.cdiv(N, cfg.rows) * segments,)](
        logits, cw, partials[0], partials[1], partials[2], N, V, logits.stride(0), segments,
        has_class_weight=int(class_weight is not None), BLOCK_R=cfg.rows, BLOCK=cfg.block,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    stats = torch.empty(3, N, dtype=torch.float32, device=logits.device)
    combine_partials_kernel[(triton.cdiv(N, combine_cfg.rows),)](
        partials[0], partials[1], partials[2], logits, target, stats[0], stats[1], stats[2], N, logits.stride(0),
        segments, BLOCK_R=combine_cfg.rows, BLOCK=combine_cfg.block, num_warps=combine_cfg.num_warps, **common)
    if write_grad:
        grad_in_place(logits, target, stats[0], alpha, alpha_lse, beta, gamma, class_weight=class_weight,
                      logit_scale=logit_scale, softcap=softcap, smoothing=smoothing, config=config)
    return stats[0], stats[1], stats[2] if smoothing else None


def grad_in_place(logits, target, lse, alpha, alpha_lse, beta, gamma, *, col_offset=0, class_weight=None,
                  logit_scale=1.0, softcap=None, smoothing=False, config=None):
    """softmax_grad_kernel alone: stored raw logits of columns [col_offset, col_offset + V) become their
    gradient in place, given the rows' lse; ``class_weight`` is the slice's own ([V])."""
    N, V = logits.shape
    if logits.is_cuda:
        major, minor = torch.cuda.get_device_capability(logits.device)
        cfg = config or configs.row_config(major * 10 + minor, _DTYPES[logits.dtype], "softmax_grad")
        fast_tanh = configs.fast_tanh(_DTYPES[logits.dtype])
    else:
        cfg, fast_tanh = config or configs.INTERPRETER_TILE, False
    segments = triton.cdiv(V, cfg.block)
    softmax_grad_kernel[(triton.cdiv(N, cfg.rows) * segments,)](
        logits, target if class_weight is None else class_weight, target, lse, alpha, alpha_lse, beta, gamma, N, V,
        logits.stride(0), segments, col_offset, float(logit_scale), float(softcap or 1.0),
        int(class_weight is not None), int(softcap is not None), int(smoothing), BLOCK_R=cfg.rows, BLOCK=cfg.block,
        FAST_TANH=fast_tanh, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return logits


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


def _single_program_config(t):
    return configs.row_config(0, "fp32", "prepare_rows") if t.is_cuda else configs.INTERPRETER_ROW


def prepare_rows(target, V, ignore_index, *, class_weight=None, label_smoothing=0.0, z_loss=0.0, mean=True,
                 coefficients=False, config=None):
    """(target with -1 where ignored, target weight, totals [sum wt, #valid, sum cw], #bad, coefficients or None)."""
    N = target.shape[0]
    cfg = config or _single_program_config(target)
    f32 = dict(dtype=torch.float32, device=target.device)
    tgt_out = torch.empty_like(target)
    wt = torch.empty(N, **f32)
    totals = torch.empty(3, **f32)
    bad = torch.empty(1, dtype=torch.int32, device=target.device)
    coef = torch.empty(4, N, **f32) if coefficients else torch.empty(4, 1, **f32)
    prepare_rows_kernel[(1,)](
        target, target if class_weight is None else class_weight, tgt_out, wt, totals, bad,
        coef[0], coef[1], coef[2], coef[3], N, V, ignore_index, float(label_smoothing), float(z_loss),
        int(class_weight is not None), int(mean), int(coefficients), BLOCK=cfg.block, num_warps=cfg.num_warps)
    return tgt_out, wt, totals, int(bad.item()), (tuple(coef) if coefficients else None)


def assemble_loss(lse, target_logit, weighted_z_sum, target, wt, totals, V, *, label_smoothing=0.0, z_loss=0.0,
                  reduction="mean", config=None):
    """The loss from row statistics (target: -1 where ignored; wt and totals from prepare_rows)."""
    N = lse.shape[0]
    cfg = config or _single_program_config(lse)
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    loss = torch.empty(N if code == 0 else 1, dtype=torch.float32, device=lse.device)
    smoothing = weighted_z_sum is not None
    assemble_loss_kernel[(1,)](
        lse, target_logit, weighted_z_sum if smoothing else lse, target, wt, totals, loss, N, V,
        float(label_smoothing), float(z_loss), int(smoothing), code, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return loss if code == 0 else loss[0]
