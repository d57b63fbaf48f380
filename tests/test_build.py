"""What the build produced: embedded cubins per architecture; no triton at import."""

import importlib
import inspect
import os
import struct
import subprocess
import sys

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


def test_cpp_launch_arguments_are_the_specs():
    # The C++ launchers (KernelArgs: .ptr/.i64/.i32/.f32 by name) and the kernels' SPECs name one list of launch
    # parameters: a parameter renamed or retyped on one side only fails here, on the CPU, and not first at a launch
    # (cuda_driver.cpp checks each launch against the embedded table).
    import re
    from pathlib import Path

    kinds = {"ptr": "pointer", "i64": "i64", "i32": "i32", "f32": "fp32"}
    used = {}
    for source in sorted((Path(__file__).parent.parent / "csrc").glob("*.cpp")):
        for kind, name in re.findall(r'\.(ptr|i64|i32|f32)\("(\w+)"', source.read_text()):
            used.setdefault(name, set()).add(kinds[kind])
    declared = {}
    for kernel in configs.KERNELS:
        for name, type_ in kernel_module(kernel).SPEC.params:
            declared.setdefault(name, set()).add("pointer" if type_.startswith("*") else type_)
    assert set(used) == set(declared), (sorted(set(used) - set(declared)), sorted(set(declared) - set(used)))
    assert used == declared, {name: (used[name], declared[name]) for name in used if used[name] != declared[name]}
