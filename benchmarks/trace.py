"""Where one fused step spends its time: the CUDA kernel timeline of one step.

    python benchmarks/trace.py [--shapes A,B] [--workspace-mib 0,64] [--workload mean|per_token|forward]
                               [--ignored 0.1] [--dtype bfloat16] [--n 131072]

The step (--workload): fwd+bwd of the mean loss ("mean"); fwd+bwd of sum(adv * nll) with reduction='none', the RL
gradient (bench_rl.py's nll workload, "per_token", also --per-token); log-probs and entropy without grad, the old and
reference policies' pass ("forward"). --ignored: the fraction of rows whose target is ignore_index (0: every row
counted); --n: the rows, instead of the shape's. For each shape (and workspace budget): the step's time by CUDA events
(median), the host's time for a step from an idle GPU to its last launch,
then one profiled step: kernel time per kernel name against its own floor
(GEMMs against the bf16 rate, row passes against the copy bandwidth), the idle
time between kernels and its largest gaps with their neighbours, and the host
calls that block (synchronisations, allocations). Writes trace.json to --out.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import PEAK_TFLOPS, SHAPES, cuda_time_ms, environment, make_inputs, plan_summary

BLOCKING_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMalloc",
    "cudaFree",
    "cudaMemcpy",
    "cudaEventSynchronize",
    "cuModuleLoadData",
    "cudaHostAlloc",
)


def short(name, width=70):
    return name if len(name) <= width else name[: width - 3] + "..."


def step_fn(x, w, t, workspace, workload):
    import fused_ce

    if workload == "forward":

        @torch.no_grad()
        def forward():
            out = fused_ce.linear_log_probs(x, w, t, return_entropy=True, workspace_bytes=workspace)
            return out.log_probs.sum() + out.entropy.sum()

        return forward
    per_token = workload == "per_token"
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    adv = torch.randn(t.shape, device=t.device) if per_token else None

    def step():
        xl.grad = wl.grad = None
        if per_token:
            nll = fused_ce.linear_cross_entropy(xl, wl, t, reduction="none", workspace_bytes=workspace)
            (adv * nll).sum().backward()
        else:
            fused_ce.linear_cross_entropy(xl, wl, t, workspace_bytes=workspace).backward()

    return step


def step_plan(x, w, t, workspace, workload):
    import fused_ce

    if workload == "forward":
        return plan_summary(x, w, t, workspace_bytes=workspace, reduction="none", pass_="forward")
    if workload == "mean":
        return plan_summary(x, w, t, workspace_bytes=workspace)
    forward = fused_ce.plan(x.detach().requires_grad_(), w, t, reduction="none", workspace_bytes=workspace)
    backward = "backward_from_logits" if forward.keeps_logits else "backward"
    kept = f" ({forward.kept_rows} rows kept)" if forward.keeps_logits else ""
    return (
        "; ".join(
            plan_summary(x, w, t, workspace_bytes=workspace, reduction="none", pass_=p) for p in ("forward", backward)
        )
        + kept
    )


def profile_step(step, back_to_back=3):
    """Kernels and blocking host calls of the last of `back_to_back` consecutive steps (a loaded GPU, as in
    training, not one woken from idle)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(back_to_back):
            step()
        torch.cuda.synchronize()
    kernels, host = [], {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif any(e.name.startswith(c) for c in BLOCKING_CALLS):
            host.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    kernels.sort()
    per_step = len(kernels) // back_to_back
    return kernels[-per_step:], {k: v[-len(v) // back_to_back :] for k, v in host.items()}


def host_time_ms(step, repeat):
    """The host's time for one step, from an idle GPU until the step's last launch returns (its host reads
    included): what a step costs beyond its kernels where nothing before it keeps the GPU busy (median)."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def analyse(kernels, host):
    span = (kernels[-1][1] - kernels[0][0]) / 1e3
    busy = sum(end - start for start, end, _ in kernels) / 1e3
    per_name = {}
    for start, end, name in kernels:
        total, count = per_name.get(name, (0.0, 0))
        per_name[name] = (total + (end - start) / 1e3, count + 1)
    gaps = []
    for (_, e0, n0), (s1, _, n1) in zip(kernels, kernels[1:]):
        if s1 > e0:
            gaps.append(((s1 - e0) / 1e3, n0, n1))
    gaps.sort(reverse=True)
    return dict(
        span_ms=span,
        busy_ms=busy,
        idle_ms=sum(g[0] for g in gaps),
        kernels=len(kernels),
        per_name=sorted(((n, t, c) for n, (t, c) in per_name.items()), key=lambda r: -r[1]),
        gaps=gaps[:8],
        host={k: (sum(v) / 1e3, len(v)) for k, v in host.items()},
        first=[((s - kernels[0][0]) / 1e3, (e - s) / 1e3, n) for s, e, n in kernels[:14]],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="A,B,C")
    parser.add_argument("--workspace-mib", default="0", help="comma list; 0 = the default budget")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--workload", default="mean", choices=("mean", "per_token", "forward"))
    parser.add_argument("--per-token", action="store_true", help="--workload per_token")
    parser.add_argument("--ignored", type=float, default=0.1, help="fraction of targets set to ignore_index")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--n", type=int, default=0, help="rows (0: the shape's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    workload = "per_token" if args.per_token else args.workload
    env = environment()
    print(f"{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}")
    results = []
    for shape in args.shapes.split(","):
        N, D, V = SHAPES[shape]
        N = args.n or N
        x, w, t = make_inputs(N, D, V, "cuda", dtype=getattr(torch, args.dtype), ignored=args.ignored)
        passes = {"mean": 6, "per_token": 8, "forward": 2}[workload]
        floor = passes * N * D * V / (PEAK_TFLOPS * 1e12) * 1e3
        for mib in (int(m) for m in args.workspace_mib.split(",")):
            step = step_fn(x, w, t, mib << 20 if mib else None, workload)
            ms = cuda_time_ms(step, 3, args.repeat)
            host_ms = host_time_ms(step, args.repeat)
            r = analyse(*profile_step(step))
            r.update(
                shape=shape,
                workspace_mib=mib or "default",
                step_ms=ms,
                host_ms=host_ms,
                floor_ms=floor,
                rows=N,
                workload=workload,
                ignored=args.ignored,
                dtype=args.dtype,
                plan=step_plan(x, w, t, mib << 20 if mib else None, workload),
            )
            results.append(r)
            print(
                f"\n== shape {shape} (N={N} D={D} V={V}) workspace {r['workspace_mib']} MiB: step {ms:.2f} ms "
                f"({passes}NDV floor {floor:.1f}); last of 3 profiled steps: kernels span {r['span_ms']:.2f} ms, busy "
                f"{r['busy_ms']:.2f}, idle {r['idle_ms']:.2f}, {r['kernels']} kernels; host {host_ms:.2f} ms a step "
                f"from an idle GPU to its last launch; plan {r['plan']}"
            )
            for name, total, count in r["per_name"][:14]:
                print(f"  {total:8.2f} ms {count:4d}x  {short(name)}")
            print("  largest gaps:")
            for gap, before, after in r["gaps"][:5]:
                print(f"  {gap:8.3f} ms  {short(before, 40)} -> {short(after, 40)}")
            print("  blocking host calls (ms, count):", {k: (round(v[0], 3), v[1]) for k, v in r["host"].items()})
            print("  first kernels (start ms, duration ms):")
            for start, dur, name in r["first"]:
                print(f"  {start:8.3f} {dur:8.3f}  {short(name)}")
        del x, w, t
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trace.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    print(
        "\nsummary: "
        + "; ".join(
            f"{r['shape']}/{r['workspace_mib']}: {r['step_ms']:.1f} ms step, "
            f"{r['busy_ms']:.1f} busy, {r['idle_ms']:.1f} idle"
            for r in results
        )
    )


if __name__ == "__main__":
    main()
