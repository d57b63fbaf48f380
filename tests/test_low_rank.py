"""The cross-entropy ops' low-rank term of the logits (``low_rank_input @ low_rank_weight.T``: LoRA on the head with
its dropout): loss and every gradient against float64, the ops' checks, compile and TorchScript, and its errors."""

import pytest
import torch

import fused_ce
from fused_ce import linear_cross_entropy, linear_log_probs
from helpers import DEVICES
from reference import make_problem, reference_loss, rel_err

R = 4


def low_rank_problem(N, D, V, dtype=torch.float32, device="cpu", rows=(), bias=False):
    """make_problem's inputs shaped [*rows, N, ...] and a rank-R term: u ~ N(0, 1), B ~ N(0, 1/R)."""
    x, w, t, b = make_problem(N * max(1, int(torch.tensor(rows).prod())) if rows else N, D, V, dtype, device, bias=bias)
    shape = (*rows, N) if rows else (N,)
    u = torch.randn(*shape, R, dtype=torch.float32).to(device=device, dtype=dtype)
    B = (torch.randn(V, R) / R**0.5).to(device=device, dtype=dtype)
    return x.reshape(*shape, D), w, t.reshape(shape), b, u, B


def float64_reference(x, w, t, b, u, B, **kwargs):
    """The reference loss of the logits x @ w.T + u @ B.T (+ b) in float64 (one product of the concatenations),
    and the float64 leaves (x, w, b, u, B)."""
    leaves = [None if v is None else v.detach().double().requires_grad_() for v in (x, w, b, u, B)]
    xd, wd, bd, ud, Bd = leaves
    loss = reference_loss(torch.cat([xd, ud], -1), torch.cat([wd, Bd], -1), t, linear_bias=bd, **kwargs)
    return leaves, loss


