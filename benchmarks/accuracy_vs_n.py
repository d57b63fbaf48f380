"""Errors of the loss, dX and dW against float32 as N grows: fused_ce and torch eager, both bf16.

    python benchmarks/accuracy_vs_n.py [--ns 16384,32768,65536] [--d 4096] [--v 128256]

The float32 reference and torch eager's gradients are computed a block of rows at a time so that
N = 65536 fits: eager's logit gradient is formed per block in bf16 as autograd forms it (float32
softmax, one rounding) into one [N, V] bf16 tensor, then multiplied back by one GEMM each for dX and
dW, which is what `F.cross_entropy(F.linear(x, w).float(), t).backward()` computes. Prints a table,
writes accuracy_vs_n.{json,md,png} to --out.
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import fused_ce
from common import environment, make_inputs

BLOCK = 4096


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(x, w, t, dtype):
    """Loss, dX, dW of the mean loss with logits from `dtype` operands; float32 softmax.

    dtype=float32: the reference (float32 accumulation everywhere). dtype=bfloat16: torch eager's
    numerics (logits and their gradient rounded to bf16, dX and dW one bf16 GEMM each over all rows).
    """
    xd, wd = x.to(dtype), w.to(dtype)
    counted = (t != -100).sum()
    loss = torch.zeros((), device=x.device, dtype=torch.float64)
    if dtype == torch.float32:  # dX and dW accumulated block by block
        grad_logits = None
        dx = torch.empty(x.shape, device=x.device, dtype=torch.float32)
        dw = torch.zeros(w.shape, device=x.device, dtype=torch.float32)
    else:  # the whole logit gradient, for one GEMM each at the end
        grad_logits = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=dtype)
    for r0 in range(0, x.shape[0], BLOCK):
        rows = slice(r0, r0 + BLOCK)
        logits = (xd[rows] @ wd.T).float().requires_grad_()
        block_loss = F.cross_entropy(logits, t[rows], reduction="sum")
        (g,) = torch.autograd.grad(block_loss / counted, logits)
        loss += block_loss.double()
        if grad_logits is None:
            dx[rows] = g @ wd
            dw.addmm_(g.T, xd[rows])
        else:
            grad_logits[rows] = g.to(dtype)
    if grad_logits is not None:
        dx, dw = grad_logits @ wd, grad_logits.T @ xd
    return (loss / counted).float(), dx, dw


def fused(x, w, t):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fused_ce.linear_cross_entropy(xg, wg, t)
    loss.backward()
    return loss.detach(), xg.grad, wg.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="16384,32768,65536")
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for n in map(int, args.ns.split(",")):
        x, w, t = make_inputs(n, args.d, args.v, "cuda", seed=n)
        plan = fused_ce.plan(x.detach().requires_grad_(), w.detach().requires_grad_(), t)
        ref = reference(x, w, t, torch.float32)
        eager = reference(x, w, t, torch.bfloat16)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ours = fused(x, w, t)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        row = dict(N=n, dW_accumulation=str(plan.grad_weight_dtype).removeprefix("torch."), peak_GiB=round(peak, 2))
        for name, o, e, r in zip(("loss", "dX", "dW"), ours, eager, ref):
            row[name] = dict(fused_ce=rel_err(o, r), torch=rel_err(e, r))
        rows.append(row)
        del x, w, t, ref, eager, ours
        torch.cuda.empty_cache()
    header = (
        "| N | dW accumulates in | fused_ce peak beyond inputs, gradients included (GiB) "
        "| loss: fused_ce / torch | dX | dW |"
    )
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [
            f"{r[k]['fused_ce']:.2e} / {r[k]['torch']:.2e} ({r[k]['fused_ce'] / r[k]['torch']:.2f}x)"
            for k in ("loss", "dX", "dW")
        ]
        lines.append(f"| {r['N']} | {r['dW_accumulation']} | {r['peak_GiB']} | " + " | ".join(cells) + " |")
    env = environment()
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"bf16, D={args.d}, V={args.v}, mean loss, 10% ignored; relative norm error against float32"
    (out / "accuracy_vs_n.md").write_text(
        f"# {title}\n\n{env['date']}, {env['device']}, torch {env['torch']}\n\n{table}\n"
    )
    (out / "accuracy_vs_n.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    ns = [r["N"] for r in rows]
    for ax, k in zip(axes, ("loss", "dX", "dW")):
        for method in ("fused_ce", "torch"):
            ax.plot(ns, [r[k][method] for r in rows], marker="o", label=method)
        ax.set(title=k, xscale="log", xlabel="N", ylabel="relative error")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_n.png", dpi=120)


if __name__ == "__main__":
    main()
