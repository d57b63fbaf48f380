"""No op writes into a tensor it was given: every op and option, float32 and a half dtype, on each device, leaves
its inputs bitwise as they were after the forward and after a backward through every differentiable output (the
returned lse too), with the inputs requiring gradients and with the features not requiring them (the caller's
cached hidden states); an expanded (stride-0) input is accepted wherever a contiguous one is."""

import math

import pytest
import torch

import fused_ce
from helpers import DEVICES

N, D, V, R, K = 96, 16, 300, 4, 5
EPS = 2.0**-12


def inputs(device, dtype, seed=0):
    """Peaked logits (each row near its target's weight row, so that grad_filter_eps skips tiles and keeps the targets'
    terms apart), 10% of rows ignored, and every other tensor an op takes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) / math.sqrt(D) * 2
    t = torch.randint(0, V, (N,), generator=g)
    x = 3.0 * w[t] * math.sqrt(D) / 2 + torch.randn(N, D, generator=g)
    t[torch.rand(N, generator=g) < 0.1] = -100
    floats = dict(
        x=x, w=w, bias=torch.randn(V, generator=g), class_weight=torch.rand(V, generator=g) + 0.5,
        u=torch.randn(N, R, generator=g), lr_w=torch.randn(V, R, generator=g) / math.sqrt(R),
        xt=torch.randn(N, 2 * D, generator=g), wt=torch.randn(V, 2 * D, generator=g) / math.sqrt(2 * D) * 2,
    )  # fmt: skip
    out = {k: v.to(device, dtype) for k, v in floats.items()}
    out["advantages"] = torch.randn(N, generator=g).to(device)
    out["old_log_probs"] = (-torch.rand(N, generator=g) * 5).to(device)
    out["ref_log_probs"] = (-torch.rand(N, generator=g) * 5).to(device)
    out["top_ids"] = torch.randint(0, V, (N, K), generator=g).to(device)
    out["top_log_probs"] = torch.randn(N, K, generator=g).log_softmax(-1).to(device)
    out["t"] = t.to(device)
    return out


lce, log_probs = fused_ce.linear_cross_entropy, fused_ce.linear_log_probs
policy, distill = fused_ce.linear_policy_loss, fused_ce.linear_distillation_loss
FEW_ROWS = 24 * V * 4  # a budget of a few rows: several row blocks
CASES = {
    "mean": lambda a: lce(a["x"], a["w"], a["t"]),
    "sum": lambda a: lce(a["x"], a["w"], a["t"], reduction="sum"),
    "none": lambda a: lce(a["x"], a["w"], a["t"], reduction="none"),
    "bias_class_weight_smoothing": lambda a: lce(
        a["x"], a["w"], a["t"], linear_bias=a["bias"], weight=a["class_weight"], label_smoothing=0.1
    ),
    "z_loss_softcap_scale": lambda a: lce(a["x"], a["w"], a["t"], z_loss=1e-3, softcap=5.0, logit_scale=0.7),
    "lse_argmax": lambda a: lce(a["x"], a["w"], a["t"], return_lse=True, return_argmax=True),
    "blocks": lambda a: lce(a["x"], a["w"], a["t"], workspace_bytes=FEW_ROWS),
    "blocks_none": lambda a: lce(a["x"], a["w"], a["t"], reduction="none", workspace_bytes=FEW_ROWS),
    "lean": lambda a: lce(a["x"], a["w"], a["t"], workspace_bytes=1),
    "grad_filter": lambda a: lce(a["x"], a["w"], a["t"], grad_filter_eps=EPS),
    # every row counted: the CPU's row block is then a view of the caller's input itself
    "grad_filter_every_row": lambda a: lce(a["x"], a["w"], a["t"].clamp_min(0), grad_filter_eps=EPS),
    "grad_filter_sum_lse": lambda a: lce(a["x"], a["w"], a["t"], grad_filter_eps=EPS, reduction="sum", return_lse=True),
    "grad_filter_blocks": lambda a: lce(a["x"], a["w"], a["t"], grad_filter_eps=EPS, workspace_bytes=FEW_ROWS),
    "low_rank": lambda a: lce(a["x"], a["w"], a["t"], low_rank_input=a["u"], low_rank_weight=a["lr_w"]),
    "k_dimensional": lambda a: lce(a["x"][:24], a["w"].reshape(V // 4, 4, D), a["t"][:96].reshape(24, 4) % (V // 4)),
    "module_every_row": lambda a: module_call(a),
    "log_probs": lambda a: log_probs(a["x"], a["w"], a["t"], temperature=0.7, return_entropy=True, return_argmax=True),
    "log_probs_blocks": lambda a: log_probs(a["x"], a["w"], a["t"], return_entropy=True, workspace_bytes=FEW_ROWS),
    "policy": lambda a: policy(
        a["x"],
        a["w"],
        a["t"],
        a["advantages"],
        old_log_probs=a["old_log_probs"],
        ref_log_probs=a["ref_log_probs"],
        kl_coef=0.04,
        entropy_coef=0.01,
        return_stats=True,
    ),  # fmt: skip
    "distillation_jsd": lambda a: distill(a["x"], a["w"], a["xt"], a["wt"], a["t"], beta=0.5, return_entropy=True),
    "distillation_hard_labels": lambda a: distill(
        a["x"], a["w"], a["xt"], a["wt"], a["t"], hard_label_weight=0.3, temperature=2.0, workspace_bytes=FEW_ROWS
    ),
    "distillation_top_k": lambda a: distill(
        a["x"], a["w"], target=a["t"], teacher_top_k=(a["top_ids"], a["top_log_probs"])
    ),
}


def module_call(a):
    """LinearCrossEntropyLoss with grad_filter_eps on the caller's features (its weight its own parameter)."""
    head = fused_ce.LinearCrossEntropyLoss(D, V, bias=False, grad_filter_eps=EPS, device=a["x"].device)
    head.linear.weight = torch.nn.Parameter(a["w"].detach().clone())
    return head(a["x"], a["t"].clamp_min(0))


