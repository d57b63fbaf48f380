"""Vocabulary-parallel fused_ce on several GPUs against one GPU and against torch's own TP loss.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py [--shape A] [--repeat 7]

Workload as benchmarks/bench.py (bf16, 10% ignored, mean loss, forward + backward), the weight split
by vocabulary over the ranks. Per rank: time (median, CUDA events, all ranks in step), workspace
(peak beyond inputs and gradients). Methods:
- fused_ce, 1 GPU: the whole weight on each GPU (what TP is measured against);
- fused_ce TP: `process_group=`, this rank's shard (one pass, 6NDV/P flops), and the two-pass plan a
  per-row loss takes (the loss, then a backward that recomputes the logits: 8NDV/P);
- torch TP: lm_head `ColwiseParallel(output_layouts=Shard(-1))` + `loss_parallel()` + F.cross_entropy
  on the logits shard, eager and torch.compile'd.
Communication is timed apart: the collectives fused_ce TP makes (two all-reduces of the row stats
per row block, one all-reduce of dX), alone, at the same sizes. Rank 0 prints the table and writes
tp.json and tp.png to --out.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fused_ce
from common import SHAPES, cuda_time_ms, environment, make_inputs, shape_parser


def timed(fn, warmup, repeat):
    def synced():
        dist.barrier()
        fn()

    return cuda_time_ms(synced, warmup, repeat)


def workspace_gib(fn, held_bytes):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - base - held_bytes) / 2**30


def main():
    args = shape_parser(__doc__, repeat=7).parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    N, D, V = SHAPES[args.shape]
    x, w, t = make_inputs(N, D, V, "cuda")
    rows = -(-V // world)
    start = rank * rows
    shard = w[start : start + rows].contiguous()
    group = dist.group.WORLD

    def step(weight, **kw):
        xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
        fused_ce.linear_cross_entropy(xg, wg, t, **kw).backward()
        return xg.grad, wg.grad

    results = {}
    one = lambda: step(w)  # noqa: E731
    tp = lambda: step(shard, process_group=group)  # noqa: E731
    grads = lambda weight: (N * D + weight.numel()) * 2  # noqa: E731
    results["fused_ce, 1 GPU"] = (timed(one, args.warmup, args.repeat), workspace_gib(one, grads(w)))
    results[f"fused_ce TP={world}"] = (timed(tp, args.warmup, args.repeat), workspace_gib(tp, grads(shard)))
    # the two-pass plan: the loss first (row stats combined once), the gradients in a backward that recomputes
    # the logits (8NDV/P flops instead of 6NDV/P): what a per-row loss takes
    counted = (t != -100).sum()

    def two_pass():
        xg, wg = x.detach().requires_grad_(), shard.detach().requires_grad_()
        (fused_ce.linear_cross_entropy(xg, wg, t, process_group=group, reduction="none").sum() / counted).backward()

    results[f"fused_ce TP={world}, two-pass"] = (
        timed(two_pass, args.warmup, args.repeat),
        workspace_gib(two_pass, grads(shard)),
    )

    # the collectives of fused_ce TP alone: per row block two all-reduces of [rows] / [5, rows] float32, and dX
    plan = fused_ce.plan(x.detach().requires_grad_(), shard.detach().requires_grad_(), t, process_group=group)
    blocks = -(-N // plan.block_rows)
    stats = [torch.ones(plan.block_rows, device="cuda"), torch.ones(5, plan.block_rows, device="cuda")]
    dx = torch.ones(N, D, device="cuda", dtype=torch.bfloat16)

    def collectives():
        for _ in range(blocks):
            dist.all_reduce(stats[0], op=dist.ReduceOp.MAX)
            dist.all_reduce(stats[1])
        dist.all_reduce(dx)

    comm_ms = timed(collectives, args.warmup, args.repeat)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = init_device_mesh("cuda", (world,))
    lm = torch.nn.Linear(D, V, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lm.weight.copy_(w)
    parallelize_module(lm, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))

    def torch_loss(xg):
        return F.cross_entropy(lm(xg).float(), t)

    compiled_loss = torch.compile(torch_loss)
    for name, fn in (
        ("torch TP + loss_parallel, eager", torch_loss),
        ("torch TP + loss_parallel, compile", compiled_loss),
    ):

        def torch_step(fn=fn):
            xg = x.detach().requires_grad_()
            lm.weight.grad = None
            with loss_parallel():
                fn(xg).backward()

        try:
            results[name] = (timed(torch_step, args.warmup, args.repeat), workspace_gib(torch_step, grads(shard)))
        except Exception as exc:  # a peer that fails is reported, not fatal
            results[name] = (float("nan"), float("nan"))
            if rank == 0:
                print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")

    every = [None] * world
    dist.all_gather_object(every, dict(results=results, comm_ms=comm_ms))
    if rank == 0:
        env = environment()
        base_ms = results["fused_ce, 1 GPU"][0]
        print(f"shape {args.shape} N={N} D={D} V={V} bf16, {world} ranks, {env['device']}, torch {env['torch']}")
        print(f"fused_ce TP plan per rank: {plan.strategy}, {plan.block_rows} rows x {blocks} blocks")
        print("| method | ms per rank (max over ranks) | vs 1 GPU | workspace GiB per rank (max) |")
        print("|---|---|---|---|")
        table = {}
        for name in results:
            ms = max(r["results"][name][0] for r in every)
            gib = max(r["results"][name][1] for r in every)
            table[name] = dict(ms=ms, workspace_gib=gib)
            print(f"| {name} | {ms:.2f} | {ms / base_ms:.3f}x | {gib:.2f} |")
        comm = max(r["comm_ms"] for r in every)
        print(
            f"communication of fused_ce TP, timed alone: {comm:.2f} ms ({blocks} x 2 stats all-reduces + dX all-reduce)"
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp.json").write_text(
            json.dumps(dict(environment=env, shape=args.shape, world=world, table=table, comm_ms=comm), indent=1)
        )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
        names = list(table)
        a.barh(names, [table[n]["ms"] for n in names])
        a.set(xlabel="ms per fwd+bwd (max over ranks)")
        b.barh(names, [table[n]["workspace_gib"] for n in names])
        b.set(xlabel="workspace GiB per rank")
        b.set_yticklabels([])
        fig.suptitle(f"shape {args.shape}, {world} x {env['device']}", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "tp.png", dpi=120)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