def grads_of(loss, tensors, upstream):
    return torch.autograd.grad((loss * upstream).sum(), tensors)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kw",
    [
        dict(reduction="mean"),
        dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3),
        dict(reduction="none", softcap=4.0, logit_scale=0.8),
        dict(reduction="mean", weight=True, label_smoothing=0.2),
        dict(reduction="none", workspace_bytes=2048),  # one row of logits per block
        dict(reduction="mean", workspace_bytes=4096, bias=True),
    ],
    ids=["mean", "sum-smoothing-zloss", "none-softcap", "mean-class-weights", "none-row-blocks", "mean-blocks-bias"],
)
def test_loss_and_every_gradient_match_float64(device, kw):
    kwargs = dict(kw)
    workspace = kwargs.pop("workspace_bytes", None)
    V = 96
    x, w, t, b, u, B = low_rank_problem(40, 24, V, device=device, rows=(2,), bias=kwargs.pop("bias", False))
    weight = torch.rand(V, device=device) + 0.5 if kwargs.pop("weight", False) else None
    inputs = [v.requires_grad_() if v is not None else None for v in (x, w, b, u, B)]
    loss = linear_cross_entropy(
        x, w, t, linear_bias=b, weight=weight, low_rank_input=u, low_rank_weight=B, workspace_bytes=workspace,
        **kwargs,
    )  # fmt: skip
    leaves, ref = float64_reference(x, w, t, b, u, B, weight=weight, **kwargs)
    assert rel_err(loss, ref) < 1e-5
    upstream = torch.randn(loss.shape, dtype=torch.float64)
    differentiable = [v for v in inputs if v is not None]
    got = grads_of(loss, differentiable, upstream.to(device=device, dtype=loss.dtype))
    want = grads_of(ref, [v for v in leaves if v is not None], upstream.to(device))
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape and g.dtype == torch.float32
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_lse_and_entropy_gradients_take_the_low_rank_term(device):
    """A gradient through the lse and the entropy: the recomputing backward op, rows ignored included."""
    x, w, t, _, u, B = low_rank_problem(30, 16, 64, device=device)
    inputs = [v.requires_grad_() for v in (x, w, u, B)]
    loss, lse, entropy, _ = torch.ops.fused_ce._linear_cross_entropy(
        x, w, t, reduction="none", return_entropy=True, low_rank_input=u, low_rank_weight=B
    )
    xd, wd, ud, Bd = [v.detach().double().requires_grad_() for v in inputs]
    z = xd @ wd.T + ud @ Bd.T
    log_p = z.log_softmax(-1)
    counted = t >= 0
    ref_loss = torch.where(counted, -log_p.gather(1, t.clamp(min=0)[:, None])[:, 0], 0)
    ref_entropy = torch.where(counted, -(log_p.exp() * log_p).sum(-1), 0)
    ref_lse = z.logsumexp(-1)
    for got, want in [(loss, ref_loss), (lse, ref_lse), (entropy, ref_entropy)]:
        assert rel_err(got, want) < 1e-5
    g = [torch.randn(30, dtype=torch.float64) for _ in range(3)]
    got = torch.autograd.grad(sum((o * gi.to(device, o.dtype)).sum() for o, gi in zip((loss, lse, entropy), g)), inputs)
    want = torch.autograd.grad(
        sum((o * gi.to(device)).sum() for o, gi in zip((ref_loss, ref_lse, ref_entropy), g)), (xd, wd, ud, Bd)
    )
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_torchs_own_error(device, dtype):
    """bfloat16 and float16 (float16's gradients at unit scale: float32 through the products) against float64,
    bounded by torch eager's error on the same inputs (its logits in the input dtype, then float32)."""
    x, w, t, _, u, B = low_rank_problem(128, 32, 128, dtype=dtype, device=device)
    inputs = [v.requires_grad_() for v in (x, w, u, B)]
    # the per-row losses (a vector: their error is not one sample's), then the mean's gradients
    per_row = linear_cross_entropy(x, w, t, reduction="none", low_rank_input=u, low_rank_weight=B)
    eager_rows = torch.nn.functional.cross_entropy((x @ w.T + u @ B.T).float(), t, reduction="none")
    ref_rows = float64_reference(x, w, t, None, u, B, reduction="none")[1]
    assert rel_err(per_row, ref_rows) <= 2 * rel_err(eager_rows, ref_rows) + 1e-6
    loss = linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B)
    got = torch.autograd.grad(loss, inputs)
    eager = torch.nn.functional.cross_entropy((x @ w.T + u @ B.T).float(), t)
    eager_grads = torch.autograd.grad(eager, inputs)
    leaves, ref = float64_reference(x, w, t, None, u, B)
    want = torch.autograd.grad(ref, [v for v in leaves if v is not None])
    for g, e, r in zip(got, eager_grads, want, strict=True):
        assert g.dtype == dtype
        assert rel_err(g, r) <= 2 * rel_err(e, r) + 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_log_probs_at_a_temperature(device):
    x, w, t, _, u, B = low_rank_problem(20, 16, 48, device=device, rows=(3,))
    inputs = [v.requires_grad_() for v in (x, w, u, B)]
    out = linear_log_probs(x, w, t, temperature=0.7, return_entropy=True, low_rank_input=u, low_rank_weight=B)
    xd, wd, ud, Bd = [v.detach().double().requires_grad_() for v in inputs]
    log_p = ((xd @ wd.T + ud @ Bd.T) / 0.7).log_softmax(-1)
    want = torch.where(t >= 0, log_p.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0)
    assert rel_err(out.log_probs, want) < 1e-5
    got = torch.autograd.grad(out.log_probs.sum(), inputs)
    for a, b in zip(got, torch.autograd.grad(want.sum(), (xd, wd, ud, Bd)), strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck_and_compile(device, reduction):
    x, w, t, _, u, B = low_rank_problem(12, 16, 40, device=device, rows=(2,))
    args = (x.requires_grad_(), w.requires_grad_(), t)
    tensors = dict(low_rank_input=u.requires_grad_(), low_rank_weight=B.requires_grad_())
    torch.library.opcheck(torch.ops.fused_ce.linear_cross_entropy.default, args, dict(reduction=reduction, **tensors))
    torch.library.opcheck(
        torch.ops.fused_ce._linear_cross_entropy.default,
        args,
        dict(reduction=reduction, return_entropy=True, **tensors),
    )

    def f(x, w, u, B):
        return linear_cross_entropy(x, w, t, reduction=reduction, low_rank_input=u, low_rank_weight=B).sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    inputs = (x, w, u, B)
    got, want = compiled(*inputs), f(*inputs)  # (the graph's sum of 'none' in its own order)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_with_grad_op_opcheck(device, dtype):
    """The forward with gradient's low-rank gradients: shaped as their arguments, float16's in float32 (as its dX)."""
    x, w, t, _, u, B = low_rank_problem(24, 16, 40, dtype=dtype, device=device)
    args = (x, w, t, None, None, [True, True, False])
    kwargs = dict(reduction="mean", label_smoothing=0.1, low_rank_input=u, low_rank_weight=B)
    torch.library.opcheck(torch.ops.fused_ce.linear_cross_entropy_with_grad.default, args, kwargs)
    out = torch.ops.fused_ce.linear_cross_entropy_with_grad(*args, **kwargs)
    gu, gB = out[8:]
    assert gu.shape == u.shape and gB.shape == B.shape
    assert gu.dtype == gB.dtype == out[4].dtype == (torch.float32 if dtype == torch.float16 else dtype)


def test_torchscript_calls_the_public_op_with_the_term():
    x, w, t, _, u, B = low_rank_problem(10, 8, 30)

    def f(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, u: torch.Tensor, B: torch.Tensor):
        return torch.ops.fused_ce.linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B)[0]

    torch.testing.assert_close(torch.jit.script(f)(x, w, t, u, B), f(x, w, t, u, B), rtol=0, atol=0)
    assert rel_err(f(x, w, t, u, B), float64_reference(x, w, t, None, u, B)[1]) < 1e-6


