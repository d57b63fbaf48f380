"""Measurements behind the tile table and the optimisation log (benchmarks/NOTES.md).

    python benchmarks/tune.py [--shape A]

On a GPU with triton: times the kernels' JIT builds under candidate
configurations (row_stats for the loss-only forward, softmax_grad for the
forward-with-gradient), breaks one fused fwd+bwd into its CUDA kernels, and
times the first call after import against a warm one in fresh processes, for
fused_ce and for torch eager. Prints tables; writes tune.json to --out.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import SHAPES, cuda_time_ms, environment, make_inputs  # noqa: E402

ROW_STATS = [  # block_n, block_v, block_d, group_n, num_warps, num_stages
    (128, 128, 64, 16, 8, 4), (128, 128, 64, 16, 8, 3), (128, 256, 64, 16, 8, 3), (128, 256, 64, 8, 8, 3),
    (256, 128, 64, 16, 8, 3), (128, 128, 128, 16, 8, 2), (64, 256, 64, 16, 4, 4), (128, 256, 32, 16, 8, 4),
]
SOFTMAX_GRAD = [(4096, 8), (2048, 8), (8192, 16), (4096, 4), (2048, 4), (8192, 8)]

FIRST_CALL = r"""
import sys, time, torch
N, D, V = %d, %d, %d
torch.mm(torch.ones(64, 64, device="cuda"), torch.ones(64, 64, device="cuda"))
x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, V, (N,), device="cuda")
if sys.argv[1] == "fused_ce":
    import fused_ce
    fn = lambda: fused_ce.linear_cross_entropy(x, w, t)
else:
    fn = lambda: torch.nn.functional.cross_entropy((x @ w.T).float(), t)
times = []
for _ in range(6):
    x.grad = w.grad = None
    torch.cuda.synchronize(); s = time.perf_counter()
    fn().backward()
    torch.cuda.synchronize(); times.append((time.perf_counter() - s) * 1e3)
print(times[0], sorted(times[1:])[2])
"""


def tune_row_stats(x, w, t, warmup, repeat):
    from fused_ce.kernels import configs, jit

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for c in ROW_STATS:
        cfg = configs.TileConfig(*c)
        splits = max(1, -(-8 * sms // -(-x.shape[0] // cfg.block_n)))
        try:
            ms = cuda_time_ms(lambda: jit.row_stats(x, w, t, num_splits=splits, config=cfg), warmup, repeat)
        except Exception as exc:  # out of shared memory, ...
            print(f"row_stats {c}: {type(exc).__name__}", file=sys.stderr)
            continue
        rows.append(dict(kernel="row_stats", config=c, ms=ms))
    return rows


def tune_softmax_grad(x, w, t, warmup, repeat):
    from fused_ce.kernels import configs, jit

    n = min(x.shape[0], 2048)
    logits = (x[:n] @ w.T).contiguous()
    ones = torch.ones(n, device="cuda")
    zeros = torch.zeros(n, device="cuda")
    rows = []
    for block, warps in SOFTMAX_GRAD:
        cfg = configs.RowConfig(block, warps)
        for softcap in (None, 30.0):
            fn = lambda: jit.softmax_grad(logits, t[:n], ones, zeros, ones, zeros, softcap=softcap, config=cfg)
            ms = cuda_time_ms(fn, warmup, repeat)
            gbytes = 3 * logits.numel() * logits.element_size() / 1e9
            rows.append(dict(kernel="softmax_grad", config=(block, warps), softcap=softcap, ms=ms,
                             tb_per_s=gbytes / ms))
    return rows


def breakdown(x, w, t):
    import fused_ce

    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    for _ in range(2):
        fused_ce.linear_cross_entropy(xl, wl, t).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        xl.grad = wl.grad = None
        fused_ce.linear_cross_entropy(xl, wl, t).backward()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time / 1e3
    return sorted(totals.items(), key=lambda kv: -kv[1])[:12]


def first_call(N, D, V):
    out = {}
    for who in ("fused_ce", "torch"):
        r = subprocess.run([sys.executable, "-c", FIRST_CALL % (N, D, V), who], capture_output=True, text=True)
        if r.returncode == 0:
            first, warm = map(float, r.stdout.split())
            out[who] = dict(first_ms=first, warm_ms=warm)
        else:
            print(r.stderr[-2000:], file=sys.stderr)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="A")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    N, D, V = SHAPES[args.shape]
    x, w, t = make_inputs(N, D, V, "cuda")
    kernel_t = torch.where(t < 0, -1, t)  # the kernels' convention for ignored rows
    env = environment()
    result = dict(env=env, shape=args.shape)
    print(f"\n{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}; shape {args.shape}")
    result["breakdown"] = breakdown(x, w, t)
    print("fused fwd+bwd kernel breakdown (ms):")
    for name, ms in result["breakdown"]:
        print(f"  {ms:8.2f}  {name[:100]}")
    result["first_call"] = first_call(N, D, V)
    print("first fwd+bwd after import vs warm (fresh processes):", result["first_call"], flush=True)
    result["row_stats"] = tune_row_stats(x, w, kernel_t, args.warmup, args.repeat)
    result["softmax_grad"] = tune_softmax_grad(x, w, kernel_t, args.warmup, args.repeat)
    floor = 2 * N * D * V / 790e12 * 1e3
    print(f"row_stats (loss-only forward), 2NDV floor {floor:.1f} ms:")
    for r in sorted(result["row_stats"], key=lambda r: r["ms"]):
        print(f"  {r['config']}  {r['ms']:.2f} ms  {2 * N * D * V / r['ms'] / 1e9:.0f} TFLOP/s")
    print("softmax_grad on a 2048-row chunk (read, re-read, write):")
    for r in sorted(result["softmax_grad"], key=lambda r: (r["softcap"] or 0, r["ms"])):
        print(f"  {r['config']} softcap={r['softcap']}  {r['ms']:.3f} ms  {r['tb_per_s']:.2f} TB/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
