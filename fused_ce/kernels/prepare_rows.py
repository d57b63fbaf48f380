"""Prologue stage: the per-row quantities every later stage needs, in one launch.

For each row: the target with ignored rows as -1, the target's class weight (1
without class weights; 0 where ignored) and whether the class index is out of
range; over all rows: the summed weights, the number of counted rows, the number
of bad class indices and the sum of the class weights. With ``write_order``, the
rows in the order the executors take them (csrc/targets.h): the counted ones
ascending, then the ignored (and bad) ones ascending. With
``write_coefficients``, also the logit-gradient coefficients of a scalar loss
for an upstream gradient of 1 (see GradCoefficients in csrc/problem.h):
``alpha = g_ce * ((1 - eps) * wt + eps / V * sum(cw) * valid)``,
``alpha_lse = 2 * z_loss * g_z * valid``, ``beta = g_ce * (1 - eps) * wt``,
``gamma = g_ce * eps / V * valid`` (exactly 0 where a row is not counted, and the smoothing terms only with
label smoothing: a non-finite class weight or weight sum must not reach other rows), with ``g_ce = 1 / sum(wt)`` and
``g_z = 1 / #valid`` for 'mean' (both 0 when nothing is counted; a zero sum(wt) of counted rows gives
inf, as torch's division does), 1 for 'sum'.

One program walks all rows (twice with coefficients): the sums come out in a
fixed order, so they are deterministic, and the op's first call needs no ATen
kernels for this bookkeeping (each one's first launch costs milliseconds).
"""
import triton
import triton.language as tl

from .spec import KernelSpec


@triton.jit
def _targets(tgt_ptr, cw_ptr, rows, N, V, ignore_index, has_class_weight):
    in_range = rows < N
    t = tl.load(tgt_ptr + rows, mask=in_range, other=ignore_index)
    ignored = t == ignore_index
    bad = (t < 0) | (t >= V)
    bad = bad & ~ignored & in_range
    valid = ~ignored & ~bad & in_range
    if has_class_weight:
        w = tl.load(cw_ptr + tl.where(valid, t, 0), mask=valid, other=0.0).to(tl.float32)
    else:
        w = valid.to(tl.float32)
    return tl.where(valid, t, -1), w, valid, bad, in_range

# The arrays of totals and counts it writes, entry by entry (assemble_loss reads the totals; csrc reads both back by
# these names: PrepareRowsArgs::Totals and ::Counts in kernel_args.h).
TOTALS = ("target_weight_sum", "counted", "class_weight_sum")
COUNTS = ("bad", "counted")
TARGET_WEIGHT_SUM = tl.constexpr(TOTALS.index("target_weight_sum"))
COUNTED = tl.constexpr(TOTALS.index("counted"))
CLASS_WEIGHT_SUM = tl.constexpr(TOTALS.index("class_weight_sum"))
BAD_TARGETS = tl.constexpr(COUNTS.index("bad"))
COUNTED_TARGETS = tl.constexpr(COUNTS.index("counted"))

SPEC = KernelSpec(
    "prepare_rows",
    params=(
        ("tgt_ptr", "*i64"), ("cw_ptr", "*fp32"), ("tgt_out_ptr", "*i64"), ("wt_ptr", "*fp32"),
        ("totals_ptr", "*fp32"), ("counts_ptr", "*i32"),
        ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"), ("gamma_ptr", "*fp32"),
        ("order_ptr", "*i64"),
        ("N", "i64"), ("V", "i64"), ("ignore_index", "i64"), ("label_smoothing", "fp32"), ("z_loss", "fp32"),
        ("has_class_weight", "i32"), ("mean", "i32"), ("write_coefficients", "i32"), ("write_order", "i32"),
    ),
    family="rows",
    grid="1",
    dtypes=("fp32",),  # float32 and int64 arguments whatever the inputs
    layouts=("general",),
    arrays=(("totals_ptr", TOTALS), ("counts_ptr", COUNTS)),
)