def test_plan_on_the_cpu_runs_the_aten_stages():
    x, w, t, _, u, B = low_rank_problem(10, 8, 30)
    plan = fused_ce.plan(x, w, t, reduction="none", low_rank_input=u, low_rank_weight=B)
    assert plan.strategy == "aten_chunks" and not plan.keeps_logits


# (reduction, float32's workspace_bytes, N, D, V; the first pass's plan in float32): each case a kernel plan
KERNEL_PLANS = {
    "stored_logits": ("mean", None, 600, 64, 3000, ("forward_with_grad", "stored_logits", False)),
    "vocab_tiles": ("mean", 4 << 20, 4096, 256, 5000, ("forward_with_grad", "vocab_tiles", False)),
    "kept_logits": ("none", 1 << 34, 1000, 128, 3008, ("forward_keeping_logits", "stored_logits", True)),
    # the first rows' logits kept, the others' gradient tiles in their storage; the recomputing backward in tiles
    "partly_kept": ("none", 20 << 20, 4096, 128, 8192, ("forward_keeping_logits", "stored_logits", True)),
    # too small for cuBLAS-sized blocks: dot_tiles without the term, the ATen stages with it
    "dot_tiles": ("none", 1 << 16, 300, 64, 3000, ("forward", "aten_chunks", False)),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(KERNEL_PLANS))
