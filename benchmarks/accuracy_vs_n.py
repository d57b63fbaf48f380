"""Errors of the loss, dX and dW against float32 as N grows: fused_ce and torch eager, both bf16.

    python benchmarks/accuracy_vs_n.py [--ns 16384,32768,65536] [--d 4096] [--v 128256]
                                       [--loss mean|per_token] [--dtypes bfloat16,float16] [--liger]
                                       [--zipf 1.0]

The float32 reference and torch eager's gradients are computed a block of rows at a time so that
N = 65536 fits: eager's logit gradient is formed per block in bf16 as autograd forms it (float32
softmax, one rounding) into one [N, V] bf16 tensor, then multiplied back by one GEMM each for dX and
dW, which is what `F.cross_entropy(F.linear(x, w).float(), t).backward()` computes. Prints a table,
writes accuracy_vs_n.{json,md,png} to --out. --zipf draws the targets with text's token frequencies
(common.zipf_targets): dW's rows of frequent tokens sum many rows, which bf16 sums round at full size.

--loss per_token: the RL objective of issue 22, `sum(adv * log_probs) + 0.01 * sum(entropy)` with per-token
advantages, through `fused_ce.linear_log_probs(..., return_entropy=True)` in its default workspace; errors of
the log-probs, the entropy, dX and dW against float64 (every product and the softmax in float64), fused_ce's
and torch eager's (logits from `dtype` operands upcast to float32, their gradient rounded to `dtype` once, one
GEMM each for dX and dW), for each of --dtypes. Writes accuracy_per_token.{json,md,png}.
"""

import argparse
import json
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


def with_peak_gib(fn, *args):
    """fn(*args) and the GiB it allocated at its peak beyond what was allocated before (gradients included)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn(*args)
    return result, (torch.cuda.max_memory_allocated() - base) / 2**30


def per_token_objective(logits, t, adv):
    log_p = logits.log_softmax(-1)
    valid = t != -100
    lp = torch.where(valid, log_p.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    return lp, entropy, (adv * lp).sum() + 0.01 * entropy.sum()


def per_token_reference(x, w, t, adv, dtype):
    """log-probs, entropy, dX, dW of the per-token objective. dtype=float64: the reference; a half dtype: torch
    eager's numerics (float32 softmax, the logit gradient rounded to `dtype`, one GEMM each for dX and dW)."""
    exact = dtype == torch.float64
    xd, wd = x.to(dtype), w.to(dtype)
    lp = torch.empty(x.shape[0], device=x.device, dtype=torch.float64 if exact else torch.float32)
    entropy = torch.empty_like(lp)
    if exact:
        dx = torch.empty(x.shape, device=x.device, dtype=torch.float64)
        dw = torch.zeros(w.shape, device=x.device, dtype=torch.float64)
    else:
        grad_logits = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=dtype)
    for r0 in range(0, x.shape[0], BLOCK):
        rows = slice(r0, r0 + BLOCK)
        logits = xd[rows] @ wd.T
        logits = (logits if exact else logits.float()).requires_grad_()
        block_lp, block_entropy, objective = per_token_objective(logits, t[rows], adv[rows].to(logits.dtype))
        (g,) = torch.autograd.grad(objective, logits)
        lp[rows], entropy[rows] = block_lp.detach(), block_entropy.detach()
        if exact:
            dx[rows] = g @ wd
            dw.addmm_(g.T, xd[rows])
        else:
            grad_logits[rows] = g.to(dtype)
    if not exact:
        dx, dw = grad_logits @ wd, grad_logits.T @ xd
    return lp, entropy, dx, dw


def fused_per_token(x, w, t, adv):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fused_ce.linear_log_probs(xg, wg, t, return_entropy=True)
    ((adv * out.log_probs).sum() + 0.01 * out.entropy.sum()).backward()
    return out.log_probs.detach(), out.entropy.detach(), xg.grad, wg.grad


