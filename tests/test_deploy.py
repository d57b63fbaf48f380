"""Deployment routes run end to end: torch.export + AOTInductor packaging, loaded in a fresh process."""

import os
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


# Seen on the H200 with torch 2.11: loading a CPU package crashes there too (exit -11); with torch 2.11 on a
# machine without a GPU, and with torch 2.13, the CPU package works.
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
CPU_CRASHES = torch.cuda.is_available() and TORCH_VERSION < (2, 13)


@pytest.mark.parametrize(
    "device",
    [
        d
        if d == "cpu" and not CPU_CRASHES
        else pytest.param(
            d,
            marks=pytest.mark.xfail(
                reason="issue 12: loading the package crashes (exit -11) on CUDA, and with torch 2.11 on a GPU machine"
            ),
        )
        for d in DEVICES
    ],
)
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
