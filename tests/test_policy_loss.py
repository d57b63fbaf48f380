"""fused_ce.linear_policy_loss (PPO-clip / GRPO with a k3 KL and an entropy bonus, fused at 6NDV) against the same
formula written with torch on materialised logits: loss, gradients (torch's subgradients) and stats."""

import pytest
import torch

import fused_ce
from helpers import DEVICES, leaves
from reference import rel_err


def torch_policy(
    x,
    w,
    t,
    A,
    *,
    old=None,
    ref=None,
    weights=None,
    clip_low=0.2,
    clip_high=0.2,
    kl_coef=0.0,
    entropy_coef=0.0,
    temperature=1.0,
    softcap=None,
    logit_scale=1.0,
    kl_times_ratio=False,
    b=None,
    ignore_index=-100,
):
    """The objective and the stats trainers log, from float32/float64 logits (what TRL's loss computes)."""
    z = x @ w.T + (0 if b is None else b)
    z = (z.float() if z.dtype in (torch.bfloat16, torch.float16) else z) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = z.log_softmax(-1)
    valid = t != ignore_index
    lp = log_p.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ratio = torch.exp(lp - (lp.detach() if old is None else old))
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    term = -torch.minimum(ratio * A, clipped * A)
    kl = torch.zeros_like(lp)
    if ref is not None:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        term = term + kl_coef * (kl * ratio if kl_times_ratio else kl)
    term = term - entropy_coef * entropy
    if weights is None:
        weights = valid.to(lp.dtype) / valid.sum()
    loss = torch.where(valid, weights * term, 0.0).sum()
    mean = lambda v: torch.where(valid, v.to(lp.dtype), 0.0).sum() / valid.sum()  # noqa: E731
    stats = [
        mean(ratio),
        mean((ratio < 1 - clip_low) & (A < 0)),
        mean((ratio > 1 + clip_high) & (A > 0)),
        mean(kl * ratio if kl_times_ratio else kl),
        mean(entropy),
        mean(z.argmax(-1) == t),
    ]
    return loss, torch.stack(stats).detach()


def rl_problem(device, N=64, D=16, V=97, dtype=torch.float64, seed=0, ignored=0.25):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64).to(device, dtype)
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5 * 3).to(device, dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignored] = -100
    A = torch.randn(N, generator=g, dtype=torch.float64).to(device)
    with torch.no_grad():
        lp = fused_ce.linear_log_probs(x, w, t.to(device)).double()
    old = lp + 0.4 * torch.randn(N, generator=g, dtype=torch.float64).to(device)  # ratios on both sides of the clip
    ref = lp + 0.3 * torch.randn(N, generator=g, dtype=torch.float64).to(device)
    return x, w, t.to(device), A, old, ref


