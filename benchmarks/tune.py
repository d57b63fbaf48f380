"""Measurements behind the tile table and the optimisation log (benchmarks/NOTES.md).

    python benchmarks/tune.py [--shape A] [--parts row_stats,softmax_grad,gemm]

On a GPU with triton: times the kernels' JIT builds under candidate
configurations (row_stats for the loss-only forward without stored logits; the
tiles of logit_partials and softmax_grad for the passes over stored logits; the
persistent TMA GEMM of gemm.py against torch.mm for the logits, dX and dW GEMMs
of a row block at every shape, the first milestone of issue 13's fused GEMMs).
Prints tables; writes tune.json to --out. The JIT specialises on integer
arguments divisible by 16; the AOT variants declare the same only where
fused_ce/_build/aot.py says so (NOTES.md, step 14), so check a JIT finding in
the pipeline with benchmarks/trace.py, which also gives the per-kernel
breakdown of a step. The first call's cost: benchmarks/first_call.py.
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from common import SHAPES, cuda_time_ms, environment, make_inputs, shape_parser

ROW_STATS = [  # block_n, block_v, block_d, group_n, num_warps, num_stages
    (128, 128, 64, 16, 8, 4),
    (128, 128, 64, 16, 8, 3),
    (128, 256, 64, 16, 8, 3),
    (128, 256, 64, 8, 8, 3),
    (256, 128, 64, 16, 8, 3),
    (128, 128, 128, 16, 8, 2),
    (64, 256, 64, 16, 4, 4),
    (128, 256, 32, 16, 8, 4),
]
# rows x columns per program, num_warps: the tiles of logit_partials and softmax_grad
SOFTMAX_GRAD = [
    (4, 2048, 4),
    (2, 4096, 4),
    (8, 2048, 4),
    (4, 4096, 8),
    (2, 2048, 2),
    (16, 512, 4),
    (16, 1024, 8),
    (8, 1024, 4),
    (8, 2048, 8),
    (32, 1024, 8),
]


# block_m, block_n, block_k, group_m, num_warps, num_stages, split_epilogue: the persistent TMA GEMM (gemm.py)
TMA_GEMM = [
    (128, 256, 64, 8, 8, 3, True),
    (128, 256, 64, 8, 8, 4, True),
    (128, 256, 64, 8, 8, 3, False),
    (128, 256, 64, 16, 8, 3, True),
    (128, 128, 64, 8, 8, 4, True),
    (128, 128, 64, 8, 4, 4, False),
    (256, 128, 64, 8, 8, 3, True),
]


def interleaved_ms(cases, warmup, repeat, before=None):
    """Median ms of each case's call (name -> fn), the cases interleaved round by round so that clock drift
    hits them alike; `before()` runs untimed ahead of every call."""
    times = {name: [] for name in cases}
    for round_ in range(warmup + repeat):
        for name, fn in cases.items():
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if round_ >= warmup:
                times[name].append(start.elapsed_time(end))
    return {name: statistics.median(ms) for name, ms in times.items()}


def tune_row_stats(x, w, t, warmup, repeat):
    from fused_ce.kernels import configs, jit

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for c in ROW_STATS:
        cfg = configs.TileConfig(*c)
        splits = max(1, -(-8 * sms // -(-x.shape[0] // cfg.block_n)))
        try:
            ms = cuda_time_ms(
                lambda cfg=cfg, splits=splits: jit.row_stats(x, w, t, num_splits=splits, config=cfg), warmup, repeat
            )
        except Exception as exc:  # out of shared memory, ...
            print(f"row_stats {c}: {type(exc).__name__}", file=sys.stderr)
            continue
        rows.append(dict(kernel="row_stats", config=c, ms=ms))
    return rows


def softmax_grad_candidates():
    """name -> fn(logits, target, ones, zeros, write_grad): the three forward stages under each tiling."""
    from fused_ce.kernels import configs, jit

    def run(cfg):
        def passes(logits, t, ones, zeros, write_grad):
            lse, _, _ = jit.stats_from_logits(logits, t, config=cfg)
            if write_grad:
                jit.softmax_grad(logits, t, lse, ones, zeros, ones, zeros, config=cfg)

        return passes

    return {f"{r}x{c}/{w}": run(configs.RowConfig(c, w, rows=r)) for r, c, w in SOFTMAX_GRAD}


def tune_softmax_grad(x, w, t, warmup, repeat, candidates=None, block_rows=2048):
    """The forward's passes over stored logits in situ: on a block of logits (`block_rows` rows: 2048 at A,
    1024 at B) just written by the cuBLAS GEMM, as in the fused forward, under the GEMMs' sustained load;
    with the gradient (read, re-read, write) and stats only. Candidates are interleaved round by round so
    that clock drift hits them alike; median per candidate."""
    candidates = candidates or softmax_grad_candidates()
    n = min(x.shape[0], block_rows)
    logits = torch.empty(n, w.shape[0], dtype=x.dtype, device="cuda")
    ones = torch.ones(n, device="cuda")
    zeros = torch.zeros(n, device="cuda")
    gbytes = logits.numel() * logits.element_size() / 1e9
    cases = {
        (name, write_grad): (lambda fn=fn, write_grad=write_grad: fn(logits, t[:n], ones, zeros, write_grad))
        for name, fn in candidates.items()
        for write_grad in (True, False)
    }
    medians = interleaved_ms(cases, warmup, repeat, before=lambda: torch.mm(x[:n], w.T, out=logits))
    rows = []
    for (name, write_grad), ms in medians.items():
        rows.append(
            dict(
                kernel="softmax_grad",
                config=name,
                write_grad=write_grad,
                ms=ms,
                tb_per_s=(3 if write_grad else 1) * gbytes / ms,
            )
        )
    return rows


def tune_gemm(shape, warmup, repeat):
    """The GEMMs of one row block (the plan's rows at `shape`): torch.mm (cuBLAS) against gemm.py under each
    TMA_GEMM candidate, interleaved round by round; median ms, TFLOP/s, the share of torch's rate and the
    relative error against float32 (torch's own beside it). dW accumulates into a bf16 dW (beta = 1), as the
    plan does for the blocks after the first, up to 8 blocks. "logits+stats": the logits GEMM with the row
    statistics (lse) in its epilogue against torch.mm followed by the passes that read them back
    (logit_partials, combine_partials): what fusing the first pass would save."""
    import fused_ce
    from fused_ce.kernels import configs, jit

    N, D, V = SHAPES[shape]
    x, w, t = make_inputs(N, D, V, "cuda")
    rows = fused_ce.plan(x.requires_grad_(), w, t).block_rows
    x = x.detach()[:rows].contiguous()
    t = torch.where(t[:rows] < 0, -1, t[:rows])  # the kernels' convention for ignored rows
    g = torch.randn(rows, V, device="cuda").div_(V**0.5).to(x.dtype)  # a logit gradient's scale
    z, dx = torch.empty(rows, V, dtype=x.dtype, device="cuda"), torch.empty(rows, D, dtype=x.dtype, device="cuda")
    dw = torch.zeros(V, D, dtype=x.dtype, device="cuda")

    def plain(fn):  # a runner: fn's output (`check`: the run whose output is compared)
        return lambda check=False: fn()

    def accumulated(fn):  # dW accumulates: the check starts from zero, the timed runs keep adding
        def run(check=False):
            if check:
                dw.zero_()
            fn()
            return dw

        return run

    cases = {  # float32 reference, torch's runner, gemm.py's runner under a configuration
        "logits": (
            lambda: x.float() @ w.float().T,
            plain(lambda: torch.mm(x, w.T, out=z)),
            lambda cfg: plain(lambda: jit.gemm(x, w, z, b_t=True, config=cfg)),
        ),
        "dX": (
            lambda: g.float() @ w.float(),
            plain(lambda: torch.mm(g, w, out=dx)),
            lambda cfg: plain(lambda: jit.gemm(g, w, dx, config=cfg)),
        ),
        "dW": (
            lambda: g.float().T @ x.float(),
            accumulated(lambda: dw.addmm_(g.T, x)),
            lambda cfg: accumulated(lambda: jit.gemm(g, x, dw, a_t=True, accumulate=True, config=cfg)),
        ),
        "logits+stats": (
            lambda: (x.float() @ w.float().T).logsumexp(1),
            plain(lambda: jit.stats_from_logits(torch.mm(x, w.T, out=z), t)[0]),
            lambda cfg: plain(lambda: jit.logits_with_partials(x, w, t, config=cfg)[1]),
        ),
    }
    methods = {"torch": None} | {str(c): configs.TmaGemmConfig(*c) for c in TMA_GEMM}
    flop = 2 * rows * D * V
    rows_out = []
    for gemm, (reference, baseline, candidate) in cases.items():
        expected = reference()
        runs, errors = {}, {}
        for name, cfg in methods.items():
            runs[name] = baseline if cfg is None else candidate(cfg)
            try:
                out = runs[name](check=True)
                torch.cuda.synchronize()
                errors[name] = ((out.float() - expected).norm() / expected.norm()).item()
            except Exception as exc:  # out of shared memory, no TMA, ...
                print(f"{shape} {gemm} {name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                del runs[name]
        del expected
        medians = interleaved_ms(runs, warmup, repeat)
        base = medians["torch"]
        for name, ms in medians.items():
            rows_out.append(
                dict(
                    kernel="gemm",
                    shape=shape,
                    gemm=gemm,
                    rows=rows,
                    config=name,
                    ms=ms,
                    tflops=flop / ms / 1e9,
                    of_torch=base / ms,
                    rel_err=errors[name],
                )
            )
    return rows_out


def main():
    parser = shape_parser(__doc__, repeat=5)
    parser.add_argument("--parts", default="row_stats,softmax_grad", help="also: gemm")
    parser.add_argument("--gemm-shapes", default="A,B,C", help="shapes of the gemm part")
    args = parser.parse_args()
    parts = args.parts.split(",")
    N, D, V = SHAPES[args.shape]
    if "row_stats" in parts or "softmax_grad" in parts:  # the gemm part makes its own, per shape
        x, w, t = make_inputs(N, D, V, "cuda")
        kernel_t = torch.where(t < 0, -1, t)  # the kernels' convention for ignored rows
    env = environment()
    result = dict(env=env, shape=args.shape)
    print(f"\n{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}; shape {args.shape}")
    if "row_stats" in parts:
        result["row_stats"] = tune_row_stats(x, w, kernel_t, args.warmup, args.repeat)
        floor = 2 * N * D * V / 790e12 * 1e3
        print(f"row_stats (loss-only forward), 2NDV floor {floor:.1f} ms:")
        for r in sorted(result["row_stats"], key=lambda r: r["ms"]):
            print(f"  {r['config']}  {r['ms']:.2f} ms  {2 * N * D * V / r['ms'] / 1e9:.0f} TFLOP/s")
    if "softmax_grad" in parts:
        result["softmax_grad"] = tune_softmax_grad(x, w, kernel_t, args.warmup, args.repeat)
        print(
            "forward passes over a 2048-row block of logits; rows x columns / warps; TB/s counts 3 passes with "
            "the gradient (read, re-read, write), 1 without:"
        )
        for r in sorted(result["softmax_grad"], key=lambda r: (r["write_grad"], r["ms"])):
            print(
                f"  {str(r['config']):14s} write_grad={int(r['write_grad'])}  {r['ms']:.3f} ms  "
                f"{r['tb_per_s']:.2f} TB/s"
            )
    if "gemm" in parts:
        result["gemm"] = [
            r for shape in args.gemm_shapes.split(",") for r in tune_gemm(shape, args.warmup, args.repeat)
        ]
        print("the GEMMs of one row block, gemm.py's persistent TMA kernel against torch (share of its rate):")
        for r in result["gemm"]:
            print(
                f"  {r['shape']} {r['gemm']:6s} {r['rows']} rows  {r['config']:36s} {r['ms']:.3f} ms  "
                f"{r['tflops']:.0f} TFLOP/s  {r['of_torch']:.3f}  rel err {r['rel_err']:.1e}"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