def test_kernel_plans_take_the_term(case, dtype):
    """On CUDA the term takes the plan the call takes without it (the stored cuBLAS logits, their vocabulary tiles,
    the kept logits of a per-row loss, whole or in part, the recomputing backward), but dot_tiles, whose kernels
    form logits of their own: the ATen stages there. Loss and every gradient (x, W, b, u, B; ignored rows
    included), the first backward's and a second one's through the retained graph (which computes them again),
    against float64: float32 within 1e-5, bfloat16 and float16 within 2x torch eager's own error."""
    reduction, workspace, N, D, V, first_plan = KERNEL_PLANS[case]
    if workspace is not None and case != "dot_tiles":
        workspace = workspace * dtype.itemsize // 4  # (the same rows in the dtype's bytes)
    x, w, t, b, u, B = low_rank_problem(N, D, V, dtype=dtype, device="cuda", bias=True)
    inputs = [v.requires_grad_() for v in (x, w, b, u, B)]
    kw = dict(reduction=reduction, linear_bias=b, workspace_bytes=workspace)
    for pass_ in (None, "backward"):
        without = fused_ce.plan(x, w, t, pass_=pass_, **kw)
        plan = fused_ce.plan(x, w, t, pass_=pass_, low_rank_input=u, low_rank_weight=B, **kw)
        if without.strategy == "dot_tiles":
            assert plan.strategy == "aten_chunks", plan
        else:
            assert plan == without, (plan, without)
        if pass_ is None:
            assert (without.strategy == "dot_tiles") == (case == "dot_tiles"), without
    first = fused_ce.plan(x, w, t, low_rank_input=u, low_rank_weight=B, **kw)
    if dtype == torch.float32:
        assert (first.pass_, first.strategy, first.keeps_logits) == first_plan, first
    if case == "partly_kept":
        assert 0 < first.kept_rows < (t >= 0).sum(), first
        assert fused_ce.plan(x, w, t, pass_="backward", **kw).strategy == "vocab_tiles"

    loss = linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B, **kw)
    upstream = torch.randn(loss.shape, dtype=torch.float64, device="cuda")
    objective = (loss * upstream.to(loss.dtype)).sum()
    first_grads = torch.autograd.grad(objective, inputs, retain_graph=True)
    again = torch.autograd.grad(objective, inputs)
    leaves, ref = float64_reference(x, w, t, b, u, B, reduction=reduction)
    want = grads_of(ref, leaves, upstream)
    if dtype == torch.float32:
        bounds = [1e-5] * 6
    else:  # torch eager: its logits in the input dtype, the loss in float32
        eager = torch.nn.functional.cross_entropy((x @ w.T + u @ B.T + b).float(), t, reduction=reduction)
        # (vocab_tiles sums a row's dX over the vocabulary slices in the input dtype, as without the term)
        factor = 3 if case == "vocab_tiles" else 2
        bounds = [factor * rel_err(e, r) + 1e-4 for e, r in zip([eager, *grads_of(eager, inputs, upstream.float())],
                                                                 [ref, *want])]  # fmt: skip
        if reduction != "none":  # a scalar's error is one sample: bounded by the mean of eager's per-row errors
            rows = torch.nn.functional.cross_entropy((x @ w.T + u @ B.T + b).float(), t, reduction="none")
            ref_rows = float64_reference(x, w, t, b, u, B, reduction="none")[1]
            per_row = (rows.double() - ref_rows).abs().sum() / ((t >= 0).sum() if reduction == "mean" else 1)
            bounds[0] = 2 * per_row.item() / ref.abs().item()
    assert rel_err(loss, ref) <= bounds[0], (rel_err(loss, ref), bounds[0])
    for got in (first_grads, again):
        for name, g, r, bound in zip("x w b u B".split(), got, want, bounds[1:], strict=True):
            assert g.dtype == dtype, name
            assert rel_err(g, r) <= bound, (name, rel_err(g, r), bound)


def test_errors_name_the_argument():
    x, w, t, _, u, B = low_rank_problem(10, 8, 30, rows=(2,))
    with pytest.raises(ValueError, match="low_rank_weight is missing"):
        linear_cross_entropy(x, w, t, low_rank_input=u)
    with pytest.raises(ValueError, match="low_rank_input is missing"):
        torch.ops.fused_ce._linear_cross_entropy(x, w, t, low_rank_weight=B)
    with pytest.raises(ValueError, match=r"low_rank_input must be the input's shape .* \[2, 10, 4\], got \[20, 4\]"):
        linear_cross_entropy(x, w, t, low_rank_input=u.reshape(20, R), low_rank_weight=B)
    with pytest.raises(ValueError, match=r"low_rank_weight must be \[30, r\]"):
        linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B[:7])
    with pytest.raises(RuntimeError, match="low_rank_weight dtype Double does not match input dtype Float"):
        linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B.double())
    with pytest.raises(ValueError, match="low_rank_input with a process_group .* is not supported"):
        torch.ops.fused_ce._linear_cross_entropy(
            x, w, t, process_group="tp", vocab_size=60, max_shard_rows=30, low_rank_input=u, low_rank_weight=B
        )
    with pytest.raises(ValueError, match="low-rank term is not supported for a K-dimensional loss"):
        linear_cross_entropy(x[0], w.reshape(30, 1, 8), t[0].reshape(10, 1), low_rank_input=u[0], low_rank_weight=B)


