"""What each loss feature costs: fused_ce fwd+bwd time with each keyword against the plain loss.

    python benchmarks/bench_features.py [--shape A] [--repeat 10]

bf16 at shape A (N=16384, D=4096, V=128256) by default, inputs as in bench.py.
Prints a table and writes features.json and features.png to --out.
"""

import json
import statistics
from pathlib import Path

import torch

import fused_ce
from common import SHAPES, cuda_time_ms, environment, make_inputs, shape_parser


def features(V, device):
    cw = torch.rand(V, device=device) + 0.5
    return {
        "plain": {},
        "weight": dict(weight=cw),
        "label_smoothing": dict(label_smoothing=0.1),
        "weight+label_smoothing": dict(weight=cw, label_smoothing=0.1),
        "z_loss": dict(z_loss=1e-4),
        "softcap": dict(softcap=30.0),
        "logit_scale": dict(logit_scale=0.5),
        "bias": dict(bias=True),
        "return_lse (lse not differentiated)": dict(return_lse="detached"),
        "return_lse (lse in the loss)": dict(return_lse=True),
        "reduction='none'": dict(reduction="none"),
        "all of the above but none": dict(
            weight=cw, label_smoothing=0.1, z_loss=1e-4, softcap=30.0, logit_scale=0.5, bias=True
        ),
    }


def main():
    parser = shape_parser(__doc__, repeat=10)
    args = parser.parse_args()
    N, D, V = SHAPES[args.shape]
    x, w, t = make_inputs(N, D, V, "cuda")
    bias = (torch.randn(V, device="cuda") * 0.1).to(x.dtype)
    xl, wl, bl = (v.detach().requires_grad_() for v in (x, w, bias))
    steps = {}
    for name, kw in features(V, "cuda").items():
        kw = dict(kw)
        use_bias = kw.pop("bias", False)
        return_lse = kw.pop("return_lse", False)

        def step(kw=kw, use_bias=use_bias, return_lse=return_lse):
            xl.grad = wl.grad = bl.grad = None
            out = fused_ce.linear_cross_entropy(
                xl, wl, t, linear_bias=bl if use_bias else None, return_lse=bool(return_lse), **kw
            )
            if return_lse == "detached":  # e.g. logged, not trained on
                out, lse = out
                lse.detach().mean()
            elif return_lse:
                out = out[0] + 1e-4 * out[1].float().mean()
            elif out.dim():
                out = out.sum() / N
            out.backward()

        steps[name] = step
    # Rounds over all features (not one feature after another), so that the GPU's
    # clock drift under sustained load hits every feature alike.
    times = {name: [] for name in steps}
    for round_ in range(args.warmup + args.repeat):
        for name, step in steps.items():
            ms = cuda_time_ms(step, 0, 1)
            if round_ >= args.warmup:
                times[name].append(ms)
    rows = [dict(feature=name, ms=statistics.median(ms)) for name, ms in times.items()]
    base = rows[0]["ms"]
    env = environment()
    print(
        f"\n{env['date']} {env['device']} torch {env['torch']}; shape {args.shape} (N={N}, D={D}, V={V}) bf16, "
        f"fwd+bwd, median of {args.repeat}"
    )
    print("| feature | ms | cost vs plain |\n|---|---|---|")
    for r in rows:
        r["overhead"] = r["ms"] / base - 1
        print(f"| {r['feature']} | {r['ms']:.2f} | {100 * r['overhead']:+.1f}% |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "features.json").write_text(json.dumps(dict(env=env, shape=args.shape, rows=rows), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh([r["feature"] for r in rows], [100 * r["overhead"] for r in rows])
        ax.axvline(5, color="k", ls="--", lw=1)
        ax.set(xlabel="% over the plain loss (fwd+bwd)", title=f"fused_ce feature cost, shape {args.shape}, bf16")
        fig.tight_layout()
        fig.savefig(out / "features.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
