"""CUDA-only behaviour: the embedded kernels run (not the fallback), streams, big shapes."""

import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fused_ce
from helpers import needs_profiler
from reference import make_problem, reference_loss, rel_err

pytestmark = pytest.mark.cuda


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events()}


# The kernels each strategy's executor launches besides prepare_rows and cuBLAS: the plan decides the
# strategy (test_plan.py asserts it); this checks that the executors follow it.
STRATEGY_KERNELS = {
    ("forward", "stored_logits"): {"logit_partials_kernel", "combine_partials_kernel"},
    ("forward", "dot_tiles"): {"row_stats_kernel"},
    ("forward_with_grad", "stored_logits"): {"logit_partials_kernel", "combine_partials_kernel", "softmax_grad_kernel"},
    ("backward", "stored_logits"): {"softmax_grad_kernel"},
    ("backward", "dot_tiles"): {"logit_grad_kernel"},
}
ALL_STAGE_KERNELS = set().union(*STRATEGY_KERNELS.values())


@needs_profiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("aligned", [True, False])
def test_executors_follow_the_plan(dtype, aligned):
    N, D, V = (256, 128, 1024) if aligned else (77, 72, 333)
    x, w, t, _ = make_problem(N, D, V, dtype=dtype, device="cuda")
    x.requires_grad_()
    w.requires_grad_()
    stored = "stored_logits"  # float16's scaled
    runs = {  # name: (passes and their expected strategies, the call)
        "loss only": ([("forward", stored)], lambda: fused_ce.linear_cross_entropy(x.detach(), w.detach(), t)),
        "scalar loss, backward": (
            [("forward_with_grad", stored)],
            lambda: fused_ce.linear_cross_entropy(x, w, t).backward(),
        ),
        "per-row loss, backward": (
            [("forward", stored), ("backward", stored)],
            lambda: fused_ce.linear_cross_entropy(x, w, t, reduction="none").sum().backward(),
        ),
    }
    for name, (passes, run) in runs.items():
        reduction = "none" if name.startswith("per-row") else "mean"
        expected = set()
        for pass_, strategy in passes:
            plan = fused_ce.plan(x, w, t, reduction=reduction, pass_=pass_)
            assert plan.strategy == strategy and plan.rows_on_device, (name, plan)
            expected |= STRATEGY_KERNELS[(pass_, strategy)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = kernel_names(run)
        assert not [w for w in caught if "fused_ce" in str(w.message)], name  # the fallback warns
        ran = {k for k in ALL_STAGE_KERNELS if any(k in n for n in names)}
        assert ran == expected, (name, sorted(ran), sorted(expected))
        assert any("prepare_rows_kernel" in n for n in names), name


@needs_profiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scalar_loss_step_runs_no_aten_kernels(dtype):
    # The per-row bookkeeping (targets, weights, coefficients, the loss) is done by
    # our own kernels: each ATen kernel's first launch in a process costs
    # milliseconds, which made the op's first call several times slower than
    # the next (benchmarks/LOG.md, step 10). Only our kernels, cuBLAS and copies remain; with ignored rows, also the
    # gather of the counted rows and the scatter of their gradient (Plan.counted_rows_only).
    x, w, t, _ = make_problem(1000, 256, 3000, dtype=dtype, device="cuda", ignore_frac=0.0)
    x.requires_grad_()
    w.requires_grad_()
    one = torch.ones((), device="cuda")
    fused_ce.linear_cross_entropy(x, w, t).backward(one)  # warm-up
    x.grad = w.grad = None
    names = kernel_names(lambda: fused_ce.linear_cross_entropy(x, w, t).backward(one))
    assert not [n for n in names if "at::native" in n], sorted(names)
    masked = t.clone()
    masked[:300] = -100
    assert fused_ce.plan(x, w, masked, pass_="forward_with_grad").counted_rows_only
    fused_ce.linear_cross_entropy(x, w, masked).backward(one)
    x.grad = w.grad = None
    with_ignored = kernel_names(lambda: fused_ce.linear_cross_entropy(x, w, masked).backward(one))
    rows_moved = ("gather", "index_copy", "index_select", "scatter", "TensorAssign", "FillFunctor")  # (dX's zeros)
    other = [n for n in with_ignored if "at::native" in n and not any(k in n for k in rows_moved)]
    assert not other, sorted(other)
    for kernel in (
        "prepare_rows_kernel",
        "logit_partials_kernel",
        "combine_partials_kernel",
        "softmax_grad_kernel",
        "assemble_loss_kernel",
        "scale_kernel",
    ):
        assert any(kernel in n for n in names), (kernel, sorted(names))


@needs_profiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3001, 129), (3000, 128)])  # the general and the aligned variant
def test_scale_grad_skips_unit_scale(dtype, shape):
    # loss.backward() scales the forward's gradients by 1: the kernel must leave
    # them bitwise as they are; any other scale multiplies in float32.
    g = torch.randn(*shape, device="cuda").to(dtype)
    before = g.clone()
    names = kernel_names(lambda: torch.ops.fused_ce._scale_grad_(g, torch.ones((), device="cuda")))
    assert any("scale_kernel" in n for n in names), sorted(names)
    assert torch.equal(g, before)
    s = torch.rand((), device="cuda") + 0.5
    torch.ops.fused_ce._scale_grad_(g, s)
    assert torch.equal(g, (before.float() * s).to(dtype))
    odd = before[1:]  # not 16-byte aligned: the general variant
    odd_before = odd.clone()
    torch.ops.fused_ce._scale_grad_(odd, s)
    assert torch.equal(odd, (odd_before.float() * s).to(dtype))


