"""The Triton kernels themselves, through triton's JIT, against a float64 reference.

The same sources are compiled to the embedded cubins. Without a GPU (CI) they run
in triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET);
fp16/fp32 only, since the interpreter's tl.dot mishandles bf16.
"""

import warnings

import pytest
import torch

from fused_ce.kernels import configs, jit
from helpers import KERNEL_DEVICE as DEVICE
from reference import make_problem


def transformed_logits(x, w, b, scale, softcap):
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def case_inputs(case):
    """x, w, target (-1 where ignored), bias, class weights, logit_scale, softcap of a case."""
    x, w, t, b = make_problem(
        case["N"], case["D"], case["V"], dtype=case["dtype"], bias=case.get("bias", False), device=DEVICE
    )
    cw = torch.rand(case["V"], device=DEVICE) if case.get("class_weight") else None
    return x, w, torch.where(t < 0, -1, t), b, cw, case.get("scale", 1.0), case.get("softcap")


CASES = [
    dict(N=40, D=48, V=100, dtype=torch.float32),  # D a multiple of BLOCK_D
    dict(N=37, D=40, V=77, dtype=torch.float16, bias=True, softcap=2.0, scale=0.8),  # tails everywhere
    dict(N=20, D=32, V=150, dtype=torch.float32, bias=True, class_weight=True, splits=3),
] + ([dict(N=300, D=128, V=1000, dtype=torch.bfloat16, bias=True, softcap=10.0)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_row_stats(case):
    x, w, t, b, cw, scale, cap = case_inputs(case)
    lse, zt, wz = jit.row_stats(
        x,
        w,
        t,
        bias=b,
        class_weight=cw,
        logit_scale=scale,
        softcap=cap,
        smoothing=True,
        num_splits=case.get("splits", 2),
    )
    z = transformed_logits(x, w, b, scale, cap)
    valid = t >= 0
    ref_zt = torch.where(valid, z.gather(1, t.clamp_min(0)[:, None])[:, 0], 0.0)
    ref_wz = z @ (cw.double() if cw is not None else torch.ones(case["V"], dtype=torch.float64, device=DEVICE))
    torch.testing.assert_close(lse.double(), z.logsumexp(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zt.double(), ref_zt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wz.double(), ref_wz, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_logit_grad(case):
    N, V = case["N"], case["V"]
    x, w, t, b, cw, scale, cap = case_inputs(case)
    z = transformed_logits(x, w, b, scale, cap)
    lse = z.logsumexp(1).float()
    alpha, beta, gamma = (torch.rand(N, device=DEVICE) * s for s in (1.0, 1.0, 0.01))
    v0, v1 = 5, V - 3  # a column slice, as the backward's blocks are
    alpha_lse = torch.rand(N, device=DEVICE) * 0.1
    g = jit.logit_grad(
        x, w, t, lse, alpha, alpha_lse, beta, gamma, v0, v1, bias=b, class_weight=cw, logit_scale=scale, softcap=cap
    )
    alpha = alpha + alpha_lse * lse
    p = (z - z.logsumexp(1, keepdim=True)).exp()
    onehot = torch.zeros(N, V, dtype=torch.float64, device=DEVICE)
    onehot[t >= 0] = onehot[t >= 0].scatter(1, t[t >= 0, None], 1.0)
    cwd = cw.double() if cw is not None else torch.ones(V, dtype=torch.float64, device=DEVICE)
    ref = p * alpha.double()[:, None] - onehot * beta.double()[:, None] - gamma.double()[:, None] * cwd
    if cap is not None:
        ref = ref * (1 - (z / cap) ** 2)
    ref = ref * scale
    assert g.dtype == x.dtype and g.shape == (N, v1 - v0)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[case["dtype"]]
    torch.testing.assert_close(g.double(), ref[:, v0:v1], rtol=tol, atol=tol)


def test_logit_grad_strided_output_and_inputs():
    # general-layout inputs (non-unit inner stride) and a padded output buffer
    N, D, V = 24, 32, 64
    xs = torch.randn(N, 2 * D, device=DEVICE)[:, ::2]
    ws = (torch.randn(D, V, device=DEVICE) / 6).T
    t = torch.randint(0, V, (N,), device=DEVICE)
    z = xs.double() @ ws.double().T
    lse = z.logsumexp(1).float()
    one, zero = torch.ones(N, device=DEVICE), torch.zeros(N, device=DEVICE)
    buf = torch.full((N, 96), float("nan"), device=DEVICE)
    jit.logit_grad(xs, ws, t, lse, one, zero, one, zero, 0, V, out=buf[:, :V])
    ref = (z - z.logsumexp(1, keepdim=True)).exp()
    ref[torch.arange(N, device=DEVICE), t] -= 1
    torch.testing.assert_close(buf[:, :V].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.isnan(buf[:, V:]).all(), "wrote outside its columns"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_stats_from_logits_and_softmax_grad(case):
    N, V = case["N"], case["V"]
    x, w, t, b, cw, scale, cap = case_inputs(case)
    raw = x.double() @ w.double().T + (b.double() if b is not None else 0)
    stored = torch.full((N, V + 7), float("nan"), dtype=x.dtype, device=DEVICE)  # padded rows
    logits = stored[:, :V]
    logits.copy_(raw)
    alpha, alpha_lse, beta = (torch.rand(N, device=DEVICE) for _ in range(3))
    gamma = torch.rand(N, device=DEVICE) * 0.01
    kw = dict(class_weight=cw, logit_scale=scale, softcap=cap, smoothing=True)
    lse, gap, log_sum, wz = jit.stats_from_logits(logits, t, **kw)
    assert torch.equal(logits, raw.to(x.dtype)), "the stats pass wrote"
    jit.softmax_grad(logits, t, lse, alpha, alpha_lse, beta, gamma, **kw)
    # reference from the logits as stored (rounded to the input dtype), like the kernel sees them
    zs = raw.to(x.dtype).double() * scale
    if cap is not None:
        zs = cap * torch.tanh(zs / cap)
    ref_lse = zs.logsumexp(1)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[case["dtype"]]
    # half-precision inputs on a GPU use the hardware's approximate tanh for the softcap
    approx = case["dtype"] != torch.float32 and cap is not None and DEVICE == "cuda"
    tol_row = 2e-3 if approx else 1e-5
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol_row, atol=tol_row)
    ref_max = zs.max(1).values
    ref_gap = torch.where(t >= 0, ref_max - zs.gather(1, t.clamp_min(0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(gap.double(), ref_gap, rtol=tol_row, atol=tol_row * cap if approx else tol_row)
    torch.testing.assert_close(log_sum.double(), ref_lse - ref_max, rtol=tol_row, atol=tol_row)
    cwd = cw.double() if cw is not None else torch.ones(V, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(wz.double(), zs @ cwd, rtol=10 * tol_row, atol=1.0 if approx else 1e-4)
    p = (zs - ref_lse[:, None]).exp()
    onehot = torch.zeros(N, V, dtype=torch.float64, device=DEVICE)
    onehot[t >= 0] = onehot[t >= 0].scatter(1, t[t >= 0, None], 1.0)
    a = alpha.double() + alpha_lse.double() * ref_lse
    ref = p * a[:, None] - onehot * beta.double()[:, None] - gamma.double()[:, None] * cwd
    if cap is not None:
        ref = ref * (1 - (zs / cap) ** 2)
    ref = ref * scale
    torch.testing.assert_close(logits.double(), ref, rtol=tol, atol=tol)
    assert torch.isnan(stored[:, V:]).all(), "wrote past the row"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_softmax_grad_on_vocabulary_slices(case):
    # Lean workspaces take the gradient in vocabulary slices (column offsets) with the lse of whole rows:
    # the slices together must give what one pass over whole rows gives.
    N, V = case["N"], case["V"]
    x, w, t, b, cw, scale, cap = case_inputs(case)
    raw = (x.double() @ w.double().T + (b.double() if b is not None else 0)).to(x.dtype)
    alpha, alpha_lse, beta = (torch.rand(N, device=DEVICE) for _ in range(3))
    gamma = torch.rand(N, device=DEVICE) * 0.01
    kw = dict(logit_scale=scale, softcap=cap, smoothing=True)
    whole = raw.clone()
    lse = jit.stats_from_logits(whole, t, class_weight=cw, **kw)[0]
    jit.softmax_grad(whole, t, lse, alpha, alpha_lse, beta, gamma, class_weight=cw, **kw)
    edges = [0, V // 3, V // 3 + 1, V]  # uneven slices, one a single column
    for v0, v1 in zip(edges[:-1], edges[1:]):
        part = torch.full((N, v1 - v0 + 5), float("nan"), dtype=x.dtype, device=DEVICE)  # padded rows
        part[:, : v1 - v0] = raw[:, v0:v1]
        jit.softmax_grad(
            part[:, : v1 - v0],
            t,
            lse,
            alpha,
            alpha_lse,
            beta,
            gamma,
            col_offset=v0,
            class_weight=None if cw is None else cw[v0:v1],
            **kw,
        )
        assert torch.equal(part[:, : v1 - v0], whole[:, v0:v1]), (v0, v1)
        assert torch.isnan(part[:, v1 - v0 :]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_scale(dtype):
    n = 3 * configs.INTERPRETER["elementwise"].block + 5  # several blocks per program and a tail
    g = torch.randn(n, device=DEVICE).to(dtype)
    before = g.clone()
    jit.scale_(g, torch.tensor(1.0, device=DEVICE), programs=2)
    assert torch.equal(g, before), "a scale of 1 must leave the gradient untouched"
    s = torch.rand((), device=DEVICE) + 0.5
    jit.scale_(g, s, programs=2)
    torch.testing.assert_close(g, (before.float() * s).to(dtype), rtol=0, atol=0)


def tied_logits(x, w, t):
    """Rows whose max logit appears twice, in different segments and splits: the argmax is the lower index."""
    V = w.shape[0]
    w = w.clone()
    w[V - 2] = w[3]  # the same logits in two far-apart columns
    x = x.clone()
    x[::2] = w[3].to(x.dtype) * 40  # ... and there the row max
    return x, w


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_entropy_and_argmax_from_both_forwards(case):
    x, w, t, b, cw, scale, cap = case_inputs(case)
    x, w = tied_logits(x, w, t)
    z = transformed_logits(x, w, b, scale, cap)
    log_p = z.log_softmax(1)
    ref_entropy = -(log_p.exp() * log_p).sum(1)
    ref_argmax = z.argmax(1)
    kw = dict(bias=b, class_weight=cw, logit_scale=scale, softcap=cap)
    *_, entropy, argmax = jit.row_stats(x, w, t, entropy=True, argmax=True, num_splits=3, **kw)
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=tol, atol=tol)
    # tl.dot's rounding may order near-equal logits otherwise than float64: the argmax holds the max (within
    # rounding); the exact tie-break is checked on stored logits below
    rows = torch.arange(x.shape[0], device=DEVICE)
    top = z.max(1).values
    assert (z[rows, argmax] >= top - tol * top.abs().clamp_min(1)).all()
    assert torch.isin(argmax[::2], torch.tensor([3, w.shape[0] - 2], device=DEVICE)).all()
    del ref_argmax
    # the stored-logits pass (logit_partials, combine_partials) on the same logits
    raw = (x.double() @ w.double().T + (b.double() if b is not None else 0)).to(x.dtype)
    raw[:, -2] = raw[:, 3]  # exact ties (a GEMM may round the two columns apart)
    zs = raw.double() * scale
    if cap is not None:
        zs = cap * torch.tanh(zs / cap)
    log_ps = zs.log_softmax(1)
    approx = x.dtype != torch.float32 and cap is not None and DEVICE == "cuda"  # tanh.approx
    *_, entropy, argmax = jit.stats_from_logits(
        raw, t, class_weight=cw, logit_scale=scale, softcap=cap, entropy=True, argmax=True
    )
    torch.testing.assert_close(
        entropy.double(), -(log_ps.exp() * log_ps).sum(1), rtol=1e-4, atol=5e-3 if approx else 1e-4
    )
    if not approx:  # stored logits tie exactly: the first of equal maxima, as torch's argmax
        assert torch.equal(argmax, zs.argmax(1))
        holds_tie = zs[:, 3] == zs.max(1).values
        assert holds_tie[::2].any() and (argmax[holds_tie] == 3).all()


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"{c['N']}x{c['D']}x{c['V']}-{c['dtype']}")
def test_entropy_gradient_term(case):
    # alpha_z * p * log p in both gradient kernels: with alpha = -g H, alpha_z = -g it is g * dH/dz
    N, V = case["N"], case["V"]
    x, w, t, b, cw, scale, cap = case_inputs(case)
    z = transformed_logits(x, w, b, scale, cap)
    log_p = z.log_softmax(1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(1)
    g_h = torch.randn(N, dtype=torch.float64, device=DEVICE)
    ref = -g_h[:, None] * p * (log_p + entropy[:, None])
    if cap is not None:
        ref = ref * (1 - (z / cap) ** 2)
    ref = ref * scale
    zero = torch.zeros(N, device=DEVICE)
    alpha, alpha_z = (-g_h * entropy).float(), (-g_h).float()
    lse = z.logsumexp(1).float()
    tol = 1e-4 if x.dtype == torch.float32 else 2e-2
    g = jit.logit_grad(
        x, w, t, lse, alpha, zero, zero, zero, 0, V, bias=b, logit_scale=scale, softcap=cap, alpha_z=alpha_z
    )
    torch.testing.assert_close(g.double(), ref, rtol=tol, atol=tol)
    raw = (x.double() @ w.double().T + (b.double() if b is not None else 0)).to(x.dtype)
    jit.softmax_grad(raw, t, lse, alpha, zero, zero, zero, logit_scale=scale, softcap=cap, alpha_z=alpha_z)
    torch.testing.assert_close(raw.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("class_weight", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_prepare_rows_and_assemble_loss(class_weight, reduction):
    N, V, ignore = 150, 70, -7  # several blocks of the interpreter's 64 rows
    t = torch.randint(0, V, (N,), device=DEVICE)
    t[::5] = ignore
    cw = torch.rand(V, device=DEVICE) + 0.5 if class_weight else None
    eps, z = 0.1, 1e-2
    tgt, wt, totals, bad, counted, coef, order = jit.prepare_rows(
        t,
        V,
        ignore,
        class_weight=cw,
        label_smoothing=eps,
        z_loss=z,
        mean=reduction == "mean",
        coefficients=True,
        order=True,
    )
    valid = t != ignore
    assert bad == 0 and counted == valid.sum().item()
    # the counted rows ascending, then the ignored ones ascending (csrc/targets.h)
    rows = torch.arange(N, device=DEVICE)
    assert torch.equal(order, torch.cat([rows[valid], rows[~valid]]))
    assert torch.equal(tgt, torch.where(valid, t, -1))
    ref_wt = (cw[t.clamp_min(0)] if cw is not None else torch.ones(N, device=DEVICE)) * valid
    torch.testing.assert_close(wt, ref_wt)
    cw_sum = cw.sum() if cw is not None else torch.tensor(float(V), device=DEVICE)
    torch.testing.assert_close(totals, torch.stack([ref_wt.sum(), valid.sum().float(), cw_sum]))
    g_ce = 1 / ref_wt.sum() if reduction == "mean" else 1.0
    g_z = 1 / valid.sum() if reduction == "mean" else 1.0
    expected = (
        g_ce * ((1 - eps) * ref_wt + eps / V * cw_sum) * valid,
        2 * z * g_z * valid,
        g_ce * (1 - eps) * ref_wt,
        g_ce * eps / V * valid.float(),
    )
    for c, e in zip(coef, expected):
        torch.testing.assert_close(c, e.float())
    # the loss from random row statistics, against the same formula in torch
    lse, gap, wz = (torch.randn(N, device=DEVICE) for _ in range(3))
    log_sum = torch.rand(N, device=DEVICE) * 5
    gap = gap.abs() * valid
    loss = jit.assemble_loss(
        lse, gap, log_sum, wz, tgt, wt, totals, V, label_smoothing=eps, z_loss=z, reduction=reduction
    )
    zero = torch.zeros((), device=DEVICE)
    ce = torch.where(valid, (1 - eps) * ref_wt * (gap + log_sum), zero)
    smooth = torch.where(valid, eps / V * (cw_sum * lse - wz), zero)
    z_term = torch.where(valid, z * lse**2, zero)
    ref = {
        "none": ce + smooth + z_term,
        "sum": ce.sum() + smooth.sum() + z_term.sum(),
        "mean": ce.sum() / ref_wt.sum() + smooth.sum() / ref_wt.sum() + z_term.sum() / valid.sum(),
    }[reduction]
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)


def test_prepare_rows_counts_bad_targets():
    t = torch.tensor([0, 5, -1, 9, -100, 3], device=DEVICE)
    tgt, _, totals, bad, counted, _, order = jit.prepare_rows(t, 9, -100, order=True)
    assert bad == 2  # -1 and 9 are outside [0, 9) and not ignore_index
    assert tgt.tolist() == [0, 5, -1, -1, -1, 3]
    assert totals[1].item() == 3 and counted == 3
    assert order.tolist() == [0, 1, 5, 2, 3, 4]  # bad rows count as ignored


def test_prepare_rows_coefficients_are_zero_where_not_counted():
    # class weights summing to 0 ('mean' divides by inf) and an infinite weight on a class no row counts
    # (1 / bincount): the coefficients of ignored rows stay exactly 0, and without label smoothing no row
    # takes the infinite weight sum
    V = 6
    t = torch.tensor([0, 1, -100, 2, -100], device=DEVICE)
    cw = torch.tensor([1.0, -1.0, 0.0, 2.0, float("inf"), 3.0], device=DEVICE)
    with warnings.catch_warnings():  # (the interpreter's numpy warns at the 1 / 0 these weights ask for: torch's inf)
        warnings.filterwarnings("ignore", "divide by zero", RuntimeWarning)
        *_, coef, _ = jit.prepare_rows(t, V, -100, class_weight=cw, mean=True, coefficients=True)
    ignored = t == -100
    for c in coef:
        assert (c[ignored] == 0).all()
    cw[0] = 2.0  # the counted weights now sum to 3: finite coefficients everywhere
    *_, coef, _ = jit.prepare_rows(t, V, -100, class_weight=cw, mean=True, coefficients=True)
    assert all(c.isfinite().all() for c in coef)


@pytest.mark.parametrize("divergence, beta", [(0, 0.0), (1, 1.0), (2, 0.3), (3, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_distill_rows(divergence, beta, dtype):
    # the three stages over stored logits of both heads (the teacher's absent for the top k: divergence 3) against
    # float64, with softcaps, logit scales, a temperature and the hard label
    g = torch.Generator().manual_seed(divergence)
    N, V, T = 13, 150, 1.7
    raw_s = (torch.randn(N, V, generator=g) * 3).to(dtype)
    raw_t = None if divergence == 3 else (torch.randn(N, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    target[2] = -1  # this row's label in another shard
    keywords = dict(temperature=T, logit_scale=0.9, softcap=5.0, teacher_logit_scale=1.2, teacher_softcap=4.0)
    z1 = transformed_logits(raw_s, torch.eye(V, dtype=dtype), None, 0.9, 5.0)
    s = torch.log_softmax(z1 / T, -1)
    if raw_t is not None:
        t = torch.log_softmax(transformed_logits(raw_t, torch.eye(V, dtype=dtype), None, 1.2, 4.0) / T, -1)
    zs = raw_s.clone().to(DEVICE)
    zt = None if raw_t is None else raw_t.clone().to(DEVICE)
    stats = torch.zeros(9, N, device=DEVICE)
    coef = torch.stack([torch.linspace(0.5, 1.5, N), torch.linspace(-1, 1, N)]).to(DEVICE)
    tgt = target.to(DEVICE)
    for stage in range(3):
        jit.distill_rows(stage, zs, zt, stats, coef, tgt, divergence=divergence, beta=beta, hard=True, **keywords)
    stats, zs = stats.cpu().double(), zs.cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    # the log-sum-exps as (max, log sum exp(z - max)); (float16's softcap: the GPU's approximate tanh)
    rtol = 1e-6 if dtype == torch.float32 else 2e-5
    torch.testing.assert_close(stats[0], (z1 / T).amax(-1), rtol=rtol, atol=1e-5)
    torch.testing.assert_close(stats[0] + stats[3], torch.logsumexp(z1 / T, -1), rtol=rtol, atol=1e-5)
    torch.testing.assert_close(stats[2] + stats[5], torch.logsumexp(z1, -1), rtol=rtol, atol=1e-5)
    torch.testing.assert_close(stats[8], (s.exp() * s).sum(-1), rtol=1e-5, atol=1e-5)
    ps = s.exp()
    if divergence == 0:
        want_sums, grad = [(t.exp() * (t - s)).sum(-1)], ps - t.exp()
    elif divergence == 1:
        kl = (ps * (s - t)).sum(-1)
        want_sums, grad = [kl], ps * ((s - t) - kl[:, None])
    elif divergence == 2:
        m = torch.logaddexp(s + torch.log1p(torch.tensor(-beta)), t + torch.log(torch.tensor(beta)))
        kl_s = (ps * (s - m)).sum(-1)
        want_sums, grad = [(t.exp() * (t - m)).sum(-1), kl_s], (1 - beta) * ps * ((s - m) - kl_s[:, None])
    else:
        want_sums, grad = [], ps
    for i, want in enumerate(want_sums):
        torch.testing.assert_close(stats[6 + i], want, rtol=1e-5, atol=1e-5)
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), V).double() * (target >= 0)[:, None]
    grad = grad * coef[0].cpu().double()[:, None] + coef[1].cpu().double()[:, None] * (torch.softmax(z1, -1) - onehot)
    grad = grad * 0.9 * (1 - (z1 / 5.0) ** 2)  # the softcap's and the scale's derivative
    assert ((zs.double() - grad).norm() / grad.norm()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_softmax_grad_marks_the_filter_tiles(dtype):
    """softmax_grad's flavor filter writes the same gradient and marks the same tiles as grad_tile_mask over the
    gradient it stored (rows and classes with tails, ignored rows, a logit scale, a peaked softmax: some tiles
    live, some not)."""
    tile = jit._config(jit._grad_tile_mask, torch.empty(0, device=DEVICE, dtype=dtype))
    N, V = 3 * tile.block_n + 5, 5 * tile.block_v + 7
    t = torch.randint(0, V, (N,), device=DEVICE)
    logits = torch.randn(N, V, device=DEVICE) * 0.5
    logits[torch.arange(N, device=DEVICE), t] += 12  # peaked at the targets: the others below the threshold
    hot = torch.rand(N, V, device=DEVICE) < 0.002
    logits[hot] += 10  # but a few
    t[::7] = -1  # (ignored rows: no coefficient, no nonzero entry, never a live tile)
    logits = logits.to(dtype)
    alpha = torch.where(t >= 0, 1 / N, 0.0).to(torch.float32)
    zeros = torch.zeros(N, device=DEVICE)
    scale, eps = 0.9, 2.0**-12
    lse = jit.stats_from_logits(logits, t, logit_scale=scale)[0]
    want = jit.softmax_grad(logits.clone(), t, lse, alpha, zeros, alpha, zeros, logit_scale=scale)
    threshold = alpha.abs() * (eps * scale)
    want_mask = jit.grad_tile_mask(want, threshold, t)
    mask = torch.zeros_like(want_mask)
    got = jit.softmax_grad(logits.clone(), t, lse, alpha, zeros, alpha, zeros, logit_scale=scale, filter_mask=mask,
                           filter_eps=eps)  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(mask, want_mask) and 0 < mask.float().mean() < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grad_tiles_mask_and_sparse_products(dtype):
    """grad_filter_eps's kernels: the tile mask (entries other than the targets at or above their row's threshold),
    then dX and dW over the live tiles alone, against ATen on the same tiles (tails in rows, classes, features)."""
    cfg = configs.INTERPRETER["grad_tiles"] if DEVICE == "cpu" else configs.config("grad_tiles", jit._arch(
        torch.empty(0, device=DEVICE)), "fp32" if dtype == torch.float32 else "fp16")  # fmt: skip
    dx_rows = jit._config(jit._sparse_grad_input, torch.empty(0, device=DEVICE, dtype=dtype)).block_n
    N, V, D = 3 * dx_rows + cfg.block_n + 5, 4 * cfg.block_v + 7, 2 * cfg.block_d + 3
    g = torch.randn(N, V, device=DEVICE) * 1e-4
    live = torch.rand(-(-N // cfg.block_n), -(-V // cfg.block_v), device=DEVICE) < 0.3
    expand = live.repeat_interleave(cfg.block_n, 0).repeat_interleave(cfg.block_v, 1)[:N, :V]
    g = torch.where(expand & (torch.rand(N, V, device=DEVICE) < 0.02), torch.randn(N, V, device=DEVICE), g)
    t = torch.randint(0, V, (N,), device=DEVICE)
    t[::5] = -1
    rows = torch.arange(N, device=DEVICE)[t >= 0]
    g[rows, t[t >= 0]] = 2.0  # a target's entry never makes its tile live
    g = g.to(dtype)
    threshold = torch.full((N,), 0.01, device=DEVICE)
    mask = jit.grad_tile_mask(g, threshold, t)
    above = g.float().abs() >= 0.01
    above[rows, t[t >= 0]] = False
    padded = torch.zeros(live.shape[0] * cfg.block_n, live.shape[1] * cfg.block_v, dtype=torch.bool, device=DEVICE)
    padded[:N, :V] = above
    want = padded.view(live.shape[0], cfg.block_n, live.shape[1], cfg.block_v).any(3).any(1)
    assert torch.equal(mask.bool(), want) and 0 < want.float().mean() < 1

    def kept_by(tiles, tile_rows):
        expanded = tiles.bool().repeat_interleave(tile_rows, 0).repeat_interleave(cfg.block_v, 1)[:N, :V]
        return torch.where(expanded, g.double(), 0)

    kept = kept_by(want, cfg.block_n)
    # dX's row tiles join dx_rows // block_n of the mask's (a tile of W read once serves them all): it reads the
    # tiles live in any of them, so more than the mask's, and still not every tile
    joined = jit.join_row_tiles(mask, dx_rows // cfg.block_n)
    assert joined.shape[0] == -(-N // dx_rows) and 0 < joined.float().mean() < 1
    if dx_rows > cfg.block_n:
        assert joined.float().mean() > mask.float().mean()
    w, x = torch.randn(V, D, device=DEVICE).to(dtype), torch.randn(N, D, device=DEVICE).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for splits in (1, 3):  # (3: a part of a row tile's live list may be empty)
        dx = jit.sparse_grad_input(g, w, mask, alpha=0.5, splits=splits)
        torch.testing.assert_close(dx.double(), 0.5 * kept_by(joined, dx_rows) @ w.double(), rtol=tol, atol=tol)
    acc = torch.randn(V, D, device=DEVICE)
    want_acc = acc.double() + 0.25 * kept.T @ x.double()
    torch.testing.assert_close(jit.sparse_grad_weight_(acc, g, x, mask, alpha=0.25).double(), want_acc, rtol=tol,
                               atol=tol)  # fmt: skip
    # the first block writes dW (tiles without a live row tile zeroed); dW summed in the input dtype (in_dtype)
    first = jit.sparse_grad_weight_(torch.randn(V, D, device=DEVICE), g, x, mask, alpha=0.25, accumulate=False)
    torch.testing.assert_close(first.double(), 0.25 * kept.T @ x.double(), rtol=tol, atol=tol)
    if dtype != torch.float32:
        out = acc.to(dtype)
        want_out = out.double() + 0.25 * kept.T @ x.double()
        got = jit.sparse_grad_weight_(out, g, x, mask, alpha=0.25).double()
        torch.testing.assert_close(got, want_out, rtol=4e-3, atol=4e-3 * want_out.abs().max().item())
