"""fused_ce against torch eager on the CPU: fwd+bwd time and peak memory against N.

    python benchmarks/bench_cpu.py [--ns 512,1024,2048] [--d 512] [--v 32000]

float32; each (method, N) runs in a fresh process so that its peak resident
memory can be read (fused_ce.demo's worker). Prints a table and writes
cpu.json and cpu.png to --out.
"""

import argparse
import io
import json
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

from fused_ce.demo import worker_command


def run(method, n, d, v, repeat):
    cmd = worker_command(method, n, d, v, repeat)
    out = subprocess.run(cmd, capture_output=True, check=True)
    r = torch.load(io.BytesIO(out.stdout))
    return r["sec"] * 1e3, r["peak"] / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="512,1024,2048")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows = []
    for n in [int(s) for s in args.ns.split(",")]:
        for method in ("pytorch", "fused_ce"):
            ms, mib = run(method, n, args.d, args.v, args.repeat)
            rows.append(dict(method=method, N=n, D=args.d, V=args.v, ms=ms, peak_mib=mib))
    env = dict(
        date=str(date.today()),
        cpu=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        torch=torch.__version__,
    )
    print(f"\n{env['date']} CPU ({env['cores']} cores) torch {env['torch']}; D={args.d} V={args.v} float32, fwd+bwd")
    print("| N | torch ms | fused_ce ms | time ratio | torch peak MiB | fused_ce peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in sorted({r["N"] for r in rows}):
        t, f = (next(r for r in rows if r["N"] == n and r["method"] == m) for m in ("pytorch", "fused_ce"))
        print(
            f"| {n} | {t['ms']:.0f} | {f['ms']:.0f} | {f['ms'] / t['ms']:.2f} | {t['peak_mib']:.0f} | "
            f"{f['peak_mib']:.0f} | {f['peak_mib'] / max(t['peak_mib'], 1e-9):.3f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        for m in ("pytorch", "fused_ce"):
            pts = sorted((r["N"], r["ms"], r["peak_mib"]) for r in rows if r["method"] == m)
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=m)
            b.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=m)
        a.set(xlabel="N", ylabel="fwd+bwd ms", title=f"CPU, D={args.d}, V={args.v}")
        b.set(xlabel="N", ylabel="peak MiB beyond inputs and grads")
        a.legend()
        fig.tight_layout()
        fig.savefig(out / "cpu.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
