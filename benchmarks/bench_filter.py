"""Gradient filtering (grad_filter_eps) against the exact loss on peaked logits, beside the peers.

    python benchmarks/bench_filter.py                        # shape A, scales 14 and 20 and random inputs
    python benchmarks/bench_filter.py --shape Llama-3.2-1B --scales 14 --ignored 0

Inputs: common.peaked_inputs at each --scales value (a trained head's peaked softmax: the larger the scale, the
fewer classes per row above 2^-12) and common.make_inputs ("random": a nearly uniform softmax, where filtering can
only cost its mask pass). For each, the share of the library's filter tiles whose entries other than the targets
are all below 2^-12, at the mask's tile (64 x 128) and at dX's joined tile (128 x 128); then each method's forward +
backward of the mean loss, every method once per round, rounds interleaved (median over rounds of each round's
median), the memory beyond inputs and gradients, and dX's and dW's relative error against float32.
Prints a table; writes bench_filter.json and bench_filter.png to --out.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from bench import available_methods
from trained_logits import reference_grads, time_method

from common import SHAPES, environment, grouped_bars, make_inputs, peaked_inputs

EPS = 2**-12  # Cut Cross-Entropy's default threshold for bfloat16, and the bench's "fused_ce filtered"
TILES = ((64, 128), (128, 128))


def dead_tiles(x, w, t, chunk=1024):
    """{tile: share of tiles with every |softmax - one-hot| entry below EPS, the targets' entries aside}."""
    N, V = x.shape[0], w.shape[0]
    dead, total = dict.fromkeys(TILES, 0), dict.fromkeys(TILES, 0)
    for r0 in range(0, N, chunk):
        xs, ts = x[r0 : r0 + chunk], t[r0 : r0 + chunk]
        above = torch.softmax((xs @ w.T).float(), -1) >= EPS
        rows = (ts >= 0).nonzero()[:, 0]
        above[rows, ts[rows]] = False
        for r, c in TILES:
            padded = torch.zeros(-(-len(ts) // r) * r, -(-V // c) * c, dtype=torch.bool, device=x.device)
            padded[: len(ts), :V] = above
            live = padded.view(padded.shape[0] // r, r, padded.shape[1] // c, c).any(3).any(1)
            dead[(r, c)] += int((~live).sum())
            total[(r, c)] += live.numel()
    return {f"{r}x{c}": dead[(r, c)] / total[(r, c)] for r, c in TILES}


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    methods = list(dict.fromkeys(r["method"] for r in results))
    cases = list(dict.fromkeys((r["inputs"], r["ignored"]) for r in results))
    ms = {(r["method"], r["inputs"], r["ignored"]): r["ms"] for r in results}
    series = {m: [ms.get((m, *case), 0) for case in cases] for m in methods}
    fig, ax = plt.subplots(figsize=(11, 4.5))
    grouped_bars(ax, [f"{inputs}\n{ignored:.0%} ignored" for inputs, ignored in cases], series, fontsize=7)
    ax.set_ylabel("forward + backward, ms")
    ax.set_title("gradient filtering (2^-12) against exact, peaked and random logits")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="A", choices=sorted(SHAPES))
    parser.add_argument("--scales", default="14,20", help="peaked_inputs' scales (comma list; '' none)")
    parser.add_argument("--no-random", action="store_true", help="no random inputs")
    parser.add_argument("--ignored", default="0,0.1", help="fractions of rows ignored (comma list)")
    parser.add_argument("--methods", default="fused_ce,fused_ce filtered,torch.compile,cut-cross-entropy")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--no-errors", action="store_true", help="no float32 reference")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda")
    N, D, V = SHAPES[args.shape]
    installed = available_methods()
    methods = {m: installed[m] for m in args.methods.split(",") if m in installed}
    env = environment()
    print(f"\n{env['date']} {env['device']} torch {env['torch']}; shape {args.shape} (N {N}, D {D}, V {V}), bf16")
    kinds = [(f"peaked {s}", float(s)) for s in args.scales.split(",") if s]
    kinds += [] if args.no_random else [("random", 0)]
    results = []
    for kind, scale in kinds:
        for ignored in (float(f) for f in args.ignored.split(",")):
            if scale:
                x, w, t = peaked_inputs(N, D, V, scale, device, ignored=ignored)
            else:
                x, w, t = make_inputs(N, D, V, device, ignored=ignored)
            dead = dead_tiles(x, w, t)
            ref = None if args.no_errors else reference_grads(x, w, t)
            times = {m: [] for m in methods}
            memory, errors = {}, {}
            for _ in range(args.rounds):
                for name, method in methods.items():
                    ms, gib = time_method(method, x, w, t, device, args.warmup, args.repeat)
                    times[name].append(ms)
                    memory[name] = gib
            for name, method in methods.items():
                if ref is not None:
                    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
                    method(xl, wl, t).backward()
                    errors[name] = [((g.float() - r).norm() / r.norm()).item() for g, r in zip((xl.grad, wl.grad), ref)]
                    del xl, wl
                results.append(dict(method=name, inputs=kind, ignored=ignored, ms=statistics.median(times[name]),
                                    rounds_ms=times[name], gib=memory[name], dead_tiles=dead,
                                    errors=errors.get(name)))  # fmt: skip
            del x, w, t, ref
            torch.cuda.empty_cache()
    print(f"\ngrad_filter_eps = 2^-12; tiles below it (targets aside): {TILES[0]} the mask's, {TILES[1]} dX's joined")
    print("| inputs | ignored | tiles below, 64x128 / 128x128 | method | ms (rounds) | x exact | GiB | dX err "
          "| dW err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    exact = {(r["inputs"], r["ignored"]): r["ms"] for r in results if r["method"] == "fused_ce"}
    for r in results:
        e = r["errors"] or [float("nan")] * 2
        base = exact.get((r["inputs"], r["ignored"]))
        speed = f"{base / r['ms']:.3f}" if base else "-"
        rounds = ", ".join(f"{ms:.2f}" for ms in r["rounds_ms"])
        d = r["dead_tiles"]
        print(f"| {r['inputs']} | {r['ignored']:.0%} | {d['64x128']:.1%} / {d['128x128']:.1%} | {r['method']} | "
              f"{r['ms']:.2f} ({rounds}) | {speed} | {r['gib']:.2f} | {e[0]:.2e} | {e[1]:.2e} |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_filter.json").write_text(json.dumps(dict(env=env, shape=args.shape, results=results), indent=1))
    plot(results, out / "bench_filter.png")


if __name__ == "__main__":
    main()
