"""JIT launchers of the kernels, one per stage of csrc/cuda_stages.cpp and named like it.

For tests (CPU tensors under ``TRITON_INTERPRET=1``) and kernel development on
a GPU with triton installed. Arguments are passed by the names of each kernel's
SPEC and checked against it; tiles come from configs.py by the SPEC's family.
The library itself never imports this module.
"""
import math

import torch
import triton

from . import (
    assemble_loss as _assemble_loss,
)
from . import (
    combine_partials as _combine_partials,
)
from . import (
    configs,
)
from . import (
    distill_rows as _distill_rows,
)
from . import (
    grad_tile_mask as _grad_tile_mask,
)
from . import (
    logit_grad as _logit_grad,
)
from . import (
    logit_partials as _logit_partials,
)
from . import (
    prepare_rows as _prepare_rows,
)
from . import (
    row_stats as _row_stats,
)
from . import (
    scale as _scale,
)
from . import (
    softmax_grad as _softmax_grad,
)
from . import (
    sparse_grad_input as _sparse_grad_input,
)
from . import (
    sparse_grad_weight as _sparse_grad_weight,
)

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _arch(t):
    major, minor = torch.cuda.get_device_capability(t.device)
    return major * 10 + minor


def _config(module, t, config=None):
    """The configuration of a kernel for tensors like `t`: the device's, or the interpreter's on the CPU."""
    if config is not None:
        return config
    if not t.is_cuda:
        return configs.INTERPRETER.get(module.SPEC.name, configs.INTERPRETER[module.SPEC.family])
    return configs.config(module.SPEC.family, _arch(t), _DTYPES.get(t.dtype, "fp32"), module.SPEC.name)


def _fast_tanh(t):
    return t.is_cuda and configs.fast_tanh(_DTYPES[t.dtype])  # the interpreter runs no inline PTX


def _launch(module, args, programs=None, **meta):
    """module's kernel with `args` checked against its SPEC's launch parameters, on its SPEC's grid."""
    spec = module.SPEC
    names = spec.param_names()
    if set(args) != set(names):
        raise TypeError(f"{spec.name}: arguments {sorted(set(args) ^ set(names))} differ from its SPEC")
    rows, cols = meta.get("BLOCK_N", meta.get("BLOCK_R")), meta.get("BLOCK_V", meta.get("BLOCK"))
    grid = (spec.grid_size(args, rows, cols, programs, meta.get("BLOCK_D")),)
    getattr(module, f"{spec.name}_kernel")[grid](*(args[n] for n in names), **meta)


def _placeholder(t, maybe):
    return t if maybe is None else maybe  # any tensor: its pointer is never read when the flag is off


def _xw_args(x, w, target, bias, class_weight, logit_scale, softcap):
    return dict(
        x_ptr=x, w_ptr=w, b_ptr=_placeholder(target, bias), cw_ptr=_placeholder(target, class_weight),
        tgt_ptr=target, D=x.shape[1],
        stride_xn=x.stride(0), stride_xd=x.stride(1), stride_wv=w.stride(0), stride_wd=w.stride(1),
        logit_scale=float(logit_scale), softcap=float(softcap or 1.0),
        has_bias=int(bias is not None), has_class_weight=int(class_weight is not None),
        has_softcap=int(softcap is not None),
    )


