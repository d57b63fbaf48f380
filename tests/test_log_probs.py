"""fused_ce.linear_log_probs (per-token log-probs, entropy, argmax: the RL primitive) against float64 references."""

import pytest
import torch

import fused_ce
from helpers import DEVICES, leaves
from reference import make_problem, rel_err


def reference(x, w, t, b=None, temperature=1.0, softcap=None, ignore_index=-100):
    """log_probs, entropy, argmax from materialised logits (ignored rows: 0, 0, -1)."""
    z = x @ w.T + (0 if b is None else b)
    if z.dtype in (torch.bfloat16, torch.float16):
        z = z.float()  # as torch eager upcasts a low-precision model's logits
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = z.log_softmax(-1)
    valid = t != ignore_index
    lp = torch.where(valid, log_p.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    argmax = torch.where(valid, z.argmax(-1), -1)
    return lp, entropy, argmax


FEATURES = [
    {},
    dict(temperature=0.7),
    dict(softcap=3.0, temperature=1.3, bias=True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("features", FEATURES, ids=str)
def test_values_and_gradients_of_every_output(device, features):
    features = dict(features)
    bias = features.pop("bias", False)
    x, w, t, b = make_problem(67, 24, 301, dtype=torch.float64, device=device, bias=bias)
    x, w, b = leaves(x, w, b)
    out = fused_ce.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True, return_argmax=True, **features)
    assert isinstance(out, fused_ce.LogProbs)
    lp, entropy, argmax = reference(x, w, t, b, **features)
    assert out.log_probs.shape == t.shape and out.argmax.dtype == torch.int64
    torch.testing.assert_close(out.log_probs, lp)
    torch.testing.assert_close(out.entropy, entropy)
    assert torch.equal(out.argmax, argmax)
    assert (out.log_probs[t == -100] == 0).all() and (out.argmax[t == -100] == -1).all()
    tensors = [v for v in (x, w, b) if v is not None]
    u1, u2 = torch.randn_like(lp), torch.randn_like(lp)
    got = torch.autograd.grad((out.log_probs * u1).sum() + (out.entropy * u2).sum(), tensors)
    want = torch.autograd.grad((lp * u1).sum() + (entropy * u2).sum(), tensors)
    for g, e in zip(got, want):
        assert rel_err(g, e) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
def test_log_probs_alone_and_none_loss_ride_the_same_path(device):
    x, w, t, _ = make_problem(40, 16, 100, dtype=torch.float64, device=device)
    x, w = leaves(x, w)
    lp = fused_ce.linear_log_probs(x, w, t)
    assert isinstance(lp, torch.Tensor)
    none = fused_ce.linear_cross_entropy(x, w, t, reduction="none")
    torch.testing.assert_close(lp, -none)
    only_argmax = fused_ce.linear_log_probs(x, w, t, return_argmax=True)
    assert only_argmax.entropy is None and torch.equal(only_argmax.argmax, reference(x, w, t)[2])
    u = torch.randn_like(lp)
    got = torch.autograd.grad((lp * u).sum(), [x, w])
    want = torch.autograd.grad((reference(x, w, t)[0] * u).sum(), [x, w])
    for g, e in zip(got, want):
        assert rel_err(g, e) < 1e-10


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (5,), (3, 7)])
def test_input_ranks(device, shape):
    D, V = 12, 50
    x = torch.randn(*shape, D, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, device=device)
    t = torch.randint(0, V, shape, device=device)
    out = fused_ce.linear_log_probs(x, w, t, return_entropy=True)
    lp, entropy, _ = reference(x, w, t)
    assert out.log_probs.shape == t.shape
    torch.testing.assert_close(out.log_probs, lp)
    torch.testing.assert_close(out.entropy, entropy)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_torch_error(device, dtype):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("needs a CUDA device: float16 GEMMs on the CPU are torch's reference only")
    x, w, t, b = make_problem(512, 128, 2000, dtype=dtype, device=device, bias=True)
    adv = torch.randn(t.shape, device=device)
    truth = reference(*leaves(x.double(), w.double()), t, b.double())
    x64, w64 = leaves(x.double(), w.double())
    lp64, ent64, _ = reference(x64, w64, t, b.double())
    grads64 = torch.autograd.grad((adv.double() * lp64).sum() + 0.01 * ent64.sum(), [x64, w64])
    xe, we = leaves(x, w)
    lpe, ente, _ = reference(xe, we, t, b)  # torch eager: float32 logits from the low-precision GEMM
    gradse = torch.autograd.grad((adv * lpe).sum() + 0.01 * ente.sum(), [xe, we])
    xf, wf = leaves(x, w)
    out = fused_ce.linear_log_probs(xf, wf, t, linear_bias=b, return_entropy=True)
    gradsf = torch.autograd.grad((adv * out.log_probs).sum() + 0.01 * out.entropy.sum(), [xf, wf])
    for name, ours, eager, want in [
        ("log_probs", out.log_probs, lpe, truth[0]),
        ("entropy", out.entropy, ente, truth[1]),
        ("dX", gradsf[0], gradse[0], grads64[0]),
        ("dW", gradsf[1], gradse[1], grads64[1]),
    ]:
        assert rel_err(ours, want) <= 1.5 * rel_err(eager, want) + 1e-6, name


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile_fullgraph(device):
    x, w, t, b = make_problem(24, 16, 40, device=device, bias=True)
    args = (x.requires_grad_(), w.requires_grad_(), t, b)
    kwargs = dict(temperature=0.8, softcap=5.0, return_entropy=True, return_argmax=True)
    torch.library.opcheck(torch.ops.fused_ce.linear_log_probs.default, args, kwargs)
    core = dict(reduction="none", lse_of_ignored_rows=False, return_entropy=True, return_argmax=True)
    torch.library.opcheck(torch.ops.fused_ce._linear_cross_entropy.default, (x, w, t, b, None), core)

    def step(x, w, t, adv):
        out = fused_ce.linear_log_probs(x, w, t, return_entropy=True, return_argmax=True)
        return (adv * out.log_probs).sum() + 0.01 * out.entropy.sum(), out.argmax

    adv = torch.randn(t.shape, device=device)
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    want, want_argmax = step(x, w, t, adv)
    got, got_argmax = compiled(x, w, t, adv)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_argmax, want_argmax)
    want_grads = torch.autograd.grad(want, [x, w])
    got_grads = torch.autograd.grad(got, [x, w])
    for g, e in zip(got_grads, want_grads):
        torch.testing.assert_close(g, e)