@pytest.mark.parametrize("front", ["linear_cross_entropy", "linear_log_probs", "linear_policy_loss"])
@pytest.mark.parametrize("given", ["low_rank_input", "low_rank_weight"])
def test_half_a_low_rank_term_is_one_error_eager_and_compiled(front, given):
    # The pairing is checked by the op (csrc/problem.cpp) and, under torch.compile, by its fake kernel: one message
    x, w, t, _, u, B = low_rank_problem(10, 8, 30, rows=(2,))
    call = {
        "linear_cross_entropy": lambda **kw: linear_cross_entropy(x, w, t, **kw),
        "linear_log_probs": lambda **kw: linear_log_probs(x, w, t, **kw)[0],
        "linear_policy_loss": lambda **kw: fused_ce.linear_policy_loss(x, w, t, torch.randn(t.shape), **kw),
    }[front]
    kwargs = {"low_rank_input": u} if given == "low_rank_input" else {"low_rank_weight": B}
    missing = "low_rank_weight" if given == "low_rank_input" else "low_rank_input"
    message = (
        f"{front}: low_rank_input and low_rank_weight go together (the logits' term low_rank_input @ "
        f"low_rank_weight.T): {missing} is missing"
    )
    with pytest.raises(ValueError) as eager:
        call(**kwargs)
    assert str(eager.value).splitlines()[0] == message
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:
        torch.compile(lambda: call(**kwargs), fullgraph=True)()
    assert message in str(compiled.value)


def test_no_grad_forward_and_frozen_base_weight():
    """LoRA's usual case: W frozen, the hidden states, u and B differentiable; and the forward alone."""
    x, w, t, _, u, B = low_rank_problem(16, 8, 30)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B)
    assert rel_err(loss, float64_reference(x, w, t, None, u, B)[1]) < 1e-6
    inputs = [v.requires_grad_() for v in (x, u, B)]
    loss = linear_cross_entropy(x, w, t, low_rank_input=u, low_rank_weight=B)
    loss.backward()
    assert w.grad is None and all(v.grad is not None for v in inputs)
    leaves, ref = float64_reference(x, w, t, None, u, B)
    want = torch.autograd.grad(ref, [leaves[0], leaves[3], leaves[4]])
    for v, r in zip(inputs, want, strict=True):
        assert rel_err(v.grad, r) < 1e-5


def test_export_keeps_the_term():
    class Head(torch.nn.Module):
        def forward(self, x, w, t, u, B):
            return linear_cross_entropy(x, w, t, reduction="none", low_rank_input=u, low_rank_weight=B)

    x, w, t, _, u, B = low_rank_problem(12, 8, 30)
    exported = torch.export.export(Head(), (x, w, t, u, B))
    (op,) = [n for n in exported.graph.nodes if n.target == torch.ops.fused_ce.linear_cross_entropy.default]
    inputs = [a.name for a in [*op.args, *op.kwargs.values()] if isinstance(a, torch.fx.Node)]
    assert inputs[-2:] == ["u", "b"], inputs  # (export lower-cases B)
    torch.testing.assert_close(exported.module()(x, w, t, u, B), Head()(x, w, t, u, B), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_takes_the_term(device):
    """linear_policy_loss with the term against the same loss of the concatenations [x, u] and [W, B] (one linear
    map: the op's tested path), loss, stats and every gradient; and its forward with gradient under opcheck."""
    x, w, t, _, u, B = low_rank_problem(30, 16, 64, device=device, rows=(2,))
    advantages = torch.randn(2, 30, device=device)
    old = -torch.rand(2, 30, device=device) * 3
    keywords = dict(old_log_probs=old, kl_coef=0.1, ref_log_probs=old - 0.1, temperature=0.8, return_stats=True)
    inputs = [v.requires_grad_() for v in (x, w, u, B)]
    loss, stats = fused_ce.linear_policy_loss(
        x, w, t, advantages, low_rank_input=u, low_rank_weight=B, **keywords
    )  # fmt: skip
    got = torch.autograd.grad(loss, inputs)
    xa, wa = torch.cat([x, u], -1).detach().requires_grad_(), torch.cat([w, B], -1).detach().requires_grad_()
    want_loss, want_stats = fused_ce.linear_policy_loss(xa, wa, t, advantages, **keywords)
    gxa, gwa = torch.autograd.grad(want_loss, (xa, wa))
    want = (gxa[..., :16], gwa[:, :16], gxa[..., 16:], gwa[:, 16:])
    # (float32 products in another order, x W^T + u B^T against [x, u] [W, B]^T: a sum of 60 terms near 80 each)
    assert rel_err(loss, want_loss) < 1e-5
    for a, b in zip(stats, want_stats, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5
    args = (x.detach(), w.detach(), t, advantages, None, old, None, None, [True, False, False])
    torch.library.opcheck(
        torch.ops.fused_ce.linear_policy_loss_with_grad.default, args, dict(low_rank_input=u.detach(),
                                                                            low_rank_weight=B.detach()),
    )  # fmt: skip
