"""Epilogue stage: the loss from the row statistics, in one launch.

Per counted row (torch's semantics for class weights and label smoothing; an
ignored row contributes exactly 0): ``(1 - eps) * wt * (gap + log_sum)`` with
``gap = max - z_target`` and ``log_sum = lse - max`` (no cancellation between
large numbers), ``+ eps / V * (sum(cw) * lse - sum_c cw_c z_c) + z_loss * lse^2``;
``reduction`` 0 writes it per row, 2 sums it, 1 ('mean') divides the
cross-entropy and smoothing parts, each on its own, by the summed target weights
and the z-loss part by the number of counted rows (NaN when nothing is counted,
like torch). One program, rows in a fixed order: deterministic.
"""
import triton
import triton.language as tl

from .prepare_rows import CLASS_WEIGHT_SUM, COUNTED, TARGET_WEIGHT_SUM, TOTALS
from .spec import KernelSpec

SPEC = KernelSpec(
    "assemble_loss",
    params=(
        ("lse_ptr", "*fp32"), ("gap_ptr", "*fp32"), ("ls_ptr", "*fp32"), ("wz_ptr", "*fp32"),
        ("tgt_ptr", "*i64"), ("wt_ptr", "*fp32"), ("totals_ptr", "*fp32"), ("loss_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("label_smoothing", "fp32"), ("z_loss", "fp32"),
        ("has_smoothing", "i32"), ("reduction", "i32"),
    ),
    family="rows",
    grid="1",
    dtypes=("fp32",),  # float32 arguments whatever the inputs
    layouts=("general",),
    arrays=(("totals_ptr", TOTALS),),  # (prepare_rows')
)


@triton.jit
def assemble_loss_kernel(
    lse_ptr, gap_ptr, ls_ptr, wz_ptr, tgt_ptr, wt_ptr, totals_ptr, loss_ptr,
    N, V,
    label_smoothing, z_loss,
    has_smoothing, reduction,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    eps = label_smoothing
    cw_sum = tl.load(totals_ptr + CLASS_WEIGHT_SUM)
    ce_acc = tl.zeros((BLOCK,), tl.float32)
    smooth_acc = tl.zeros((BLOCK,), tl.float32)
    z_acc = tl.zeros((BLOCK,), tl.float32)
    for r0 in range(0, N, BLOCK):
        rows = r0 + offs
        in_range = rows < N
        lse = tl.load(lse_ptr + rows, mask=in_range, other=0.0)
        w = tl.load(wt_ptr + rows, mask=in_range, other=0.0)
        counted = tl.load(tgt_ptr + rows, mask=in_range, other=-1) >= 0
        # an ignored row contributes exactly 0, whatever its logits (NaN or inf included), as in torch
        gap = tl.load(gap_ptr + rows, mask=in_range, other=0.0)
        log_sum = tl.load(ls_ptr + rows, mask=in_range, other=0.0)
        ce = tl.where(counted, (1.0 - eps) * w * (gap + log_sum), 0.0)
        smooth = tl.zeros((BLOCK,), tl.float32)
        if has_smoothing:
            wz = tl.load(wz_ptr + rows, mask=in_range, other=0.0)
            smooth = tl.where(counted, eps / tl.cast(V, tl.float32) * (cw_sum * lse - wz), 0.0)
        z = tl.where(counted, z_loss * lse * lse, 0.0)
        if reduction == 0:
            tl.store(loss_ptr + rows, ce + smooth + z, mask=in_range)
        else:
            ce_acc += tl.where(in_range, ce, 0.0)
            smooth_acc += tl.where(in_range, smooth, 0.0)
            z_acc += tl.where(in_range, z, 0.0)
    if reduction != 0:
        ce_total = tl.sum(ce_acc, axis=0)
        smooth_total = tl.sum(smooth_acc, axis=0)
        z_total = tl.sum(z_acc, axis=0)
        if reduction == 1:  # torch divides each term by the weight sum on its own (0/0 stays NaN)
            ce_total = ce_total / tl.load(totals_ptr + TARGET_WEIGHT_SUM)
            smooth_total = smooth_total / tl.load(totals_ptr + TARGET_WEIGHT_SUM)
            z_total = z_total / tl.load(totals_ptr + COUNTED)
        if has_smoothing:
            ce_total += smooth_total
        if z_loss > 0:
            ce_total += z_total
        tl.store(loss_ptr, ce_total)
