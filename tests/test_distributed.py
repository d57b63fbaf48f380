"""Vocabulary parallel over torch.distributed (fused_ce/distributed.py): gloo on CPU, 2 and 4 processes.

Every rank's loss, lse and gradients must equal the single-process result (float32, 1e-5 relative):
uneven shards, shards out of rank order, every keyword and reduction, DTensor inputs (replicated and
sequence parallel), FSDP2 (the supported pattern, the refused misuse, and FSDP2 + TP on a 2-D mesh),
torch.compile(fullgraph=True) of a tensor-parallel step. One spawn per case list: each checks many.
The same equality on two GPUs over NCCL, and the compiled step there, is test_nccl_* (device only).
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fused_ce

N, D, V = 37, 16, 50
TOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world, *args, backend="gloo"):
    mp.spawn(_entry, args=(fn, world, free_port(), backend, args), nprocs=world, join=True)


def _entry(rank, fn, world, port, backend, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # no rank tears the group down while another still uses it (gloo then aborts the other process:
        # "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed: leave without interpreter finalization, where tensors still held by gloo's worker
    # threads can abort the process the same way (seen about once in five full suite runs; the mechanism as
    # pytorch/pytorch#179291 describes it). A failure above still raises and fails the spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def problem(device="cpu", dtype=torch.float32, n=N, d=D, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d**0.5 * 4
    b = torch.randn(v, generator=g, dtype=torch.float64)
    cw = torch.rand(v, generator=g, dtype=torch.float64) + 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    return [u.to(device=device, dtype=dtype if u.is_floating_point() else u.dtype) for u in (x, w, b, cw)] + [
        t.to(device)
    ]


KEYWORDS = [
    {},
    dict(reduction="sum"),
    dict(reduction="none"),
    dict(weight=True),
    dict(weight=True, label_smoothing=0.2),
    dict(label_smoothing=0.1, reduction="sum"),
    dict(z_loss=1e-2, softcap=3.0, logit_scale=1.5),
    dict(bias=True, weight=True, label_smoothing=0.1, z_loss=1e-3, reduction="none"),
    dict(ignore_index=7),
    dict(return_lse=True),
]


def run_case(x, w, t, b, cw, shard, group, kw, vocab_start=None):
    """(outputs, dX, dW shard, db shard) of one call; with shard=(start, rows) a vocabulary-parallel one."""
    kw = dict(kw)
    start, rows = shard
    use_bias, use_weight = kw.pop("bias", False), kw.pop("weight", False)
    xg = x.detach().clone().requires_grad_()
    wg = w[start : start + rows].detach().clone().requires_grad_()
    bg = b[start : start + rows].detach().clone().requires_grad_() if use_bias else None
    extra = dict(process_group=group, vocab_start=vocab_start) if group is not None else {}
    out = fused_ce.linear_cross_entropy(xg, wg, t, linear_bias=bg, weight=cw if use_weight else None, **kw, **extra)
    loss, lse = out if kw.get("return_lse") else (out, None)
    total = loss.sum() + (lse.sum() * 0.3 if lse is not None else 0)  # a gradient through the lse too
    total.backward()
    outs = (loss,) if lse is None else (loss, lse)
    return outs, xg.grad, wg.grad, bg.grad if use_bias else None


def check_every_keyword(rank, world, sizes, order):
    """sizes[r] rows on rank r; `order` lists the ranks by the position of their shard (None: rank order)."""
    x, w, b, cw, t = problem()
    if order is None:
        start, vocab_start = sum(sizes[:rank]), None
    else:
        start = sum(sizes[r] for r in order[: order.index(rank)])
        vocab_start = start
    # every rank plans for the largest shard: the same row blocks, so the same collectives
    plan = fused_ce.plan(
        x.requires_grad_(), w[start : start + sizes[rank]], t, process_group=dist.group.WORLD, vocab_start=vocab_start
    )
    x = x.detach()
    plans = [None] * world
    dist.all_gather_object(plans, (plan.strategy, plan.block_rows, plan.tile_cols))
    assert all(p == plans[0] for p in plans) and plan.tile_cols == max(sizes), plans
    for kw in KEYWORDS:
        t = torch.where(t < 0, kw.get("ignore_index", -100), t)
        ref = run_case(x, w, t, b, cw, (0, V), None, kw)
        got = run_case(x, w, t, b, cw, (start, sizes[rank]), dist.group.WORLD, kw, vocab_start)
        for o, r in zip(got[0], ref[0]):
            assert rel(o, r) < TOL, (kw, "loss/lse", rel(o, r))
        assert rel(got[1], ref[1]) < TOL, (kw, "dX", rel(got[1], ref[1]))
        assert rel(got[2], ref[2][start : start + sizes[rank]]) < TOL, (kw, "dW")
        if got[3] is not None:
            assert rel(got[3], ref[3][start : start + sizes[rank]]) < TOL, (kw, "db")


@pytest.mark.parametrize(
    "world, sizes, order",
    [(2, [20, 30], None), (2, [30, 20], [1, 0]), (4, [13, 12, 15, 10], None), (4, [13, 12, 15, 10], [2, 0, 3, 1])],
)
def test_every_keyword_matches_one_process(world, sizes, order):
    spawn(check_every_keyword, world, sizes, order)


def check_policy_loss(rank, world):
    # linear_policy_loss on a vocabulary shard: loss, stats, dX and this rank's dW rows as in one process
    x, w, b, _, t = problem(dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(t.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp = fused_ce.linear_log_probs(x, w, t)
    old = lp + 0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64)
    ref = lp + 0.2 * torch.randn(t.shape, generator=g, dtype=torch.float64)
    sizes = [V // 3, V - V // 3][:world]  # uneven shards
    start = sum(sizes[:rank])
    kw = dict(old_log_probs=old, ref_log_probs=ref, kl_coef=0.05, kl_times_ratio=True, entropy_coef=0.01,
              temperature=0.9, softcap=4.0, return_stats=True)  # fmt: skip
    for bias in (False, True):
        xs, ws = x.clone().requires_grad_(), w[start : start + sizes[rank]].clone().requires_grad_()
        bs = b[start : start + sizes[rank]].clone().requires_grad_() if bias else None
        loss, stats = fused_ce.linear_policy_loss(xs, ws, t, adv, linear_bias=bs, process_group=dist.group.WORLD,
                                                  **kw)  # fmt: skip
        loss.backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        br = b.clone().requires_grad_() if bias else None
        want, want_stats = fused_ce.linear_policy_loss(xr, wr, t, adv, linear_bias=br, **kw)
        want.backward()
        assert rel(loss, want) < 1e-12, (bias, loss, want)
        assert rel(torch.stack(list(stats)), torch.stack(list(want_stats))) < 1e-12, (bias, stats, want_stats)
        assert rel(xs.grad, xr.grad) < 1e-12
        assert rel(ws.grad, wr.grad[start : start + sizes[rank]]) < 1e-12
        if bias:
            assert rel(bs.grad, br.grad[start : start + sizes[rank]]) < 1e-12


def test_policy_loss_vocabulary_parallel():
    spawn(check_policy_loss, 2)


def check_log_probs(rank, world, sizes):
    # linear_log_probs on a vocabulary shard: log-probs, entropy and argmax combined over the shards, and the
    # gradients of both float outputs, as in one process (float64); an argmax tied across two shards is the lower
    x, w, b, _, t = problem(dtype=torch.float64)
    tied_low, tied_high = 3, V - 2  # on the first and the last shard
    x[0] = 0.0
    x[0, 0] = 1.0  # row 0's logits are w[:, 0] + b, exact in any summation order
    w[tied_low, 0] = w[tied_high, 0] = 20.0  # its most likely class, and its twin
    b[tied_high] = b[tied_low]
    t[0] = 11
    g = torch.Generator().manual_seed(6)
    u1, u2 = (
        torch.randn(t.shape, generator=g, dtype=torch.float64),
        torch.randn(t.shape, generator=g, dtype=torch.float64),
    )
    start = sum(sizes[:rank])
    for kw in (dict(), dict(temperature=0.7, softcap=4.0, bias=True)):
        kw = dict(kw)
        bias = kw.pop("bias", False)
        xs, ws = x.clone().requires_grad_(), w[start : start + sizes[rank]].clone().requires_grad_()
        bs = b[start : start + sizes[rank]].clone().requires_grad_() if bias else None
        got = fused_ce.linear_log_probs(xs, ws, t, linear_bias=bs, return_entropy=True, return_argmax=True,
                                        process_group=dist.group.WORLD, **kw)  # fmt: skip
        ((got.log_probs * u1).sum() + (got.entropy * u2).sum()).backward()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        br = b.clone().requires_grad_() if bias else None
        want = fused_ce.linear_log_probs(xr, wr, t, linear_bias=br, return_entropy=True, return_argmax=True, **kw)
        ((want.log_probs * u1).sum() + (want.entropy * u2).sum()).backward()
        assert rel(got.log_probs, want.log_probs) < 1e-12 and rel(got.entropy, want.entropy) < 1e-12, kw
        assert torch.equal(got.argmax, want.argmax) and got.argmax[0] == tied_low, (kw, got.argmax[0])
        assert (got.argmax[t == -100] == -1).all()
        assert rel(xs.grad, xr.grad) < 1e-12
        assert rel(ws.grad, wr.grad[start : start + sizes[rank]]) < 1e-12
        if bias:
            assert rel(bs.grad, br.grad[start : start + sizes[rank]]) < 1e-12


@pytest.mark.parametrize("world, sizes", [(2, [20, 30]), (4, [13, 12, 15, 10])])
def test_log_probs_entropy_argmax_vocabulary_parallel(world, sizes):
    spawn(check_log_probs, world, sizes)


def check_bad_layouts(rank, world):
    x, w, b, cw, t = problem()
    with pytest.raises(ValueError, match="do not tile"):  # both ranks claim class 0
        fused_ce.linear_cross_entropy(x, w[:25], t, process_group=dist.group.WORLD, vocab_start=0)
    with pytest.raises(ValueError, match="vocab_start needs a process_group"):
        fused_ce.linear_cross_entropy(x, w, t, vocab_start=0)
    # the module takes the same keywords: num_classes is this rank's shard, class weights stay global
    head = fused_ce.LinearCrossEntropyLoss(D, 25, weight=cw, process_group=dist.group.WORLD)
    with torch.no_grad():
        head.linear.weight.copy_(w[rank * 25 : (rank + 1) * 25])
    expected = fused_ce.linear_cross_entropy(x, w, t, weight=cw)
    assert rel(head(x, t), expected) < TOL
    with pytest.raises(IndexError, match="target 50 is out of bounds"):  # targets are global: V = 50
        bad = t.clone()
        bad[0] = V
        fused_ce.linear_cross_entropy(x, w[rank * 25 : (rank + 1) * 25], bad, process_group=dist.group.WORLD)


def test_bad_layouts_and_targets_are_errors():
    spawn(check_bad_layouts, 2)


def check_dtensor(rank, world, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x, w, b, cw, t = problem(n=2 * 12)
    x3, t3 = x.reshape(2, 12, D), t.reshape(2, 12)
    ref = run_case(x3, w, t3, b, cw, (0, V), None, dict(label_smoothing=0.1, weight=True))
    wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
    xd = distribute_tensor(x3.clone(), mesh, [Shard(1) if sequence_parallel else Replicate()]).requires_grad_()
    loss = fused_ce.linear_cross_entropy(xd, wd, t3, weight=cw, label_smoothing=0.1)
    loss.backward()
    assert rel(loss, ref[0][0]) < TOL
    assert tuple(wd.grad.placements) == (Shard(0),) and rel(wd.grad.full_tensor(), ref[2]) < TOL
    # the shards' parts of dX: reduced (sequence parallel: reduce-scattered) or labelled Partial, never a
    # partial sum labelled Replicate
    expected = (Shard(1),) if sequence_parallel else (Partial(),)
    assert tuple(xd.grad.placements) == expected, xd.grad.placements
    assert rel(xd.grad.full_tensor(), ref[1]) < TOL
    if sequence_parallel:  # the same step compiled (fullgraph): DTensors need no eager call first

        def step(xd, wd):
            return fused_ce.linear_cross_entropy(xd, wd, t3, weight=cw, label_smoothing=0.1)

        wc = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        xc = distribute_tensor(x3.clone(), mesh, [Shard(1)]).requires_grad_()
        compiled = torch.compile(step, fullgraph=True)(xc, wc)
        compiled.backward()
        assert rel(compiled, loss) < TOL and rel(wc.grad.full_tensor(), wd.grad.full_tensor()) < TOL
        assert rel(xc.grad.full_tensor(), xd.grad.full_tensor()) < TOL


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dtensor_weight_and_input(sequence_parallel):
    spawn(check_dtensor, 2, sequence_parallel)


class Head(nn.Module):
    """An lm_head whose loss is fused_ce, called inside the module's forward (the FSDP2 pattern)."""

    def __init__(self):
        super().__init__()
        self.lm = nn.Linear(D, V, bias=False)

    def forward(self, hidden, target):
        weight = self.lm.weight
        if type(weight).__name__ == "DTensor":  # FSDP2 + TP: the TP shard, gathered over the DP ranks
            from torch.distributed.tensor import DTensor, Replicate

            hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()])
        return fused_ce.linear_cross_entropy(hidden, weight, target, reduction="sum")


