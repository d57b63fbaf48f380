"""What the build produced: embedded cubins per architecture; no triton at import."""

import importlib
import inspect
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fused_ce
from fused_ce.kernels import configs


def cubin_arch(blob: bytes) -> int:
    """The SM version in a CUDA ELF header (e_flags; layout differs by ELF ABI version)."""
    assert blob[:4] == b"\x7fELF" and blob[4] == 2, "not a 64-bit ELF"
    flags = struct.unpack_from("<I", blob, 48)[0]
    abi_version = blob[8]
    return (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF


def kernel_module(kernel):
    return importlib.import_module(f"fused_ce.kernels.{kernel}")


def requested_archs():
    spec = os.environ.get("FUSED_CE_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST")
    return None if spec else list(configs.DEFAULT_ARCHS)


def test_every_arch_embedded_as_real_cubins():
    archs = fused_ce.cuda_archs()
    assert archs, "the build embedded no kernels"
    expected = requested_archs()
    if expected is not None:
        # the defaults: every arch up to sm_90 is mandatory; newer ones where triton can target them
        assert {a for a in expected if a <= 90} <= set(archs)
    for arch in archs:
        for kernel in configs.KERNELS:
            spec = kernel_module(kernel).SPEC
            for name, _ in spec.kernels():  # the plain kernel and its flavors
                for dtype, layout in spec.variants():
                    blob = bytes(torch.ops.fused_ce._embedded_cubin(arch, name, dtype, layout).tolist())
                    assert len(blob) > 1000
                    assert cubin_arch(blob) == arch, (name, dtype, layout, arch)


@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_spec_matches_kernel(kernel):
    # The SPEC beside each @triton.jit lists its launch parameters in order; the rest are constexprs.
    module = kernel_module(kernel)
    spec, fn = module.SPEC, getattr(module, f"{kernel}_kernel")
    assert spec.name == kernel
    names = spec.param_names()
    assert list(fn.arg_names[: len(names)]) == names
    annotations = [p.annotation for p in inspect.signature(getattr(fn, "fn", fn)).parameters.values()]
    assert all("constexpr" in str(a) for a in annotations[len(names) :]), annotations
    assert spec.divisible_by_16 <= set(names) and spec.unit_stride <= set(names)
    configs.config(spec.family, 90, "bf16")  # a configuration family that exists


def test_missing_cubin_is_an_error():
    with pytest.raises(RuntimeError, match="no embedded cubin"):
        torch.ops.fused_ce._embedded_cubin(12, "row_stats", "bf16", "aligned")


def test_import_does_not_import_triton():
    code = "import sys, fused_ce; assert 'triton' not in sys.modules, 'triton imported'; print('ok')"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("kernel", ["logit_partials", "softmax_grad", "scale"])
def test_aligned_memory_bound_kernels_vectorise(kernel):
    # Their speed is bandwidth: the aligned variants must move 16 bytes per access. A mask bound not known to
    # be a multiple of 16 (V, numel) once made every access 2 bytes in the cubins while the JIT, which
    # specialises on divisibility itself, was fast (benchmarks/LOG.md, step 13).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not interpret
    code = f"from fused_ce._build import aot; print(aot.compile_kernel({kernel!r}, 'bf16', 'aligned', 90).asm['ptx'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ptx = out.stdout
    assert "ld.global.v4" in ptx and "ld.global.b16" not in ptx
    if kernel != "logit_partials":  # it stores per-row partials only
        assert "st.global.v4" in ptx and "st.global.b16" not in ptx


def test_import_names_both_torch_versions_on_mismatch():
    # a build loads only with the torch it was compiled against: a clear error instead of undefined symbols
    code = "import torch; torch.__version__ = '9.9.9+cpu'; import fused_ce"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "9.9.9" in out.stderr and torch.__version__.split("+")[0] in out.stderr


LAUNCH_SITE = """
#include "kernel_args.h"
void site(const at::Tensor& t) {
  fused_ce::ScaleArgs a;
  a.g_ptr = t;
  a.scale_ptr = t;
  a.numel = t.numel();
  ASSIGNMENT;
}
"""


@pytest.mark.parametrize(
    "assignment, error",
    [
        ("a.numel = int64_t{3}", None),
        ("a.num_el = int64_t{3}", "has no member named"),  # a parameter renamed in its SPEC
        ("a.numel = int32_t{3}", "deleted function"),  # of another type than its SPEC's (i64)
        ("fused_ce::DistillRowsArgs d; d.inv_t = 0.5", "deleted function"),  # a double for an fp32
    ],
)
def test_launch_arguments_are_checked_when_the_library_builds(tmp_path, assignment, error):
    # The C++ launchers fill each kernel's argument struct, generated from its SPEC by the build (kernel_args.h): a
    # parameter renamed or retyped in a SPEC, or given a value of another type, fails the C++ build, not a launch.
    from torch.utils import cpp_extension

    aot = importlib.import_module("fused_ce._build.aot")
    (tmp_path / "kernel_args.h").write_text(aot.launch_args_header())
    (tmp_path / "arch_constants.h").write_text(aot.arch_constants_header())
    (tmp_path / "site.cpp").write_text(LAUNCH_SITE.replace("ASSIGNMENT", assignment))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    includes = [os.path.join(root, "csrc"), str(tmp_path)] + cpp_extension.include_paths()
    command = ["c++", "-std=c++17", "-fsyntax-only", *(f"-I{i}" for i in includes), str(tmp_path / "site.cpp")]
    out = subprocess.run(command, capture_output=True, text=True)
    if error is None:
        assert out.returncode == 0, out.stderr[-2000:]
    else:
        assert out.returncode != 0 and error in out.stderr, out.stderr[-2000:]


def test_arch_constants_struct_is_generated_from_configs():
    # One source: the C++ struct's fields are configs.ArchConstants' in their order, with their types, and the
    # embedded table fills them in that order (a field moved in Python moves in both; none is filled by a
    # position written by hand)
    import dataclasses

    aot = importlib.import_module("fused_ce._build.aot")
    header = aot.arch_constants_header()
    declared = re.findall(r"^  (int|double) (\w+);", header, flags=re.M)
    types = {int: "int", float: "double"}
    assert declared == [("int", "arch")] + [
        (types[f.type], f.name) for f in dataclasses.fields(configs.ArchConstants)
    ], declared
    table = (Path(__file__).parent.parent / "csrc" / "kernel_table.h").read_text()
    assert "struct ArchConstants" not in table and '#include "arch_constants.h"' in table


def test_spec_grids_are_the_launchers():
    # One grid per kernel, its SPEC's: the JIT launchers evaluate it, the generated C++ structs compute it.
    aot = importlib.import_module("fused_ce._build.aot")
    header = aot.launch_args_header()
    for kernel in configs.KERNELS:
        spec = kernel_module(kernel).SPEC
        assert f"// SPEC.grid: {spec.grid}" in header
        args = {name: 1000 for name in spec.param_names()}
        args.update(v_begin=0, v_end=1000)
        assert spec.grid_size(args, rows=16, cols=128, programs=4, depth=64) >= 1


def csrc_units():
    """csrc's units (a .cpp with its .h, by path under csrc without the suffix: "plan", "ops/cross_entropy") and the
    units each one's files include (a quoted include found beside the file first, then in csrc, as the compiler
    looks)."""
    root = Path(__file__).parent.parent / "csrc"
    files = {}
    for path in root.rglob("*"):
        if path.suffix in (".h", ".cpp"):
            files.setdefault(path.relative_to(root).with_suffix("").as_posix(), []).append(path)
    uses = {unit: set() for unit in files}
    for unit, paths in files.items():
        for path in paths:
            for included in re.findall(r'#include "([\w/]+)\.h"', path.read_text()):
                beside = path.parent / f"{included}.h"
                used = beside.relative_to(root).with_suffix("").as_posix() if beside.exists() else included
                if used != unit and used in files:
                    uses[unit].add(used)
    return files, uses


def test_csrc_units_form_a_ladder():
    # docs/design.md: no two units use each other, none of the engine uses an op's, the longest chain of units
    # using units is at most 11, no file is over 400 lines; a change that breaks one fails here, on the CPU.
    import functools

    files, uses = csrc_units()
    pairs = sorted((a, b) for a in uses for b in uses[a] if a < b and a in uses[b])
    assert not pairs, f"units that use each other: {pairs}"
    # the ops (csrc/ops/) stand on the engine, which knows none of them
    upward = sorted((a, b) for a in uses for b in uses[a] if b.startswith("ops/") and not a.startswith("ops/"))
    assert not upward, f"engine units that use an op's: {upward}"

    @functools.lru_cache(None)
    def chain(unit):
        return [unit] + max((chain(used) for used in uses[unit]), key=len, default=[])

    longest = max((chain(unit) for unit in uses), key=len)
    assert len(longest) <= 11, " -> ".join(longest)
    lengths = {path.name: len(path.read_text().splitlines()) for paths in files.values() for path in paths}
    assert max(lengths.values()) <= 400, {name: n for name, n in lengths.items() if n > 400}
