"""dX of a block from its gradient's live tiles: ``out = alpha * G[:, live] @ W[live]`` per row tile.

G [N, V] (a block's logit gradient), W [V, D]. Each program computes a BLOCK_N x BLOCK_D tile of ``out``
(float32 [N, D]) from the vocabulary tiles its row tile lists as live (``live_ptr``: row m's live tile indices
first, ``count_ptr``: how many; from grad_tile_mask.py's mask), skipping the others (grad_filter_eps).
"""
import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "sparse_grad_input",
    params=(
        ("g_ptr", "*T"), ("w_ptr", "*T"), ("out_ptr", "*fp32"), ("live_ptr", "*i32"), ("count_ptr", "*i32"),
        ("N", "i64"), ("V", "i64"), ("D", "i64"), ("stride_gn", "i64"), ("stride_wv", "i64"), ("stride_on", "i64"),
        ("live_cols", "i64"), ("alpha", "fp32"),
    ),
    family="grad_tiles",
    grid="cdiv(N, ROWS) * cdiv(D, DEPTH)",
    divisible_by_16=frozenset({"g_ptr", "w_ptr", "stride_gn", "stride_wv", "D"}),
)


@triton.jit
def sparse_grad_input_kernel(
    g_ptr, w_ptr, out_ptr, live_ptr, count_ptr,
    N, V, D, stride_gn, stride_wv, stride_on,
    live_cols, alpha,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    m = pid // d_tiles
    n = pid % d_tiles
    rows = m.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    dcols = n.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    d_mask = dcols < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    count = tl.load(count_ptr + m)
    for i in range(0, count):
        k = tl.load(live_ptr + m.to(tl.int64) * live_cols + i).to(tl.int64)
        cols = k * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < V
        g = tl.load(g_ptr + rows[:, None] * stride_gn + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wv + dcols[None, :], mask=col_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc = tl.dot(g, w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + rows[:, None] * stride_on + dcols[None, :], acc * alpha,
             mask=row_mask[:, None] & d_mask[None, :])
