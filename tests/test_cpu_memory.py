"""The CPU path's memory: bfloat16 and float16 calls hold at most workspace_bytes plus one block beyond their
inputs and gradients (the weight is never converted to float32, the products run in the input dtype as torch's),
and never more than 1.5x torch's own peak for the same call. Allocations are counted with torch's profiler."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import fused_ce

MiB = 1 << 20


def cpu_peak_bytes(fn):
    """The most CPU memory fn held at once beyond what was allocated before it (the profiler's allocations)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def problem(N, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * D**-0.5).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[::5] = -100
    return x, w, t


def fused_call(x, w, t, workspace, grad, **keywords):
    if not grad:
        with torch.no_grad():
            return lambda: fused_ce.linear_cross_entropy(x, w, t, workspace_bytes=workspace, **keywords)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    return lambda: fused_ce.linear_cross_entropy(xl, wl, t, workspace_bytes=workspace, **keywords).backward()


def torch_call(x, w, t, grad, reduction="mean"):
    if not grad:
        return lambda: F.cross_entropy((x @ w.T).float(), t, reduction=reduction)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    return lambda: F.cross_entropy((xl @ wl.T).float(), t, reduction=reduction).sum().backward()


def budget_and_block(x, w, t, workspace, grad, **keywords):
    """The budget and the largest block (its bytes as planned) of the passes the call runs, the latter with the
    scratch torch's own product of such a block holds beyond its output (oneDNN's on CPUs with AMX: ~2.7 MiB for
    a [5, 1024] x [1024, 32768] bf16 product), which no budget of ours governs."""
    passes = ["forward"] if not grad else ["forward_with_grad", "forward", "backward"]
    plans = [fused_ce.plan(x, w, t, pass_=p, workspace_bytes=workspace, **keywords) for p in passes]
    rows = max(min(p.block_rows, x.shape[0]) for p in plans)
    block = torch.ones(rows, w.shape[0], dtype=x.dtype)
    products = (lambda: x[:rows] @ w.T, lambda: block @ w, lambda: block.T @ x[:rows])  # logits, dX, dW
    scratch = max(cpu_peak_bytes(product) - out_bytes for product, out_bytes in
                  zip(products, (block.nbytes, rows * w.shape[1] * x.element_size(), w.nbytes)))  # fmt: skip
    return plans[0].budget_bytes, max(p.workspace_bytes for p in plans) + max(0, scratch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "fwd_bwd"])
@pytest.mark.parametrize("workspace", [1 * MiB, None], ids=["1MiB", "default"])
def test_half_precision_peak_within_the_workspace_and_torchs(dtype, grad, workspace):
    N, D, V = (256 if grad else 64), 1024, 32768  # a 64 MiB weight: converted, it would dwarf both budgets
    x, w, t = problem(N, D, V, dtype)
    gradients = (N * D + V * D) * x.element_size() if grad else 0  # what the call returns, as torch's
    budget, block = budget_and_block(x, w, t, workspace, grad)
    fused = cpu_peak_bytes(fused_call(x, w, t, workspace, grad)) - gradients
    own = cpu_peak_bytes(torch_call(x, w, t, grad)) - gradients
    assert fused <= budget + block, (fused / MiB, budget / MiB, block / MiB)
    assert fused + gradients <= 1.5 * (own + gradients), (fused / MiB, own / MiB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_features_within_the_workspace(dtype):
    # the softcap's slope, the entropy and label smoothing's class weights: one more temporary at most, counted
    N, D, V = 128, 512, 16384
    x, w, t = problem(N, D, V, dtype, seed=1)
    cw = torch.rand(V) + 0.5
    workspace = 2 * MiB
    for keywords in (dict(softcap=15.0), dict(label_smoothing=0.1, weight=cw), dict(z_loss=1e-4)):
        budget, block = budget_and_block(x, w, t, workspace, True, **keywords)
        gradients = (N * D + V * D) * x.element_size()
        fused = cpu_peak_bytes(fused_call(x, w, t, workspace, True, **keywords)) - gradients
        assert fused <= budget + block, (keywords, fused / MiB)
    xl = x.clone().requires_grad_()
    with_entropy = lambda: fused_ce.linear_log_probs(xl, w, t, return_entropy=True, workspace_bytes=workspace)  # noqa: E731
    fused = cpu_peak_bytes(lambda: sum(v.sum() for v in with_entropy()[:2]).backward()) - N * D * x.element_size()
    assert fused <= workspace + 2 * 128 * V * 4, fused / MiB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_torchs_error(dtype):
    # the products in the input dtype, as torch's: the loss and gradients within torch's own error against
    # float64 (dW summed in float32 where that fits in the budget, else by vocabulary slices summed in float32)
    N, D, V = 1024, 64, 4096
    x, w, t = problem(N, D, V, dtype, seed=2)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(xr @ wr.T, t)
    ref.backward()
    errors = {}
    for name, fn in {
        "torch": lambda xl, wl: F.cross_entropy((xl @ wl.T).float(), t),
        "fused_ce": lambda xl, wl: fused_ce.linear_cross_entropy(xl, wl, t),
        "fused_ce_blocks": lambda xl, wl: fused_ce.linear_cross_entropy(xl, wl, t, workspace_bytes=2 * MiB),
    }.items():
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xl, wl)
        loss.backward()
        pairs = ((loss, ref), (xl.grad, xr.grad), (wl.grad, wr.grad))
        errors[name] = [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]
    # (float16's gradients come from the recomputing backward on the CPU: gradients_in_forward, csrc/plan.h)
    blocks = fused_ce.plan(x, w, t, workspace_bytes=2 * MiB, pass_="forward_with_grad" if dtype == torch.bfloat16
                           else "backward")  # fmt: skip
    assert blocks.block_rows < N // 8 and blocks.grad_weight_dtype == torch.float32  # dW summed in float32
    for name in ("fused_ce", "fused_ce_blocks"):
        for got, want in zip(errors[name], errors["torch"]):
            assert got <= 1.5 * want + 1e-6, errors


