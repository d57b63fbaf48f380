"""dW's error where bf16 row blocks' products are summed in bf16 (cuBLAS's accumulating GEMM into a bf16 dW: one
rounding a block), against torch eager's single rounding, both against a float32 reference: the GPU's arithmetic
emulated in float32 on the CPU at a real head's shape (bf16 logits, float32 softmax, the gradient rounded to bf16,
float32 products). What the plan's rule for summing dW in bf16 rests on where no GPU measured it
(csrc/strategies.h, sums_weight_grad_in_input_dtype).

    python benchmarks/dw_sum_emulation.py --n 32768 --v 32000 --d 4096 --blocks 8192,16384

The emulation leaves out the GPU path's own rounding of the gradient (its figures run below the GPU's: 1.08x where
the GPU measured 1.35x at the Llama-3-8B shape), so it bounds the in-dtype sum's error from below.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common import zipf_targets


def run(N, V, D, block_rows_list, sub, seed=0, ignored=0.1, keep_v=None, zipf=0.0):
    # dW's first keep_v rows alone (the memory of a V x D float32 sum x 3 at V = 128256; the error is per element)
    keep_v = keep_v or V
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).bfloat16()  # (benchmarks/common.py's make_inputs, on the CPU)
    w = (torch.randn(V, D, generator=g) / D**0.5).bfloat16()
    t = torch.randint(0, V, (N,), generator=g)
    if zipf:  # token frequencies of text
        t = zipf_targets(N, V, zipf, g)
    t[torch.rand(N, generator=g) < ignored] = -100
    counted = int((t != -100).sum())
    exact = torch.zeros(keep_v, D)
    eager_acc = torch.zeros(keep_v, D)
    partial = {r: torch.zeros(keep_v, D) for r in block_rows_list if r != sub}
    running = {r: torch.zeros(keep_v, D, dtype=torch.bfloat16) for r in block_rows_list}
    wf = w.float()
    start = time.time()
    for r0 in range(0, N, sub):
        xs, ts = x[r0 : r0 + sub].float(), t[r0 : r0 + sub]
        valid = ts != -100
        rows = torch.arange(len(ts))[valid]
        z = xs @ wf.T  # float32 logits of the bf16 inputs: the reference's
        p = torch.softmax(z, -1)
        p[rows, ts[valid]] -= 1
        p[~valid] = 0
        exact.addmm_(p[:, :keep_v].T, xs, alpha=1.0 / counted)
        p = torch.softmax(z.bfloat16().float(), -1)  # bf16 logits (stored), float32 softmax
        del z
        p[rows, ts[valid]] -= 1
        p[~valid] = 0
        gb = (p[:, :keep_v] / counted).bfloat16().float()  # the gradient block, rounded to bf16
        del p
        contrib = gb.T @ xs
        eager_acc += contrib
        for r in block_rows_list:
            if r == sub:
                running[r] = (running[r].float() + contrib).bfloat16()
                continue
            partial[r] += contrib
            if (r0 + sub) % r == 0 or r0 + sub >= N:
                running[r] = (running[r].float() + partial[r]).bfloat16()
                partial[r].zero_()
        print(f"  rows {r0 + sub}/{N} {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    err = lambda a: ((a.float() - exact).norm() / exact.norm()).item()
    eager = err(eager_acc.bfloat16())
    out = {"torch eager (one rounding)": eager}
    for r in block_rows_list:
        e = err(running[r])
        out[f"{-(-N // r)} blocks of {r} rows in bf16"] = (e, e / eager)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--v", type=int, default=128256)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--blocks", default="2048", help="rows a block, comma-separated (multiples of the smallest)")
    parser.add_argument("--keep-v", type=int, default=0, help="dW's first rows alone (memory; 0: all)")
    parser.add_argument("--zipf", type=float, default=0.0, help="targets by text-like frequencies (0: uniform)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    result = run(args.n, args.v, args.d, blocks, sub=min(blocks), keep_v=args.keep_v or None, zipf=args.zipf)
    print(f"N {args.n}, V {args.v}, D {args.d}, rows a class {args.n / args.v:.3f}, zipf {args.zipf}")
    print("| dW summed | error against float32 | over torch eager's |\n|---|---|---|")
    for name, value in result.items():
        err, ratio = value if isinstance(value, tuple) else (value, 1.0)
        print(f"| {name} | {err:.3e} | {ratio:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"dw_sum_emulation_n{args.n}_v{args.v}_d{args.d}" + (f"_zipf{args.zipf}" if args.zipf else "")
    (out / f"{stem}.json").write_text(json.dumps(dict(args=vars(args), result=result), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    names = list(result)
    ratios = [v[1] if isinstance(v, tuple) else 1.0 for v in result.values()]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(names, ratios)
    ax.axvline(1.5, color="red", linestyle="--")
    ax.set_xlabel("dW error over torch eager's")
    ax.set_title(f"N {args.n}, V {args.v}, D {args.d} (emulated)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


if __name__ == "__main__":
    main()
