"""Tile configurations per kernel family and architecture, the kernels the build compiles, and the plan's
per-architecture constants.

Pure data (no triton import): read by the AOT build, by the JIT launchers and by
tests. Entries are measured on the device; benchmarks/LOG.md says how each was chosen.
"""
from dataclasses import dataclass, field

# The kernels the build compiles, one module each in this package, each with its SPEC (spec.py).
KERNELS = ("row_stats", "logit_grad", "logit_partials", "combine_partials", "softmax_grad", "scale",
           "prepare_rows", "assemble_loss", "distill_rows", "grad_tile_mask", "sparse_grad_input",
           "sparse_grad_weight")
DEFAULT_ARCHS = (80, 86, 89, 90, 100, 120)


@dataclass(frozen=True)
class TileConfig:  # family "dot_tiles": tl.dot tiles of logits
    block_n: int
    block_v: int
    block_d: int
    group_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class GradTileConfig:  # family "grad_tiles": a block's gradient in tiles of block_n rows x block_v classes
    block_n: int  # (sparse_grad_input: rows per program, a multiple of the filter tile's, whose live lists it joins)
    block_v: int
    block_d: int  # features per program of the products over the live tiles
    block_k: int  # the products' K step: rows (dW) or classes (dX) of a live tile per tl.dot
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class RowConfig:  # the other families: 1-D grids over tiles of stored logits, rows or elements
    block: int  # columns (or elements, or segments for combine_partials) per program and step
    num_warps: int
    num_stages: int = 1
    rows: int = 1  # rows per program (tile kernels)


