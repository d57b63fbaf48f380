"""Autograd paths, dtypes, autocast, float16 range and determinism."""

import math

import pytest
import torch

import fused_ce
from helpers import DEVICES, leaves
from reference import make_problem, reference_loss, rel_err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_from_forward_match_recomputed(device, reduction):
    # A scalar loss computes its gradients in the forward; a second backward
    # (retain_graph) recomputes them: both must agree with the reference.
    x, w, t, b = make_problem(70, 48, 500, device=device, bias=True)
    cw = torch.rand(500, device=device) + 0.5
    kw = dict(weight=cw, label_smoothing=0.1, z_loss=1e-3, softcap=6.0, logit_scale=0.9, reduction=reduction)
    xl, wl, bl = leaves(x, w, b)
    loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, workspace_bytes=20 * 500 * 4, **kw)
    first = torch.autograd.grad(loss * 1.7, [xl, wl, bl], retain_graph=True)
    second = torch.autograd.grad(loss * 1.7, [xl, wl, bl])
    xr, wr, br = leaves(x.double(), w.double(), b.double())
    ref = reference_loss(xr, wr, t, linear_bias=br, **kw)
    expected = torch.autograd.grad(ref * 1.7, [xr, wr, br])
    assert rel_err(loss, ref) < 1e-5
    for a, c, e in zip(first, second, expected):
        assert rel_err(a, e) < 1e-5
        assert rel_err(c, e) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_class_weighted_smoothing_without_softcap(device, dtype, reduction):
    # Without a softcap, the class-weighted smoothing terms are rank one and the
    # CUDA path computes them outside the row kernel (GEMVs and rank-one
    # updates): loss-only forward and forward with gradient, over several blocks.
    x, w, t, b = make_problem(90, 64, 700, dtype=dtype, device=device, bias=True)
    cw = torch.rand(700, device=device) + 0.5
    kw = dict(
        weight=cw, label_smoothing=0.2, z_loss=1e-3, logit_scale=0.8, reduction=reduction, workspace_bytes=32 * 700 * 4
    )
    xl, wl, bl = leaves(x, w, b)
    loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, **kw)
    loss.backward()
    with torch.no_grad():  # the default workspace holds all rows: the cuBLAS-block forward
        loss_only = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, **dict(kw, workspace_bytes=None))
    xr, wr, br = leaves(x.double(), w.double(), b.double())
    ref = reference_loss(xr, wr, t, linear_bias=br, **{k: v for k, v in kw.items() if k != "workspace_bytes"})
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(loss, ref) < tol / 10 and rel_err(loss_only, ref) < tol / 10
    for a, e in ((xl.grad, xr.grad), (wl.grad, wr.grad), (bl.grad, br.grad)):
        assert rel_err(a, e) < tol, rel_err(a, e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_with_grad_op_opcheck(device, dtype):
    # float16's dX and db come back in float32, dW in float16 times a power of two (its last output)
    x, w, t, b = make_problem(24, 16, 40, device=device, bias=True, dtype=dtype)
    cw = torch.rand(40, device=device)
    args = (x, w, t, b, cw, [True, True, True], "mean", -100, 0.1, 1e-3, 4.0, 1.0, None)
    torch.library.opcheck(torch.ops.fused_ce.linear_cross_entropy_with_grad.default, args)
    out = torch.ops.fused_ce.linear_cross_entropy_with_grad(*args)
    gx, gw, gb, gw_scale = out[4:8]
    assert all(g.numel() == 0 for g in out[8:])  # (no low-rank term: its gradients empty)
    if dtype == torch.float32:
        assert gx.dtype == gw.dtype == gb.dtype == torch.float32 and gw_scale.numel() == 0
        return
    assert gx.dtype == gb.dtype == torch.float32 and gw.dtype == torch.float16
    assert gw_scale.shape == () and gw_scale.dtype == torch.float32 and gw_scale.device == x.device
    assert gw_scale.item() == 2.0 ** round(math.log2(gw_scale.item()))  # a power of two: exact to divide out
    wr = w.double().requires_grad_()
    reference_loss(x.double(), wr, t, linear_bias=b.double(), weight=cw, label_smoothing=0.1, z_loss=1e-3,
                   softcap=4.0).backward()  # fmt: skip
    assert rel_err(gw.double() / gw_scale.item(), wr.grad) < 1e-2
    with pytest.raises(ValueError, match="reduction"):
        torch.ops.fused_ce.linear_cross_entropy_with_grad(*args[:6], "none", *args[7:])


@pytest.mark.parametrize("device", DEVICES)
def test_none_reduction_non_uniform_upstream(device):
    x, w, t, _ = make_problem(60, 32, 200, device=device)
    xl, wl = leaves(x, w)
    mask = (torch.rand(60, device=device) > 0.3).float() * torch.randn(60, device=device)
    (fused_ce.linear_cross_entropy(xl, wl, t, reduction="none", z_loss=1e-2) * mask).sum().backward()
    xr, wr = leaves(x.double(), w.double())
    (reference_loss(xr, wr, t, reduction="none", z_loss=1e-2) * mask.double()).sum().backward()
    assert rel_err(xl.grad, xr.grad) < 1e-5 and rel_err(wl.grad, wr.grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_autocast(device):
    dtype = torch.bfloat16
    x, w, t, b = make_problem(64, 32, 300, device=device, bias=True)
    xl, wl, bl = leaves(x, w, b)
    with torch.autocast(device_type=device, dtype=dtype):
        loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl)
    assert loss.dtype == torch.float32
    loss.backward()
    assert xl.grad.dtype == torch.float32 and wl.grad.dtype == torch.float32
    # what autocast's F.linear does: the linear part in bf16
    expected = reference_loss(x.to(dtype).double(), w.to(dtype).double(), t, linear_bias=b.to(dtype).double())
    assert rel_err(loss, expected) < 1e-3
    xr, wr, br = leaves(x, w, b)
    reference_loss(xr.double(), wr.double(), t, linear_bias=br.double()).backward()
    assert rel_err(xl.grad, xr.grad) < 3e-2 and rel_err(wl.grad, wr.grad) < 3e-2
    # mixed dtypes outside autocast are an error, as for F.linear
    with pytest.raises(RuntimeError, match="dtype"):
        fused_ce.linear_cross_entropy(x.to(dtype), w, t)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_logits_beyond_float16_range(device):
    # logits around 1e5 overflow float16; the loss and gradients must stay finite and right
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 64, generator=g) * 60).half().to(device)
    w = (torch.randn(100, 64, generator=g) * 60).half().to(device)
    t = torch.randint(0, 100, (40,), generator=g).to(device)
    assert (x.double() @ w.double().T).abs().max() > 70000
    xl, wl = leaves(x, w)
    loss = fused_ce.linear_cross_entropy(xl, wl, t, reduction="sum")
    loss.backward()
    xr, wr = leaves(x.double(), w.double())
    ref = reference_loss(xr, wr, t, reduction="sum")
    ref.backward()
    assert torch.isfinite(loss) and rel_err(loss, ref) < 1e-3
    assert torch.isfinite(xl.grad).all() and torch.isfinite(wl.grad).all()
    assert rel_err(xl.grad, xr.grad) < 1e-2 and rel_err(wl.grad, wr.grad) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_float16_gradients_under_a_loss_scale(device):
    # Mixed precision in float16 scales the loss (torch.amp.GradScaler) so that gradients ~ p / N stay
    # above float16's smallest subnormal. Formed at unit scale in the forward and stored in float16 they
    # lost that (dX 2.6x torch's error on CPU): on CUDA the forward keeps dX in float32 and dW in float16 times a
    # power of two (Plan.grad_weight_scale), its float16 gradient blocks at a power-of-two scale (Plan.grad_scale),
    # and the backward rounds dX once after the scale, scales dW in place; on the CPU
    # the backward forms them at the upstream gradient's scale (gradients_in_forward, csrc/plan.h).
    N, D, V = (16384, 64, 2000) if device == "cpu" else (16384, 256, 32000)
    x, w, t, _ = make_problem(N, D, V, device=device, dtype=torch.float16)
    scale = 1024.0  # small enough that dW (~ scale * |x|) stays finite in float16
    plan = fused_ce.plan(*leaves(x, w), t)
    if device == "cpu":
        assert plan.pass_ == "forward"
    else:
        assert plan.pass_ == "forward_with_grad" and plan.grad_input_dtype == torch.float32
        assert plan.grad_weight_dtype == torch.float16 and plan.grad_weight_scale > 1  # (csrc/plan.h)
    xr, wr = leaves(x.double(), w.double())
    (reference_loss(xr, wr, t) * scale).backward()
    errors = {}
    for name, loss_fn in {
        "fused_ce": lambda xl, wl: fused_ce.linear_cross_entropy(xl, wl, t),
        "torch": lambda xl, wl: torch.nn.functional.cross_entropy(xl @ wl.T, t),
    }.items():
        xl, wl = leaves(x, w)
        (loss_fn(xl, wl) * scale).backward()
        assert torch.isfinite(xl.grad).all() and torch.isfinite(wl.grad).all(), name
        errors[name] = (rel_err(xl.grad, xr.grad), rel_err(wl.grad, wr.grad))
    assert errors["fused_ce"][0] <= 1.5 * errors["torch"][0] + 1e-4, errors
    assert errors["fused_ce"][1] <= 1.5 * errors["torch"][1] + 1e-4, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes(device, dtype):
    shape = (32, 16, 100) if device == "cpu" and dtype == torch.float16 else (128, 64, 700)  # CPU float16 is slow
    x, w, t, b = make_problem(*shape, device=device, bias=True, dtype=dtype)
    xl, wl, bl = leaves(x, w, b)
    loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == torch.float32
    assert xl.grad.dtype == dtype and wl.grad.dtype == dtype and bl.grad.dtype == dtype
    xr, wr, br = leaves(x.double(), w.double(), b.double())
    reference_loss(xr, wr, t, linear_bias=br, label_smoothing=0.1).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(xl.grad, xr.grad) < tol and rel_err(wl.grad, wr.grad) < tol


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_deterministic_runs_are_bitwise_identical(reduction):
    x, w, t, b = make_problem(1000, 256, 5000, dtype=torch.bfloat16, device="cuda", bias=True)
    kw = dict(weight=torch.rand(5000, device="cuda"), label_smoothing=0.1, z_loss=1e-4, softcap=20.0)
    results = []
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            xl, wl, bl = leaves(x, w, b)
            loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, reduction=reduction, **kw)
            loss.sum().backward()
            results.append([loss.detach(), xl.grad, wl.grad, bl.grad])
    finally:
        torch.use_deterministic_algorithms(previous)
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)


