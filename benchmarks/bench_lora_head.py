"""LoRA on the lm_head with dropout: fwd+bwd time and peak memory, fused_ce's low-rank term against torch.

    python benchmarks/bench_lora_head.py [--device cpu|cuda] [--n N] [--d D] [--v V] [--rank R] [--repeat K]

The head's logits are ``x @ W.T + s * (dropout(x) @ A.T) @ B.T`` (PEFT's LoRA layer with ``lora_dropout > 0``),
W frozen, x, A and B trained. Methods, each in a fresh process (its peak read alone: CUDA's allocator peak beyond
the inputs, or the CPU process's peak resident memory), interleaved over the repeats:

- torch: the head as PEFT computes it, then ``F.cross_entropy`` on float32 logits; with ``--compile`` also
  torch.compile: the same function compiled;
- fused_ce: ``linear_cross_entropy(x, W, t, low_rank_input=s * A(dropout(x)), low_rank_weight=B)``;
- fused_ce merged: ``W + s * B @ A`` as the weight (what the integrations passed before the low-rank term, without
  dropout, so not the same function: its cost for comparison).

Full rows and 10% ignored. Prints a table (date, device, command) and writes lora_head.json and lora_head.png to
--out.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

METHODS = ("torch", "torch.compile", "fused_ce", "fused_ce merged")


def inputs(args, masked):
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.n, args.d, generator=g).to(args.device, dtype).requires_grad_()
    w = (torch.randn(args.v, args.d, generator=g) / args.d**0.5).to(args.device, dtype)
    a = (torch.randn(args.rank, args.d, generator=g) / args.d**0.5).to(args.device, dtype).requires_grad_()
    b = (torch.randn(args.v, args.rank, generator=g) / args.rank**0.5).to(args.device, dtype).requires_grad_()
    t = torch.randint(0, args.v, (args.n,), generator=g)
    if masked:
        t[torch.rand(args.n, generator=g) < 0.1] = -100
    return x, w, a, b, t.to(args.device)


def step_of(method, args):
    import fused_ce

    scale = 2.0

    def torch_step(x, w, a, b, t):
        logits = x @ w.T + scale * (F.dropout(x, 0.1) @ a.T) @ b.T
        return F.cross_entropy(logits.float(), t)

    def fused_step(x, w, a, b, t):
        u = scale * (F.dropout(x, 0.1) @ a.T)
        return fused_ce.linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=b)

    def merged_step(x, w, a, b, t):
        return fused_ce.linear_cross_entropy(x, w + scale * (b @ a), t)

    if method == "torch.compile":
        return torch.compile(torch_step)
    return {"torch": torch_step, "fused_ce": fused_step, "fused_ce merged": merged_step}[method]


def worker(args):
    """One method in this process: (ms per fwd+bwd, peak MiB beyond the inputs) as JSON on stdout."""
    x, w, a, b, t = inputs(args, args.masked)
    step = step_of(args.worker, args)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):  # warm-up (and compilation)
        step(x, w, a, b, t).backward()
    x.grad = a.grad = b.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.repeat):
        sync()
        start = time.perf_counter()
        step(x, w, a, b, t).backward()
        sync()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # (KiB on Linux)
    times.sort()
    print(json.dumps(dict(ms=1e3 * times[len(times) // 2], peak_mib=peak)))


def run(method, masked, args):
    cmd = [sys.executable, __file__, "--worker", method, "--device", args.device, "--n", str(args.n), "--d",
           str(args.d), "--v", str(args.v), "--rank", str(args.rank), "--dtype", args.dtype, "--repeat",
           str(args.repeat)] + (["--masked"] if masked else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, check=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--d", type=int, default=None)
    parser.add_argument("--v", type=int, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every method")
    parser.add_argument("--compile", action="store_true", help="add torch.compile's method (the torch one compiled)")
    parser.add_argument("--masked", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.n = args.n or (16384 if cuda else 2048)
    args.d = args.d or (4096 if cuda else 512)
    args.v = args.v or (128256 if cuda else 32000)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.worker:
        return worker(args)
    methods = METHODS if args.compile else tuple(m for m in METHODS if m != "torch.compile")
    results = {}
    for _ in range(args.rounds):  # interleaved: each round runs every method once per row kind
        for masked in (False, True):
            for method in methods:
                r = run(method, masked, args)
                best = results.setdefault((method, masked), r)
                if r["ms"] < best["ms"]:
                    results[(method, masked)] = r
    device = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    command = "python benchmarks/bench_lora_head.py " + " ".join(sys.argv[1:])
    print(f"\n{date.today()} {device}, torch {torch.__version__}; N={args.n} D={args.d} V={args.v} r={args.rank} "
          f"{args.dtype}, fwd+bwd, LoRA dropout 0.1; `{command.strip()}`")  # fmt: skip
    peak = "peak MiB beyond the inputs" if cuda else "process peak RSS MiB"
    print(f"| method | full rows ms | 10% ignored ms | {peak} (full rows) |")
    print("|---|---|---|---|")
    for method in methods:
        full, masked = results[(method, False)], results[(method, True)]
        print(f"| {method} | {full['ms']:.1f} | {masked['ms']:.1f} | {full['peak_mib']:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [dict(method=m, masked=k, **r) for (m, k), r in results.items()]
    (out / "lora_head.json").write_text(json.dumps(dict(device=device, args=vars(args), rows=rows), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: lora_head.png not written; pip install matplotlib)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for i, masked in enumerate((False, True)):
        left.bar([j + 0.4 * i for j in range(len(methods))], [results[(m, masked)]["ms"] for m in methods], 0.4,
                 label="10% ignored" if masked else "full rows")  # fmt: skip
    left.set_xticks([j + 0.2 for j in range(len(methods))], methods)
    left.set_ylabel("ms, fwd+bwd")
    left.legend()
    right.bar(methods, [results[(m, False)]["peak_mib"] for m in methods])
    right.set_ylabel(peak)
    fig.suptitle(f"LoRA head with dropout, N={args.n} D={args.d} V={args.v} r={args.rank}, {device}")
    fig.tight_layout()
    fig.savefig(out / "lora_head.png", dpi=120)


if __name__ == "__main__":
    main()