_DOT_TILES_HALF = {
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
_DOT_TILES_FP32 = {
    80: TileConfig(64, 64, 32, 16, 4, 3),
    86: TileConfig(64, 64, 32, 16, 4, 3),
    89: TileConfig(64, 64, 32, 16, 4, 3),
    90: TileConfig(64, 128, 32, 16, 4, 3),
    100: TileConfig(64, 128, 32, 16, 4, 3),
    120: TileConfig(64, 64, 32, 16, 4, 3),
}

# Small tiles for the CPU interpreter (tests), per family or kernel: fast there and exercise tails.
INTERPRETER = {
    "dot_tiles": TileConfig(16, 32, 16, 2, 4, 1),
    "grad_tiles": GradTileConfig(16, 32, 16, 8, 4, 1),
    "sparse_grad_input": GradTileConfig(32, 32, 16, 8, 4, 1),  # (two of the mask's row tiles joined)
    "stored_logits": RowConfig(32, 4, rows=4),
    "combine": RowConfig(2, 4, rows=4),  # 2 segments per step: several steps in tests
    "elementwise": RowConfig(64, 4),
    "rows": RowConfig(64, 4),
    "row_sweeps": RowConfig(64, 4),
}


# Half-precision products over a block's live tiles (grad_filter_eps) on the larger parts, per kernel: filter tiles
# of rows per program (dX: a program joins the live lists of that many row tiles: a W tile read once serves more
# rows), features per program, K step, warps, stages (benchmarks/LOG.md, step 67).
GRAD_TILE_PRODUCTS = {"sparse_grad_input": (2, 256, 64, 8, 3), "sparse_grad_weight": (1, 256, 64, 8, 3)}


def config(family: str, arch: int, dtype: str, kernel: str = ""):
    """The configuration of a kernel family (of kernel `kernel`, where the family's kernels differ) on `arch` for
    input dtype `dtype` ("bf16", "fp16", "fp32")."""
    if family == "dot_tiles":
        table = _DOT_TILES_FP32 if dtype == "fp32" else _DOT_TILES_HALF
        if arch in table:
            return table[arch]
        # Same-major fallback to the nearest lower minor we have a measurement for.
        lower = [a for a in table if a // 10 == arch // 10 and a <= arch] or [min(table)]
        return table[max(lower)]
    if family == "grad_tiles":
        # the gradient tiles grad_filter_eps skips: ARCH_CONSTANTS' filter tile on every architecture (the plan's
        # ATen stages filter the same tiles), the products' features per program within shared memory
        tile = ARCH_CONSTANTS[0]
        small = arch in (86, 89, 120)  # ~99 KB of shared memory per block
        if dtype == "fp32" or small:
            return GradTileConfig(tile.filter_tile_rows, tile.filter_tile_cols, 64, 32, 4, 2)
        # (the mask: its tile alone matters, read in slices of 64 rows)
        row_tiles, *products = GRAD_TILE_PRODUCTS.get(kernel, (1, 128, 64, 4, 1))
        return GradTileConfig(row_tiles * tile.filter_tile_rows, tile.filter_tile_cols, *products)
    if family == "elementwise":  # 16 bytes per thread per access
        return RowConfig(4096 if dtype != "fp32" else 2048, 8)
    if family == "rows":  # one program over all rows: per-row bookkeeping
        # 4096 rows a step: the first GEMM waits on prepare_rows' counts (a host read), and at 1024 rows a step
        # its serial steps took 94 us at 16384 rows on the H200 (44 us now; LOG.md, step 48)
        return RowConfig(4096, 16)
    if family == "row_sweeps":  # one program per row sweeping its stored logits (distill_rows)
        return RowConfig(1024, 4)
    if family == "combine":  # a few KB of partials per row: many small programs
        return RowConfig(64, 4, rows=16)
    if family == "stored_logits":
        # Memory-bound passes over the stored logits; chosen by the H200 sweep of benchmarks/tune.py
        # (benchmarks/LOG.md, step 13). float32 tiles take half the columns: the same bytes per thread.
        return RowConfig(2048 if dtype != "fp32" else 1024, 4, rows=4)
    raise ValueError(f"unknown kernel family {family!r}")


def fast_tanh(dtype: str) -> bool:
    # hardware tanh.approx for half-precision inputs, whose logits carry more rounding than it adds
    return dtype != "fp32"


def dot_precision(dtype: str) -> str:
    # float32 inputs must match torch's float32 matmul (no TF32 by default).
    return "ieee" if dtype == "fp32" else "tf32"


def _doc(text):
    return field(metadata={"doc": text})


@dataclass(frozen=True)
class ArchConstants:
    """What the plan (csrc/plan.cpp) weighs its strategies by, per architecture; embedded by the build, which
    generates the C++ struct from these fields (their names, types and docs: arch_constants.h) and fills it by
    them (kernel_table.cpp): one source."""

    memory_bytes_per_s: float = _doc("sustained device-memory bandwidth of the passes over stored logits")
    gemm_flops_per_s: float = _doc("sustained GEMM rate at our shapes")
    min_stored_rows: int = _doc("fewer rows per block and the loss-only forward's cuBLAS blocks lose to tl.dot tiles")
    gemm_tile_rows: int = _doc("cuBLAS's row tile: blocks in whole tiles waste none")
    vocab_tile_rows: int = _doc("rows of a VocabTiles tile: enough for the dW GEMM to stay compute-bound")
    filter_tile_rows: int = _doc("grad_filter_eps's tiles of a block's gradient: rows")
    filter_tile_cols: int = _doc("... and classes")


# Measured on the H200 (benchmarks/LOG.md: ~3 TB/s for the tile passes under the GEMMs' load, ~700 TFLOP/s
# for cuBLAS at shape A, step 15). Arch 0 serves every architecture without an entry of its own (sm_90
# included): the decisions depend on the ratio of the two rates, which other datacenter parts share roughly.
# An architecture measured to differ gets an entry of its own.
ARCH_CONSTANTS = {
    0: ArchConstants(
        memory_bytes_per_s=3e12,
        gemm_flops_per_s=700e12,
        min_stored_rows=512,
        gemm_tile_rows=128,
        vocab_tile_rows=2048,
        filter_tile_rows=64,
        filter_tile_cols=128,
    ),
}