def per_token_main(args):
    names = ("log_probs", "entropy", "dX", "dW")
    rows = []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for n in map(int, args.ns.split(",")):
            x, w, t = make_inputs(n, args.d, args.v, "cuda", dtype=dtype, seed=n, zipf=args.zipf)
            adv = torch.randn(n, device="cuda")
            xl = x.detach().requires_grad_()
            forward = fused_ce.plan(xl, w, t, reduction="none")
            # the backward that runs: from the kept logits (the first rows'), or recomputing every row's
            back = fused_ce.plan(
                xl, w, t, pass_="backward_from_logits" if forward.keeps_logits else "backward", reduction="none"
            )
            kept = f", {back.kept_rows} rows kept" if forward.keeps_logits else ""
            tiles = f"{back.strategy} {back.block_rows} x {back.tile_cols}{kept}"
            ref = per_token_reference(x, w, t, adv.double(), torch.float64)
            eager = per_token_reference(x, w, t, adv, dtype)
            ours, peak = with_peak_gib(fused_per_token, x, w, t, adv)
            row = dict(dtype=str(dtype).removeprefix("torch."), N=n, backward=tiles, peak_GiB=round(peak, 2))
            for name, o, e, r in zip(names, ours, eager, ref):
                row[name] = dict(fused_ce=rel_err(o, r), torch=rel_err(e, r))
            rows.append(row)
            del x, w, t, ref, eager, ours
            torch.cuda.empty_cache()
    header = (
        "| dtype | N | backward tiles | fused_ce peak (GiB) | "
        + " | ".join(f"{k}: fused_ce / torch" if i == 0 else k for i, k in enumerate(names))
        + " |"
    )
    lines = [header, "|" + "---|" * (4 + len(names))]
    for r in rows:
        cells = [
            f"{r[k]['fused_ce']:.2e} / {r[k]['torch']:.2e} ({r[k]['fused_ce'] / r[k]['torch']:.2f}x)" for k in names
        ]
        lines.append(f"| {r['dtype']} | {r['N']} | {r['backward']} | {r['peak_GiB']} | " + " | ".join(cells) + " |")
    title = (
        f"D={args.d}, V={args.v}, sum(adv * log_probs) + 0.01 * sum(entropy), 10% ignored; "
        "relative norm error against float64"
    )
    write(args, "accuracy_per_token", title, lines, rows, names, series=lambda r: f"{r['dtype']} N")


def write(args, stem, title, lines, rows, names, series=None):
    env = environment()
    if args.zipf:
        stem, title = f"{stem}_zipf{args.zipf}", f"{title}; targets by Zipf {args.zipf} frequencies"
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(f"# {title}\n\n{env['date']}, {env['device']}, torch {env['torch']}\n\n{table}\n")
    (out / f"{stem}.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5))
    groups = sorted({r.get("dtype", "") for r in rows})
    for ax, k in zip(axes, names):
        for group in groups:
            part = [r for r in rows if r.get("dtype", "") == group]
            for method in [m for m in ("fused_ce", "torch", "liger-kernel") if m in part[0][k]]:
                label = f"{method} {group}".strip()
                ax.plot([r["N"] for r in part], [r[k][method] for r in part], marker="o", label=label)
        ax.set(title=k, xscale="log", xlabel="N", ylabel="relative error")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


def fused(x, w, t):
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fused_ce.linear_cross_entropy(xg, wg, t)
    loss.backward()
    return loss.detach(), xg.grad, wg.grad


def liger(x, w, t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    loss = liger_fused_linear_cross_entropy(xg, wg, t)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    return loss.detach(), xg.grad, wg.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="16384,32768,65536")
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--loss", choices=("mean", "per_token"), default="mean")
    parser.add_argument("--dtypes", default="bfloat16,float16", help="per_token: the input dtypes")
    parser.add_argument("--liger", action="store_true", help="mean loss: also Liger-Kernel's errors (and its dW's)")
    parser.add_argument("--zipf", type=float, default=0.0, help="targets by text's token frequencies (0: uniform)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.loss == "per_token":
        return per_token_main(args)
    rows = []
    for n in map(int, args.ns.split(",")):
        x, w, t = make_inputs(n, args.d, args.v, "cuda", seed=n, zipf=args.zipf)
        plan = fused_ce.plan(x.detach().requires_grad_(), w.detach().requires_grad_(), t)
        ref = reference(x, w, t, torch.float32)
        eager = reference(x, w, t, torch.bfloat16)
        ours, peak = with_peak_gib(fused, x, w, t)
        row = dict(N=n, dW_accumulation=str(plan.grad_weight_dtype).removeprefix("torch."), peak_GiB=round(peak, 2))
        for name, o, e, r in zip(("loss", "dX", "dW"), ours, eager, ref):
            row[name] = dict(fused_ce=rel_err(o, r), torch=rel_err(e, r))
        del ours
        if args.liger:
            (peer, row["liger_peak_GiB"]) = with_peak_gib(liger, x, w, t)
            for name, o, r in zip(("loss", "dX", "dW"), peer, ref):
                row[name]["liger-kernel"] = rel_err(o, r)
            del peer
        rows.append(row)
        del x, w, t, ref, eager
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
    if args.liger:
        lines += ["", "| N | Liger-Kernel peak (GiB) | loss: Liger / torch | dX | dW |", "|---|---|---|---|---|"]
        for r in rows:
            cells = [
                f"{r[k]['liger-kernel']:.2e} / {r[k]['torch']:.2e} ({r[k]['liger-kernel'] / r[k]['torch']:.2f}x)"
                for k in ("loss", "dX", "dW")
            ]
            lines.append(f"| {r['N']} | {r['liger_peak_GiB']:.2f} | " + " | ".join(cells) + " |")
    title = f"bf16, D={args.d}, V={args.v}, mean loss, 10% ignored; relative norm error against float32"
    write(args, "accuracy_vs_n", title, lines, rows, ("loss", "dX", "dW"))


if __name__ == "__main__":
    main()
