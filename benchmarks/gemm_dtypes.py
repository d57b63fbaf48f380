"""cuBLAS's GEMMs of one row block in bfloat16 and in float16, with the SM clock and the power drawn.

    python benchmarks/gemm_dtypes.py [--shape A] [--rows 2048] [--rounds 3]

The three products of a 2048-row block of the stored-logits path (logits = x W^T, dX = G W, dW = G^T x; random
x ~ N(0, 1), W ~ N(0, 1/D), G ~ N(0, 1e-3), float32 accumulation as torch's default), each timed back to back
(--calls products between one pair of CUDA events), the dtypes alternating round by round. Whether float16's
products take longer than bfloat16's at the same shapes, and whether the card's power limit is why (the SM
clock each holds). Prints a table and writes gemm_dtypes.json and gemm_dtypes.png to --out.
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

from common import SHAPES, ClockSampler, back_to_back_ms, environment, grouped_bars


def products(rows, D, V, dtype, seed=0, variants=False, float32_out=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, D, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, D, device="cuda", generator=g) / D**0.5).to(dtype)
    grad = (torch.randn(rows, V, device="cuda", generator=g) * 1e-3).to(dtype)
    out_dtype = torch.float32 if float32_out else dtype

    def product(a, b, rows_out, cols_out, out_dtype=out_dtype):
        out = torch.empty(rows_out, cols_out, device="cuda", dtype=out_dtype)
        if out_dtype != dtype:  # as the pipeline's float16 gradients: cuBLAS writing float32 (addmm.dtype_out, beta 0)
            return lambda: torch.ops.aten.addmm.dtype_out(out, a, b, torch.float32, beta=0, out=out)
        return lambda: torch.mm(a, b, out=out)

    fns = {
        "logits = x W^T": product(x, w.T, rows, V, dtype),
        "dX = G W": product(grad, w, rows, D),
        "dW = G^T x": product(grad.T, x, V, D),
    }
    if variants:  # the same products with the operands' layouts swapped (cuBLAS picks its kernel per layout)
        fns["dX^T = W^T G^T"] = product(w.T, grad.T, D, rows)
        fns["dW^T = x^T G"] = product(x.T, grad, D, V)
    return fns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="A")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--variants", action="store_true", help="also dX and dW with their operands' layouts swapped")
    parser.add_argument("--float32-out", action="store_true", help="dX and dW written in float32 (the float16 path's)")
    parser.add_argument("--blas", default="", help="torch.backends.cuda.preferred_blas_library: cublas or cublaslt")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    env = environment()
    print(f"{env['date']} {env['device']} torch {env['torch']}")
    _, D, V = SHAPES[args.shape]
    flop = 2 * args.rows * D * V
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    options = dict(variants=args.variants, float32_out=args.float32_out)
    runs = {dtype: products(args.rows, D, V, getattr(torch, dtype), **options) for dtype in ("bfloat16", "float16")}
    samples = {}  # (product, dtype): [(ms, MHz, W)]
    for _ in range(args.rounds):
        for dtype, fns in runs.items():
            for name, fn in fns.items():
                with ClockSampler() as s:
                    ms = back_to_back_ms(fn, args.calls, 3)
                c = s.summary()
                samples.setdefault((name, dtype), []).append((ms, c["sm_mhz"], c["watts"]))
    rows = []
    for (name, dtype), vals in samples.items():
        ms = statistics.median(v[0] for v in vals)
        rows.append(dict(product=name, dtype=dtype, ms=ms, tflops=flop / ms / 1e9,
                         sm_mhz=statistics.median(v[1] for v in vals), watts=statistics.median(v[2] for v in vals),
                         rounds=[v[0] for v in vals]))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_dtypes.json").write_text(json.dumps(dict(env=env, args=vars(args), rows=rows), indent=1))
    print(f"\n| product ({args.rows} rows, shape {args.shape}) | dtype | ms | TFLOP/s | SM MHz | W | float16 / bf16 |")
    print("|---|---|---|---|---|---|---|")
    by = {(r["product"], r["dtype"]): r for r in rows}
    for r in rows:
        ratio = r["ms"] / by[(r["product"], "bfloat16")]["ms"]
        print(f"| {r['product']} | {r['dtype']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['sm_mhz']:.0f} | "
              f"{r['watts']:.0f} | {ratio:.3f} |")  # fmt: skip
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(runs["bfloat16"])
    grouped_bars(ax, names, {dtype: [by[(n, dtype)]["tflops"] for n in names] for dtype in runs})
    ax.set_ylabel("TFLOP/s (back to back)")
    ax.set_title(f"cuBLAS, {args.rows}-row block of shape {args.shape} ({env['device']})")
    fig.tight_layout()
    fig.savefig(out / "gemm_dtypes.png", dpi=120)


if __name__ == "__main__":
    main()
