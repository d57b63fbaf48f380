"""Two builds of fused_ce side by side on one GPU: whether a change left its ops no slower.

    python benchmarks/compare_builds.py --builds /path/to/before,/path/to/after --rounds 3

Each build is a source tree built in place (``python setup.py build_ext --inplace``). The builds run alternately,
--rounds times, each round a fresh process per build (two builds of one op library cannot share a process): fwd+bwd
of linear_cross_entropy (mean) at shapes A, B and C, every row counted and 10% ignored, and of
linear_distillation_loss at the distillation benchmark's shape (bench_distillation.py: JSD and the teacher's top k,
25% of the rows ignored). bf16, CUDA events after warm-up; the table gives each build's median over the rounds, the
ratio after / before, and each build's workspace (peak beyond inputs and gradients, GiB). Writes compare_builds.json
and .png to --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cases():
    from common import SHAPES

    for shape in ("A", "B", "C"):
        for ignored in (0.0, 0.1):
            yield f"{shape} ignored {ignored:.0%}", ("cross_entropy", shape, ignored)
    for loss in ("jsd", "topk"):
        yield f"distillation {loss}", ("distillation", loss, 0.25)
    assert SHAPES  # (the shapes' one source)


def make_step(kind, what, ignored):
    """A case's fwd+bwd as a function of no arguments, and the leaves whose gradients it leaves."""
    from bench_distillation import BETAS
    from bench_distillation import inputs as distillation_inputs

    import fused_ce
    from common import SHAPES, make_inputs

    if kind == "cross_entropy":
        x, w, t = make_inputs(*SHAPES[what], "cuda", ignored=ignored)
        x.requires_grad_()
        w.requires_grad_()

        def step():
            x.grad = w.grad = None
            fused_ce.linear_cross_entropy(x, w, t).backward()

        return step, (x, w)
    xs, ws, xt, wt, target, top_k = distillation_inputs(ignored)
    xs.requires_grad_()
    ws.requires_grad_()
    teacher = dict(teacher_top_k=top_k) if what == "topk" else dict(teacher_input=xt, teacher_weight=wt)
    beta = BETAS.get(what, 0.0)

    def step():
        xs.grad = ws.grad = None
        fused_ce.linear_distillation_loss(xs, ws, target=target, beta=beta, **teacher).backward()

    return step, (xs, ws)


def worker(warmup, repeat):
    """Times every case in the fused_ce on sys.path; prints {case: ms} and {case: workspace GiB} as JSON."""
    import torch

    import fused_ce
    from common import cuda_time_ms, workspace_gib

    times, workspace = {}, {}
    for name, case in cases():
        step, leaves = make_step(*case)
        times[name] = cuda_time_ms(step, warmup, repeat)
        workspace[name] = workspace_gib(step, leaves)
        del step, leaves
        torch.cuda.empty_cache()
    print(json.dumps({"fused_ce": str(Path(fused_ce.__file__).parent.parent), "times": times, "gib": workspace}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builds", help="before,after: two source trees built in place")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.warmup, args.repeat)
    builds = [str(Path(b).resolve()) for b in args.builds.split(",")]
    assert len(builds) == 2, "--builds takes two trees: before,after"
    runs = {b: [] for b in builds}
    for r in range(args.rounds):
        for build in builds if r % 2 == 0 else builds[::-1]:  # alternating, each first in turn
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([build, str(HERE)]))
            command = [sys.executable, str(HERE / "compare_builds.py"), "--worker"]
            command += ["--warmup", str(args.warmup), "--repeat", str(args.repeat)]
            done = subprocess.run(command, env=env, cwd="/", capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{build}: {done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["fused_ce"] == build, (result["fused_ce"], build)  # the build asked for, not another
            runs[build].append(result)
    names = [name for name, _ in cases()]
    median = {b: {n: statistics.median(run["times"][n] for run in runs[b]) for n in names} for b in builds}
    gib = {b: {n: max(run["gib"][n] for run in runs[b]) for n in names} for b in builds}
    before, after = builds
    print(f"{'case':<24} {'before ms':>10} {'after ms':>10} {'after/before':>13} {'before GiB':>11} {'after GiB':>10}")
    for n in names:
        b, a = median[before][n], median[after][n]
        print(f"{n:<24} {b:>10.2f} {a:>10.2f} {a / b:>13.3f} {gib[before][n]:>11.2f} {gib[after][n]:>10.2f}")
    import torch

    from common import environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(), "builds": builds, "rounds": runs, "median_ms": median, "workspace_gib": gib}
    (out / "compare_builds.json").write_text(json.dumps(record, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common import grouped_bars

    fig, ax = plt.subplots(figsize=(10, 4))
    grouped_bars(ax, names, {"before": [median[before][n] for n in names], "after": [median[after][n] for n in names]})
    ax.set_ylabel("fwd+bwd ms (median)")
    ax.set_title(f"two builds of fused_ce, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(out / "compare_builds.png", dpi=120)


if __name__ == "__main__":
    main()