@triton.jit
def prepare_rows_kernel(
    tgt_ptr, cw_ptr, tgt_out_ptr, wt_ptr, totals_ptr, counts_ptr,
    alpha_ptr, alpha_lse_ptr, beta_ptr, gamma_ptr,
    order_ptr,
    N, V, ignore_index,
    label_smoothing, z_loss,
    has_class_weight, mean, write_coefficients, write_order,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    cw_acc = tl.zeros((BLOCK,), tl.float32)
    if has_class_weight:
        for c0 in range(0, V, BLOCK):
            cols = c0 + offs
            cw_acc += tl.load(cw_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
    w_acc = tl.zeros((BLOCK,), tl.float32)
    valid_acc = tl.zeros((BLOCK,), tl.int32)
    bad_acc = tl.zeros((BLOCK,), tl.int32)
    for r0 in range(0, N, BLOCK):
        rows = r0 + offs
        t, w, valid, bad, in_range = _targets(tgt_ptr, cw_ptr, rows, N, V, ignore_index, has_class_weight)
        tl.store(tgt_out_ptr + rows, t, mask=in_range)
        tl.store(wt_ptr + rows, w, mask=in_range)
        w_acc += w
        valid_acc += valid.to(tl.int32)
        bad_acc += bad.to(tl.int32)
    w_sum = tl.sum(w_acc, axis=0)
    n_valid = tl.sum(valid_acc, axis=0).to(tl.float32)
    if has_class_weight:
        cw_sum = tl.sum(cw_acc, axis=0)
    else:
        cw_sum = tl.cast(V, tl.float32)
    tl.store(totals_ptr + TARGET_WEIGHT_SUM, w_sum)
    tl.store(totals_ptr + COUNTED, n_valid)
    tl.store(totals_ptr + CLASS_WEIGHT_SUM, cw_sum)
    n_counted = tl.sum(valid_acc, axis=0)
    tl.store(counts_ptr + BAD_TARGETS, tl.sum(bad_acc, axis=0))
    tl.store(counts_ptr + COUNTED_TARGETS, n_counted)

    if write_coefficients:
        # torch's 'mean': divided by the signed sum of the counted weights (0 gives inf, so NaN gradients);
        # nothing counted: gradients 0
        g_ce = tl.where(mean != 0, tl.where(n_valid > 0, 1.0 / w_sum, 0.0), 1.0)
        g_z = tl.where(mean != 0, tl.where(n_valid > 0, 1.0 / n_valid, 0.0), 1.0)
        eps = label_smoothing
        smooth = eps / tl.cast(V, tl.float32)
        for r0 in range(0, N, BLOCK):
            rows = r0 + offs
            t, w, valid, bad, in_range = _targets(tgt_ptr, cw_ptr, rows, N, V, ignore_index, has_class_weight)
            smoothing = eps > 0  # 0 * an infinite class-weight sum would be NaN
            alpha = g_ce * (1.0 - eps) * w + tl.where(smoothing, g_ce * smooth * cw_sum, 0.0)
            gamma = tl.where(smoothing, g_ce * smooth, 0.0) + tl.zeros((BLOCK,), tl.float32)
            tl.store(alpha_ptr + rows, tl.where(valid, alpha, 0.0), mask=in_range)
            tl.store(alpha_lse_ptr + rows, tl.where(valid, 2.0 * z_loss * g_z, 0.0), mask=in_range)
            tl.store(beta_ptr + rows, tl.where(valid, g_ce * (1.0 - eps) * w, 0.0), mask=in_range)
            tl.store(gamma_ptr + rows, tl.where(valid, gamma, 0.0), mask=in_range)

    if write_order:
        counted_seen = 0
        ignored_seen = 0
        for r0 in range(0, N, BLOCK):
            rows = r0 + offs
            t, w, valid, bad, in_range = _targets(tgt_ptr, cw_ptr, rows, N, V, ignore_index, has_class_weight)
            c = valid.to(tl.int32)
            i = (in_range & ~valid).to(tl.int32)
            position = tl.where(valid, counted_seen + tl.cumsum(c, axis=0) - 1,
                                n_counted + ignored_seen + tl.cumsum(i, axis=0) - 1)
            tl.store(order_ptr + position, rows, mask=in_range)
            counted_seen += tl.sum(c, axis=0)
            ignored_seen += tl.sum(i, axis=0)
