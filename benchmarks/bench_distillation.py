"""Distillation losses on a GPU: fused_ce.linear_distillation_loss beside TRL's, Liger's and torch.compile's.

    python benchmarks/bench_distillation.py                  # the shape below, every divergence and top-k
    python benchmarks/bench_distillation.py --losses jsd --rounds 3

The shape: a student's hidden states [8192, 2048] with a [128256, 2048] head, a teacher's [8192, 4096] with a
[128256, 4096] head (no gradient), bf16, x ~ N(0, 1), W ~ N(0, 1/D), 25% of the rows ignored (--ignored 0: every
row counted); fwd+bwd of the mean over the counted rows, temperature 1. Losses: jsd (generalised JSD, beta 0.5),
fkl (beta 0: KL(teacher || student)), rkl (beta 1), topk (the teacher's top 64 log-probs, offline, against the
student's full distribution).
Peers: TRL's ChunkedDivergenceFunction (on the counted rows, as its DistillationTrainer calls it), Liger-Kernel's
LigerFusedLinearJSDLoss (its hard-label weight 0), torch.compile on materialised logits; each where installed.
fused_ce runs in its default workspace and with workspace_bytes=4 GiB (larger row blocks).
The methods run interleaved, --rounds times; the table gives each one's median. Time: CUDA events after warm-up.
Workspace: peak allocated during a step minus the inputs and the gradients it leaves. Errors: the relative norm
error of the loss and of the student's head gradient against float64 on the same inputs, beside torch eager's in
bf16 (logits in bf16, softmax in float32). Prints a table and writes bench_distillation.json and .png to --out.
"""

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from common import PEAK_TFLOPS, cuda_time_ms, environment, workspace_gib

N, DS, DT, V, TOP_K = 8192, 2048, 4096, 128256, 64
BETAS = {"jsd": 0.5, "fkl": 0.0, "rkl": 1.0}


def inputs(ignored, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    xs, ws = randn(N, DS), randn(V, DS, scale=1 / math.sqrt(DS))
    xt, wt = randn(N, DT), randn(V, DT, scale=2 / math.sqrt(DT))  # a sharper teacher
    target = torch.randint(0, V, (N,), device="cuda", generator=g)
    target[torch.rand(N, device="cuda", generator=g) < ignored] = -100
    with torch.no_grad():
        lp, idx = F.log_softmax((xt @ wt.T).float(), -1).topk(TOP_K, -1)
    return xs, ws, xt, wt, target, (idx, lp)


def divergence(s, t, beta):
    """Per-row divergence from log-probs (TRL's convention)."""
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def materialised(xs, ws, xt, wt, target, top_k, loss, dtype=None):
    """The loss from the whole logits (torch eager; torch.compile fuses it); dtype: the products' (float64)."""
    counted = target != -100
    xs, xt = xs[counted], xt[counted]
    if dtype is not None:
        xs, ws, xt, wt = xs.to(dtype), ws.to(dtype), xt.to(dtype), wt.to(dtype)
    s = F.log_softmax((xs @ ws.T).to(dtype or torch.float32), -1)
    if loss == "topk":
        idx, lp = top_k[0][counted], top_k[1][counted]
        log_q = torch.log_softmax(lp.to(s.dtype), -1)
        return (log_q.exp() * (log_q - s.gather(-1, idx))).sum(-1).mean()
    t = F.log_softmax((xt @ wt.T).to(dtype or torch.float32), -1)
    return divergence(s, t, BETAS[loss]).mean()


def methods(loss, available):
    """name -> fn(xs, ws, xt, wt, target, top_k) returning the scalar loss."""
    import fused_ce

    def fused(workspace=None):
        def call(xs, ws, xt, wt, target, top_k):
            if loss == "topk":
                return fused_ce.linear_distillation_loss(xs, ws, target=target, teacher_top_k=top_k,
                                                         workspace_bytes=workspace)  # fmt: skip
            return fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, beta=BETAS[loss],
                                                     workspace_bytes=workspace)  # fmt: skip

        return call

    out = {"fused_ce": fused(), "fused_ce 4 GiB": fused(4 << 30)}
    compiled = torch.compile(functools.partial(materialised, loss=loss))
    out["torch.compile"] = compiled
    if loss != "topk" and "trl" in available:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl(xs, ws, xt, wt, target, top_k):
            counted = target != -100
            per_row, _ = ChunkedDivergenceFunction.apply(xs[counted], ws, None, xt[counted], wt, None, BETAS[loss])
            return per_row.sum() / counted.sum()

        out["TRL chunked"] = trl
    if loss != "topk" and "liger" in available:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        liger_loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=BETAS[loss])
        out["Liger JSD"] = lambda xs, ws, xt, wt, target, top_k: liger_loss(xs, ws, xt, wt, target)
    return out