def _ops_called(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("device", DEVICES)
def test_scalar_loss_does_not_recompute_logits(device):
    x, w, t, _ = make_problem(64, 32, 300, device=device)
    xl, wl = leaves(x, w)
    called = _ops_called(lambda: fused_ce.linear_cross_entropy(xl, wl, t).backward())
    assert "fused_ce::linear_cross_entropy_with_grad" in called
    assert "fused_ce::linear_cross_entropy_backward" not in called
    # no gradient wanted: the plain forward only
    with torch.no_grad():
        called = _ops_called(lambda: fused_ce.linear_cross_entropy(xl, wl, t))
    assert "fused_ce::linear_cross_entropy" in called and "fused_ce::linear_cross_entropy_with_grad" not in called


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("workspace", [4 << 10, 64 << 10, None], ids=["4KiB", "64KiB", "default"])
def test_weight_grad_within_torchs_error_at_any_budget(device, dtype, reduction, workspace):
    # A budget without room for a float32 V x D accumulator would sum dW's row blocks in the input dtype (here
    # hundreds of them: up to 47x torch's error); dW comes instead from vocabulary slices summed in float32
    # (Plan::weight_grad_slice_classes), within 1.5x torch eager's error at any budget.
    N, D, V = 1024, 128, 4096
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device=device, bias=True, seed=11)
    upstream = torch.rand(N, device=device) + 0.5  # per-row gradients: the recomputing backward

    def loss_of(loss):
        return loss if reduction == "mean" else (loss * upstream.to(loss.dtype)).sum()

    xr, wr, br = leaves(x.double(), w.double(), b.double())
    loss_of(
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(xr, wr, br), t, reduction=reduction)
    ).backward()
    xe, we, be = leaves(x, w, b)
    loss_of(
        torch.nn.functional.cross_entropy(torch.nn.functional.linear(xe, we, be).float(), t, reduction=reduction)
    ).backward()
    xl, wl, bl = leaves(x, w, b)
    loss_of(
        fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, reduction=reduction, workspace_bytes=workspace)
    ).backward()
    for got, eager, want in ((xl.grad, xe.grad, xr.grad), (wl.grad, we.grad, wr.grad), (bl.grad, be.grad, br.grad)):
        assert rel_err(got, want) <= 1.5 * rel_err(eager, want) + 1e-6, (rel_err(got, want), rel_err(eager, want))
    if workspace is not None:  # dW summed in float32: by the row blocks (CUDA's dot tiles), or by slices
        passes = ["backward"] + (["forward_with_grad"] if reduction == "mean" and dtype == torch.bfloat16 else [])
        for pass_ in passes:
            plan = fused_ce.plan(x, w, t, linear_bias=b, reduction=reduction, workspace_bytes=workspace, pass_=pass_)
            assert plan.grad_weight_dtype == torch.float32 or plan.weight_grad_slice_classes > 0, plan


