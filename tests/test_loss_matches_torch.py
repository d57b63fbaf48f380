"""The op against the PyTorch reference, on CPU and (where present) CUDA."""

import pytest
import torch
import torch.nn.functional as F

import fused_ce
from helpers import DEVICES
from reference import make_problem, reference_loss, rel_err

REDUCTIONS = ["mean", "sum", "none"]


def grads(loss, tensors, upstream=None):
    if upstream is None:
        upstream = torch.randn_like(loss)
    return torch.autograd.grad((loss * upstream).sum(), [t for t in tensors if t is not None]), upstream


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def compare(device, dtype, shape, reduction, tol, bias=False, **kw):
    N, D, V = shape
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device=device, bias=bias)
    x, w, b = leaf(x), leaf(w), leaf(b)
    out = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, **kw)
    kw.pop("workspace_bytes", None)
    xs, ws, bs = leaf(x.double()), leaf(w.double()), leaf(None if b is None else b.double())
    ref = reference_loss(xs, ws, t, linear_bias=bs, reduction=reduction, **kw)
    assert out.dtype == torch.float32
    assert out.shape == ref.shape
    assert rel_err(out, ref) < tol
    got, up = grads(out, [x, w, b])
    exp, _ = grads(ref, [xs, ws, bs], up.double())
    for g, e in zip(got, exp):
        assert g.dtype == dtype
        assert rel_err(g, e) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_reference(device, reduction, bias):
    compare(device, torch.float32, (67, 48, 333), reduction, 1e-5, bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_float64_gives_a_float64_loss_as_torch(device):
    # (documented: float64 inputs for checks; float64 arithmetic, loss and lse, on ATen's products)
    x, w, t, b = make_problem(40, 16, 70, dtype=torch.float64, device=device, bias=True)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=b, z_loss=1e-3, return_lse=True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = reference_loss(xr, wr, t, linear_bias=b, z_loss=1e-3)
    assert loss.dtype == lse.dtype == torch.float64
    assert rel_err(loss, want) < 1e-12
    for got, ref in zip(torch.autograd.grad(loss, (xl, wl)), torch.autograd.grad(want, (xr, wr)), strict=True):
        assert got.dtype == torch.float64 and rel_err(got, ref) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_odd_sizes_and_small_workspace(device):
    # D and V not multiples of 16, several row/column blocks in the backward.
    compare(device, torch.float32, (29, 37, 211), "mean", 1e-5, bias=True, workspace_bytes=4096)


def _bf16_errors(device, dtype, N, D, V, reduction, **kw):
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device=device, bias=True)
    # float64 truth
    x64, w64, b64 = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref = reference_loss(x64, w64, t, linear_bias=b64, reduction=reduction, **kw)
    # a scalar loss's gradients are computed in the forward for an upstream gradient
    # of 1 (the usual loss.backward()); other upstream scalars: test_upstream_scaling
    up = torch.randn_like(ref) if reduction == "none" else torch.ones_like(ref)
    truth = [ref] + list(torch.autograd.grad((ref * up).sum(), [x64, w64, b64]))
    # torch eager in the low-precision dtype
    xt, wt, bt = leaf(x), leaf(w), leaf(b)
    eager = reference_loss(xt, wt, t, linear_bias=bt, reduction=reduction, **kw)
    eager_all = [eager] + list(torch.autograd.grad((eager * up.float()).sum(), [xt, wt, bt]))
    # ours
    xf, wf, bf = leaf(x), leaf(w), leaf(b)
    ours = fused_ce.linear_cross_entropy(xf, wf, t, linear_bias=bf, reduction=reduction, **kw)
    ours_all = [ours] + list(torch.autograd.grad((ours * up.float()).sum(), [xf, wf, bf]))
    return [(rel_err(o, r), rel_err(e, r)) for o, e, r in zip(ours_all, eager_all, truth)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_bf16_within_torch_error(device, reduction):
    errors = _bf16_errors(device, torch.bfloat16, 256, 128, 1000, reduction)
    for name, (ours, eager) in zip(("loss", "dX", "dW", "db"), errors):
        assert ours <= 1.5 * eager + 1e-6, (name, ours, eager)


@pytest.mark.cuda
def test_fp16_within_torch_error():
    errors = _bf16_errors("cuda", torch.float16, 256, 128, 1000, "mean")
    for name, (ours, eager) in zip(("loss", "dX", "dW", "db"), errors):
        assert ours <= 1.5 * eager + 1e-6, (name, ours, eager)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_scaling(device, dtype):
    # The gradients of a scalar loss are computed in the forward and scaled by the
    # upstream gradient in the backward (in float32, one rounding to the input
    # dtype): exact for powers of two (loss scaling).
    x, w, t, b = make_problem(200, 64, 500, dtype=dtype, device=device, bias=True)

    def grads_for(upstream):
        xl, wl, bl = leaf(x), leaf(w), leaf(b)
        (fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl) * upstream).backward()
        return xl.grad, wl.grad, bl.grad

    unit = grads_for(1.0)
    for g, u in zip(grads_for(0.25), unit):
        assert torch.equal(g, u * 0.25)
    scale = 0.3
    xs, ws, bs = leaf(x.double()), leaf(w.double()), leaf(b.double())
    (reference_loss(xs, ws, t, linear_bias=bs) * scale).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, e in zip(grads_for(scale), (xs.grad, ws.grad, bs.grad)):
        assert rel_err(g, e) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_3d_input_noncontiguous_and_transposed_weight(device):
    N, D, V = 4 * 9, 40, 150
    x, w, t, _ = make_problem(N, D, V, device=device)
    x3 = leaf(torch.randn(9, 2 * D, 4, device=device)[:, ::2, :].transpose(1, 2))  # [9, 4, D] strided
    assert not x3.is_contiguous()
    w_storage = leaf(torch.randn(D, V, device=device) / D**0.5)  # tied embedding stored [D, V]
    wt = w_storage.t()
    t3 = t.reshape(9, 4)
    for reduction in REDUCTIONS:
        out = fused_ce.linear_cross_entropy(x3, wt, t3, reduction=reduction)
        xr, wr = leaf(x3.detach().double()), leaf(w_storage.detach().double())
        ref = reference_loss(xr, wr.t(), t3, reduction=reduction)
        assert out.shape == ref.shape
        assert rel_err(out, ref) < 1e-5
        got, up = grads(out, [x3, w_storage])
        exp, _ = grads(ref, [xr, wr], up.double())
        assert got[0].shape == x3.shape
        for g, e in zip(got, exp):
            assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_ignore_index_custom_and_all_ignored(device):
    x, w, t, _ = make_problem(50, 32, 64, device=device)
    t = t.clamp_min(0)
    t[::3] = 7  # a real class index used as ignore_index
    compare_ignore = dict(ignore_index=7)
    for reduction in REDUCTIONS:
        out = fused_ce.linear_cross_entropy(x, w, t, reduction=reduction, **compare_ignore)
        ref = reference_loss(x.double(), w.double(), t, reduction=reduction, **compare_ignore)
        assert rel_err(out, ref) < 1e-5
    none = fused_ce.linear_cross_entropy(x, w, t, reduction="none", ignore_index=7)
    assert (none[t == 7] == 0).all()

    t_all = torch.full_like(t, -100)
    xl, wl = leaf(x), leaf(w)
    mean = fused_ce.linear_cross_entropy(xl, wl, t_all)
    assert torch.isnan(mean)  # like torch: 0 / 0
    assert torch.isnan(reference_loss(x, w, t_all))
    mean.backward()
    assert torch.equal(xl.grad, torch.zeros_like(x)) and torch.equal(wl.grad, torch.zeros_like(w))
    assert fused_ce.linear_cross_entropy(x, w, t_all, reduction="sum").item() == 0.0
    assert (fused_ce.linear_cross_entropy(x, w, t_all, reduction="none") == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_int32_target_and_no_grad(device):
    x, w, t, _ = make_problem(40, 32, 100, device=device)
    a = fused_ce.linear_cross_entropy(x, w, t)
    b = fused_ce.linear_cross_entropy(x, w, t.int())
    assert torch.equal(a, b)
    with torch.no_grad():
        c = fused_ce.linear_cross_entropy(x, w, t)
    assert not c.requires_grad and torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
def test_only_weight_requires_grad(device):
    x, w, t, _ = make_problem(40, 32, 100, device=device)
    wl = leaf(w)
    fused_ce.linear_cross_entropy(x, wl, t).backward()
    wr = leaf(w.double())
    reference_loss(x.double(), wr, t).backward()
    assert rel_err(wl.grad, wr.grad) < 1e-5


FEATURES = [
    dict(weight="rand"),
    dict(label_smoothing=0.1),
    dict(label_smoothing=0.3, weight="rand"),
    dict(z_loss=1e-3),
    dict(softcap=5.0),
    dict(logit_scale=0.5),
    dict(logit_scale=2.0, softcap=3.0, z_loss=1e-2, label_smoothing=0.1, weight="rand"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "+".join(f))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_features(device, features, reduction):
    kw = dict(features)
    if kw.get("weight") == "rand":
        kw["weight"] = torch.rand(300, device=device) + 0.1
    compare(device, torch.float32, (45, 40, 300), reduction, 2e-5, bias=True, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_return_lse_carries_gradient(device):
    x, w, t, b = make_problem(45, 40, 300, device=device, bias=True)
    xl, wl, bl = leaf(x), leaf(w), leaf(b)
    loss, lse = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=bl, return_lse=True, softcap=4.0)
    assert lse.dtype == torch.float32 and lse.shape == t.shape
    xr, wr, br = leaf(x.double()), leaf(w.double()), leaf(b.double())
    ref_loss, ref_lse = reference_loss(xr, wr, t, linear_bias=br, return_lse=True, softcap=4.0)
    assert rel_err(lse, ref_lse) < 1e-6
    up = torch.randn_like(lse)
    got = torch.autograd.grad(loss * 0.3 + (lse * up).sum(), [xl, wl, bl])
    exp = torch.autograd.grad(ref_loss * 0.3 + (ref_lse * up.double()).sum(), [xr, wr, br])
    for g, e in zip(got, exp):
        assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    torch.manual_seed(0)
    cw = torch.rand(120, device=device)
    m = fused_ce.LinearCrossEntropyLoss(32, 120, bias=True, device=device, weight=cw, label_smoothing=0.1)
    assert m.linear.weight.shape == (120, 32)
    x = torch.randn(3, 10, 32, device=device)
    t = torch.randint(0, 120, (3, 10), device=device)
    loss = m(x, t)
    ref = reference_loss(x, m.linear.weight, t, linear_bias=m.linear.bias, weight=cw, label_smoothing=0.1)
    assert rel_err(loss, ref) < 1e-5
    loss.backward()
    assert m.linear.weight.grad is not None and m.linear.bias.grad is not None


def test_matches_torch_functional_signature():
    F = torch.nn.functional
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip("torch < 2.13 has no F.linear_cross_entropy")
    x, w, t, b = make_problem(30, 16, 50, bias=True)
    cw = torch.rand(50)
    kw = dict(linear_bias=b, weight=cw, reduction="sum", ignore_index=None, label_smoothing=0.2)
    assert rel_err(fused_ce.linear_cross_entropy(x, w, t, **kw), F.linear_cross_entropy(x, w, t, **kw)) < 1e-5


BAD_ARGUMENTS = [  # (keywords or a function of (x, w, t), exception class as torch raises it, text in the message)
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.5), RuntimeError, "label_smoothing"),
    (dict(label_smoothing=-0.1), RuntimeError, "label_smoothing"),  # torch 2.13 accepts it
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(z_loss=-1.0), ValueError, "z_loss"),
    (dict(logit_scale=float("inf")), ValueError, "logit_scale"),
    (dict(weight=torch.ones(19)), RuntimeError, "weight"),
    (dict(linear_bias=torch.ones(21)), RuntimeError, "linear_bias"),
    (dict(workspace_bytes=0), ValueError, "workspace_bytes"),
    (lambda x, w, t: (x, w, torch.full_like(t, 20)), IndexError, "target"),
    (lambda x, w, t: (x, w, torch.full_like(t, -5)), IndexError, "target"),
    (lambda x, w, t: (x, w, t.float()), RuntimeError, "target"),
    (lambda x, w, t: (x, w, t[:-1]), ValueError, "target shape"),
    (lambda x, w, t: (x, w[:, :-1], t), RuntimeError, "linear_weight"),
    (lambda x, w, t: (x, w.double(), t), RuntimeError, "linear_weight dtype"),
]


@pytest.mark.parametrize("case", range(len(BAD_ARGUMENTS)))
def test_bad_arguments_raise_torchs_exception_classes(case):
    bad, exc, text = BAD_ARGUMENTS[case]
    x, w, t, _ = make_problem(8, 16, 20)
    args, kw = (bad(x, w, t), {}) if callable(bad) else ((x, w, t), bad)
    with pytest.raises(exc, match=text):
        fused_ce.linear_cross_entropy(*args, **kw)
    ours_only = {"softcap", "z_loss", "logit_scale", "workspace_bytes"}
    if hasattr(F, "linear_cross_entropy") and not set(kw) & ours_only and kw.get("label_smoothing", 0) >= 0:
        with pytest.raises(exc):  # the same class as torch's own (torch >= 2.13)
            F.linear_cross_entropy(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_target_dtypes(dtype):
    x, w, t, _ = make_problem(8, 16, 20, ignore_frac=0.0)
    ref = fused_ce.linear_cross_entropy(x, w, t)
    assert torch.equal(fused_ce.linear_cross_entropy(x, w, t.to(dtype)), ref)
