"""fused_ce against its peers: forward + backward time, workspace and accuracy.

    python benchmarks/bench.py                 # shapes A, B, C and an N sweep, every installed peer
    python benchmarks/bench.py --quick         # fewer repeats, smaller sweep
    python benchmarks/bench.py --shapes A --methods fused_ce,torch.compile
    python benchmarks/bench.py --shapes Qwen2.5-0.5B,Qwen2.5-1.5B,Qwen2.5-3B,Llama-3.2-1B,Llama-3.2-3B --ignored 0
                                               # the small heads (common.SHAPES), every row counted
    python benchmarks/bench.py --dtype float16  # the same in float16
    python benchmarks/bench.py --ignored 0.5 --mask prompt  # the first half of every 2048-token sequence ignored
    python benchmarks/bench.py --fused-workspace-mib 1024  # also fused_ce with workspace_bytes=1 GiB

Workload (issue 3): bf16 (or --dtype) input ~ N(0, 1) and weight ~ N(0, 1/D), int64 targets
with 10% ignore_index (--ignored: at random rows, or --mask prompt: the start of each
sequence), mean loss; time of forward + backward, median of timed runs after warm-up
(CUDA events). Workspace = peak allocated during fwd+bwd minus the inputs minus the
gradients. Errors are relative norm errors against a float32 reference (loss, dX, dW).
Prints a table and writes a JSON file and a PNG plot of time and workspace against N to --out.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import PEAK_TFLOPS, SHAPES, cuda_time_ms, environment, make_inputs, plan_summary, workspace_gib


def torch_eager(x, w, t):
    return F.cross_entropy((x @ w.T).float(), t)


_compiled = {}


def torch_compiled(x, w, t):
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(torch_eager)
    return _compiled["fn"](x, w, t)


def available_methods():
    methods = {}
    try:
        import fused_ce

        methods["fused_ce"] = lambda x, w, t: fused_ce.linear_cross_entropy(x, w, t)
        # gradient filtering at Cut Cross-Entropy's default threshold for bfloat16 (2**-12)
        methods["fused_ce filtered"] = lambda x, w, t: fused_ce.linear_cross_entropy(x, w, t, grad_filter_eps=2**-12)
    except ImportError as exc:
        print(f"fused_ce not importable: {exc}", file=sys.stderr)
    methods["torch eager"] = torch_eager
    methods["torch.compile"] = torch_compiled
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        opts = torch.nn.LinearCrossEntropyOptions()
        methods["torch chunked"] = lambda x, w, t: F.linear_cross_entropy(x, w, t, options=opts)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(x, w, t):
            out = liger_fused_linear_cross_entropy(x, w, t)
            return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

        methods["liger-kernel"] = liger
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        methods["cut-cross-entropy"] = lambda x, w, t: cce(x, w, t)  # its default: gradient filtering ("high")
        methods["cut-cross-entropy exact"] = lambda x, w, t: cce(x, w, t, filter_eps=None)
    except ImportError:
        pass
    return methods


def reference(x, w, t):
    """float32 loss, dX, dW (no TF32)."""
    xf = x.float().requires_grad_()
    wf = w.float().requires_grad_()
    loss = F.cross_entropy(xf @ wf.T, t)
    loss.backward()
    return loss.detach(), xf.grad, wf.grad


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(method, x, w, t, ref, warmup, repeat):
    xl = x.detach().requires_grad_()
    wl = w.detach().requires_grad_()

    def fwd_bwd():
        xl.grad = wl.grad = None
        loss = method(xl, wl, t)
        loss.backward()
        return loss

    loss = fwd_bwd()  # also compiles / warms up
    torch.cuda.synchronize()
    errs = (
        {"loss": rel_err(loss.detach(), ref[0]), "dX": rel_err(xl.grad, ref[1]), "dW": rel_err(wl.grad, ref[2])}
        if ref is not None
        else dict.fromkeys(("loss", "dX", "dW"), float("nan"))
    )
    ms = cuda_time_ms(fwd_bwd, warmup, repeat)
    return ms, workspace_gib(fwd_bwd, (xl, wl)), errs


def loss_only_ms(x, w, t, warmup, repeat):
    import fused_ce

    with torch.no_grad():
        return cuda_time_ms(lambda: fused_ce.linear_cross_entropy(x, w, t), warmup, repeat)


def first_call_ms(x, w, t):
    """fwd+bwd: the first fused_ce call of this process against warm ones (no JIT: should be close)."""
    import fused_ce

    xl = x.detach().requires_grad_()
    wl = w.detach().requires_grad_()

    def once():
        xl.grad = wl.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        fused_ce.linear_cross_entropy(xl, wl, t).backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    first = once()
    warm = statistics.median(once() for _ in range(5))
    return first, warm


def run(args):
    device = "cuda"
    methods = available_methods()
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods.split(",")}
    for mib in filter(None, args.fused_workspace_mib.split(",")):
        import fused_ce

        methods[f"fused_ce ws={mib}MiB"] = lambda x, w, t, b=int(mib) << 20: fused_ce.linear_cross_entropy(
            x, w, t, workspace_bytes=b
        )
    rows = []
    # a cuBLAS call first so that the first-call figure isolates fused_ce's own start-up
    torch.mm(torch.ones(64, 64, device=device), torch.ones(64, 64, device=device))
    first_call = None
    shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",") if name]
    sweep_n = [int(n) for n in args.sweep.split(",") if n] if args.sweep not in ("", "none") else []
    if sweep_n:
        shapes += [(f"A@N={n}", n, SHAPES["A"][1], SHAPES["A"][2]) for n in sweep_n if n != SHAPES["A"][0]]
    for name, N, D, V in shapes:
        x, w, t = make_inputs(N, D, V, device, dtype=getattr(torch, args.dtype), ignored=args.ignored, mask=args.mask)
        if first_call is None and "fused_ce" in methods:
            first_call = first_call_ms(x, w, t)
        ref = None if args.no_reference else reference(x, w, t)
        torch.cuda.empty_cache()
        flops = 6 * N * D * V
        floor_ms = flops / (PEAK_TFLOPS * 1e12) * 1e3
        for mname, fn in methods.items():
            if mname == "torch eager" and N * V > 2**31 and not args.eager_big:
                continue  # its 22 GiB of logits is known; skip unless asked
            if name.startswith("A@") and mname not in args.sweep_methods.split(","):
                continue
            try:
                ms, ws, errs = measure(fn, x, w, t, ref, args.warmup, args.repeat)
            except torch.cuda.OutOfMemoryError:
                print(f"{name} {mname}: out of memory", file=sys.stderr)
                continue
            finally:
                torch.cuda.empty_cache()
            row = dict(
                shape=name,
                ignored=args.ignored,
                mask=args.mask,
                N=N,
                D=D,
                V=V,
                method=mname,
                ms=ms,
                tflops=flops / ms / 1e9,
                workspace_gib=ws,
                floor_ms=floor_ms,
                **{f"err_{k}": v for k, v in errs.items()},
            )
            if mname == "fused_ce":
                row["loss_only_ms"] = loss_only_ms(x, w, t, args.warmup, args.repeat)
                row["loss_only_floor_ms"] = floor_ms / 3
                row["plan"] = plan_summary(x, w, t)
            rows.append(row)
            print(
                f"{name:>10} {mname:>18} {ms:8.2f} ms {row['tflops']:6.0f} TFLOP/s {ws:6.3f} GiB  "
                f"err loss {errs['loss']:.1e} dX {errs['dX']:.1e} dW {errs['dW']:.1e}",
                flush=True,
            )
        del x, w, t, ref
        torch.cuda.empty_cache()
    return rows, first_call


def print_table(rows, first_call, env, dtype):
    masks = sorted({f"{r['ignored']:.0%} ignored ({r['mask']})" for r in rows})
    print(f"\n{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}, {dtype}, {', '.join(masks)}")
    if first_call:
        print(
            f"fused_ce fwd+bwd: first call after import {first_call[0]:.1f} ms, warm {first_call[1]:.1f} ms "
            f"(first shape)"
        )
    header = "| shape | method | fwd+bwd ms | TFLOP/s | x floor | workspace GiB | err loss | err dX | err dW |"
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        print(
            f"| {r['shape']} | {r['method']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['ms'] / r['floor_ms']:.2f} | "
            f"{r['workspace_gib']:.3f} | {r['err_loss']:.1e} | {r['err_dX']:.1e} | {r['err_dW']:.1e} |"
        )
    for r in rows:
        if "plan" in r:
            print(f"fused_ce plan at {r['shape']}: {r['plan']}")
    lo = [r for r in rows if "loss_only_ms" in r]
    if lo:
        print(
            "\nfused_ce loss only (no grad): "
            + ", ".join(
                f"{r['shape']} {r['loss_only_ms']:.2f} ms "
                f"({r['loss_only_ms'] / r['loss_only_floor_ms']:.2f}x 2NDV floor)"
                for r in lo
            )
        )


def plot_shapes(plt, rows, path, dtype):
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(shapes)), 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        by_shape = {r["shape"]: r for r in rows if r["method"] == method}
        xs = [k + i * width for k, shape in enumerate(shapes) if shape in by_shape]
        ax_t.bar(xs, [by_shape[s]["ms"] for s in shapes if s in by_shape], width, label=method)
        ax_m.bar(xs, [by_shape[s]["workspace_gib"] for s in shapes if s in by_shape], width, label=method)
    ignored = sorted({r["ignored"] for r in rows})
    for ax, label in ((ax_t, "fwd+bwd ms"), (ax_m, "workspace GiB (beyond inputs and grads)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(shapes))], shapes, rotation=20, fontsize=8)
        ax.set(ylabel=label)
    ax_t.set_title(f"{dtype}, {', '.join(f'{100 * i:g}%' for i in ignored)} ignored")
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def plot(rows, path, dtype):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    sweep = [r for r in rows if r["shape"] == "A" or r["shape"].startswith("A@")]
    if len(sweep) <= len({r["method"] for r in sweep}):  # no N sweep: each shape's methods side by side
        plot_shapes(plt, rows, path, dtype)
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for method in sorted({r["method"] for r in sweep}):
        pts = sorted((r["N"], r["ms"], r["workspace_gib"]) for r in sweep if r["method"] == method)
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
        ax_m.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=method)
    floor = sorted({(r["N"], r["floor_ms"]) for r in sweep})
    ax_t.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="6NDV floor")
    ax_t.set(xlabel="N (tokens)", ylabel="fwd+bwd ms", title=f"D=4096, V=128256, {dtype}", xscale="log", yscale="log")
    ax_m.set(
        xlabel="N (tokens)", ylabel="workspace GiB", title="peak beyond inputs and grads", xscale="log", yscale="symlog"
    )
    ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="A,B,C")
    parser.add_argument("--methods", default=None, help="comma list (default: every installed one)")
    parser.add_argument("--sweep", default="2048,4096,8192", help="extra N values at shape A's D and V ('none')")
    parser.add_argument("--sweep-methods", default="fused_ce,torch.compile,liger-kernel,cut-cross-entropy")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="warmup 1, repeat 5")
    parser.add_argument("--eager-big", action="store_true", help="also run torch eager when N*V > 2^31")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument(
        "--no-reference", action="store_true", help="no float32 reference, no errors (N = 131072: 67 GB of logits)"
    )
    parser.add_argument("--ignored", type=float, default=0.1, help="fraction of targets set to ignore_index")
    parser.add_argument("--mask", default="scattered", choices=["scattered", "prompt"])
    parser.add_argument(
        "--fused-workspace-mib", default="", help="comma list: also fused_ce with workspace_bytes of these MiB"
    )
    parser.add_argument("--tag", default="", help="suffix of the result files (bench{tag}.json / .png)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.repeat = 1, 5
    if not torch.cuda.is_available():
        sys.exit("bench.py times CUDA kernels; for the CPU comparison run benchmarks/bench_cpu.py")
    rows, first_call = run(args)
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(env=env, dtype=args.dtype, first_call_ms=first_call, rows=rows)
    (out / f"bench{args.tag}.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / f"bench{args.tag}.png", args.dtype)
    print_table(rows, first_call, env, args.dtype)


if __name__ == "__main__":
    main()
