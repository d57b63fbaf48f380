"""The three GEMMs of a row block as one persistent TMA kernel (issue 13, lead 2: milestone one).

C[M, N] = op(A) @ op(B), or C += op(A) @ op(B) with ACCUMULATE, every operand row-major in memory:
- logits: Z = X @ W.T         A = X [rows, D],            B = W [V, D] read transposed (B_T);
- dX:     dX = G @ W          A = G [rows, V],            B = W [V, D];
- dW:     dW (+)= G.T @ X     A = G [rows, V] read transposed (A_T), B = X [rows, D], C float32 or the input dtype.
Each program walks output tiles in steps of the grid (persistent: one wave, the next tile's loads issued
while the current one's epilogue runs), grouped along M so that consecutive tiles share B's columns in L2.
Operands and C move through tensor descriptors made on the device (TMA): out-of-bounds parts of a tile
read as zeros and are not written, so no shape needs to divide the tiles; each descriptor's row stride must
be a multiple of 16 bytes. Accumulation is float32.

For the logits (STATS), the epilogue also adds the bias, and writes per row of each stored piece of the
tile (BLOCK_N columns, or half of them with SPLIT_EPILOGUE) what logit_partials.py would read back from
it: the max, the sum of exp(z - max) and, for label smoothing, the (class-weighted) sum of the transformed
stored logits z = softcap(logit_scale * logit). combine_partials.py takes them as they are, and the pass
that logit_partials makes over the stored logits is gone.

A JIT candidate only (``jit.gemm``, ``jit.logits_with_partials``; ``benchmarks/tune.py --parts gemm``
times them against torch.mm and torch.mm + logit_partials at the plan's shapes). Measured on the H200
(benchmarks/NOTES.md, step 21): logits at torch.mm's rate, dX too except at B (no split-K), dW 5-10% behind;
the statistics epilogue costs more than the pass it removes, since without warp specialisation on sm_90 it
runs while the tensor cores idle. So it is not in the AOT build (configs.KERNELS) or the plan; device-side
descriptors would also need a global scratch buffer per program, which the AOT launcher does not allocate.
"""

import triton
import triton.language as tl

from .spec import KernelSpec
from .tile import softcap_tanh

SPEC = KernelSpec(
    "gemm",
    params=(
        ("a_ptr", "*T"), ("b_ptr", "*T"), ("c_ptr", "*T"), ("bias_ptr", "*T"), ("cw_ptr", "*fp32"),
        ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"),
        ("M", "i32"), ("N", "i32"), ("K", "i32"), ("lda", "i64"), ("ldb", "i64"), ("ldc", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ),
    family="tma_gemm",
    divisible_by_16=frozenset({"a_ptr", "b_ptr", "c_ptr"}),
    layouts=("aligned",),
)


@triton.jit
def finish_piece(acc, c_desc, off_m, off_n, M, N, bias_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr, segments,
                 logit_scale, softcap, has_bias, has_class_weight, has_softcap, has_smoothing,
                 BLOCK_M: tl.constexpr, COLS: tl.constexpr, ACCUMULATE: tl.constexpr, STATS: tl.constexpr,
                 FAST_TANH: tl.constexpr):
    """One BLOCK_M x COLS piece of an output tile: (+ C | + bias), stored in C's dtype; with STATS, the
    partial row statistics of the stored values (one segment per piece). The runtime flags select without
    branching: a branch that yields a tensor inside the flattened tile loop fails triton 3.6's loop fusion."""
    cols = off_n + tl.arange(0, COLS)
    if ACCUMULATE:
        acc += c_desc.load([off_m, off_n]).to(tl.float32)
    acc += tl.load(bias_ptr + cols, mask=cols < tl.where(has_bias != 0, N, 0), other=0.0).to(tl.float32)[None, :]
    out = acc.to(c_desc.dtype)
    c_desc.store([off_m, off_n], out)
    if STATS:
        rows = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        row_mask = rows < tl.where(off_n < N, M, 0)  # a right half wholly past N is no segment
        mask = row_mask[:, None] & (cols < N)[None, :]
        z = out.to(tl.float32) * logit_scale  # the stored (rounded) logits, as the later passes read them
        z = tl.where(has_softcap != 0, softcap * softcap_tanh(z * (1.0 / softcap), FAST_TANH), z)
        m = tl.max(tl.where(mask, z, float("-inf")), axis=1)
        m = tl.where(row_mask, m, 0.0)
        idx = rows * segments + off_n // COLS
        tl.store(pm_ptr + idx, m, mask=row_mask)
        tl.store(ps_ptr + idx, tl.sum(tl.where(mask, tl.exp(z - m[:, None]), 0.0), axis=1), mask=row_mask)
        cw = tl.load(cw_ptr + cols, mask=cols < tl.where(has_class_weight != 0, N, 0), other=1.0).to(tl.float32)
        smoothing_rows = rows < tl.where((off_n < N) & (has_smoothing != 0), M, 0)
        tl.store(pw_ptr + idx, tl.sum(tl.where(mask, z * cw[None, :], 0.0), axis=1), mask=smoothing_rows)


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr,
    M, N, K, lda, ldb, ldc, segments,
    logit_scale, softcap,
    has_bias, has_class_weight, has_softcap, has_smoothing,
    A_T: tl.constexpr, B_T: tl.constexpr, ACCUMULATE: tl.constexpr, STATS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr, FAST_TANH: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[lda, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[ldb, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[ldb, 1], block_shape=[BLOCK_K, BLOCK_N])
    # the epilogue in two column halves: half the shared memory for C, so more of it stays with the pipeline
    C_COLS: tl.constexpr = BLOCK_N // 2 if SPLIT_EPILOGUE else BLOCK_N
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[ldc, 1], block_shape=[BLOCK_M, C_COLS])

    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        off_m = (first_m + tile % group_m) * BLOCK_M
        off_n = (tile % tiles_per_group) // group_m * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            off_k = kt * BLOCK_K
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        if SPLIT_EPILOGUE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            finish_piece(left, c_desc, off_m, off_n, M, N, bias_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr, segments,
                         logit_scale, softcap, has_bias, has_class_weight, has_softcap, has_smoothing,
                         BLOCK_M, C_COLS, ACCUMULATE, STATS, FAST_TANH)
            finish_piece(right, c_desc, off_m, off_n + C_COLS, M, N, bias_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr,
                         segments, logit_scale, softcap, has_bias, has_class_weight, has_softcap, has_smoothing,
                         BLOCK_M, C_COLS, ACCUMULATE, STATS, FAST_TANH)
        else:
            finish_piece(acc, c_desc, off_m, off_n, M, N, bias_ptr, cw_ptr, pm_ptr, ps_ptr, pw_ptr, segments,
                         logit_scale, softcap, has_bias, has_class_weight, has_softcap, has_smoothing,
                         BLOCK_M, C_COLS, ACCUMULATE, STATS, FAST_TANH)
