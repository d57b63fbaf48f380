"""bfloat16 on the CPU: fused_ce's float32 products against its bfloat16 ones and torch's, fwd+bwd.

    python benchmarks/cpu_bf16.py [--n 256] [--d 2048] [--v 8192] [--rounds 2] [--methods ...] [--out DIR]

On a CPU without bfloat16 dot-product instructions (x86 without AVX512-BF16 or AMX-BF16) torch's bfloat16
matmul runs far slower than its float32 one, and fused_ce forms the ATen path's products in float32 there
(Plan::logits_product_dtype). This script times each way on this CPU whatever it has: each method runs in a
process of its own (FUSED_CE_CPU_FLOAT32_PRODUCTS is read once per process), the methods' order reversed
round by round; full rows and 10% of the targets ignored; fused_ce at the default workspace (32 MiB) and at
1 MiB (and fused_ce's float32 at 1 MiB: what that budget costs by itself). Each run also measures the loss's,
dX's and dW's relative error against float64. Prints a table (median ms of the rounds) and writes
cpu_bf16.{json,png} to --out.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (environment, what runs)
METHODS = {
    "torch float32": ({}, "torch_float32"),
    "torch bf16": ({}, "torch_bf16"),
    "fused_ce bf16 float32 products": ({"FUSED_CE_CPU_FLOAT32_PRODUCTS": "1"}, "fused_ce"),
    "fused_ce bf16 float32 products 1 MiB": ({"FUSED_CE_CPU_FLOAT32_PRODUCTS": "1"}, "fused_ce_1mib"),
    "fused_ce bf16 bf16 products": ({"FUSED_CE_CPU_FLOAT32_PRODUCTS": "0"}, "fused_ce"),
    "fused_ce bf16 bf16 products 1 MiB": ({"FUSED_CE_CPU_FLOAT32_PRODUCTS": "0"}, "fused_ce_1mib"),
    "fused_ce float32 1 MiB": ({}, "fused_ce_float32_1mib"),  # (what the 1 MiB budget costs float32 itself)
}


def child(spec):
    """One method's fwd+bwd: median seconds of `repeat` calls after one warm-up, and the errors."""
    import torch
    import torch.nn.functional as F

    import fused_ce

    torch.manual_seed(0)
    n, d, v = spec["n"], spec["d"], spec["v"]
    x32, w32 = torch.randn(n, d), torch.randn(v, d) / d**0.5
    t = torch.randint(0, v, (n,))
    t[torch.rand(n) < spec["ignored"]] = -100
    what = spec["what"]
    if what.startswith("fused_ce"):
        budget = {"workspace_bytes": 2**20} if what.endswith("1mib") else {}

        def loss(x, w):
            return fused_ce.linear_cross_entropy(x, w, t, **budget)

        dtype = torch.float32 if "float32" in what else torch.bfloat16
    elif what == "torch_bf16":  # bf16 logits, the loss in float32 (autocast's way)

        def loss(x, w):
            return F.cross_entropy((x @ w.T).float(), t)

        dtype = torch.bfloat16
    else:

        def loss(x, w):
            return F.cross_entropy(x @ w.T, t)

        dtype = torch.float32

    def step():
        x, w = x32.to(dtype).detach().requires_grad_(), w32.to(dtype).detach().requires_grad_()
        value = loss(x, w)
        value.backward()
        return value, x.grad, w.grad

    times = []
    for _ in range(spec["repeat"] + 1):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    x, w = x32.double().detach().requires_grad_(), w32.double().detach().requires_grad_()
    reference = F.cross_entropy(x @ w.T, t)
    reference.backward()
    errors = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(result, (reference, x.grad, w.grad))]
    plan = None
    if what.startswith("fused_ce"):
        p = fused_ce.plan(x32.to(dtype).detach().requires_grad_(), w32.to(dtype).detach().requires_grad_(), t, **budget)
        plan = dict(product=str(p.logits_product_dtype), block_rows=p.block_rows, blocks=-(-p.rows // p.block_rows))
    return dict(seconds=statistics.median(times[1:]), errors=errors, plan=plan)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--v", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names of METHODS")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    import torch

    methods = [m for m in args.methods.split(",") if m]
    runs = {}
    for ignored in (0.0, 0.1):
        for r in range(args.rounds):
            for name in methods if r % 2 == 0 else reversed(methods):
                environment, what = METHODS[name]
                spec = dict(n=args.n, d=args.d, v=args.v, ignored=ignored, what=what, repeat=args.repeat)
                out = subprocess.run(
                    [sys.executable, __file__, "--child", json.dumps(spec)],
                    env={**os.environ, **environment},
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.setdefault((name, ignored), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    capabilities = torch.backends.cpu.get_cpu_capability()
    print(
        f"\n{date.today()}, {platform.machine()} CPU ({os.cpu_count()} cores, torch's kernels {capabilities}), "
        f"torch {torch.__version__}; N {args.n}, D {args.d}, V {args.v}, fwd+bwd, median of {args.rounds} rounds"
    )
    print("| method | ignored | ms | / torch float32 | / torch bf16 | loss err | dX err | dW err | products, blocks |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (name, ignored), results in runs.items():
        ms = statistics.median(r["seconds"] for r in results) * 1e3
        base = {m: statistics.median(r["seconds"] for r in runs.get((m, ignored), [{"seconds": float("nan")}])) * 1e3
                for m in ("torch float32", "torch bf16")}  # fmt: skip
        errors, plan = results[0]["errors"], results[0]["plan"]
        rows.append(dict(method=name, ignored=ignored, ms=ms, rounds=[r["seconds"] for r in results], errors=errors,
                         plan=plan))  # fmt: skip
        layout = f"{plan['product']}, {plan['blocks']}" if plan else ""
        print(
            f"| {name} | {ignored:.0%} | {ms:.0f} | {ms / base['torch float32']:.2f} | {ms / base['torch bf16']:.3f} | "
            f"{errors[0]:.1e} | {errors[1]:.1e} | {errors[2]:.1e} | {layout} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(date=str(date.today()), cpu_capability=capabilities, cores=os.cpu_count(), torch=torch.__version__,
                  args={k: v for k, v in vars(args).items() if k != "child"}, rows=rows)  # fmt: skip
    (out / "cpu_bf16.json").write_text(json.dumps(record, indent=1))
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(rows)))
    labels = [f"{r['method']} ({r['ignored']:.0%} ignored)" for r in rows]
    ax.barh(labels, [r["ms"] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("ms, fwd+bwd (log scale)")
    ax.set_title(f"bf16 on the CPU ({capabilities}), N {args.n}, D {args.d}, V {args.v}")
    fig.tight_layout()
    fig.savefig(out / "cpu_bf16.png", dpi=120)


if __name__ == "__main__":
    main()
