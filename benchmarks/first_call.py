"""Where the first call's extra time goes: fresh processes, each timing one setup step and then the op.

    python benchmarks/first_call.py [--shape A]

1. The first fwd+bwd after import against the next ones, in fresh processes:
   fused_ce and torch eager (`torch`), both also with CUDA_MODULE_LOADING=EAGER;
   fused_ce after a tiny fused call (`op_warm`), after the op's GEMM shapes
   through torch.mm (`gemm_warm`) or after its large allocations (`alloc_warm`).
2. One process timing, each with a device sync, the first and second use of:
   the library's own kernel (one cubin load), a few ATen elementwise ops, and
   tiny loss-only and fwd+bwd calls in bf16 and fp32.
"""

import argparse
import os
import subprocess
import sys

from common import SHAPES

WARMUPS = r"""
import sys, time, torch
N, D, V = %d, %d, %d
torch.mm(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (N,), device="cuda")
mode = sys.argv[1]
torch.cuda.synchronize()
s0 = time.perf_counter()
if mode == "gemm_warm":
    with torch.no_grad():
        rows = 2048
        buf = torch.empty(rows, V, device="cuda", dtype=torch.bfloat16)
        torch.mm(x[:rows], w.T, out=buf)
        torch.mm(buf, w, out=torch.empty(rows, D, device="cuda", dtype=torch.bfloat16))
        gw = torch.empty(V, D, device="cuda", dtype=torch.bfloat16)
        torch.mm(buf.T, x[:rows], out=gw)
        gw.addmm_(buf.T, x[:rows])
if mode == "alloc_warm":
    big = [torch.empty(n, device="cuda", dtype=torch.uint8) for n in (2 * V * D, 2 * N * D, 2 * 2048 * V)]
    del big
if mode == "torch":
    fn = lambda: torch.nn.functional.cross_entropy((x @ w.T).float(), t)
else:
    import fused_ce
    fn = lambda: fused_ce.linear_cross_entropy(x, w, t)
if mode == "op_warm":
    xs, ws = x[:64, :64].detach().clone().requires_grad_(), w[:128, :64].detach().clone().requires_grad_()
    fused_ce.linear_cross_entropy(xs, ws, t[:64] %% 128).backward()
torch.cuda.synchronize()
prep = (time.perf_counter() - s0) * 1e3
times = []
for i in range(4):
    x.grad = w.grad = None
    torch.cuda.synchronize(); s = time.perf_counter()
    fn().backward()
    torch.cuda.synchronize(); times.append((time.perf_counter() - s) * 1e3)
print(f"{mode:11s} {sys.argv[2]:24s} setup {prep:7.1f} ms, first call {times[0]:7.1f} ms, "
      f"then {times[1]:.1f} {times[2]:.1f} {times[3]:.1f}")
"""

FIRST_USES = r"""
import time, torch
torch.mm(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))
torch.cuda.synchronize()
def timed(label, fn):
    torch.cuda.synchronize(); s = time.perf_counter(); fn(); torch.cuda.synchronize()
    print(f"{label:56s} {(time.perf_counter() - s) * 1e3:8.1f} ms", flush=True)
timed("import fused_ce", lambda: __import__("fused_ce"))
import fused_ce
g = torch.randn(1000, device="cuda").to(torch.bfloat16)
half = torch.tensor(0.5, device="cuda")
timed("_scale_grad_, first (loads its cubin)", lambda: torch.ops.fused_ce._scale_grad_(g, half))
timed("_scale_grad_, second", lambda: torch.ops.fused_ce._scale_grad_(g, half))
t = torch.randint(0, 128, (64,), device="cuda")
t[::7] = -100
timed("8 ATen elementwise ops, first use (eq, where, any, ...)",
      lambda: (t.eq(-100).logical_not().logical_and_(t.lt(0).logical_or_(t.ge(128))).any().item(),
               torch.where(t.eq(-100), -1, t)))
x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
timed("tiny loss-only bf16, first", lambda: fused_ce.linear_cross_entropy(x, w, t))
timed("tiny loss-only bf16, second", lambda: fused_ce.linear_cross_entropy(x, w, t))
xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
timed("tiny fwd+bwd bf16, first", lambda: fused_ce.linear_cross_entropy(xl, wl, t).backward())
timed("tiny fwd+bwd bf16, second", lambda: fused_ce.linear_cross_entropy(xl, wl, t).backward())
xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
timed("tiny fwd+bwd fp32, first (other cubins)", lambda: fused_ce.linear_cross_entropy(xf, wf, t).backward())
timed("tiny fwd+bwd fp32, second", lambda: fused_ce.linear_cross_entropy(xf, wf, t).backward())
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="A")
    args = parser.parse_args()
    N, D, V = SHAPES[args.shape]
    eager = dict(os.environ, CUDA_MODULE_LOADING="EAGER")
    runs = [
        ("plain", None),
        ("plain", None),
        ("torch", None),
        ("plain", eager),
        ("torch", eager),
        ("op_warm", None),
        ("gemm_warm", None),
        ("alloc_warm", None),
    ]
    for mode, env in runs:
        label = "CUDA_MODULE_LOADING=EAGER" if env else "-"
        r = subprocess.run(
            [sys.executable, "-c", WARMUPS % (N, D, V), mode, label], capture_output=True, text=True, env=env
        )
        print(r.stdout.strip() or r.stderr[-1500:], flush=True)
    r = subprocess.run([sys.executable, "-c", FIRST_USES], capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr[-1500:])


if __name__ == "__main__":
    main()
