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

Today only a JIT candidate (``jit.gemm``; ``benchmarks/tune.py --parts gemm`` times it against torch.mm at
the plan's shapes): it joins the AOT build (configs.KERNELS) once it runs at cuBLAS's rate, and then takes
the row statistics into the logits epilogue. Device-side descriptors need a global scratch buffer per
program, which the AOT launcher does not allocate yet (it passes triton's scratch pointers as null).
"""

import triton
import triton.language as tl

from .spec import KernelSpec

SPEC = KernelSpec(
    "gemm",
    params=(
        ("a_ptr", "*T"), ("b_ptr", "*T"), ("c_ptr", "*T"),
        ("M", "i32"), ("N", "i32"), ("K", "i32"), ("lda", "i64"), ("ldb", "i64"), ("ldc", "i64"),
    ),
    family="tma_gemm",
    divisible_by_16=frozenset({"a_ptr", "b_ptr", "c_ptr"}),
    layouts=("aligned",),
)


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K, lda, ldb, ldc,
    A_T: tl.constexpr, B_T: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,
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
            acc = tl.dot(a, b, acc)

        if SPLIT_EPILOGUE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            if ACCUMULATE:
                left += c_desc.load([off_m, off_n]).to(tl.float32)
                right += c_desc.load([off_m, off_n + C_COLS]).to(tl.float32)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + C_COLS], right.to(c_desc.dtype))
        else:
            if ACCUMULATE:
                acc += c_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