def tensors_of(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors_of(o)]
    return []


def snapshot(args):
    return {k: v.detach().clone() for k, v in args.items()}


def assert_unchanged(args, before, when):
    for name, value in args.items():
        assert torch.equal(value.detach(), before[name]), f"{when}: the op wrote into its input {name}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grads", ["all", "weights"], ids=["all-grads", "features-without-grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inputs_bitwise_unchanged(case, grads, dtype, device):
    args = inputs(device, dtype)
    differentiable = {"x", "u", "w", "lr_w", "bias"} if grads == "all" else {"w", "lr_w", "bias"}
    for name in differentiable:
        args[name].requires_grad_()
    if case == "grad_filter" and (device == "cuda" or dtype != torch.float16):  # (CPU float16: from the backward)
        plan = fused_ce.plan(args["x"], args["w"], args["t"], grad_filter_eps=EPS)
        assert plan.filters_grads, plan  # (the filtered products run: the path that once scaled x in place)
    before = snapshot(args)
    outs = [o for o in tensors_of(CASES[case](args)) if o.requires_grad]
    assert_unchanged(args, before, "forward")
    assert outs, "nothing differentiable came out"
    leaves = [v for k, v in args.items() if v.requires_grad]
    upstream = [torch.randn_like(o) for o in outs]
    first = torch.autograd.grad(outs, leaves, upstream, allow_unused=True, retain_graph=True)
    assert_unchanged(args, before, "backward")
    # a second backward over the retained graph gives the first's gradients (its saved inputs were not changed)
    second = torch.autograd.grad(outs, leaves, upstream, allow_unused=True)
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_filter_eps", [0.0, EPS])
@pytest.mark.parametrize("ignored", [True, False], ids=["ignored-rows", "every-row"])
def test_expanded_input(device, grad_filter_eps, ignored):
    """A stride-0 input (one hidden state for every row) is read as the contiguous one with the same values."""
    args = inputs(device, torch.float32)
    if not ignored:
        args["t"] = args["t"].clamp_min(0)
    row = args["x"][:1]
    w = args["w"].clone().requires_grad_()
    expanded = row.expand(N, D).requires_grad_()
    contiguous = row.expand(N, D).contiguous().requires_grad_()
    got = fused_ce.linear_cross_entropy(expanded, w, args["t"], grad_filter_eps=grad_filter_eps)
    got_grads = torch.autograd.grad(got, (expanded, w))
    want = fused_ce.linear_cross_entropy(contiguous, w, args["t"], grad_filter_eps=grad_filter_eps)
    want_grads = torch.autograd.grad(want, (contiguous, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