@needs_profiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "features",
    [
        {},
        {"label_smoothing": 0.2, "z_loss": 1e-3},
        {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0, "logit_scale": 0.9},
    ],
    ids=["plain", "smoothing", "softcap"],
)
def test_lean_workspace_takes_vocabulary_tiles(dtype, features):
    # A workspace that holds only a few hundred whole rows: many row blocks would re-read dW once each, so the
    # plan takes 2-D tiles (2048 rows x a vocabulary slice) after a stats pass.
    N, D, V, budget = 4096, 256, 5000, 4 << 20
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device="cuda", bias=True)
    cw = torch.rand(V, device="cuda") + 0.5
    kw = dict(features, weight=cw, reduction="mean")
    xl, wl, bl = (v.detach().clone().requires_grad_() for v in (x, w, b))
    plan = fused_ce.plan(xl, wl, t, linear_bias=bl, workspace_bytes=budget, **kw)
    assert (plan.strategy, plan.block_rows) == ("vocab_tiles", 2048), plan
    assert plan.tile_cols == budget // (2048 * x.element_size()) // 128 * 128
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, workspace_bytes=budget, **kw)
        loss.backward()
        torch.cuda.synchronize()
    launches = sum(1 for e in prof.events() if "softmax_grad_kernel" in e.name)
    assert launches == -(-N // plan.block_rows) * -(-V // plan.tile_cols), launches  # one per tile of the plan
    xr, wr, br = (v.double().requires_grad_() for v in (x, w, b))
    ref = reference_loss(xr, wr, t, linear_bias=br, **kw)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(loss, ref) < tol / 10
    for got, expected in ((xl.grad, xr.grad), (wl.grad, wr.grad), (bl.grad, br.grad)):
        assert rel_err(got, expected) < tol, rel_err(got, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float16_scaled_logits_over_blocks(reduction):
    # float16's 6NDV path: logits stored times 2^-8, gradient blocks at a power-of-two scale (none for 'sum'
    # with class weights), float32 gradients rounded once in the backward; over several row blocks with every
    # feature, within 1.5x of torch eager's own float16 error against float64.
    N, D, V = 700, 128, 3000
    x, w, t, b = make_problem(N, D, V, dtype=torch.float16, device="cuda", bias=True)
    cw = torch.rand(V, device="cuda") + 0.5
    kw = dict(weight=cw, label_smoothing=0.1, z_loss=1e-3, softcap=20.0, logit_scale=0.9, reduction=reduction)
    budget = 300 * V * 2  # blocks of 256 rows
    xl, wl, bl = (v.detach().clone().requires_grad_() for v in (x, w, b))
    plan = fused_ce.plan(xl, wl, t, linear_bias=bl, workspace_bytes=budget, **kw)
    assert (plan.strategy, plan.block_rows, plan.logits_scale) == ("stored_logits", 256, 2.0**-8), plan
    assert plan.grad_scale == (2.0**13 if reduction == "mean" else 1.0)  # z_loss 1e-3: one power of two of room
    scale = 256.0  # a loss scaler's factor
    loss = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, workspace_bytes=budget, **kw)
    (loss * scale).backward()
    xe, we, be = (v.detach().clone().requires_grad_() for v in (x, w, b))
    (reference_loss(xe, we, t, linear_bias=be, **kw) * scale).backward()  # torch eager in float16
    xr, wr, br = (v.double().requires_grad_() for v in (x, w, b))
    ref = reference_loss(xr, wr, t, linear_bias=br, **kw)
    (ref * scale).backward()
    assert rel_err(loss, ref) < 1e-3
    for got, eager, expected in ((xl.grad, xe.grad, xr.grad), (wl.grad, we.grad, wr.grad), (bl.grad, be.grad, br.grad)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert rel_err(got, expected) <= 1.5 * rel_err(eager, expected) + 1e-4, (
            rel_err(got, expected),
            rel_err(eager, expected),
        )


def test_float16_gradient_blocks_leave_room_for_the_logit_scale():
    # One counted row of a mean loss has coefficient 1, so its logit gradient reaches |logit_scale|: at 8, the
    # gradient blocks' 2^14 overflowed float16 (8 * 2^14 > 65504) and dX and dW came back inf; the scale takes
    # the logit scale's powers of two off (2^11).
    N, D, V = 8, 64, 3000
    x, w, t, _ = make_problem(N, D, V, dtype=torch.float16, device="cuda", ignore_frac=0.0)
    t[1:] = -100  # one counted row
    kw = dict(logit_scale=8.0)
    plan = fused_ce.plan(x, w, t, pass_="forward_with_grad", **kw)
    assert plan.grad_scale == 2.0**11 and plan.grad_input_dtype == torch.float32, plan
    assert fused_ce.plan(x, w, t, pass_="forward_with_grad", logit_scale=0.25).grad_scale == 2.0**14
    xl, wl = (v.detach().clone().requires_grad_() for v in (x, w))
    fused_ce.linear_cross_entropy(xl, wl, t, **kw).backward()
    xe, we = (v.detach().clone().requires_grad_() for v in (x, w))
    reference_loss(xe, we, t, **kw).backward()  # torch eager in float16
    xr, wr = (v.double().requires_grad_() for v in (x, w))
    reference_loss(xr, wr, t, **kw).backward()
    for got, eager, expected in ((xl.grad, xe.grad, xr.grad), (wl.grad, we.grad, wr.grad)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert rel_err(got, expected) <= 1.5 * rel_err(eager, expected) + 1e-4, (
            rel_err(got, expected),
            rel_err(eager, expected),
        )


FLOAT16_WEIGHT_GRAD_CASES = {
    # name: (rows per block, options, change to the inputs)
    "4 blocks": (512, {}, None),
    "5 blocks of the budget, grown to 4 within the float32 sum's bytes": (420, {}, None),
    "8 blocks: float32, then rounded": (256, {}, None),
    "15 blocks": (128, {}, None),
    "an outlier feature": (512, {}, "outlier"),
    "sum": (512, dict(reduction="sum"), None),
    "logit scale 8 with smoothing and z-loss": (512, dict(logit_scale=8.0, label_smoothing=0.1, z_loss=1e-3), None),
    "inf in an ignored row: no bound": (512, {}, "inf"),
}


@pytest.mark.parametrize("case", list(FLOAT16_WEIGHT_GRAD_CASES))
def test_float16_weight_grad_at_its_scale(case):
    # float16's dW comes back in float16 times a power of two chosen from a bound on |dW| (max|x| times the
    # coefficients' sum, Plan.grad_weight_scale), summed in float16 over up to 4 row blocks (the budget's blocks grown
    # to 4 where they fit in it plus the float32 sum's bytes) and in float32 beyond;
    # where there is no bound (an inf in an ignored row's x), summed at unit scale in float32 and scaled by its
    # largest element. Finite, and within 1.5x of torch eager's float16 error against float64 under a loss scale.
    rows, kw, change = FLOAT16_WEIGHT_GRAD_CASES[case]
    N, D, V = 2000, 64, 3000  # (D: room for dW's float32 sum beside 128-row blocks, else a lean budget keeps float16)
    x, w, t, _ = make_problem(N, D, V, dtype=torch.float16, device="cuda")
    if change == "outlier":
        x[:, 3] = 300.0  # one feature far out, as in the hidden states of large models
    clean = x.clone()
    if change == "inf":
        t[7] = -100
        x[7] = float("inf")
    budget = (rows + 4) * V * 2
    plan = fused_ce.plan(x, w, t, pass_="forward_with_grad", workspace_bytes=budget, **kw)
    blocks = math.ceil(plan.rows / plan.block_rows)  # (the counted rows: 10% are ignored)
    assert blocks == {512: 4, 420: 4, 256: 8, 128: 15}[rows] and plan.grad_input_dtype == torch.float32, plan
    if change == "inf":
        assert plan.grad_weight_scale == 0.0 and plan.grad_weight_dtype == torch.float32
    else:
        coefficients = plan.rows if kw.get("reduction") == "sum" else 1  # (the counted rows)
        bound = clean.abs().max().item() * coefficients * max(1.0, kw.get("logit_scale", 1.0))
        bound *= 1 + 200 * kw.get("z_loss", 0.0)
        assert plan.grad_weight_scale == 2.0 ** math.floor(math.log2(16384 / bound))
        assert plan.grad_weight_dtype == (torch.float16 if blocks <= 4 else torch.float32)
    # a loss scaler's factor, within float16's range for the gradient itself (|dW| reaches max|x| * the scale)
    scale = 64.0 if kw.get("reduction") == "sum" or change == "outlier" else 1024.0
    xl, wl = (v.detach().clone().requires_grad_() for v in (x, w))
    (fused_ce.linear_cross_entropy(xl, wl, t, workspace_bytes=budget, **kw) * scale).backward()
    xe, we = (v.detach().clone().requires_grad_() for v in (clean, w))
    (reference_loss(xe, we, t, **kw) * scale).backward()  # torch eager in float16, on the finite rows
    xr, wr = (v.double().requires_grad_() for v in (clean, w))
    (reference_loss(xr, wr, t, **kw) * scale).backward()
    # dW summed in float16 over the blocks is rounded once per block and once by the backward's scaling: where a few
    # elements dominate its norm (an outlier feature's column), eager's single rounding can be near 0 by chance
    # (seeds where it was 0.2x its usual), so dW may also take those half-ulps (2^-12 each), its bound by design
    roundings = (blocks + 1) * 2.0**-12 if plan.grad_weight_dtype == torch.float16 else 0.0
    for got, eager, expected, floor in ((xl.grad, xe.grad, xr.grad, 0.0), (wl.grad, we.grad, wr.grad, roundings)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert rel_err(got, expected) <= max(1.5 * rel_err(eager, expected) + 1e-4, floor), (
            rel_err(got, expected),
            rel_err(eager, expected),
        )


def weighted_mean_coefficients(cw, t, V, eps):
    """The bounds on a class-weighted mean's row coefficients that float16's scales take (the largest and the sum
    of |g| ((1 - eps) |w_t| + eps / V (|sum cw| + max|cw|)), g = 1 / the counted rows' weight sum), in float64."""
    cw, counted = cw.double(), t >= 0
    target_weights = cw[t[counted]]
    g = 1 / target_weights.sum().abs()
    smoothing = eps / V * (cw.sum().abs() + cw.abs().max())
    largest = g * ((1 - eps) * target_weights.abs().max() + smoothing)
    total = g * ((1 - eps) * target_weights.abs().sum() + counted.sum() * smoothing)
    return largest.item(), total.item()


WEIGHTED_MEAN_CASES = {
    # name: (N, counted rows, label smoothing, weight scale of the head, loss scale)
    "class weights of both signs summing near 0": (2000, 2000, 0.0, 1.0, 16.0),
    "smoothing over two rows whose weights are far below the classes'": (64, 2, 0.2, 30.0, 16.0),
    "positive class weights: the unweighted bounds": (2000, 1800, 0.0, 1.0, 1024.0),
}


@pytest.mark.parametrize("case", list(WEIGHTED_MEAN_CASES))
def test_float16_scales_of_a_class_weighted_mean(case):
    # A class-weighted mean's row coefficient is w_t / (the counted rows' weight sum) plus smoothing's share: over
    # 1 where the weights have both signs and sum near 0, or where smoothing's sum of every class weight meets a
    # few counted rows of small weight. float16's gradient blocks (2^14 over the unweighted bound) and dW's scale
    # (max|x| times a coefficient sum of 1) then overflowed to inf where torch's gradients are finite; the scales
    # now take the coefficients read with the targets' count.
    N, counted, eps, head_scale, loss_scale = WEIGHTED_MEAN_CASES[case]
    D, V = 64, 3000
    x, w, t, _ = make_problem(N, D, V, dtype=torch.float16, device="cuda", ignore_frac=0.0)
    w = w * head_scale  # (30: confident rows, whose probability mass on one class carries the full coefficient)
    cw = torch.rand(V, device="cuda") + 0.5
    if case.startswith("class weights of both signs"):
        t = torch.arange(N, device="cuda") % 2  # half of the rows class 0, half class 1
        cw[0], cw[1] = 1.0, -(1.0 - 1e-4)
    elif case.startswith("smoothing"):
        t[counted:] = -100
        t[:counted] = torch.arange(counted, device="cuda")
        cw[:counted] = 0.01
    else:
        t[counted:] = -100
    kw = dict(weight=cw, label_smoothing=eps)
    largest, total = weighted_mean_coefficients(cw, t, V, eps)
    plan = fused_ce.plan(x, w, t, pass_="forward_with_grad", **kw)
    if case.startswith("positive"):
        assert largest <= 2 and total <= 2
        assert plan.grad_scale == 2.0**14, plan
        assert plan.grad_weight_scale == 2.0 ** math.floor(math.log2(16384 / x.abs().max().item())), plan
    else:
        assert largest > 4 and total > 4  # past float16's room: the unweighted scales overflow
        assert plan.grad_scale == 2.0 ** (14 - math.ceil(math.log2(largest))), (plan, largest)
        bound = x.abs().max().item() * total
        assert plan.grad_weight_scale == 2.0 ** math.floor(math.log2(16384 / bound)), (plan, total)
    xl, wl = (v.detach().clone().requires_grad_() for v in (x, w))
    loss = fused_ce.linear_cross_entropy(xl, wl, t, **kw)
    (loss * loss_scale).backward()
    xe, we = (v.detach().clone().requires_grad_() for v in (x, w))
    eager = reference_loss(xe, we, t, **kw)  # torch eager in float16
    (eager * loss_scale).backward()
    xr, wr = (v.double().requires_grad_() for v in (x, w))
    ref = reference_loss(xr, wr, t, **kw)
    (ref * loss_scale).backward()
    assert rel_err(loss, ref) <= 1.5 * rel_err(eager, ref) + 1e-3, (rel_err(loss, ref), rel_err(eager, ref))
    for got, expected_eager, expected in ((xl.grad, xe.grad, xr.grad), (wl.grad, we.grad, wr.grad)):
        assert torch.isfinite(expected_eager).all()
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert rel_err(got, expected) <= 1.5 * rel_err(expected_eager, expected) + 1e-4, (
            rel_err(got, expected),
            rel_err(expected_eager, expected),
        )


FALLBACK_CHECK = r"""
import sys, torch, fused_ce
sys.path.insert(0, sys.argv[1])
from reference import make_problem, reference_loss, rel_err
x, w, t, b = make_problem(300, 96, 1000, dtype=torch.bfloat16, device="cuda", bias=True)
leaves = [v.clone().requires_grad_() for v in (x, w, b)]
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    loss = fused_ce.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], label_smoothing=0.1)
    loss.backward()
    none = fused_ce.linear_cross_entropy(x, w, t, reduction="none")
    torch.cuda.synchronize()
for pass_ in ("forward", "forward_with_grad", "backward"):
    assert fused_ce.plan(x, w, t, pass_=pass_).strategy == "aten_chunks"
names = " ".join(e.name for e in prof.events())
assert not any(k in names for k in ("prepare_rows", "assemble_loss", "scale_kernel")), names
ref = [v.double().requires_grad_() for v in (x, w, b)]
r = reference_loss(ref[0], ref[1], t, linear_bias=ref[2], label_smoothing=0.1)
r.backward()
assert rel_err(loss, r) < 1e-3, rel_err(loss, r)
for a, c in zip(leaves, ref):
    assert rel_err(a.grad, c.grad) < 2e-2, rel_err(a.grad, c.grad)
assert rel_err(none, reference_loss(x.double(), w.double(), t, reduction="none")) < 1e-3
print("ok")
"""


def test_aten_fallback_on_cuda():
    # The path taken on devices without a fitting cubin, forced here with FUSED_CE_DISABLE_KERNELS.
    env = dict(os.environ, FUSED_CE_DISABLE_KERNELS="1")
    tests = os.path.dirname(os.path.abspath(__file__))  # (the cwd: the installed fused_ce, not a source tree's)
    out = subprocess.run([sys.executable, "-c", FALLBACK_CHECK, tests], capture_output=True, text=True, env=env,
                         cwd=tests)  # fmt: skip
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_side_stream_matches_default_stream():
    x, w, t, b = make_problem(300, 256, 5000, dtype=torch.bfloat16, device="cuda", bias=True)
    ref_loss = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        xs = x.clone().requires_grad_()
        loss = fused_ce.linear_cross_entropy(xs, w, t, linear_bias=b, reduction="none")
        loss.sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(loss.detach(), ref_loss)
    xr = x.clone().requires_grad_()
    fused_ce.linear_cross_entropy(xr, w, t, linear_bias=b, reduction="none").sum().backward()
    assert torch.equal(xs.grad, xr.grad)


def test_other_device_index_and_cpu_tensors_rejected():
    x, w, t, _ = make_problem(16, 32, 50, device="cuda")
    with pytest.raises(RuntimeError, match="target is on"):
        fused_ce.linear_cross_entropy(x, w, t.cpu())
    with pytest.raises(RuntimeError, match="linear_weight is on"):
        fused_ce.linear_cross_entropy(x, w.cpu(), t)


@pytest.mark.parametrize("N", [16384, 32768])  # 2 grown row blocks: dW added in bf16; 16: in float32 (strategies.cpp)
def test_llama3_shape_bf16_against_float32(N):
    """D=4096, V=128256 in bf16 against a float32 reference: errors within 1.5x of torch bf16's."""
    if torch.cuda.get_device_properties(0).total_memory < N // 16384 * 60 * 2**30:
        pytest.skip(f"needs ~{N // 16384 * 40} GiB of GPU memory")
    D, V = 4096, 128256
    x, w, t, _ = make_problem(N, D, V, dtype=torch.bfloat16, device="cuda")

    def run(fn, dtype):
        xl = x.to(dtype, copy=True).requires_grad_()
        wl = w.to(dtype, copy=True).requires_grad_()
        loss = fn(xl, wl)
        loss.backward()
        return loss.detach().float(), xl.grad.float(), wl.grad.float()

    def torch_loss(xl, wl):
        return reference_loss(xl, wl, t)

    ref = run(torch_loss, torch.float32)
    eager = run(torch_loss, torch.bfloat16)
    torch.cuda.empty_cache()
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    plan = fused_ce.plan(xg, wg, t)
    expected = (torch.bfloat16, 2) if N == 16384 else (torch.float32, 16)  # (8 blocks grown to 2 at N = 16384)
    assert (plan.grad_weight_dtype, -(-plan.rows // plan.block_rows)) == expected, plan
    ours = run(lambda xl, wl: fused_ce.linear_cross_entropy(xl, wl, t), torch.bfloat16)
    for name, o, e, r in zip(("loss", "dX", "dW"), ours, eager, ref):
        err, torch_err = rel_err(o, r), rel_err(e, r)
        print(f"{name}: fused_ce {err:.2e}  torch bf16 {torch_err:.2e}")
        assert err <= 1.5 * torch_err + 1e-6, (name, err, torch_err)


def test_threads_on_separate_streams_match_one_thread():
    # eight threads calling the op at once, each on its own stream, give the single-thread results bitwise
    import threading

    problems = [make_problem(300, 128, 3000, dtype=torch.bfloat16, device="cuda", bias=True, seed=i) for i in range(8)]

    def step(x, w, t, b):
        leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]
        loss = fused_ce.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], label_smoothing=0.1)
        loss.backward()
        return [loss.detach()] + [v.grad for v in leaves]

    expected = [step(*p) for p in problems]
    torch.cuda.synchronize()
    results, errors = [None] * 8, []

    def worker(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(3):
                    results[i] = step(*problems[i])
            stream.synchronize()
        except Exception as exc:  # reported below: a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for got, exp in zip(results, expected):
        for a, b in zip(got, exp):
            assert torch.equal(a, b)


def test_many_steps_leave_memory_flat():
    x, w, t, b = make_problem(512, 256, 4000, dtype=torch.bfloat16, device="cuda", bias=True)
    leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]

    def step():
        for v in leaves:
            v.grad = None
        fused_ce.linear_cross_entropy(leaves[0], leaves[1], t, linear_bias=leaves[2], z_loss=1e-4).backward()
        fused_ce.linear_cross_entropy(leaves[0], leaves[1], t, reduction="none").sum().backward()

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
