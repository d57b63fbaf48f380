"""One step timed three ways, with the SM clock and the power drawn: where a step's time goes beyond its kernels.

    python benchmarks/timing_modes.py [--shapes A] [--workloads forward,mean,per_token] [--ignored 0,0.1]

- per call: CUDA events around one call from an idle GPU (as bench.py and bench_rl.py time): the host's time
  before the first kernel and at every host read counts.
- back to back: --calls calls between one pair of events, divided by the count (as a training loop issues them:
  the host works while the GPU runs the previous call), median of --repeat such runs.
- graph: the step captured once in a CUDA graph and its replays timed (the GPU's time alone). Only steps that
  capture the same work as they run: no host read of the counted rows under capture, so every row is computed,
  which is the same work where nothing is ignored.
- the logits GEMMs of the step's row blocks alone (bench_rl.py's "cuBLAS logits alone"), per call and back to back.
The SM clock (MHz) and the power (W) are sampled every 5 ms in a thread during each timing (NVML through
torch.cuda). Prints a table and writes timing_modes.json and timing_modes.png to --out.
"""

import argparse
import json
from pathlib import Path

import torch

from common import (
    SHAPES,
    ClockSampler,
    back_to_back_ms,
    cuda_time_ms,
    environment,
    grouped_bars,
    logits_gemms,
    make_inputs,
)


def graph_ms(fn, repeat):
    """fn captured in a CUDA graph (after warm-up on a side stream, as torch.cuda.graphs asks), its replays timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, 2, repeat)


def steps(x, w, t, workload):
    """fused_ce's step, as trace.py runs it."""
    import fused_ce

    if workload == "forward":

        def forward():
            with torch.no_grad():
                out = fused_ce.linear_log_probs(x, w, t, return_entropy=True)
                return out.log_probs.sum() + out.entropy.sum()

        return forward
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    adv = torch.randn(t.shape, device=t.device)

    def step():
        xl.grad = wl.grad = None
        if workload == "per_token":
            (adv * fused_ce.linear_cross_entropy(xl, wl, t, reduction="none")).sum().backward()
        else:
            fused_ce.linear_cross_entropy(xl, wl, t).backward()

    return step


def timed(label, fn, args, graph):
    row = dict(label=label)
    with ClockSampler() as s:
        row["per_call_ms"] = cuda_time_ms(fn, 2, args.repeat)
    row.update({f"per_call_{k}": v for k, v in s.summary().items()})
    with ClockSampler() as s:
        row["back_to_back_ms"] = back_to_back_ms(fn, args.calls, max(3, args.repeat // 2))
    row.update({f"back_to_back_{k}": v for k, v in s.summary().items()})
    row["graph_ms"] = float("nan")
    if graph:
        with ClockSampler() as s:
            row["graph_ms"] = graph_ms(fn, args.repeat)
        row.update({f"graph_{k}": v for k, v in s.summary().items()})
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="A")
    parser.add_argument("--workloads", default="forward,mean,per_token")
    parser.add_argument("--ignored", default="0,0.1", help="fractions of targets ignored (comma list)")
    parser.add_argument("--calls", type=int, default=8, help="calls between one pair of events, back to back")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    env = environment()
    print(f"{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}")
    rows = []
    for shape in args.shapes.split(","):
        N, D, V = SHAPES[shape]
        for ignored in (float(f) for f in args.ignored.split(",")):
            x, w, t = make_inputs(N, D, V, "cuda", ignored=ignored)
            runs = [("cuBLAS logits GEMMs alone", logits_gemms(x, w, t), True)]
            runs += [(f"fused_ce {wl}", steps(x, w, t, wl), wl == "forward" and ignored == 0) for wl in
                     args.workloads.split(",")]  # fmt: skip
            for label, fn, graph in runs:
                row = timed(label, fn, args, graph)
                row.update(shape=shape, ignored=ignored)
                rows.append(row)
                print(
                    f"{shape} {ignored:4.0%} {label:28s} per call {row['per_call_ms']:7.2f} ms "
                    f"({row['per_call_sm_mhz']:.0f} MHz, {row['per_call_watts']:.0f} W)  back to back "
                    f"{row['back_to_back_ms']:7.2f} ({row['back_to_back_sm_mhz']:.0f} MHz, "
                    f"{row['back_to_back_watts']:.0f} W)  graph {row['graph_ms']:7.2f}",
                    flush=True,
                )
            del x, w, t
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timing_modes.json").write_text(json.dumps(dict(env=env, args=vars(args), rows=rows), indent=1))
    header = "| shape | ignored | step | per call ms | back to back ms | graph ms | SM MHz (per call / b2b) | W |"
    print("\n" + header + "\n|" + "---|" * 8)
    for r in rows:
        print(
            f"| {r['shape']} | {r['ignored']:.0%} | {r['label']} | {r['per_call_ms']:.2f} | {r['back_to_back_ms']:.2f} "
            f"| {r['graph_ms']:.2f} | {r['per_call_sm_mhz']:.0f} / {r['back_to_back_sm_mhz']:.0f} "
            f"| {r['per_call_watts']:.0f} / {r['back_to_back_watts']:.0f} |"
        )
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r['shape']} {r['ignored']:.0%}\n{r['label'].replace('fused_ce ', '')}" for r in rows]
    modes = {"per call": "per_call_ms", "back to back": "back_to_back_ms", "graph replay": "graph_ms"}
    grouped_bars(ax, labels, {name: [r[key] for r in rows] for name, key in modes.items()}, fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title(f"One step timed three ways ({env['device']}, torch {env['torch']})")
    fig.tight_layout()
    fig.savefig(out / "timing_modes.png", dpi=120)


if __name__ == "__main__":
    main()
