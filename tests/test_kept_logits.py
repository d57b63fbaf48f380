"""Per-token losses that keep their logits from the forward for the backward where the workspace has room for
them (Plan.keeps_logits: 6NDV instead of 8NDV): against float64 and against the recomputing backward, with every
masking pattern, feature and dtype; the fallbacks (a gradient on ignored rows' lse, a second backward); CUDA graph
capture; torch.compile; the ops' registrations (opcheck)."""

import pytest
import torch
from test_log_probs import reference

import fused_ce
from helpers import leaves
from reference import make_problem, rel_err

KEEP = 1 << 34  # room for every test's logits
LEAN = 1 << 20  # room for none: the recomputing backward
N, D, V = 1000, 128, 3008


def partial(dtype, rows=600, d=D, v=V):
    """A workspace with room for `rows` rows' logits (and their partials, gathered x and dX rows) but not for
    every row's: the forward keeps the first `rows` rows of the counted-first order (kept_logit_rows)."""
    elem = torch.finfo(dtype).bits // 8
    return rows * (v * elem + (v + 1023) // 1024 * 12 + 2 * d * elem)


def test_cpu_never_keeps():
    x, w, t, _ = make_problem(64, 16, 100)
    x.requires_grad_()
    plan = fused_ce.plan(x, w, t, reduction="none", workspace_bytes=KEEP)
    assert plan.pass_ == "forward" and not plan.keeps_logits
    with torch.no_grad():  # the op decides: none kept, the forward's outputs alone
        *outputs, logits = torch.ops.fused_ce._linear_cross_entropy_keeping_logits(x, w, t, reduction="none")
        want = torch.ops.fused_ce._linear_cross_entropy(x, w, t, reduction="none")
    assert logits.shape == (0, 100)
    for got, expected in zip(outputs, want):
        torch.testing.assert_close(got, expected)


def masked(t, mask):
    t = t.clone()
    if mask == "scattered":
        t[torch.rand(t.shape, device=t.device) < 0.3] = -100
    elif mask == "prompt":
        t.view(4, -1)[:, : t.numel() // 8] = -100  # the first half of each of 4 sequences
    elif mask == "all":
        t[:] = -100
    elif mask == "one":
        t[:] = -100
        t[t.numel() // 3] = 7
    return t


def float64_grads(x, w, t, b, u1, u2, **features):
    x64, w64, b64 = leaves(x.double(), w.double(), None if b is None else b.double())
    lp, entropy, _ = reference(x64, w64, t, b64, **features)
    tensors = [v for v in (x64, w64, b64) if v is not None]
    return lp, entropy, torch.autograd.grad((lp * u1).sum() + (entropy * u2).sum(), tensors)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", ["none", "scattered", "prompt", "all", "one"])
def test_log_probs_and_entropy_gradients_match_float64_and_the_recomputing_backward(dtype, mask):
    x, w, t, b = make_problem(N, D, V, dtype=dtype, device="cuda", ignore_frac=0.0, bias=True)
    t = masked(t, mask)
    features = dict(temperature=0.8, softcap=15.0)
    u1, u2 = torch.randn(N, device="cuda", dtype=torch.float64), torch.randn(N, device="cuda", dtype=torch.float64)
    lp64, entropy64, want = float64_grads(x, w, t, b, u1, u2, **features)
    errors = {}
    counted = int((t != -100).sum())
    for workspace in (KEEP, partial(dtype), LEAN):
        xl, wl, bl = leaves(x, w, b)
        plan = fused_ce.plan(xl, wl, t, reduction="none", linear_bias=bl, workspace_bytes=workspace)
        assert plan.keeps_logits == (workspace != LEAN)
        assert plan.pass_ == ("forward_keeping_logits" if workspace != LEAN else "forward")
        assert plan.kept_rows == {KEEP: counted, LEAN: 0}.get(workspace, min(600, counted))
        out = fused_ce.linear_log_probs(
            xl, wl, t, linear_bias=bl, return_entropy=True, workspace_bytes=workspace, **features
        )
        assert rel_err(out.log_probs, lp64) < 2e-2 and rel_err(out.entropy, entropy64) < 2e-2
        got = torch.autograd.grad((out.log_probs * u1.float()).sum() + (out.entropy * u2.float()).sum(), [xl, wl, bl])
        assert all(g.dtype == dtype for g in got)
        if mask == "all":
            assert all(g.count_nonzero() == 0 for g in got)
            continue
        assert (got[0][t == -100] == 0).all()  # exact zeros at ignored rows
        errors[workspace] = [rel_err(g, e) for g, e in zip(got, want)]
    if mask != "all":
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for workspace, errs in errors.items():
            assert max(errs) < tolerance, (workspace, errs)
        # keeping the logits, all or some, rounds no more than computing them again (the same products, summed
        # in another order: float32's errors are ~1e-7 either way)
        for workspace in (KEEP, partial(dtype)):
            for kept, recomputed in zip(errors[workspace], errors[LEAN]):
                assert kept <= 1.5 * recomputed + tolerance / 10, (workspace, errors[workspace], errors[LEAN])


# The cross-entropy's features on the per-token paths (also test_backward_tiles.py); class_weights: random ones.
CROSS_ENTROPY_FEATURES = [
    dict(label_smoothing=0.1, class_weights=True),
    dict(z_loss=1e-3, logit_scale=0.5),
    dict(label_smoothing=0.05, softcap=20.0, class_weights=True),
]


def with_class_weights(features, V):
    features = dict(features)
    if features.pop("class_weights", False):
        features["weight"] = torch.rand(V, device="cuda") + 0.5
    return features


@pytest.mark.cuda
@pytest.mark.parametrize("features", CROSS_ENTROPY_FEATURES, ids=str)
def test_cross_entropy_none_with_every_feature_keeps_and_matches(features):
    x, w, t, b = make_problem(N, D, V, dtype=torch.bfloat16, device="cuda", ignore_frac=0.2, bias=True)
    features = with_class_weights(features, V)
    upstream = torch.randn(N, device="cuda")
    results = {}
    some = partial(torch.bfloat16)
    for workspace in (KEEP, some, LEAN):
        xl, wl, bl = leaves(x, w, b)
        loss = fused_ce.linear_cross_entropy(
            xl, wl, t, linear_bias=bl, reduction="none", workspace_bytes=workspace, **features
        )
        results[workspace] = (loss.detach(), *torch.autograd.grad((loss * upstream).sum(), [xl, wl, bl]))
    assert fused_ce.plan(x.requires_grad_(), w, t, reduction="none", workspace_bytes=KEEP).keeps_logits
    assert 0 < fused_ce.plan(x, w, t, reduction="none", workspace_bytes=some).kept_rows < int((t != -100).sum())
    for workspace in (KEEP, some):
        for kept, recomputed in zip(results[workspace], results[LEAN]):
            assert rel_err(kept.float(), recomputed.float()) < 1e-2


@pytest.mark.cuda
def test_lse_gradient_of_ignored_rows_and_a_second_backward_recompute():
    x, w, t, _ = make_problem(N, D, V, dtype=torch.float32, device="cuda", ignore_frac=0.3)
    upstream = torch.randn(N, device="cuda")

    def grads(workspace, retain=False):
        xl, wl = leaves(x, w)
        loss, lse = fused_ce.linear_cross_entropy(
            xl, wl, t, reduction="none", return_lse=True, workspace_bytes=workspace
        )
        total = (loss * upstream).sum() + 0.1 * lse.sum()  # the ignored rows' lse has a gradient
        first = torch.autograd.grad(total, [xl, wl], retain_graph=retain)
        second = torch.autograd.grad(total, [xl, wl]) if retain else None
        return first, second

    want, _ = grads(LEAN)
    got, again = grads(KEEP, retain=True)
    for g, a, e in zip(got, again, want):
        assert rel_err(g, e) < 1e-5 and rel_err(a, e) < 1e-5
    # a second backward through a retained graph after the kept logits were used up: computed again
    xl, wl = leaves(x, w)
    lp = fused_ce.linear_log_probs(xl, wl, t, workspace_bytes=KEEP)
    first = torch.autograd.grad((lp * upstream).sum(), [xl, wl], retain_graph=True)
    second = torch.autograd.grad((lp * upstream).sum(), [xl, wl])
    for a, b in zip(first, second):
        assert rel_err(a, b) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("keep", ["all", "some"])
def test_captured_forward_and_backward_match_eager_with_masked_targets(keep):
    # (captured: every row runs, counted ones first; "some": the first 600 of that order are kept, as eager
    # keeps the first 600 counted rows)
    x, w, t, _ = make_problem(N, D, V, dtype=torch.bfloat16, device="cuda", ignore_frac=0.0)
    xs, ws, ts = x.clone().requires_grad_(), w.clone().requires_grad_(), t.clone()
    adv = torch.randn(N, device="cuda")
    workspace = KEEP if keep == "all" else partial(torch.bfloat16)

    def step(x, w, t):
        lp = fused_ce.linear_log_probs(x, w, t, return_entropy=True, workspace_bytes=workspace)
        ((lp.log_probs * adv).sum() + 0.01 * lp.entropy.sum()).backward()
        return lp.log_probs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            xs.grad = ws.grad = None
            step(xs, ws, ts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    xs.grad = ws.grad = None
    with torch.cuda.graph(graph):
        static_lp = step(xs, ws, ts)
    for mask in ("prompt", "scattered", "none"):
        tm = masked(t, mask)
        ts.copy_(tm)
        graph.replay()
        xe, we = leaves(x, w)
        want = step(xe, we, tm)
        for got, e in zip((static_lp, xs.grad, ws.grad), (want, xe.grad, we.grad)):
            assert rel_err(got.float(), e.float()) < 1e-2, mask


@pytest.mark.cuda
@pytest.mark.parametrize("keep", ["all", "some"])
def test_compiled_fullgraph_dynamic_matches_eager(keep):
    x, w, t, _ = make_problem(N, D, V, dtype=torch.bfloat16, device="cuda")
    adv = torch.randn(N, device="cuda")
    workspace = KEEP if keep == "all" else partial(torch.bfloat16, rows=520)

    def objective(x, w, t, adv):
        out = fused_ce.linear_log_probs(x, w, t, return_entropy=True, workspace_bytes=workspace)
        return (out.log_probs * adv).sum() + 0.01 * out.entropy.sum()

    compiled = torch.compile(objective, fullgraph=True, dynamic=True)
    for rows in (N, N // 2):
        xe, we = leaves(x[:rows], w)
        xc, wc = leaves(x[:rows], w)
        want = torch.autograd.grad(objective(xe, we, t[:rows], adv[:rows]), [xe, we])
        got = torch.autograd.grad(compiled(xc, wc, t[:rows], adv[:rows]), [xc, wc])
        for g, e in zip(got, want):
            assert rel_err(g.float(), e.float()) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("keep", ["all", "some"])
def test_opcheck(keep):
    # every target counted: the kept logits of ignored rows are not computed (left uninitialised), so two runs
    # would differ there
    rows = 200 if keep == "all" else 700  # "some": 512 of them kept
    x, w, t, b = make_problem(rows, 64, 1024, dtype=torch.bfloat16, device="cuda", ignore_frac=0.0, bias=True)
    workspace = KEEP if keep == "all" else partial(torch.bfloat16, rows=512, d=64, v=1024)
    options = dict(reduction="none", return_entropy=True, workspace_bytes=workspace)
    torch.library.opcheck(torch.ops.fused_ce._linear_cross_entropy_keeping_logits.default, (x, w, t, b), options)
    loss, lse, entropy, _, logits = torch.ops.fused_ce._linear_cross_entropy_keeping_logits(x, w, t, b, **options)
    assert logits.shape == (rows if keep == "all" else 512, 1024)
    grad_loss, grad_entropy = torch.randn_like(loss), torch.randn_like(entropy)
    # (its logits become their gradient: the checks that run it on clones of its arguments)
    torch.library.opcheck(
        torch.ops.fused_ce._linear_cross_entropy_backward_from_logits.default,
        (grad_loss, None, grad_entropy, logits, x, w, t, b, None, lse, entropy, [True, True, True]),
        options,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_some_rows_kept_the_others_in_vocabulary_tiles_within_the_budget(dtype):
    # 512 rows kept of 3600 counted: the others' tiles (vocabulary slices, several row blocks) take the kept
    # tensor's storage, so the whole fwd+bwd stays within the workspace (beside inputs and gradients)
    n, d, v = 4096, 64, 8192
    x, w, t, b = make_problem(n, d, v, dtype=dtype, device="cuda", ignore_frac=0.12, bias=True)
    workspace = partial(dtype, rows=512, d=d, v=v)
    xl, wl, bl = leaves(x, w, b)
    forward = fused_ce.plan(xl, wl, t, reduction="none", linear_bias=bl, workspace_bytes=workspace)
    backward = fused_ce.plan(
        xl, wl, t, reduction="none", linear_bias=bl, workspace_bytes=workspace, pass_="backward_from_logits"
    )
    assert forward.pass_ == "forward_keeping_logits" and forward.kept_rows == 512
    assert backward.strategy == "vocab_tiles" and backward.tile_cols < v
    assert -(-(int((t != -100).sum()) - 512) // backward.block_rows) >= 2  # row blocks after the kept one
    upstream = torch.randn(n, device="cuda", dtype=torch.float64)
    lp64, entropy64, want = float64_grads(x, w, t, b, upstream, 0.1 * upstream)
    u = upstream.float()

    def step():
        out = fused_ce.linear_log_probs(xl, wl, t, linear_bias=bl, return_entropy=True, workspace_bytes=workspace)
        return out, torch.autograd.grad((out.log_probs * u).sum() + (out.entropy * 0.1 * u).sum(), [xl, wl, bl])

    step()  # (the first call's one-off allocations, cuBLAS's workspaces, are not the op's)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, got = step()
    grads = sum(g.numel() * g.element_size() for g in got)
    peak = torch.cuda.max_memory_allocated() - base - grads
    # bf16's dW over more than 2 row blocks (the kept block and the others' blocks) sums in a float32 V x D
    # accumulator, which the docs place beside workspace_bytes where the budget holds it (docs/usage.md, "Accuracy
    # against memory"; a smaller explicit budget takes vocabulary slices for dW instead)
    accumulator = v * d * 4 if backward.grad_weight_dtype == torch.float32 and dtype != torch.float32 else 0
    assert dtype == torch.float32 or accumulator, backward  # (3+ blocks: bf16's dW is not summed in bf16)
    assert peak < 1.1 * workspace + accumulator, (peak, workspace, accumulator)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(out.log_probs, lp64) < tolerance and rel_err(out.entropy, entropy64) < tolerance
    assert max(rel_err(g, e) for g, e in zip(got, want)) < tolerance
    assert (got[0][t == -100] == 0).all()
