"""dX of a block from its gradient's live tiles: ``out[s] = alpha * G[:, live_s] @ W[live_s]`` per row tile.

G [N, V] (a block's logit gradient), W [V, D]. Each row tile's live vocabulary tiles (``live_ptr``: row m's live tile
indices first, ``count_ptr``: how many; from grad_tile_mask.py's mask) are split in ``splits`` consecutive parts (a
block has few row tiles: the parts fill the GPU); each program computes a BLOCK_N x BLOCK_D tile of one part's sum
``out[s]`` (float32 [splits, N, D], summed by the caller), skipping the dead tiles (grad_filter_eps).

One loop over (live tile, BLOCK_K-wide slice of it): a GEMM's K loop whose steps are gathered from the live list, so
that the software pipeline keeps its loads in flight across tiles as over a dense K (wgmma-sized tiles: GEMM-rate
products over the live tiles, not one short product per tile).
"""
import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "sparse_grad_input",
    params=(
        ("g_ptr", "*T"), ("w_ptr", "*T"), ("out_ptr", "*fp32"), ("live_ptr", "*i32"), ("count_ptr", "*i32"),
        ("N", "i64"), ("V", "i64"), ("D", "i64"), ("stride_gn", "i64"), ("stride_wv", "i64"), ("stride_os", "i64"),
        ("stride_on", "i64"), ("live_cols", "i64"), ("splits", "i64"), ("alpha", "fp32"),
    ),
    family="grad_tiles",
    grid="cdiv(N, ROWS) * cdiv(D, DEPTH) * splits",
    divisible_by_16=frozenset({"g_ptr", "w_ptr", "stride_gn", "stride_wv", "D", "V"}),
)


@triton.jit
def sparse_grad_input_kernel(
    g_ptr, w_ptr, out_ptr, live_ptr, count_ptr,
    N, V, D, stride_gn, stride_wv, stride_os, stride_on,
    live_cols, splits, alpha,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    STEPS: tl.constexpr = BLOCK_V // BLOCK_K  # K steps per live tile
    pid = tl.program_id(0)
    d_tiles = tl.cdiv(D, BLOCK_D)
    s = pid % splits
    tile = pid // splits
    m = tile // d_tiles
    n = tile % d_tiles
    rows = m.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    dcols = n.to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < N
    d_mask = dcols < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    steps = tl.load(count_ptr + m) * STEPS
    per_split = tl.cdiv(tl.cdiv(steps, splits), STEPS) * STEPS  # whole tiles per part
    live_row = live_ptr + m.to(tl.int64) * live_cols
    for j in range(s * per_split, tl.minimum(steps, (s + 1) * per_split)):
        k = tl.load(live_row + j // STEPS).to(tl.int64)
        cols = k * BLOCK_V + (j % STEPS) * BLOCK_K + tl.arange(0, BLOCK_K)
        col_mask = cols < V
        g = tl.load(g_ptr + rows[:, None] * stride_gn + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wv + dcols[None, :], mask=col_mask[:, None] & d_mask[None, :],
                    other=0.0)
        acc = tl.dot(g, w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + s.to(tl.int64) * stride_os + rows[:, None] * stride_on + dcols[None, :], acc * alpha,
             mask=row_mask[:, None] & d_mask[None, :])
