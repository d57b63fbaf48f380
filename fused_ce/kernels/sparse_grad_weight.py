"""dW of a block from its gradient's live tiles: ``dW[v] (+)= alpha * G[live, v].T @ X[live]`` per vocabulary tile.

G [N, V] (a block's logit gradient), X [N, D] (its rows). dW [V, D] sums over the row blocks in the plan's dW dtype
(csrc/strategies.cpp): in float32 (``acc_ptr``), or in the input dtype (``out_ptr``, the flavor IN_DTYPE: each
block's sum rounded once, as cuBLAS's accumulating GEMM does on the exact path). Each program sums a BLOCK_V x
BLOCK_D tile over the row tiles its vocabulary tile lists as live (``live_ptr``: tile k's live row tiles first,
``count_ptr``: how many; from grad_tile_mask.py's mask, transposed) and adds it to dW's tile (``accumulate`` 1) or
writes it there (0: the first block; a tile with no live row tile then writes zeros).

One loop over (live row tile, BLOCK_K rows of it), as sparse_grad_input.py's: a GEMM's K loop gathered from the
live list.
"""
import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "sparse_grad_weight",
    params=(
        ("g_ptr", "*T"), ("x_ptr", "*T"), ("acc_ptr", "*fp32"), ("out_ptr", "*T"), ("live_ptr", "*i32"),
        ("count_ptr", "*i32"), ("N", "i64"), ("V", "i64"), ("D", "i64"), ("stride_gn", "i64"), ("stride_xn", "i64"),
        ("stride_an", "i64"), ("live_rows", "i64"), ("alpha", "fp32"), ("accumulate", "i32"),
    ),
    family="grad_tiles",
    grid="cdiv(V, COLS) * cdiv(D, DEPTH)",
    divisible_by_16=frozenset({"g_ptr", "x_ptr", "stride_gn", "stride_xn", "D", "V"}),
    flavors=(("in_dtype", (("IN_DTYPE", True),)),),
)


@triton.jit
def sparse_grad_weight_kernel(
    g_ptr, x_ptr, acc_ptr, out_ptr, live_ptr, count_ptr,
    N, V, D, stride_gn, stride_xn, stride_an,
    live_rows, alpha, accumulate,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IN_DTYPE: tl.constexpr,
):
    STEPS: tl.constexpr = BLOCK_N // BLOCK_K  # K steps per live row tile
    pid = tl.program_id(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    k = pid // d_tiles
    n = pid % d_tiles
    count = tl.load(count_ptr + k)
    if accumulate != 0 and count == 0:
        return
    cols = k.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    dcols = n.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < V
    d_mask = dcols < D
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    live_col = live_ptr + k.to(tl.int64) * live_rows
    for j in range(0, count * STEPS):
        m = tl.load(live_col + j // STEPS).to(tl.int64)
        rows = m * BLOCK_N + (j % STEPS) * BLOCK_K + tl.arange(0, BLOCK_K)
        row_mask = rows < N
        g = tl.load(g_ptr + rows[:, None] * stride_gn + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xn + dcols[None, :], mask=row_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(g), x, acc, input_precision=DOT_PRECISION)
    acc = acc * alpha
    offsets = cols[:, None] * stride_an + dcols[None, :]
    out_mask = col_mask[:, None] & d_mask[None, :]
    if IN_DTYPE:
        if accumulate != 0:
            acc += tl.load(out_ptr + offsets, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        if accumulate != 0:
            acc += tl.load(acc_ptr + offsets, mask=out_mask, other=0.0)
        tl.store(acc_ptr + offsets, acc, mask=out_mask)
