"""The recomputing backward in 2-D tiles of cuBLAS logits (Strategy 'vocab_tiles' of pass 'backward': plan.cpp's
backward_tiles): row blocks x vocabulary slices, each slice's gradient from the forward's lse alone, dX summed over
the slices, dW over the row blocks. Against float64, with every masking pattern (the counted rows gathered once
per block; dX of the slices summed in float32), bias, softcap, temperature, the entropy, and the cross-entropy's
features. Such a budget also keeps the first rows' logits from the forward (kept_logit_rows): the first backward
reads them and computes the others' tiles in their storage; a second backward through the retained graph runs
the recomputing backward itself. Both are checked."""

import pytest
import torch
from test_kept_logits import CROSS_ENTROPY_FEATURES, masked, with_class_weights
from test_log_probs import reference

import fused_ce
from helpers import leaves
from reference import make_problem, reference_loss, rel_err

pytestmark = pytest.mark.cuda

N, D, V = 4096, 128, 8192


def tiled_budget(dtype):
    # 5 MiB per byte of element: 2 to 4 row blocks x 2 to 4 slices (backward_tiles' fewest bytes moved here)
    return 5 * (1 << 20) * torch.empty((), dtype=dtype).element_size()


def assert_tiled(plan, blocks):
    assert plan.pass_ == "backward" and plan.strategy == "vocab_tiles" and plan.tile_cols < V, plan
    assert plan.block_rows < plan.rows or not blocks, plan  # several row blocks
    assert plan.workspace_bytes <= plan.budget_bytes, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["none", "scattered", "prompt"])
def test_log_probs_and_entropy_gradients_in_tiles_match_float64(dtype, mask):
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device="cuda", ignore_frac=0.0, bias=True)
    t = masked(t, mask)
    features = dict(temperature=0.8, softcap=15.0)
    budget = tiled_budget(dtype)
    xl, wl, bl = leaves(x, w, b)
    assert_tiled(
        fused_ce.plan(xl, wl, t, pass_="backward", reduction="none", linear_bias=bl, workspace_bytes=budget),
        blocks=mask == "none",
    )
    u1, u2 = torch.randn(N, device="cuda", dtype=torch.float64), torch.randn(N, device="cuda", dtype=torch.float64)
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    lp64, entropy64, _ = reference(x64, w64, t, b64, **features)
    want = torch.autograd.grad((lp64 * u1).sum() + (entropy64 * u2).sum(), [x64, w64, b64])
    out = fused_ce.linear_log_probs(xl, wl, t, linear_bias=bl, return_entropy=True, workspace_bytes=budget, **features)
    objective = (out.log_probs * u1.float()).sum() + (out.entropy * u2.float()).sum()
    kept = torch.autograd.grad(objective, [xl, wl, bl], retain_graph=True)
    recomputed = torch.autograd.grad(objective, [xl, wl, bl])
    for got in (kept, recomputed):
        assert all(g.dtype == dtype for g in got)
        assert (got[0][t == -100] == 0).all()  # exact zeros at ignored rows
        errors = [rel_err(g, e) for g, e in zip(got, want)]
        assert max(errors) < (1e-5 if dtype == torch.float32 else 2e-2), errors


@pytest.mark.parametrize("features", CROSS_ENTROPY_FEATURES, ids=str)
def test_cross_entropy_none_in_tiles_matches_float64(features):
    x, w, t, b = make_problem(N, D, V, dtype=torch.float32, device="cuda", ignore_frac=0.2, bias=True)
    features = with_class_weights(features, V)
    budget = tiled_budget(torch.float32)
    xl, wl, bl = leaves(x, w, b)
    assert_tiled(
        fused_ce.plan(
            xl, wl, t, pass_="backward", reduction="none", linear_bias=bl, workspace_bytes=budget, **features
        ),
        blocks=True,
    )
    upstream = torch.randn(N, device="cuda", dtype=torch.float64)
    x64, w64, b64 = leaves(x.double(), w.double(), b.double())
    f64 = {k: (v.double() if torch.is_tensor(v) else v) for k, v in features.items()}
    want_loss = reference_loss(x64, w64, t, linear_bias=b64, reduction="none", **f64)
    want = torch.autograd.grad((want_loss * upstream).sum(), [x64, w64, b64])
    loss = fused_ce.linear_cross_entropy(
        xl, wl, t, linear_bias=bl, reduction="none", workspace_bytes=budget, **features
    )
    objective = (loss * upstream.float()).sum()
    assert rel_err(loss, want_loss) < 1e-5
    for got in (
        torch.autograd.grad(objective, [xl, wl, bl], retain_graph=True),
        torch.autograd.grad(objective, [xl, wl, bl]),
    ):
        errors = [rel_err(g, e) for g, e in zip(got, want)]
        assert max(errors) < 1e-5, errors


def test_only_the_gradients_asked_for():
    x, w, t, _ = make_problem(N, D, V, dtype=torch.bfloat16, device="cuda")
    budget = tiled_budget(torch.bfloat16)
    upstream = torch.randn(N, device="cuda")

    def grads(x, w):
        loss = fused_ce.linear_cross_entropy(x, w, t, reduction="none", workspace_bytes=budget)
        return torch.autograd.grad((loss * upstream).sum(), [v for v in (x, w) if v.requires_grad])

    both = grads(*leaves(x, w))
    (gx,) = grads(leaves(x)[0], w)
    (gw,) = grads(x, leaves(w)[0])
    assert torch.equal(gx, both[0]) and torch.equal(gw, both[1])  # the same products in the same order


def test_the_large_shapes_plan_two_row_blocks():
    # At A in the default 0.5 GiB: 2 blocks of 8192 whole rows (the budget's 8 blocks grown to 2 within it plus the
    # float32 dW sum's bytes that 8 would hold: dW summed in bf16, moved once more; 8 row blocks or vocabulary
    # slices would move it 7 times, in float32); B: 2 x 4096 rows; a problem whose logits fit one block keeps it.
    for n, d, v in [(16384, 4096, 128256), (8192, 2304, 256000)]:
        x = torch.empty(1, 1, dtype=torch.bfloat16, device="cuda").expand(n, d).requires_grad_()
        w = torch.empty(1, 1, dtype=torch.bfloat16, device="cuda").expand(v, d)
        t = torch.zeros(1, dtype=torch.long, device="cuda").expand(n)
        plan = fused_ce.plan(x, w, t, pass_="backward", reduction="none")
        assert (plan.strategy, plan.block_rows, plan.tile_cols) == ("stored_logits", n // 2, v), plan
        assert plan.grad_input_dtype == plan.grad_weight_dtype == torch.bfloat16
        assert plan.workspace_bytes <= plan.budget_bytes + v * d * 4
    x, w, t, _ = make_problem(1000, 64, 3000, dtype=torch.bfloat16, device="cuda")
    assert fused_ce.plan(x.requires_grad_(), w, t, pass_="backward", reduction="none").strategy == "stored_logits"