def available_peers():
    found = []
    for name, module in (("trl", "trl.kernels.chunked_divergence"), ("liger", "liger_kernel.chunked_loss")):
        try:
            __import__(module)
            found.append(name)
        except Exception as e:  # a peer that does not import here is left out, and said so
            print(f"({name} not available: {type(e).__name__}: {e})", file=sys.stderr)
    return found


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", default="jsd,fkl,rkl,topk")
    parser.add_argument("--ignored", type=float, default=0.25, help="fraction of the rows whose target is ignored")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    xs, ws, xt, wt, target, top_k = inputs(args.ignored)
    counted = int((target != -100).sum())
    peers = available_peers()
    rows = []
    for loss in args.losses.split(","):
        runs = methods(loss, peers)
        x, w = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()

        def student(fn, x=x, w=w):
            return lambda: fn(x, w, xt, wt, target, top_k).backward()

        # float64 reference and torch eager's bf16 error
        x64, w64 = xs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
        ref = materialised(x64, w64, xt, wt, target, top_k, loss, dtype=torch.float64)
        ref.backward()
        ref_gw = w64.grad.float()
        del x64, w64
        errors = {}
        eager = functools.partial(materialised, loss=loss)
        for name, fn in [("torch eager", eager)] + list(runs.items()):
            x.grad = w.grad = None
            value = fn(x, w, xt, wt, target, top_k)
            value.backward()
            errors[name] = (relative(value.detach(), ref.detach()), relative(w.grad, ref_gw))
        del ref_gw
        times = {name: [] for name in runs}
        for _ in range(args.rounds):  # interleaved
            for name, fn in runs.items():
                times[name].append(cuda_time_ms(student(fn), args.warmup, args.repeat))
        flops = (6 * DS + 2 * DT) * counted * V if loss != "topk" else 6 * DS * counted * V
        for name, fn in runs.items():
            ms = statistics.median(times[name])
            rows.append(dict(loss=loss, method=name, ms=ms, gib=workspace_gib(student(fn), [x, w]),
                             tflops=flops / ms / 1e9, loss_error=errors[name][0], grad_error=errors[name][1],
                             torch_loss_error=errors["torch eager"][0],
                             torch_grad_error=errors["torch eager"][1]))  # fmt: skip
            print(f"{loss:5s} {name:16s} {ms:8.2f} ms {rows[-1]['gib']:6.2f} GiB", flush=True)
        torch.cuda.empty_cache()
    env = environment()
    print(f"\n{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; N={N} (counted {counted}),"
          f" D_student={DS}, D_teacher={DT}, V={V}, bf16")  # fmt: skip
    print("| loss | method | ms | GiB beyond inputs and grads | TFLOP/s (of the 6NDsV+2NDtV) | loss error | dW error"
          " | torch eager's loss / dW error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loss']} | {r['method']} | {r['ms']:.1f} | {r['gib']:.2f} | {r['tflops']:.0f} | "
              f"{r['loss_error']:.1e} | {r['grad_error']:.1e} | {r['torch_loss_error']:.1e} / "
              f"{r['torch_grad_error']:.1e} |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(environment=env, peak_tflops=PEAK_TFLOPS, ignored=args.ignored, rows=rows)
    (out / "bench_distillation.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "bench_distillation.png", args.ignored)


def plot(rows, path, ignored):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    losses = list(dict.fromkeys(r["loss"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for ax, key in zip(axes, ("ms", "gib")):
            xs = [j + i * width for j, loss in enumerate(losses) if any(r["loss"] == loss and r["method"] == name
                                                                        for r in rows)]  # fmt: skip
            ys = [r[key] for loss in losses for r in rows if r["loss"] == loss and r["method"] == name]
            ax.bar(xs, ys, width, label=name)
    for ax, title in zip(axes, ("fwd+bwd ms", "GiB beyond inputs and gradients")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(losses))], losses)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"distillation, student [{N}, {DS}] x [{V}, {DS}], teacher D={DT}, bf16, {ignored:.0%} ignored")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
