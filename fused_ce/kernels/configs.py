"""Tile configurations and the kernel variants the build compiles.

Pure data (no triton import): read by the AOT build, by the JIT launchers and by
tests. Configurations are per architecture and measured on the device; see
benchmarks/NOTES.md for how each entry was chosen.
"""
from dataclasses import dataclass

GEMM_KERNELS = ("row_stats", "logit_grad")  # logits tiles from tl.dot; TileConfig
# 1-D grids over tiles of stored logits, rows or elements, or one program over all rows; RowConfig
ROW_KERNELS = ("logit_partials", "combine_partials", "softmax_grad", "scale", "prepare_rows", "assemble_loss")
KERNELS = GEMM_KERNELS + ROW_KERNELS
DTYPES = ("bf16", "fp16", "fp32")
# "aligned": unit inner strides, 16-byte aligned base pointers, row strides and D
# multiples of 16 elements, D a multiple of BLOCK_D. "general": anything else.
LAYOUTS = ("aligned", "general")
DEFAULT_ARCHS = (80, 86, 89, 90, 100, 120)
# Kernels whose arguments do not depend on the input dtype or layout: one variant per arch.
DTYPE_FREE = ("prepare_rows", "assemble_loss")
# Kernels that gain nothing from aligned accesses (a gathered load per row): one variant per dtype.
LAYOUT_FREE = ("combine_partials",)


def variant_keys(kernel: str):
    """The (dtype, layout) variants the build compiles for `kernel`."""
    if kernel in DTYPE_FREE:
        return [("fp32", "general")]
    if kernel in LAYOUT_FREE:
        return [(d, "general") for d in DTYPES]
    return [(dtype, layout) for dtype in DTYPES for layout in LAYOUTS]


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_d: int
    group_n: int
    num_warps: int
    num_stages: int


_HALF = {
    # Ampere datacenter (164 KB shared memory per block).
    80: TileConfig(128, 128, 64, 16, 8, 3),
    # Consumer parts: ~99 KB of shared memory per block.
    86: TileConfig(128, 128, 32, 16, 4, 4),
    89: TileConfig(128, 128, 32, 16, 4, 4),
    # Hopper / datacenter Blackwell: 227 KB of shared memory per block.
    90: TileConfig(128, 128, 64, 16, 8, 4),
    100: TileConfig(128, 128, 64, 16, 8, 4),
    120: TileConfig(128, 128, 32, 16, 4, 4),
}
_FP32 = {
    80: TileConfig(64, 64, 32, 16, 4, 3),
    86: TileConfig(64, 64, 32, 16, 4, 3),
    89: TileConfig(64, 64, 32, 16, 4, 3),
    90: TileConfig(64, 128, 32, 16, 4, 3),
    100: TileConfig(64, 128, 32, 16, 4, 3),
    120: TileConfig(64, 64, 32, 16, 4, 3),
}
@dataclass(frozen=True)
class RowConfig:
    block: int  # columns (or elements, or segments for combine_partials) per program and step
    num_warps: int
    num_stages: int = 1
    rows: int = 1  # rows per program (tile kernels)


TILE_KERNELS = ("logit_partials", "softmax_grad")  # BLOCK_R x BLOCK tiles of stored logits

# Small tiles for the CPU interpreter (tests): fast there and exercise tails.
INTERPRETER = TileConfig(16, 32, 16, 2, 4, 1)
INTERPRETER_ROW = RowConfig(64, 4)
INTERPRETER_TILE = RowConfig(32, 4, rows=4)
INTERPRETER_COMBINE = RowConfig(2, 4, rows=4)  # 2 segments per step: several steps in tests


def row_config(arch: int, dtype: str, kernel: str) -> RowConfig:
    if kernel == "scale":  # elementwise: 16 bytes per thread per access
        return RowConfig(4096 if dtype != "fp32" else 2048, 8)
    if kernel in ("prepare_rows", "assemble_loss"):  # one program over all rows: per-row bookkeeping
        return RowConfig(1024, 4)
    if kernel == "combine_partials":  # a few KB of partials per row: many small programs
        return RowConfig(64, 4, rows=16)
    if kernel in TILE_KERNELS:
        # Memory-bound passes over the stored logits; chosen by the H200 sweep of benchmarks/tune.py
        # (benchmarks/NOTES.md, step 13). float32 tiles take half the columns: the same bytes per thread.
        return RowConfig(2048 if dtype != "fp32" else 1024, 4, rows=4)
    raise ValueError(f"unknown row kernel {kernel!r}")


def tile_config(kernel: str, arch: int, dtype: str) -> TileConfig:
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"unknown GEMM kernel {kernel!r}")
    table = _FP32 if dtype == "fp32" else _HALF
    if arch in table:
        return table[arch]
    # Same-major fallback to the nearest lower minor we have a measurement for.
    lower = [a for a in table if a // 10 == arch // 10 and a <= arch] or [min(table)]
    return table[max(lower)]


def fast_tanh(dtype: str) -> bool:
    # hardware tanh.approx for half-precision inputs, whose logits carry more rounding than it adds
    return dtype != "fp32"


def dot_precision(dtype: str) -> str:
    # float32 inputs must match torch's float32 matmul (no TF32 by default).
    return "ieee" if dtype == "fp32" else "tf32"
