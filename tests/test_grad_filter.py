"""Opt-in gradient filtering (``grad_filter_eps``): the loss exact; dX and dW those of the logits' gradient with
every tile (64 rows of a block's counted rows x 128 classes) whose non-target entries are all below the threshold
dropped, the targets' entries kept; against that float64 reference on CPU and CUDA, bfloat16 within torch's own
error of it; what the plan says; the errors."""

import pytest
import torch

import fused_ce
from fused_ce import linear_cross_entropy
from helpers import DEVICES
from reference import rel_err

EPS = 2.0**-12
TILE = (64, 128)  # configs.ARCH_CONSTANTS' filter tile


def peaked_problem(N, D, V, device, dtype=torch.float32, sharpness=3.0, seed=0):
    """A trained head's shape of softmax: each row's hidden state near its target's weight row (plus noise), so
    that most of each row's probability sits on few classes; 10% of rows ignored."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) / D**0.5 * 2
    t = torch.randint(0, V, (N,), generator=g)
    x = sharpness * w[t] * D**0.5 / 2 + torch.randn(N, D, generator=g)
    t[torch.rand(N, generator=g) < 0.1] = -100
    return x.to(device, dtype), w.to(device, dtype), t.to(device)


def input_tile_rows(x):
    """Rows of dX's tiles where x's call runs: on CUDA its products join the mask's row tiles (configs'
    sparse_grad_input), elsewhere the mask's."""
    if not x.is_cuda:
        return TILE[0]
    from fused_ce.kernels import configs

    major, minor = torch.cuda.get_device_capability(x.device)
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[x.dtype]
    return configs.config("grad_tiles", 10 * major + minor, dtype, "sparse_grad_input").block_n