def check_fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    head = Head()
    w0 = head.lm.weight.detach().clone()
    fully_shard(head, mesh=mesh)
    data = [problem(seed=r) for r in range(world)]  # each rank its own tokens
    x, t = data[rank][0], data[rank][4]
    # the misuse: the sharded weight outside the module's forward is refused, not taken as a vocabulary shard
    with pytest.raises(
        ValueError, match=r"FSDP2.*integrations\.transformers\.apply\(model\).*register_fsdp_forward_method"
    ):
        fused_ce.linear_cross_entropy(x, head.lm.weight, t)
    head(x, t).backward()
    expected = torch.zeros_like(w0)
    for xr, *_, tr in data:
        wr = w0.clone().requires_grad_()
        fused_ce.linear_cross_entropy(xr, wr, tr, reduction="sum").backward()
        expected += wr.grad / world  # FSDP2 averages over the data-parallel ranks
    assert rel(head.lm.weight.grad.full_tensor(), expected) < TOL


def test_fsdp2_inside_forward_and_misuse_error():
    spawn(check_fsdp2, 2)


def check_fsdp2_with_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    head = Head()
    w0 = head.lm.weight.detach().clone()
    parallelize_module(head, mesh["tp"], {"lm": ColwiseParallel()})
    fully_shard(head, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    data = [problem(seed=r) for r in range(2)]  # per data-parallel rank; the same on both TP ranks
    x, t = data[dp][0], data[dp][4]
    head(x, t).backward()
    expected = torch.zeros_like(w0)
    for xr, *_, tr in data:
        wr = w0.clone().requires_grad_()
        fused_ce.linear_cross_entropy(xr, wr, tr, reduction="sum").backward()
        expected += wr.grad / 2
    # the local gradient: FSDP2's rows (dp) of this rank's TP shard (tp); compared in place rather than
    # gathered (a 2-D _StridedShard gather is what this test would otherwise exercise)
    tp = mesh["tp"].get_local_rank()
    tp_rows = V // 2
    dp_rows = -(-tp_rows // 2)
    first = tp * tp_rows + dp * dp_rows
    local = head.lm.weight.grad.to_local()
    assert rel(local, expected[first : first + local.shape[0]]) < TOL


def test_fsdp2_with_tensor_parallel_on_2d_mesh():
    spawn(check_fsdp2_with_tp, 4)


def check_compiled_step(rank, world, device="cpu"):
    x, w, b, cw, t = problem(device)
    shard = w[rank * 25 : (rank + 1) * 25].clone()
    group = dist.group.WORLD

    def step(x, w):
        return fused_ce.linear_cross_entropy(x, w, t, process_group=group, z_loss=1e-3)

    eager = [u.detach().clone().requires_grad_() for u in (x, shard)]
    step(*eager).backward()  # also gathers the shard sizes, which the compiled step reuses
    compiled = [u.detach().clone().requires_grad_() for u in (x, shard)]
    loss = torch.compile(step, fullgraph=True)(*compiled)
    loss.backward()
    assert rel(loss, step(*eager)) < TOL
    for a, e in zip(compiled, eager):
        assert rel(a.grad, e.grad) < TOL


def test_compiled_tensor_parallel_step():
    spawn(check_compiled_step, 2)


def check_nccl(rank, world):
    N, D, V = 4096, 4096, 128256
    x, w, b, cw, t = problem("cuda", torch.bfloat16, N, D, V)
    rows = V // world
    kw = dict(label_smoothing=0.1, z_loss=1e-4)
    ref = run_case(x, w, t, b, cw, (0, V), None, kw)
    got = run_case(x, w, t, b, cw, (rank * rows, rows), dist.group.WORLD, kw)
    assert rel(got[0][0], ref[0][0]) < 1e-5
    assert rel(got[1], ref[1]) < 1e-2  # bf16: each rank's dX part rounded once, then summed
    assert rel(got[2], ref[2][rank * rows : (rank + 1) * rows]) < 1e-2
    check_compiled_step(rank, world, "cuda")  # fullgraph over NCCL's functional collectives


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a CUDA device: two GPUs")
def test_nccl_two_gpus_match_one():
    spawn(check_nccl, 2, backend="nccl")