def text_like_problem(N, D, V, targets, device, seed=0):
    """bf16 inputs with x ~ N(0, 1), W ~ N(0, 1/D), 10% of the rows ignored, and targets drawn uniformly,
    with text's token frequencies (Zipf 1.0 over the ids: the most frequent token holds ~N / ln V rows), with those
    frequencies carried by the logits too (a unigram prior: a constant feature whose weights are the log
    frequencies), or uniformly with logits of std 2."""
    g = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    zipf /= zipf.sum()
    x = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / math.sqrt(D) * (2.0 if targets == "std 2 logits" else 1.0)
    if targets in ("zipf", "unigram prior"):
        t = torch.multinomial(zipf, N, replacement=True, generator=g)
    else:
        t = torch.randint(0, V, (N,), generator=g)
    if targets == "unigram prior":
        x[:, 0] = 1.0
        w[:, 0] = zipf.log().float() - zipf.log().mean().float()
    t[torch.rand(N, generator=g) < 0.1] = -100
    return x.to(device, torch.bfloat16), w.to(device, torch.bfloat16), t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("targets", ["uniform", "zipf", "unigram prior", "std 2 logits"])
@pytest.mark.parametrize("blocks", [2, 6])
def test_bf16_weight_gradient_within_torchs_error_whatever_the_targets(device, targets, blocks):
    # dW of bf16 summed over row blocks: in bf16 over 2 at most (one more rounding of the first block's sum), in
    # float32 past them, so that its error stays within 1.5x torch eager's (bf16 logits, one rounding of dW) on every
    # target distribution; 6 blocks summed in bf16 left it at 1.6-2.0x with text's frequencies (strategies.h)
    N, D, V = 1024, 32, 16000
    x, w, t = text_like_problem(N, D, V, targets, device)
    counted = int((t != -100).sum())
    # a block's row on the CPU: float32 and bf16 logits, its gathered x and dX rows (and their float32 copies where
    # the products are float32: Plan::logits_product_dtype); past 2 blocks dW's float32 sum
    float32_rows = 8 * D if fused_ce.plan(x, w, t).logits_product_dtype == torch.float32 else 0
    budget = -(-counted // blocks) * (V * 6 + 4 * D + float32_rows) + (V * D * 4 if blocks > 2 else 0)
    wl = w.clone().requires_grad_()
    plan = fused_ce.plan(x, wl, t, workspace_bytes=budget)
    planned = -(-plan.rows // plan.block_rows)
    assert planned == blocks or device == "cuda", plan  # (CUDA's blocks hold bf16 logits alone: fewer of them)
    assert plan.grad_weight_dtype == (torch.bfloat16 if planned <= 2 else torch.float32), plan
    fused_ce.linear_cross_entropy(x, wl, t, workspace_bytes=budget).backward()
    we = w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, we).float(), t).backward()
    wr = w.double().requires_grad_()
    torch.nn.functional.cross_entropy(x.double() @ wr.T, t).backward()
    ours, torchs = rel_err(wl.grad, wr.grad), rel_err(we.grad, wr.grad)
    assert ours <= 1.5 * torchs, (ours, torchs, ours / torchs)