def filtered_reference(x, w, t, eps, reduction="mean", z_loss=0.0, block_rows=None):
    """float64 dX, dW of the filtered gradient (tiles over the counted rows in order, as the plan runs them: from
    the start of each block of `block_rows`; dX's of input_tile_rows(x) rows), the exact ones, and the fraction of
    live tiles."""
    counted = t >= 0
    xd, wd, tc = x[counted].double(), w.double(), t[counted]
    n, V = len(tc), w.shape[0]
    z = xd @ wd.T
    lse = z.logsumexp(-1)
    p = (z - lse[:, None]).exp()
    onehot = torch.zeros_like(p)
    onehot[torch.arange(n), tc] = 1
    alpha = (1.0 if reduction == "sum" else 1.0 / n) * (1 + 2 * z_loss * lse)
    g = alpha[:, None] * p - onehot * (1.0 if reduction == "sum" else 1.0 / n)
    above = (p * alpha[:, None].abs() >= eps * alpha[:, None].abs()) & (onehot == 0)

    def kept(rows):  # (each block's tiles of `rows` rows live where an entry is above, and their fraction)
        keep, live = [], []
        for r0 in range(0, n, block_rows or n):
            block = above[r0 : r0 + (block_rows or n)]
            rt, vt = -(-len(block) // rows), -(-V // TILE[1])
            padded = torch.zeros(rt * rows, vt * TILE[1], dtype=torch.bool, device=x.device)
            padded[: len(block), :V] = block
            tiles = padded.view(rt, rows, vt, TILE[1]).any(3).any(1)
            keep.append(tiles.repeat_interleave(rows, 0).repeat_interleave(TILE[1], 1)[: len(block), :V])
            live.append(tiles.flatten())
        return g * (torch.cat(keep) | (onehot == 1)), torch.cat(live).double().mean().item()

    gf, live = kept(TILE[0])
    gf_input = kept(input_tile_rows(x))[0]

    def full(rows):
        return torch.zeros(len(t), x.shape[1], dtype=rows.dtype, device=x.device).index_copy_(
            0, counted.nonzero()[:, 0], rows
        )

    return (full(gf_input @ wd), gf.T @ xd), (full(g @ wd), g.T @ xd), live


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum", z_loss=1e-3)], ids=["mean", "sum-zloss"])
def test_gradients_are_the_filtered_gradients(device, kw):
    x, w, t = peaked_problem(300, 32, 1000, device)
    inputs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    plan = fused_ce.plan(*inputs, t, grad_filter_eps=EPS, **kw)
    assert plan.filters_grads and plan.block_rows >= plan.rows, plan  # (one block: the reference's tiles)
    loss = linear_cross_entropy(*inputs, t, grad_filter_eps=EPS, **kw)
    torch.testing.assert_close(loss, linear_cross_entropy(x, w, t, **kw), rtol=0, atol=0)  # the loss is exact
    loss.backward()
    filtered, exact, live = filtered_reference(x, w, t, EPS, **kw)
    assert 0.05 < live < 0.95, live  # some tiles skipped, some kept
    # the exact path's own error on these peaked logits (large ones: float32's rounding of the softmax shows)
    unfiltered = [v.clone().requires_grad_() for v in (x, w)]
    linear_cross_entropy(*unfiltered, t, **kw).backward()
    for got, want, full, own in zip([v.grad for v in inputs], filtered, exact, unfiltered, strict=True):
        bound = max(1e-5, 2 * rel_err(own.grad, full))
        assert rel_err(got, want) <= bound, (rel_err(got, want), bound)
        assert rel_err(want, full) > 10 * rel_err(got, want)  # (the filter dropped something measurable)


@pytest.mark.cuda
def test_bfloat16_within_torchs_own_error_of_the_filtered_gradient():
    x, w, t = peaked_problem(2000, 256, 8192, "cuda", dtype=torch.bfloat16, sharpness=2.0)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    plan = fused_ce.plan(xl, wl, t, grad_filter_eps=EPS)
    assert plan.filters_grads and plan.strategy == "stored_logits", plan
    linear_cross_entropy(xl, wl, t, grad_filter_eps=EPS).backward()
    filtered, _, live = filtered_reference(x, w, t, EPS)
    assert live < 0.9, live
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy((xe @ we.T).float(), t).backward()  # torch eager, bf16 products
    _, exact, _ = filtered_reference(x, w, t, 0.0)
    for got, want, eager, full in zip((xl.grad, wl.grad), filtered, (xe.grad, we.grad), exact, strict=True):
        assert rel_err(got, want) <= 2 * rel_err(eager, full) + 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_off_by_default_and_where_the_plan_does_not_filter(device):
    x, w, t = peaked_problem(200, 16, 600, device)
    xl = x.clone().requires_grad_()
    assert not fused_ce.plan(xl, w, t).filters_grads
    assert not fused_ce.plan(xl, w, t, grad_filter_eps=EPS, pass_="backward").filters_grads
    # eps 0 is the exact path, bit for bit
    a = [v.clone().requires_grad_() for v in (x, w)]
    b = [v.clone().requires_grad_() for v in (x, w)]
    linear_cross_entropy(*a, t, grad_filter_eps=0.0).backward()
    linear_cross_entropy(*b, t).backward()
    for u, v in zip(a, b, strict=True):
        assert u.grad is not None
        torch.testing.assert_close(u.grad, v.grad, rtol=0, atol=0)


def test_errors_name_the_argument():
    x, w, t = peaked_problem(20, 8, 50, "cpu")
    with pytest.raises(ValueError, match="linear_cross_entropy: grad_filter_eps must be in \\[0, 1\\), got -1"):
        linear_cross_entropy(x, w, t, grad_filter_eps=-1.0)
    with pytest.raises(ValueError, match="grad_filter_eps does not combine with label_smoothing"):
        linear_cross_entropy(x, w, t, grad_filter_eps=EPS, label_smoothing=0.1)
    with pytest.raises(ValueError, match="grad_filter_eps applies to a scalar loss"):
        linear_cross_entropy(x, w, t, grad_filter_eps=EPS, reduction="none")
    with pytest.raises(ValueError, match="grad_filter_eps is not supported for a K-dimensional loss"):
        linear_cross_entropy(x, w.reshape(50, 1, 8), t.reshape(20, 1), grad_filter_eps=EPS)


def test_compiles_with_the_option():
    x, w, t = peaked_problem(100, 16, 400, "cpu")
    xl = x.clone().requires_grad_()

    def f(x, w, t):
        return linear_cross_entropy(x, w, t, grad_filter_eps=EPS)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    got = torch.autograd.grad(compiled(xl, w, t), xl)[0]
    want = torch.autograd.grad(f(xl, w, t), xl)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_several_blocks_and_targets_shared_by_rows(device):
    """dW over several row blocks (the first writes it, the others add) in the plan's dW dtype, and the skipped
    targets' terms of rows sharing a target (summed per target before one addition): against the float64 filtered
    reference, and the same bits on a second call."""
    x, w, t = peaked_problem(640, 32, 1000, device, sharpness=6.0)
    t = torch.where(t >= 0, t % 7 * 131, t)  # 7 targets, each of ~80 rows, in different vocabulary tiles
    x = 6.0 * w[t.clamp_min(0)] * 32**0.5 / 2 + torch.randn_like(x)
    budget = 200 * 1000 * x.element_size()  # a few hundred rows a block
    inputs = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    plan = fused_ce.plan(*inputs, t, grad_filter_eps=EPS, workspace_bytes=budget)
    assert plan.filters_grads and plan.block_rows < plan.rows, plan
    linear_cross_entropy(*inputs, t, grad_filter_eps=EPS, workspace_bytes=budget).backward()
    filtered, exact, live = filtered_reference(x, w, t, EPS, block_rows=plan.block_rows)
    assert live < 0.9, live
    own = [v.clone().requires_grad_() for v in (x, w)]
    linear_cross_entropy(*own, t, workspace_bytes=budget).backward()
    for got, want, full, mine in zip([v.grad for v in inputs], filtered, exact, own, strict=True):
        assert rel_err(got, want) <= max(1e-5, 2 * rel_err(mine.grad, full)), rel_err(got, want)
    again = [v.clone().requires_grad_() for v in (x, w)]
    linear_cross_entropy(*again, t, grad_filter_eps=EPS, workspace_bytes=budget).backward()
    for a, b in zip(inputs, again, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_memory_within_the_exact_plans():
    """On CUDA the filtered products sum dW in the plan's dW dtype (bf16 here, in dW itself: the in_dtype flavor):
    the peak beyond inputs and gradients is the exact plan's plus the tile lists and dX's partial sums."""
    x, w, t = peaked_problem(2000, 256, 8192, "cuda", dtype=torch.bfloat16, sharpness=2.0)

    def peak(**kw):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(xl, wl, t, **kw).backward()  # (cuBLAS's workspace and the cubins: not ours)
        xl.grad = wl.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            linear_cross_entropy(xl, wl, t, **kw).backward()
            torch.cuda.synchronize()
        assert wl.grad.dtype == torch.bfloat16
        grads = xl.grad.numel() * 2 + wl.grad.numel() * 2
        return torch.cuda.max_memory_allocated() - base - grads, {e.name for e in prof.events()}

    exact, _ = peak()
    filtered, kernels = peak(grad_filter_eps=EPS)
    assert any("sparse_grad_weight_kernel" in k for k in kernels), kernels
    assert filtered <= exact + 8 * 2000 * 256 * 4 + (4 << 20), (filtered, exact)
