"""Property-based: random problems against the float64 reference (hypothesis).

Random N (0 included), D, V (1 included), 2-D or 3-D input, strided inputs, every keyword and reduction,
return_lse with its gradient, tiny workspaces. CPU: float32 and float64, 300 cases. CUDA: the same generator
in bfloat16, float16 and float32 through the embedded kernels.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_ce
from helpers import HAS_CUDA
from reference import reference_loss


def close(got, expected, tol, floor):
    """Relative norm error within tol, measured against a norm of at least `floor`."""
    got, expected = got.double(), expected.double()
    return ((got - expected).norm() / expected.norm().clamp_min(floor)).item() <= tol


@st.composite
def problems(draw, dtypes):
    N = draw(st.integers(0, 40))
    shape = (N,) if draw(st.booleans()) else (draw(st.integers(0, 5)), draw(st.integers(1, 8)))
    D = draw(st.integers(1, 24))
    V = draw(st.integers(1, 60))
    kw = dict(
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignore_index=draw(st.sampled_from([-100, 0, V - 1, None])),
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        z_loss=draw(st.sampled_from([0.0, 1e-2])),
        softcap=draw(st.sampled_from([None, 2.0, 30.0])),
        logit_scale=draw(st.sampled_from([1.0, 0.5, 1.7])),
        workspace_bytes=draw(st.sampled_from([None, 1, 300, 4096])),
    )
    return dict(
        shape=shape,
        D=D,
        V=V,
        dtype=draw(st.sampled_from(dtypes)),
        bias=draw(st.booleans()),
        class_weight=draw(st.booleans()),
        strided=draw(st.booleans()),
        return_lse=draw(st.booleans()),
        ignore_frac=draw(st.sampled_from([0.0, 0.3, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
        kw=kw,
    )


def make_inputs(case, device):
    g = torch.Generator().manual_seed(case["seed"])
    shape, D, V = case["shape"], case["D"], case["V"]
    x = torch.randn(*shape, 2 * D if case["strided"] else D, generator=g)
    x = x[..., ::2] if case["strided"] else x  # a non-unit inner stride
    w = torch.randn(D, V, generator=g).T / D**0.5 if case["strided"] else torch.randn(V, D, generator=g) / D**0.5
    t = torch.randint(0, V, shape, generator=g)
    ignore = case["kw"]["ignore_index"]
    t[torch.rand(shape, generator=g) < case["ignore_frac"]] = -100 if ignore is None else ignore
    b = torch.randn(V, generator=g) * 0.1 if case["bias"] else None
    cw = torch.rand(V, generator=g) + 0.5 if case["class_weight"] else None
    to = dict(device=device, dtype=case["dtype"])
    return x.to(**to), w.to(**to), t.to(device), None if b is None else b.to(**to), cw if cw is None else cw.to(device)


def check(case, device, tol):
    x, w, t, b, cw = make_inputs(case, device)
    # results that cancel to 0 (V = 1) keep the rounding of their terms, which are of order 1
    floor = 1e-2 if case["dtype"] == torch.float64 else 1.0
    kw = dict(case["kw"], weight=cw)
    leaves = [v.detach().clone().requires_grad_() for v in (x, w) + ((b,) if b is not None else ())]
    ref_leaves = [v.detach().double().requires_grad_() for v in leaves]

    def run(fn, xs, keywords):
        bias = xs[2] if b is not None else None
        out = fn(xs[0], xs[1], t, linear_bias=bias, return_lse=case["return_lse"], **keywords)
        loss, lse = out if case["return_lse"] else (out, None)
        total = loss.sum() + (0.3 * lse.sum() if lse is not None else 0)  # the lse's gradient too
        total.backward()
        return loss.detach(), lse

    ref_kw = {k: v for k, v in kw.items() if k != "workspace_bytes"}
    ref_kw["ignore_index"] = -100 if kw["ignore_index"] is None else kw["ignore_index"]
    loss, lse = run(fused_ce.linear_cross_entropy, leaves, kw)
    ref_loss, ref_lse = run(reference_loss, ref_leaves, ref_kw)
    if not torch.isfinite(ref_loss).all():  # 'mean' with nothing counted: NaN, as torch, and gradients 0 but
        # the lse's (the reference's formula turns its z-loss term's 0 / 0 into NaN gradients)
        torch.testing.assert_close(loss.double(), ref_loss.double(), equal_nan=True, rtol=tol, atol=tol)
        assert all(torch.isfinite(v.grad).all() for v in leaves), case
        return
    assert close(loss, ref_loss, tol, floor), (loss, ref_loss, case)
    if lse is not None:
        assert lse.dtype == (torch.float64 if case["dtype"] == torch.float64 else torch.float32)
        assert close(lse, ref_lse, tol, floor), case
    for got, expected in zip(leaves, ref_leaves):
        assert got.grad.shape == got.shape and got.grad.dtype == got.dtype
        assert close(got.grad, expected.grad, 10 * tol, floor), case


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems([torch.float32, torch.float64]))
def test_cpu_matches_float64_reference(case):
    check(case, "cpu", 1e-5 if case["dtype"] == torch.float32 else 1e-10)


@pytest.mark.cuda
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems([torch.bfloat16, torch.float16, torch.float32]))
def test_cuda_matches_float64_reference(case):
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[case["dtype"]]
    check(case, "cuda", tol)


def test_has_cuda_flag_is_consistent():
    assert HAS_CUDA == torch.cuda.is_available()