def _every_op(x, w, t, workspace):
    """A fwd+bwd call of each op at `workspace`, its leaves fresh."""
    g = torch.Generator().manual_seed(4)
    xt = torch.randn(x.shape[0], 64, generator=g).to(x.dtype)
    wt = (torch.randn(w.shape[0], 64, generator=g) / 8).to(x.dtype)
    adv = torch.randn(x.shape[0], generator=g)
    full = t.clamp(min=0)
    ops = {
        "linear_cross_entropy": lambda x, w: fused_ce.linear_cross_entropy(x, w, t, workspace_bytes=workspace),
        "linear_log_probs": lambda x, w: fused_ce.linear_log_probs(x, w, full, workspace_bytes=workspace).sum(),
        "linear_policy_loss": lambda x, w: fused_ce.linear_policy_loss(x, w, full, adv, workspace_bytes=workspace),
        "linear_distillation_loss": lambda x, w: fused_ce.linear_distillation_loss(
            x, w, xt, wt, t, workspace_bytes=workspace
        ),
        "linear_distillation_loss, 'none'": lambda x, w: fused_ce.linear_distillation_loss(
            x, w, xt, wt, t, reduction="none", workspace_bytes=workspace
        ).sum(),
    }
    for name, op in ops.items():
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        yield name, lambda op=op, xl=xl, wl=wl: op(xl, wl).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_within_the_workspace(dtype):
    # docs/usage.md's bound for every op: beyond inputs and gradients at most workspace_bytes (a [V, D] product
    # per block beside dW, 48.8 MiB here, would pass it sixfold)
    N, D, V = 128, 256, 50000
    x, w, t = problem(N, D, V, dtype, seed=3)
    workspace = 8 * MiB
    gradients = (N * D + V * D) * x.element_size()
    for name, call in _every_op(x, w, t, workspace):
        held = cpu_peak_bytes(call) - gradients
        assert held <= workspace + MiB, (name, held / MiB)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_weight_grad_slices_within_the_workspace(dtype, reduction):
    # 38 row blocks at this budget: dW from vocabulary slices summed in float32 (Plan::weight_grad_slice_classes),
    # their accumulator and blocks within the budget too
    N, D, V = 1024, 256, 50000
    x, w, t = problem(N, D, V, dtype, seed=5)
    workspace = 8 * MiB
    assert fused_ce.plan(
        x, w, t, reduction=reduction, workspace_bytes=workspace, pass_="backward"
    ).weight_grad_slice_classes
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = lambda: fused_ce.linear_cross_entropy(xl, wl, t, reduction=reduction, workspace_bytes=workspace)  # noqa: E731
    held = cpu_peak_bytes(lambda: loss().sum().backward()) - (N * D + V * D) * x.element_size()
    assert held <= workspace + MiB, held / MiB