def _dot_tile_meta(cfg, x):
    return dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP_N=cfg.group_n,
                EVEN_D=x.shape[1] % cfg.block_d == 0, DOT_PRECISION=configs.dot_precision(_DTYPES[x.dtype]),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def row_stats(x, w, target, *, bias=None, class_weight=None, logit_scale=1.0, softcap=None, smoothing=False,
              entropy=False, argmax=False, num_splits=None, config=None):
    """(lse, target_logit, weighted_z_sum or None) per row, and with ``entropy`` or ``argmax`` also (entropy or
    None, argmax or None); ``target`` holds -1 for ignored rows. The splits combine as cuda_row_stats does."""
    cfg = _config(_row_stats, x, config)
    N, V = x.shape[0], w.shape[0]
    vocab_tiles = triton.cdiv(V, cfg.block_v)
    splits = min(num_splits or 1, vocab_tiles)
    cols_per_split = triton.cdiv(vocab_tiles, splits) * cfg.block_v
    splits = triton.cdiv(V, cols_per_split)
    partial = torch.empty(5, splits, N, dtype=torch.float32, device=x.device)
    arg = torch.empty(splits, N, dtype=torch.int64, device=x.device)
    args = dict(m_ptr=partial[0], s_ptr=partial[1], zt_ptr=partial[2], wz_ptr=partial[3], t_ptr=partial[4],
                am_ptr=arg, N=N, V=V, cols_per_split=cols_per_split, has_smoothing=int(smoothing),
                has_entropy=int(entropy), has_argmax=int(argmax),
                **_xw_args(x, w, target, bias, class_weight, logit_scale, softcap))
    _launch(_row_stats, args, **_dot_tile_meta(cfg, x))
    # the splits combined by the library's own combination (csrc/problem.cpp, combine_row_stat_splits)
    lse, _, _, wz, ent, am = torch.ops.fused_ce._combine_row_stat_splits(
        partial, arg, target, smoothing, entropy, argmax)
    stats = (lse, partial[2].sum(0), wz if smoothing else None)
    if not (entropy or argmax):
        return stats
    return stats + (ent if entropy else None, am if argmax else None)


def logit_grad(x, w, target, lse, alpha, alpha_lse, beta, gamma, v_begin, v_end, *, bias=None,
               class_weight=None, logit_scale=1.0, softcap=None, alpha_z=None, smoothing=True, out=None):
    """The logit gradient (see logit_grad.py) for all rows and columns [v_begin, v_end)."""
    cfg = _config(_logit_grad, x)
    N = x.shape[0]
    if out is None:
        out = torch.empty(N, v_end - v_begin, dtype=x.dtype, device=x.device)
    args = dict(lse_ptr=lse, alpha_ptr=alpha, alpha_lse_ptr=alpha_lse, beta_ptr=beta, gamma_ptr=gamma,
                alpha_z_ptr=_placeholder(alpha, alpha_z), g_ptr=out, N=N, v_begin=v_begin, v_end=v_end,
                stride_gn=out.stride(0), has_smoothing=int(smoothing), has_alpha_z=int(alpha_z is not None),
                **_xw_args(x, w, target, bias, class_weight, logit_scale, softcap))
    _launch(_logit_grad, args, **_dot_tile_meta(cfg, x))
    return out