def test_torchscript_calls_the_op(tmp_path):
    @torch.jit.script
    def fn(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
        return torch.ops.fused_ce.linear_log_probs(x, w, t, None, 0.5, None, 1.0, -100, True, True, None)

    path = tmp_path / "log_probs.pt"
    torch.jit.save(fn, str(path))
    x, w, t, _ = make_problem(20, 8, 30, dtype=torch.float64)
    lp, entropy, argmax = torch.jit.load(str(path))(x, w, t)
    want = reference(x, w, t, temperature=0.5)
    torch.testing.assert_close(lp, want[0])
    torch.testing.assert_close(entropy, want[1])
    assert torch.equal(argmax, want[2])


def test_bad_temperature_is_an_error():
    x, w, t, _ = make_problem(4, 8, 10)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            fused_ce.linear_log_probs(x, w, t, temperature=bad)


@pytest.mark.cuda
def test_gradient_kernels_match_on_cuda():
    # the stored-logits backward (cuBLAS logits, softmax_grad with the entropy's term) against float64, in a
    # workspace with room for blocks of logits but not for all of them (all: test_kept_logits.py): the first
    # rows' logits kept from the forward, the others' computed again; the recomputing backward alone plans two
    # vocabulary slices (test_backward_tiles.py)
    x, w, t, b = make_problem(3000, 256, 5000, dtype=torch.float32, device="cuda", bias=True)
    x, w, b = leaves(x, w, b)
    workspace = 32 << 20
    out = fused_ce.linear_log_probs(
        x, w, t, linear_bias=b, temperature=0.9, softcap=20.0, return_entropy=True, workspace_bytes=workspace
    )
    plan = fused_ce.plan(x, w, t, reduction="none", pass_="backward", linear_bias=b, workspace_bytes=workspace)
    assert plan.strategy == "vocab_tiles" and plan.counted_rows_only
    forward = fused_ce.plan(x, w, t, reduction="none", linear_bias=b, workspace_bytes=workspace)
    assert forward.keeps_logits and 512 <= forward.kept_rows < int((t != -100).sum())
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    lp, entropy, _ = reference(x64, w64, t, b64, temperature=0.9, softcap=20.0)
    u1, u2 = torch.randn_like(lp), torch.randn_like(lp)
    got = torch.autograd.grad((out.log_probs * u1.float()).sum() + (out.entropy * u2.float()).sum(), [x, w, b])
    want = torch.autograd.grad((lp * u1).sum() + (entropy * u2).sum(), [x64, w64, b64])
    for g, e in zip(got, want):
        assert rel_err(g, e) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_returns_the_argmax_from_its_own_pass(device, reduction):
    x, w, t, b = make_problem(67, 24, 301, dtype=torch.float64, device=device, bias=True)
    _, _, want = reference(x, w, t, b)
    xl, wl = leaves(x, w)
    loss, lse, argmax = fused_ce.linear_cross_entropy(
        xl, wl, t, linear_bias=b, reduction=reduction, return_lse=True, return_argmax=True
    )
    assert torch.equal(argmax, want) and argmax.dtype == torch.int64
    only_loss, argmax_alone = fused_ce.linear_cross_entropy(xl, wl, t, linear_bias=b, reduction=reduction,
                                                            return_argmax=True)  # fmt: skip
    assert torch.equal(argmax_alone, want)
    plain = fused_ce.linear_cross_entropy(*leaves(x, w), t, linear_bias=b, reduction=reduction)
    torch.testing.assert_close(loss, plain)
    torch.testing.assert_close(only_loss, plain)
    # the argmax changes no gradient
    got = torch.autograd.grad(loss.sum(), [xl, wl])
    xp, wp = leaves(x, w)
    want_grads = torch.autograd.grad(fused_ce.linear_cross_entropy(xp, wp, t, linear_bias=b, reduction=reduction).sum(),
                                     [xp, wp])  # fmt: skip
    for g, e in zip(got, want_grads):
        torch.testing.assert_close(g, e)
    with pytest.raises(ValueError, match="return_argmax"):
        fused_ce.linear_cross_entropy(x, w.view(301, 1, 24).expand(301, 2, 24), t.view(-1, 1).expand(-1, 2),
                                      return_argmax=True)  # fmt: skip
