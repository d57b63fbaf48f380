"""Deployment routes run end to end: torch.export + AOTInductor packaging, loaded in a fresh process."""

import os
import re
import subprocess
import sys

import pytest
import torch

import fused_ce
from helpers import DEVICES

LOAD_AND_RUN = r"""
import sys, torch, fused_ce
inputs = torch.load(sys.argv[2])
runner = torch._inductor.aoti_load_package(sys.argv[1])
out = runner(*inputs["args"])
out = out[0] if isinstance(out, (list, tuple)) else out
torch.testing.assert_close(out.cpu(), inputs["expected"].cpu(), rtol=1e-5, atol=1e-6)
print("ok")
"""


class Scorer(torch.nn.Module):
    """An evaluation model whose forward returns the fused per-token loss."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 50, bias=True)

    def forward(self, hidden, target):
        return fused_ce.linear_cross_entropy(
            hidden, self.head.weight, target, linear_bias=self.head.bias, reduction="none", label_smoothing=0.1
        )


def loaded_libstdcxx():
    with open("/proc/self/maps") as maps:
        return {os.path.realpath(p) for p in re.findall(r"\S*/libstdc\+\+\.so\S*", maps.read())}


def uses_loaded_libstdcxx(cxx, loaded, workdir):
    """Whether a shared library built by `cxx` links this process's libstdc++ (not another one, not statically)."""
    src, lib = os.path.join(workdir, "probe.cpp"), os.path.join(workdir, f"probe_{len(os.listdir(workdir))}.so")
    with open(src, "w") as f:
        f.write("#include <string>\nstd::string probe(int i) { return std::to_string(i); }\n")
    try:
        built = subprocess.run([cxx, "-shared", "-fPIC", src, "-o", lib], capture_output=True, timeout=120)
        own = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=60)
        needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return False
    return built.returncode == 0 and "libstdc++.so.6" in needed and os.path.realpath(own.stdout.strip()) in loaded


def package_compiler(workdir):
    """The C++ compiler for AOTInductor's package: $CXX (inductor's choice), unless what it builds does not run on
    the libstdc++ this process has loaded and g++ on PATH's does. The package compiles torch's AOTI runtime
    headers (their std::regex among them); with another libstdc++, or one linked in statically, loading any
    package crashes (seen on the H200 machine, whose CXX is a GCC wrapper that links it statically: README)."""
    cxx = os.environ.get("CXX", "g++")
    loaded = loaded_libstdcxx()
    if not loaded or uses_loaded_libstdcxx(cxx, loaded, workdir) or not uses_loaded_libstdcxx("g++", loaded, workdir):
        return cxx
    return "g++"


@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_in_a_fresh_process(device, tmp_path):
    torch.manual_seed(0)
    model = Scorer().to(device).eval()
    hidden = torch.randn(8, 16, device=device)
    target = torch.randint(0, 50, (8,), device=device)
    target[2] = -100
    with torch.no_grad():
        expected = model(hidden, target)
    exported = torch.export.export(model, (hidden, target))
    assert "fused_ce.linear_cross_entropy" in exported.graph_module.code  # one node, not decomposed
    with torch._inductor.config.patch({"cpp.cxx": (None, package_compiler(str(tmp_path)))}):
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "scorer.pt2"))
    torch.save(dict(args=(hidden, target), expected=expected), tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        # faulthandler: a crash prints the Python stack (load or call) instead of only exit -11
        [sys.executable, "-X", "faulthandler", "-c", LOAD_AND_RUN, package, str(tmp_path / "inputs.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0 and "ok" in out.stdout, (out.returncode, out.stderr[-3000:])