def _tile_meta(cfg, logits):
    """Launch metadata of the kernels over tiles of stored logits."""
    return dict(BLOCK_R=cfg.rows, BLOCK=cfg.block, FAST_TANH=_fast_tanh(logits), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _transform_args(logits, logit_scale, softcap, smoothing):
    return dict(logits_ptr=logits, stride_ln=logits.stride(0), logit_scale=float(logit_scale),
                softcap=float(softcap or 1.0), has_softcap=int(softcap is not None), has_smoothing=int(smoothing))


def stats_from_logits(logits, target, *, class_weight=None, logit_scale=1.0, softcap=None, smoothing=False,
                      entropy=False, argmax=False, config=None, combine_config=None):
    """(lse, target_gap, log_sum, weighted_z_sum or None) per row of stored raw logits [N, V], which stay as
    they are: logit_partials, then combine_partials (cuda_stats_from_logits; the gap is max - z_target and
    log_sum is lse - max, both without cancellation); with ``entropy`` or ``argmax`` also (entropy or None,
    argmax or None). ``config`` tiles the pass over the logits."""
    N, V = logits.shape
    cfg = _config(_logit_partials, logits, config)
    common = dict(_transform_args(logits, logit_scale, softcap, smoothing), has_entropy=int(entropy),
                  has_argmax=int(argmax))
    segments = triton.cdiv(V, cfg.block)
    partials = torch.empty(4, N, segments, dtype=torch.float32, device=logits.device)
    arg = torch.empty(N, segments, dtype=torch.int64, device=logits.device)
    _launch(_logit_partials,
            dict(cw_ptr=_placeholder(target, class_weight), pm_ptr=partials[0], ps_ptr=partials[1],
                 pw_ptr=partials[2], pe_ptr=partials[3], pa_ptr=arg, N=N, V=V, segments=segments,
                 has_class_weight=int(class_weight is not None), **common),
            **_tile_meta(cfg, logits), EXTRAS=entropy or argmax, TRANSFORMS=softcap is not None or smoothing)
    cfg = _config(_combine_partials, logits, combine_config)
    stats = torch.empty(5, N, dtype=torch.float32, device=logits.device)
    am = torch.empty(N, dtype=torch.int64, device=logits.device)
    _launch(_combine_partials,
            dict(pm_ptr=partials[0], ps_ptr=partials[1], pw_ptr=partials[2], pe_ptr=partials[3], pa_ptr=arg,
                 tgt_ptr=target, lse_ptr=stats[0], gap_ptr=stats[1], ls_ptr=stats[2], wz_ptr=stats[3],
                 ent_ptr=stats[4], am_ptr=am, N=N, segments=segments, **common),
            BLOCK_R=cfg.rows, BLOCK=cfg.block, FAST_TANH=_fast_tanh(logits), num_warps=cfg.num_warps,
            EXTRAS=entropy or argmax)
    out = (stats[0], stats[1], stats[2], stats[3] if smoothing else None)
    if not (entropy or argmax):
        return out
    return out + (stats[4] if entropy else None, am if argmax else None)


def softmax_grad(logits, target, lse, alpha, alpha_lse, beta, gamma, *, col_offset=0, class_weight=None,
                 logit_scale=1.0, softcap=None, smoothing=False, alpha_z=None, filter_mask=None, filter_eps=0.0,
                 config=None):
    """Stored raw logits of columns [col_offset, col_offset + V) become their gradient in place, given the rows'
    lse (cuda_softmax_grad); ``class_weight`` is the slice's own ([V]). With ``smoothing`` False, gamma is taken
    as zero. ``filter_mask`` (zeros [cdiv(N, tile rows), cdiv(V, tile cols)] int32, grad_tile_mask's tiles): also
    marks the tiles live at ``filter_eps`` (the flavor filter)."""
    N, V = logits.shape
    cfg = _config(_softmax_grad, logits, config)
    tile = _config(_grad_tile_mask, logits)
    segments = triton.cdiv(V, cfg.block)
    filtered = filter_mask is not None
    _launch(_softmax_grad,
            dict(cw_ptr=_placeholder(target, class_weight), tgt_ptr=target, lse_ptr=lse, alpha_ptr=alpha,
                 alpha_lse_ptr=alpha_lse, beta_ptr=beta, gamma_ptr=gamma, alpha_z_ptr=_placeholder(alpha, alpha_z),
                 N=N, V=V, segments=segments, col_offset=col_offset, has_class_weight=int(class_weight is not None),
                 mask_ptr=filter_mask if filtered else torch.empty(1, dtype=torch.int32, device=logits.device),
                 mask_cols=filter_mask.shape[1] if filtered else 0,
                 filter_scale=float(filter_eps * abs(logit_scale)),
                 **_transform_args(logits, logit_scale, softcap, smoothing)),
            **_tile_meta(cfg, logits), ALPHA_Z=alpha_z is not None, TRANSFORMS=softcap is not None or smoothing,
            FILTER=filtered, FILTER_ROWS=tile.block_n, FILTER_COLS=tile.block_v)  # fmt: skip
    return logits


def scale_(g, scale, *, config=None, programs=None):
    """g *= scale in place (g contiguous; scale a one-element float32 tensor); nothing when scale is 1."""
    cfg = _config(_scale, g, config)
    if programs is None:
        programs = 4 * torch.cuda.get_device_properties(g.device).multi_processor_count if g.is_cuda else 4
    _launch(_scale, dict(g_ptr=g, scale_ptr=scale, numel=g.numel()), programs, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return g


def prepare_rows(target, V, ignore_index, *, class_weight=None, label_smoothing=0.0, z_loss=0.0, mean=True,
                 coefficients=False, order=False, config=None):
    """(target with -1 where ignored, target weight, totals [sum wt, #valid, sum cw], #bad, #counted, coefficients
    or None, the rows counted first (csrc/targets.h) or None)."""
    N = target.shape[0]
    cfg = _config(_prepare_rows, target, config)
    f32 = dict(dtype=torch.float32, device=target.device)
    tgt_out = torch.empty_like(target)
    wt = torch.empty(N, **f32)
    totals = torch.empty(len(_prepare_rows.TOTALS), **f32)
    counts = torch.empty(len(_prepare_rows.COUNTS), dtype=torch.int32, device=target.device)
    coef = torch.empty(4, N, **f32) if coefficients else torch.empty(4, 1, **f32)
    rows = torch.empty(N if order else 1, dtype=torch.int64, device=target.device)
    _launch(_prepare_rows,
            dict(tgt_ptr=target, cw_ptr=_placeholder(target, class_weight), tgt_out_ptr=tgt_out, wt_ptr=wt,
                 totals_ptr=totals, counts_ptr=counts, alpha_ptr=coef[0], alpha_lse_ptr=coef[1], beta_ptr=coef[2],
                 gamma_ptr=coef[3], order_ptr=rows, N=N, V=V, ignore_index=ignore_index,
                 label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                 has_class_weight=int(class_weight is not None), mean=int(mean), write_coefficients=int(coefficients),
                 write_order=int(order)),
            BLOCK=cfg.block, num_warps=cfg.num_warps)
    values = counts.tolist()  # (one read of the device)
    bad, counted = (values[_prepare_rows.COUNTS.index(name)] for name in ("bad", "counted"))
    return tgt_out, wt, totals, bad, counted, (tuple(coef) if coefficients else None), (rows if order else None)


def assemble_loss(lse, target_gap, log_sum, weighted_z_sum, target, wt, totals, V, *, label_smoothing=0.0,
                  z_loss=0.0, reduction="mean", config=None):
    """The loss from row statistics (stats_from_logits'; target: -1 where ignored; wt and totals from
    prepare_rows)."""
    N = lse.shape[0]
    cfg = _config(_assemble_loss, lse, config)
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    loss = torch.empty(N if code == 0 else 1, dtype=torch.float32, device=lse.device)
    smoothing = weighted_z_sum is not None
    _launch(_assemble_loss,
            dict(lse_ptr=lse, gap_ptr=target_gap, ls_ptr=log_sum, wz_ptr=_placeholder(lse, weighted_z_sum),
                 tgt_ptr=target, wt_ptr=wt, totals_ptr=totals, loss_ptr=loss, N=N, V=V,
                 label_smoothing=float(label_smoothing), z_loss=float(z_loss), has_smoothing=int(smoothing),
                 reduction=code),
            BLOCK=cfg.block, num_warps=cfg.num_warps)
    return loss if code == 0 else loss[0]


def distill_rows(stage, zs, zt, stats, coef, target, *, divergence, beta=0.0, temperature=1.0, hard=False,
                 logit_scale=1.0, softcap=None, teacher_logit_scale=1.0, teacher_softcap=None, config=None):
    """One stage of the distillation loss over a block of stored raw logits (csrc/distillation_cuda.cpp): zs, zt
    [N, V] (zt None: the teacher's top k), stats [9, N] and coef [2, N] float32, target [N] int64 (this shard's
    column or -1). Stage 2 turns zs into its gradient in place."""
    N, V = zs.shape
    cfg = _config(_distill_rows, zs, config)
    has_teacher = zt is not None
    zt = zs if zt is None else zt
    _launch(_distill_rows,
            dict(zs_ptr=zs, zt_ptr=zt, stats_ptr=stats, coef_ptr=coef, tgt_ptr=target, N=N, V=V,
                 stride_s=zs.stride(0), stride_t=zt.stride(0), inv_t=1.0 / temperature, s_scale=float(logit_scale),
                 s_softcap=float(softcap or 1.0), t_scale=float(teacher_logit_scale),
                 t_softcap=float(teacher_softcap or 1.0), log_1mb=math.log1p(-beta) if beta < 1 else 0.0,
                 log_b=math.log(beta) if beta > 0 else 0.0, stage=stage, divergence=divergence,
                 has_teacher=int(has_teacher), hard=int(hard), has_s_softcap=int(softcap is not None),
                 has_t_softcap=int(teacher_softcap is not None)),
            BLOCK=cfg.block, num_warps=cfg.num_warps, FAST_TANH=_fast_tanh(zs))
    return zs



def _grad_tile_meta(cfg, g):
    return dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, BLOCK_K=cfg.block_k,
                DOT_PRECISION=configs.dot_precision(_DTYPES[g.dtype]), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def grad_tile_mask(g, threshold, target, *, config=None):
    """int32 [cdiv(N, block_n), cdiv(V, block_v)]: 1 where a tile of the gradient block g [N, V] has an entry other
    than its row's target (-1: none) at or above its row's threshold (cuda_grad_tile_mask)."""
    cfg = _config(_grad_tile_mask, g, config)
    N, V = g.shape
    mask = torch.empty(triton.cdiv(N, cfg.block_n), triton.cdiv(V, cfg.block_v), dtype=torch.int32, device=g.device)
    _launch(_grad_tile_mask, dict(g_ptr=g, thr_ptr=threshold, tgt_ptr=target, mask_ptr=mask, N=N, V=V,
                                  stride_gn=g.stride(0), mask_cols=mask.shape[1]),
            **_grad_tile_meta(cfg, g))
    return mask


def live_tiles(mask):
    """(indices, counts) of each row of a tile mask: its live columns first (int32), and how many."""
    order = torch.sort(mask, dim=1, descending=True, stable=True).indices.to(torch.int32)
    return order.contiguous(), mask.sum(1, dtype=torch.int32)


def join_row_tiles(mask, factor):
    """A tile mask whose row tiles are `factor` of mask's, live where any of them is (filtered_grads.cpp)."""
    if factor == 1:
        return mask
    rows = -(-mask.shape[0] // factor)
    padded = torch.nn.functional.pad(mask, (0, 0, 0, rows * factor - mask.shape[0]))
    return padded.view(rows, factor, mask.shape[1]).amax(1).contiguous()


def sparse_grad_input(g, w, mask, *, alpha=1.0, splits=1, tile_rows=None, config=None):
    """float32 [N, D]: alpha * g @ w over the tiles of g the mask marks live (the others read as zero), each row
    tile's live list summed in `splits` parts. The mask's tiles are `tile_rows` rows (by default grad_tile_mask's);
    the kernel's row tiles join block_n // tile_rows of them."""
    cfg = _config(_sparse_grad_input, g, config)
    tile_rows = tile_rows or _config(_grad_tile_mask, g).block_n
    N, V = g.shape
    out = torch.empty(splits, N, w.shape[1], dtype=torch.float32, device=g.device)
    live, count = live_tiles(join_row_tiles(mask, cfg.block_n // tile_rows))
    _launch(_sparse_grad_input, dict(g_ptr=g, w_ptr=w, out_ptr=out, live_ptr=live, count_ptr=count, N=N, V=V,
                                     D=w.shape[1], stride_gn=g.stride(0), stride_wv=w.stride(0),
                                     stride_os=out.stride(0), stride_on=out.stride(1), live_cols=live.shape[1],
                                     splits=splits, alpha=float(alpha)),
            **_grad_tile_meta(cfg, g))
    return out.sum(0)


def sparse_grad_weight_(acc, g, x, mask, *, alpha=1.0, accumulate=True, config=None):
    """acc [V, D] (+)= alpha * g.T @ x over the tiles of g the mask marks live (accumulate False: written, a tile with
    none live zeroed); acc float32, or in g's dtype (the flavor in_dtype); returns acc."""
    cfg = _config(_sparse_grad_weight, g, config)
    N, V = g.shape
    live, count = live_tiles(mask.t())
    in_dtype = acc.dtype != torch.float32
    _launch(_sparse_grad_weight, dict(g_ptr=g, x_ptr=x, acc_ptr=g if in_dtype else acc,
                                      out_ptr=acc if in_dtype else g, live_ptr=live, count_ptr=count, N=N, V=V,
                                      D=x.shape[1], stride_gn=g.stride(0), stride_xn=x.stride(0),
                                      stride_an=acc.stride(0), live_rows=live.shape[1], alpha=float(alpha),
                                      accumulate=int(accumulate)),
            IN_DTYPE=in_dtype, **_grad_tile_meta(cfg, g))
    return acc