OPTIONS = [
    {},  # on-policy GRPO: ratio 1, the gradient -A * dlogp
    dict(old=True),
    dict(old=True, ref=True, kl_coef=0.04),
    dict(old=True, ref=True, kl_coef=0.04, entropy_coef=0.01, temperature=0.7),
    dict(old=True, clip_low=0.1, clip_high=0.28),  # DAPO's asymmetric clip
    dict(ref=True, kl_coef=0.1, entropy_coef=0.02, bias=True),
    dict(old=True, ref=True, kl_coef=0.04, kl_times_ratio=True),  # TRL's use_bias_correction_kl
    dict(old=True, entropy_coef=0.01, softcap=3.0, logit_scale=0.8, temperature=1.3),  # Gemma-, Cohere-style heads
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_loss_gradients_and_stats_match_torch(device, options):
    options = dict(options)
    x, w, t, A, old, ref = rl_problem(device)
    b = torch.randn(w.shape[0], dtype=torch.float64, device=device) if options.pop("bias", False) else None
    use_old, use_ref = options.pop("old", False), options.pop("ref", False)
    inputs = dict(old_log_probs=old if use_old else None, ref_log_probs=ref if use_ref else None)
    xf, wf, bf = leaves(x, w, b)
    loss, stats = fused_ce.linear_policy_loss(xf, wf, t, A, linear_bias=bf, return_stats=True, **inputs, **options)
    xr, wr, br = leaves(x, w, b)
    want, want_stats = torch_policy(
        xr, wr, t, A, old=inputs["old_log_probs"], ref=inputs["ref_log_probs"], b=br, **options
    )
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(torch.stack(list(stats)), want_stats)
    tensors = [v for v in (xf, wf, bf) if v is not None]
    got = torch.autograd.grad(loss * 1.7, tensors)  # an upstream gradient other than 1: the backward scales
    expected = torch.autograd.grad(want * 1.7, [v for v in (xr, wr, br) if v is not None])
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_every_aggregation_through_token_weights(device, aggregation):
    x, w, t, A, old, ref = rl_problem(device, N=8 * 12)
    valid = (t != -100).double()
    if aggregation == "token_mean":  # over the batch (GRPO's default in TRL: the DAPO loss)
        weights = valid / valid.sum()
    elif aggregation == "sequence_mean":  # each sequence's mean, then the mean over sequences (GRPO's paper)
        per_seq = valid.view(8, 12)
        weights = (per_seq / per_seq.sum(1, keepdim=True).clamp_min(1) / 8).reshape(-1)
    else:  # a constant normaliser (Dr. GRPO: the maximum completion length)
        weights = valid / (8 * 12)
    xf, wf = leaves(x, w)
    loss = fused_ce.linear_policy_loss(xf, wf, t, A, token_weights=weights, old_log_probs=old)
    xr, wr = leaves(x, w)
    want, _ = torch_policy(xr, wr, t, A, old=old, weights=weights)
    torch.testing.assert_close(loss, want)
    for g, e in zip(torch.autograd.grad(loss, [xf, wf]), torch.autograd.grad(want, [xr, wr])):
        assert rel_err(g, e) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_ignored_tokens_and_every_token_ignored(device):
    x, w, t, A, old, _ = rl_problem(device, ignored=0.6)
    xf = x.detach().clone().requires_grad_()
    fused_ce.linear_policy_loss(xf, w, t, A, old_log_probs=old).backward()
    assert (xf.grad[t == -100] == 0).all()
    everything = torch.full_like(t, -100)
    xf = x.detach().clone().requires_grad_()
    loss = fused_ce.linear_policy_loss(xf, w, everything, A)
    loss.backward()
    assert loss.item() == 0 and (xf.grad == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_within_torch_error(device):
    x, w, t, A, old, ref = rl_problem(device, N=256, D=64, V=1000)
    kw = dict(kl_coef=0.04, entropy_coef=0.01)
    x64, w64 = leaves(x, w)
    want = torch_policy(x64, w64, t, A, old=old, ref=ref, **kw)[0]
    grads64 = torch.autograd.grad(want, [x64, w64])
    for dtype in [torch.bfloat16] + ([torch.float16] if device == "cuda" else []):
        xe, we = leaves(x.to(dtype), w.to(dtype))
        eager = torch_policy(xe, we, t, A.float(), old=old.float(), ref=ref.float(), **kw)[0]
        ge = torch.autograd.grad(eager, [xe, we])
        xf, wf = leaves(x.to(dtype), w.to(dtype))
        ours = fused_ce.linear_policy_loss(
            xf, wf, t, A.float(), old_log_probs=old.float(), ref_log_probs=ref.float(), **kw
        )
        gf = torch.autograd.grad(ours, [xf, wf])
        assert rel_err(ours, want) <= 1.5 * rel_err(eager, want) + 1e-6, dtype
        for name, a, e, r in zip(("dX", "dW"), gf, ge, grads64):
            assert rel_err(a, r) <= 1.5 * rel_err(e, r) + 1e-6, (dtype, name)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_and_opcheck(device):
    x, w, t, A, old, ref = rl_problem(device, dtype=torch.float32)
    A, old, ref = A.float(), old.float(), ref.float()
    args = (x.requires_grad_(), w.requires_grad_(), t, A, None, old, ref, None)
    torch.library.opcheck(
        torch.ops.fused_ce.linear_policy_loss.default, args, dict(kl_coef=0.04, entropy_coef=0.01, return_stats=True)
    )

    def step(x, w):
        loss, stats = fused_ce.linear_policy_loss(
            x, w, t, A, old_log_probs=old, ref_log_probs=ref, kl_coef=0.04, return_stats=True
        )
        return loss, stats.ratio

    compiled = torch.compile(step, fullgraph=True)
    (want, want_ratio), (got, got_ratio) = step(x, w), compiled(x, w)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_ratio, want_ratio)
    for g, e in zip(torch.autograd.grad(got, [x, w]), torch.autograd.grad(want, [x, w])):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_the_linear_in_the_autocast_dtype(device):
    # like F.linear: float32 inputs under autocast give the loss of their bfloat16 casts, every stat included
    x, w, t, A, old, ref = rl_problem(device, N=128, D=32, V=300, dtype=torch.float32)
    kw = dict(old_log_probs=old.float(), ref_log_probs=ref.float(), kl_coef=0.04, entropy_coef=0.01, return_stats=True)
    xf, wf = leaves(x, w)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, stats = fused_ce.linear_policy_loss(xf, wf, t, A.float(), **kw)
    gx, gw = torch.autograd.grad(loss, [xf, wf])
    xb, wb = leaves(x.bfloat16(), w.bfloat16())
    want, want_stats = fused_ce.linear_policy_loss(xb, wb, t, A.float(), **kw)
    want_gx, want_gw = torch.autograd.grad(want, [xb, wb])
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(list(stats)), torch.stack(list(want_stats)), rtol=0, atol=0)
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32  # gradients in the leaves' dtypes
    torch.testing.assert_close(gx, want_gx.float(), rtol=0, atol=0)
    torch.testing.assert_close(gw, want_gw.float(), rtol=0, atol=0)


