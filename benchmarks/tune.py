"""Measurements behind the tile table and the optimisation log (benchmarks/LOG.md).

    python benchmarks/tune.py [--shape A] [--parts row_stats,softmax_grad,passes,partials,overlap,grad_tiles]

On a GPU with triton: times the kernels' JIT builds under candidate
configurations (row_stats for the loss-only forward without stored logits; the
tiles of logit_partials and softmax_grad for the passes over stored logits);
"passes": the embedded (AOT) passes of a per-token fwd+bwd against the same kernels' JIT builds on the
same rows, kernel times from the profiler; "partials": the statistics pass with the entropy's partials at each
tiling; "overlap": the stored-logits step with its passes on a second
stream; "grad_tiles": grad_filter_eps's mask and block-sparse products at each tiling and share of live tiles,
beside cuBLAS's dense products of the block.
Prints tables; writes tune.json to --out. The JIT specialises on integer
arguments divisible by 16; the AOT variants declare the same only where
fused_ce/_build/aot.py says so (LOG.md, step 14), so check a JIT finding in
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
    (1, 4096, 4),
    (1, 8192, 8),
    (2, 4096, 8),
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


# grad_filter_eps's products over a block's live tiles: dX's (the mask's row tiles joined per program, features per
# program, K step, warps, stages) and dW's (features, K step, warps, stages); the first of each is step 61's tiling
GRAD_INPUT_TILES = [
    (1, 128, 128, 4, 3),
    (1, 256, 64, 4, 3),
    (1, 256, 64, 8, 3),
    (2, 128, 64, 4, 4),
    (2, 256, 64, 8, 3),
    (2, 256, 64, 8, 4),
    (2, 256, 32, 8, 5),
]
GRAD_WEIGHT_TILES = [
    (128, 64, 4, 3),
    (128, 64, 8, 4),
    (256, 64, 8, 3),
    (256, 64, 8, 4),
    (256, 32, 8, 5),
    (128, 32, 4, 4),
]


def grad_tile_cases_at(shape, scale, warmup, repeat, block_rows):
    """tune_grad_tiles' rows at one scale."""
    from common import peaked_inputs
    from fused_ce.kernels import configs, jit

    N, D, V = SHAPES[shape]
    rows = min(N, block_rows)
    tile = configs.ARCH_CONSTANTS[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, w, t = peaked_inputs(rows, D, V, scale, "cuda", ignored=0)
    g = torch.softmax((x @ w.T).float(), -1)
    g[torch.arange(rows, device="cuda"), t] -= 1
    g = g.to(x.dtype)
    threshold = torch.full((rows,), 2.0**-12, device="cuda")
    mask_cfg = configs.config("grad_tiles", jit._arch(x), "bf16", "grad_tile_mask")
    mask = jit.grad_tile_mask(g, threshold, t, config=mask_cfg)
    dw = torch.zeros(V, D, device="cuda", dtype=x.dtype)
    cases, live = {}, {}
    for tiling in GRAD_INPUT_TILES:
        joined, *product = tiling
        cfg = configs.GradTileConfig(joined * tile.filter_tile_rows, tile.filter_tile_cols, *product)
        programs = -(-rows // cfg.block_n) * -(-D // cfg.block_d)
        splits = max(1, min(8, -(-4 * sms // programs)))  # (cuda_grad_tiles.cpp's rule)
        name = f"dX {tiling}"
        cases[name] = lambda cfg=cfg, splits=splits: jit.sparse_grad_input(
            g, w, mask, splits=splits, tile_rows=tile.filter_tile_rows, config=cfg)  # fmt: skip
        live[name] = jit.join_row_tiles(mask, joined).float().mean().item()
    for tiling in GRAD_WEIGHT_TILES:
        cfg = configs.GradTileConfig(tile.filter_tile_rows, tile.filter_tile_cols, *tiling)
        name = f"dW {tiling}"
        cases[name] = lambda cfg=cfg: jit.sparse_grad_weight_(dw, g, x, mask, config=cfg)
        live[name] = mask.float().mean().item()
    cases["mask"] = lambda: jit.grad_tile_mask(g, threshold, t, config=mask_cfg)
    cases["dX cuBLAS dense"] = lambda: g @ w
    cases["dW cuBLAS dense"] = lambda: dw.addmm_(g.T, x)
    out = []
    for name, ms in interleaved_ms(cases, warmup, repeat).items():
        share = live.get(name, 1.0)
        flops = 0 if name == "mask" else 2 * rows * D * V * share
        out.append(dict(scale=scale, rows=rows, case=name, live=share, ms=ms, tflops=flops / ms / 1e9))
    return out


def tune_grad_tiles(shape, warmup, repeat, scales=(14, 20)):
    """grad_filter_eps's mask and products over one row block's live tiles (JIT) at each tiling, on the gradient of
    peaked logits (common.peaked_inputs at each scale, every row counted: G = softmax - one-hot, the threshold
    2^-12), against cuBLAS's dense dX and dW of the same block; the block's rows are the plan's for a filtered call
    at this shape. The live share is the mask's (64 x 128 tiles) or, for dX, its joined tiles'."""
    import fused_ce

    N, D, V = SHAPES[shape]
    x = torch.empty(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(V, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block_rows = fused_ce.plan(x, w, torch.zeros(N, device="cuda", dtype=torch.long), grad_filter_eps=2**-12).block_rows
    del x, w
    out = []
    for scale in scales:
        out += grad_tile_cases_at(shape, scale, warmup, repeat, block_rows)
        torch.cuda.empty_cache()
    return out


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
            lse = jit.stats_from_logits(logits, t, config=cfg)[0]
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


def profiled_kernel_ms(fn, calls, names):
    """Total CUDA time per kernel name (those in `names`) over `calls` calls of fn, and their launch counts."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name in names:
            ms, count = totals.get(e.name, (0.0, 0))
            totals[e.name] = (ms + (e.time_range.end - e.time_range.start) / 1e3, count + 1)
    return totals


def tune_passes(x, w, t, calls):
    """The passes of a per-token fwd+bwd (sum(adv * nll), reduction='none') as the library runs them (its
    embedded cubins, the plan's blocks) against the same kernels' JIT builds over one block of the same rows
    just written by torch.mm: the bandwidth each reaches. TB/s: logit_partials reads the logits once,
    softmax_grad reads and writes them."""
    import fused_ce
    from fused_ce.kernels import jit

    rows = fused_ce.plan(x, w, t, reduction="none", pass_="forward").block_rows
    xs, ts = x[:rows].contiguous(), t[:rows].contiguous()
    kernel_t = torch.where(ts < 0, -1, ts)
    counted = int((ts >= 0).sum())
    xl, wl = xs.clone().requires_grad_(), w.clone().requires_grad_()
    adv = torch.randn(rows, device="cuda")

    def embedded():
        xl.grad = wl.grad = None
        (adv * fused_ce.linear_cross_entropy(xl, wl, ts, reduction="none")).sum().backward()

    z = torch.empty(rows, w.shape[0], dtype=x.dtype, device="cuda")
    coefficient = torch.where(kernel_t >= 0, adv, 0.0)
    zeros = torch.zeros(rows, device="cuda")

    def jit_passes():
        torch.mm(xs, w.T, out=z)
        lse = jit.stats_from_logits(z, kernel_t)[0]
        torch.mm(xs, w.T, out=z)
        jit.softmax_grad(z, kernel_t, lse, coefficient, zeros, coefficient, zeros)

    names = {"logit_partials_kernel", "softmax_grad_kernel"}
    out = []
    for build, fn, rows_run in (("aot", embedded, counted), ("jit", jit_passes, rows)):
        for name, (ms, count) in sorted(profiled_kernel_ms(fn, calls, names).items()):
            gbytes = (2 if name.startswith("softmax") else 1) * rows_run * w.shape[0] * x.element_size() / 1e9
            out.append(
                dict(
                    build=build,
                    kernel=name,
                    launches=count // calls,
                    ms_per_call=ms / calls,
                    tb_per_s=gbytes / (ms / calls),
                )
            )
    return out


def tune_partials(x, w, t, calls, block_rows=2048):
    """The statistics pass over a block of logits just written by torch.mm (logit_partials + combine_partials,
    JIT builds, profiler kernel times, candidates interleaved over 3 rounds): plain, and with the entropy's
    partials (the "extras" flavor the no-grad log-probs + entropy forward runs) at each tiling of SOFTMAX_GRAD."""
    from fused_ce.kernels import configs, jit

    xs, ts = x[:block_rows].contiguous(), t[:block_rows].contiguous()
    z = torch.empty(block_rows, w.shape[0], dtype=x.dtype, device="cuda")
    names = {"logit_partials_kernel", "combine_partials_kernel"}
    cases = {("plain", None): False}
    cases.update({("entropy", cfg): True for cfg in [None] + SOFTMAX_GRAD})
    times = {case: [] for case in cases}
    for _ in range(3):
        for (label, cfg), entropy in cases.items():
            config = None if cfg is None else configs.RowConfig(cfg[1], cfg[2], rows=cfg[0])

            def fn(entropy=entropy, config=config):
                torch.mm(xs, w.T, out=z)
                jit.stats_from_logits(z, ts, entropy=entropy, config=config)

            totals = profiled_kernel_ms(fn, calls, names)
            times[(label, cfg)].append(sum(ms for ms, _ in totals.values()) / calls)
    gbytes = block_rows * w.shape[0] * x.element_size() / 1e9
    return [
        dict(kind=label, config=cfg or "default", ms=statistics.median(v), tb_per_s=gbytes / statistics.median(v))
        for (label, cfg), v in times.items()
    ]


def block_step(x, w, t, rows, buffers, grad, overlap):
    """One step of the stored-logits pipeline from JIT kernels: per row block the cuBLAS logits, then
    logit_partials + combine_partials (+ softmax_grad and the dX and dW GEMMs with ``grad``), in `buffers`
    logit buffers of `rows` rows. With ``overlap`` the passes over block i run on a second stream while the
    main stream runs the logits GEMM of block i+1 (and, with ``grad``, before the dX and dW GEMMs of block i,
    which wait for them through an event): lead 1 of issue 13. Returns the step (a callable) and the lse
    and dX it leaves (to check that the two orders agree)."""
    from fused_ce.kernels import jit

    N, V = x.shape[0], w.shape[0]
    bufs = [torch.empty(rows, V, dtype=x.dtype, device="cuda") for _ in range(buffers)]
    zeros = torch.zeros(N, device="cuda")
    alpha = torch.full((N,), 1.0 / N, device="cuda")
    dx, dw, lse_all = torch.empty_like(x), torch.empty_like(w), torch.empty(N, device="cuda")
    side = torch.cuda.Stream()
    starts = list(range(0, N, rows))

    def passes(i):  # the passes over block i, on the current stream
        r0, r1 = starts[i], min(N, starts[i] + rows)
        block, tb = bufs[i % buffers][: r1 - r0], t[r0:r1]
        lse = jit.stats_from_logits(block, tb)[0]
        lse_all[r0:r1].copy_(lse)
        if grad:
            jit.softmax_grad(block, tb, lse, alpha[r0:r1], zeros[r0:r1], alpha[r0:r1], zeros[r0:r1])

    def products(i):  # the gradient GEMMs of block i
        r0, r1 = starts[i], min(N, starts[i] + rows)
        block = bufs[i % buffers][: r1 - r0]
        torch.mm(block, w, out=dx[r0:r1])
        if i == 0:
            torch.mm(block.T, x[r0:r1], out=dw)
        else:
            dw.addmm_(block.T, x[r0:r1])

    def logits(i):
        r0, r1 = starts[i], min(N, starts[i] + rows)
        torch.mm(x[r0:r1], w.T, out=bufs[i % buffers][: r1 - r0])

    def serial():
        for i in range(len(starts)):
            logits(i)
            passes(i)
            if grad:
                products(i)

    def overlapped():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        done = {}

        def issue(i):  # block i's logits on main, its passes on the side stream once they are written
            if i >= buffers and not grad:  # the buffer's previous block's passes must be done
                main.wait_event(done[i - buffers])
            logits(i)
            written = torch.cuda.Event()
            written.record(main)
            side.wait_event(written)
            with torch.cuda.stream(side):
                passes(i)
                done[i] = torch.cuda.Event()
                done[i].record(side)

        issue(0)
        for i in range(len(starts)):
            if i + 1 < len(starts):
                issue(i + 1)
            if grad:
                main.wait_event(done[i])
                products(i)
        main.wait_stream(side)

    return (overlapped if overlap else serial), (lse_all, dx)


def tune_overlap(shape, warmup, repeat):
    """The step at the plan's block rows R, serial, against the same step with the passes on a second stream:
    two buffers of R/2 rows (the same workspace) and of R rows (twice it); with and without the gradient."""
    import fused_ce

    N, D, V = SHAPES[shape]
    x, w, t = make_inputs(N, D, V, "cuda")
    R = fused_ce.plan(x.requires_grad_(), w, t).block_rows
    x = x.detach()
    t = torch.where(t < 0, -1, t)
    half = max(128, R // 2 // 128 * 128)
    variants = {  # name: (rows, buffers, overlap)
        f"serial, 1 x {R} rows": (R, 1, False),
        f"serial, 1 x {half} rows": (half, 1, False),
        f"overlap, 2 x {half} rows": (half, 2, True),
        f"overlap, 2 x {R} rows": (R, 2, True),
    }
    out = []
    for grad in (False, True):
        steps, outputs = {}, {}
        for name, (rows, buffers, overlap) in variants.items():
            steps[name], outputs[name] = block_step(x, w, t, rows, buffers, grad, overlap)
            steps[name]()
        torch.cuda.synchronize()
        base = next(iter(outputs.values()))
        checked = 2 if grad else 1  # lse, and dX with the gradient
        errors = {
            name: max((a.float() - b.float()).abs().max().item() for a, b in zip(v[:checked], base[:checked]))
            for name, v in outputs.items()
        }
        medians = interleaved_ms(steps, warmup, repeat)
        first = next(iter(medians.values()))
        for name, ms in medians.items():
            out.append(
                dict(
                    kernel="overlap",
                    shape=shape,
                    grad=grad,
                    variant=name,
                    ms=ms,
                    of_serial=first / ms,
                    max_diff=errors[name],
                )
            )
        del steps, outputs
        torch.cuda.empty_cache()
    return out


def main():
    parser = shape_parser(__doc__, repeat=5)
    parser.add_argument("--parts", default="row_stats,softmax_grad", help="also: passes, partials, overlap, grad_tiles")
    parser.add_argument("--gemm-shapes", default="A,B,C", help="shapes of the overlap part")
    args = parser.parse_args()
    parts = args.parts.split(",")
    N, D, V = SHAPES[args.shape]
    # (the overlap part makes its own, per shape)
    if {"row_stats", "softmax_grad", "passes", "partials"} & set(parts):
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
    if "passes" in parts:
        result["passes"] = tune_passes(x, w, t, args.repeat)
        print("passes over stored logits, embedded (AOT) against JIT on the same rows (profiler kernel times):")
        for r in result["passes"]:
            print(
                f"  {r['build']:4s} {r['kernel']:24s} {r['launches']:3d}x  {r['ms_per_call']:.3f} ms per call  "
                f"{r['tb_per_s']:.2f} TB/s"
            )
    if "partials" in parts:
        result["partials"] = tune_partials(x, w, kernel_t, args.repeat)
        print("statistics pass over a 2048-row block (logit_partials + combine_partials, JIT, in situ):")
        for r in sorted(result["partials"], key=lambda r: (r["kind"], r["ms"])):
            print(f"  {r['kind']:8s} {str(r['config']):14s} {r['ms']:.3f} ms  {r['tb_per_s']:.2f} TB/s")
    if "grad_tiles" in parts:
        result["grad_tiles"] = tune_grad_tiles(args.shape, args.warmup, args.repeat)
        print(
            "grad_filter_eps's mask and products over a row block's live tiles (JIT), peaked logits, and cuBLAS's "
            "dense products; dX (joined, features, K, warps, stages), dW (features, K, warps, stages):"
        )
        for r in result["grad_tiles"]:
            print(f"  scale {r['scale']} {r['rows']} rows  {r['case']:28s} live {r['live']:.3f} {r['ms']:7.3f} ms  "
                  f"{r['tflops']:5.0f} TFLOP/s of live work")  # fmt: skip
    per_shape = {  # the parts that make their own inputs per shape: (function, title, a row's line)
        "overlap": (
            tune_overlap,
            "the stored-logits step with its passes on a second stream (JIT kernels; x: serial / this):",
            lambda r: (
                f"  {r['shape']} {'fwd+bwd' if r['grad'] else 'loss only':9s} {r['variant']:28s} "
                f"{r['ms']:8.2f} ms  {r['of_serial']:.3f}x  lse/dX max diff from serial {r['max_diff']:.1e}"
            ),
        ),
    }
    for part, (tune, title, line) in per_shape.items():
        if part in parts:
            result[part] = [r for shape in args.gemm_shapes.split(",") for r in tune(shape, args.warmup, args.repeat)]
            print(title)
            for r in result[part]:
                print(line(r))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
