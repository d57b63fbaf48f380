"""Which tiles of a block of logit gradients hold an entry at or above its row's threshold (grad_filter_eps).

Over a block's gradient G [N, V] (softmax_grad's output, in place of the logits), each program reads one
BLOCK_N x BLOCK_V tile and writes 1 to its entry of ``mask`` [cdiv(N, BLOCK_N), mask_cols] where some nonzero
entry other than its row's target has ``|G| >= thr`` (the row's threshold: grad_filter_eps times the row's
coefficient of the probability, csrc/filtered_grads.cpp; a row whose coefficient is 0 has no nonzero entry), else
0. The products over G (sparse_grad_input.py, sparse_grad_weight.py) then skip the tiles marked 0; the targets'
entries of those tiles are added apart. softmax_grad.py's flavor filter gives the same answer in its own pass.
"""
import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "grad_tile_mask",
    params=(
        ("g_ptr", "*T"), ("thr_ptr", "*fp32"), ("tgt_ptr", "*i64"), ("mask_ptr", "*i32"),
        ("N", "i64"), ("V", "i64"), ("stride_gn", "i64"), ("mask_cols", "i64"),
    ),
    family="grad_tiles",
    grid="cdiv(N, ROWS) * cdiv(V, COLS)",
    divisible_by_16=frozenset({"g_ptr", "stride_gn", "V"}),
)


@triton.jit
def grad_tile_mask_kernel(
    g_ptr, thr_ptr, tgt_ptr, mask_ptr,
    N, V, stride_gn, mask_cols,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(V, BLOCK_V)
    m = pid // col_tiles
    k = pid % col_tiles
    cols = k.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    live = 0
    for r in tl.static_range(0, BLOCK_N, BLOCK_K):  # the tile in slices of BLOCK_K rows (registers)
        rows = m.to(tl.int64) * BLOCK_N + r + tl.arange(0, BLOCK_K)
        row_mask = rows < N
        g = tl.load(g_ptr + rows[:, None] * stride_gn + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        thr = tl.load(thr_ptr + rows, mask=row_mask, other=float("inf"))
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
        above = (tl.abs(g) >= thr[:, None]) & (g != 0.0) & (cols[None, :] != tgt[:, None])
        live = tl.maximum(live, tl.max(tl.max(above.to(tl.int32), axis=1), axis=0))
    tl.store(mask_ptr + m.to(tl.int64) * mask_cols + k, live)