def test_inputs_with_grad_and_bad_shapes_are_errors():
    x, w, t, A, old, _ = rl_problem("cpu", dtype=torch.float32)
    x.requires_grad_()
    with pytest.raises(RuntimeError, match="advantages"):
        fused_ce.linear_policy_loss(x, w, t, A.float().requires_grad_())
    with pytest.raises(ValueError, match="old_log_probs must have the target's shape"):
        fused_ce.linear_policy_loss(x, w, t, A.float(), old_log_probs=old[:5].float())
    with pytest.raises(ValueError, match="clip_low"):
        fused_ce.linear_policy_loss(x, w, t, A.float(), clip_low=1.5)


@pytest.mark.cuda
def test_cuda_blocks_match_float64():
    x, w, t, A, old, ref = rl_problem("cuda", N=3000, D=128, V=4000, dtype=torch.float32)
    kw = dict(kl_coef=0.04, entropy_coef=0.01, temperature=0.9)
    xf, wf = leaves(x, w)
    loss, stats = fused_ce.linear_policy_loss(
        xf,
        wf,
        t,
        A.float(),
        old_log_probs=old.float(),
        ref_log_probs=ref.float(),
        return_stats=True,
        workspace_bytes=500 * 4000 * 4,
        **kw,
    )
    x64, w64 = leaves(x.double(), w.double())
    want, want_stats = torch_policy(x64, w64, t, A, old=old, ref=ref, **kw)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(list(stats)).double(), want_stats, rtol=1e-4, atol=1e-5)
    for g, e in zip(torch.autograd.grad(loss, [xf, wf]), torch.autograd.grad(want, [x64, w64])):
        assert rel_err(g, e) < 1e-5
