"""Run from an installed wheel, in an environment with torch and neither triton nor a compiler (.ci/run):

    python tests/check_wheel.py 80,90

the op's CPU forward and backward against float64, the embedded architectures, and every kernel's cubin bytes
for each of them (the ELF header's SM). Not a pytest module: it must not import the source tree.
"""

import importlib.util
import shutil
import struct
import sys

import torch

assert importlib.util.find_spec("triton") is None, "this check wants an environment without triton"
assert not any(shutil.which(c) for c in ("cc", "gcc", "g++", "c++", "clang")), "this check wants no compiler"

import fused_ce  # noqa: E402
from fused_ce.kernels import configs, spec  # noqa: E402  (pure data: no triton)

assert "site-packages" in fused_ce.__file__, f"fused_ce imported from {fused_ce.__file__}, not the wheel"
assert "triton" not in sys.modules

# forward and backward on the CPU against float64
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 32, generator=g, requires_grad=True)
w = (torch.randn(300, 32, generator=g) / 32**0.5).requires_grad_()
t = torch.randint(0, 300, (64,), generator=g)
t[::7] = -100
loss = fused_ce.linear_cross_entropy(x, w, t, label_smoothing=0.1)
loss.backward()
xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
ref = torch.nn.functional.cross_entropy(xr @ wr.T, t, label_smoothing=0.1)
ref.backward()
for got, want in ((loss, ref), (x.grad, xr.grad), (w.grad, wr.grad)):
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 1e-5, err

# the embedded cubins: every kernel for every requested architecture, each a real cubin of that SM
requested = sorted(int(a) for a in sys.argv[1].split(","))
assert fused_ce.cuda_archs() == requested, (fused_ce.cuda_archs(), requested)


def cubin_arch(blob):
    assert blob[:4] == b"\x7fELF" and blob[4] == 2, "not a 64-bit ELF"
    flags = struct.unpack_from("<I", blob, 48)[0]
    return (flags >> 8) & 0xFF if blob[8] >= 8 else flags & 0xFF


count = 0
names = list(torch.ops.fused_ce._embedded_kernels())  # the kernels and their flavors (spec.py)
assert set(configs.KERNELS) <= set(names), names
for arch in requested:
    for name in names:
        found = 0
        for dtype in spec.DTYPES:
            for layout in spec.LAYOUTS:
                try:
                    blob = bytes(torch.ops.fused_ce._embedded_cubin(arch, name, dtype, layout).tolist())
                except RuntimeError:
                    continue  # a variant the kernel's SPEC does not build
                assert len(blob) > 1000 and cubin_arch(blob) == arch, (name, dtype, layout, arch)
                found += 1
        assert found, (name, arch)
        count += found
# the metadata a package index shows
import importlib.metadata  # noqa: E402

meta = importlib.metadata.metadata("fused_ce")
license_field = meta.get("License-Expression") or meta.get("License")
assert license_field == "BSD-3-Clause" and meta.get("Author"), (license_field, meta.get("Author"))
assert any(f.name == "LICENSE" for f in importlib.metadata.files("fused_ce")), "no LICENSE in the wheel"
print(
    f"wheel ok: torch {torch.__version__}, archs {requested}, {count} cubins, loss {loss.item():.6f}, {license_field}"
)
