"""No silent wrong answers: what the op does not support is an error, and torch's semantics at the edges."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import fused_ce
from helpers import DEVICES, leaves
from reference import make_problem, reference_loss, rel_err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_is_an_error(device, reduction):
    x, w, t, _ = make_problem(16, 8, 30, device=device)
    x, w = leaves(x, w)
    loss = fused_ce.linear_cross_entropy(x, w, t, reduction=reduction).sum()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.functional.hessian(lambda xx: fused_ce.linear_cross_entropy(xx, w.detach(), t), x.detach())
    # a plain backward after all that still works
    fused_ce.linear_cross_entropy(x, w, t, reduction=reduction).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_ad_is_an_error(device):
    x, w, t, _ = make_problem(16, 8, 30, device=device)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        with fwAD.dual_level():
            fused_ce.linear_cross_entropy(fwAD.make_dual(x, torch.randn_like(x)), w, t)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda ww: fused_ce.linear_cross_entropy(x, ww, t), (w,), (torch.randn_like(w),))


@pytest.mark.parametrize("device", DEVICES)
def test_class_weights_requiring_grad_are_an_error(device):
    x, w, t, _ = make_problem(16, 8, 30, device=device)
    cw = torch.rand(30, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
        fused_ce.linear_cross_entropy(x, w, t, weight=cw)
    with torch.no_grad():  # as torch: only where a graph would be built
        fused_ce.linear_cross_entropy(x, w, t, weight=cw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "case",
    ["negative sum", "zero sum", "zero-weight rows only", "nothing counted"],
)
def test_mean_divides_by_the_signed_weight_sum_as_torch(device, smoothing, case):
    # torch divides 'mean' by the signed sum of the counted targets' weights: a zero sum gives an infinite or NaN
    # loss and NaN gradients; with nothing counted the loss is NaN and the gradients 0.
    x, w, _, _ = make_problem(6, 8, 5, dtype=torch.float64, device=device)
    cw = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0], dtype=torch.float64, device=device)
    t = {
        "negative sum": [1, 1, 0, 3, 4, -100],
        "zero sum": [0, 1, 0, 1, 2, 3],
        "zero-weight rows only": [4, 4, 4, 4, 4, 4],
        "nothing counted": [-100] * 6,
    }[case]
    t = torch.tensor(t, device=device)
    ours, ref = leaves(x, w), leaves(x, w)
    loss = fused_ce.linear_cross_entropy(*ours, t, weight=cw, label_smoothing=smoothing)
    loss.backward()
    expected = F.cross_entropy(ref[0] @ ref[1].T, t, weight=cw, label_smoothing=smoothing)
    expected.backward()
    torch.testing.assert_close(loss, expected, equal_nan=True)
    for a, b in zip(ours, ref):
        # a zero sum makes the gradients +-inf or NaN, which of the two depending on the order of the sums
        # (inf + -inf): non-finite where torch's are, equal elsewhere
        finite = torch.isfinite(b.grad)
        assert torch.equal(torch.isfinite(a.grad), finite)
        torch.testing.assert_close(a.grad[finite], b.grad[finite])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_non_finite_logits_of_ignored_rows_contribute_nothing(device, reduction):
    # An ignored row whose logits overflow (inf, and NaN after the softmax) must not reach the loss or any
    # other row's gradient, forward or backward, on every path (CPU: ATen; CUDA: the kernels).
    x, w, t, b = make_problem(40, 16, 50, device=device, bias=True, ignore_frac=0.0)
    t[[3, 17]] = -100
    x[3] = 1e38  # logits of +-inf
    x[17] = float("inf")
    kw = dict(
        linear_bias=b, reduction=reduction, z_loss=1e-3, label_smoothing=0.1, weight=torch.rand(50, device=device)
    )
    ours = leaves(x, w, b)
    loss = fused_ce.linear_cross_entropy(ours[0], ours[1], t, **{**kw, "linear_bias": ours[2]})
    loss.sum().backward()
    keep = torch.ones(40, dtype=torch.bool, device=device)
    keep[[3, 17]] = False
    ref = [v.double().requires_grad_() for v in (x[keep], w, b)]
    expected = reference_loss(ref[0], ref[1], t[keep], **{**kw, "linear_bias": ref[2]})
    if reduction == "none":
        assert torch.equal(loss[~keep], torch.zeros(2, device=device)), loss[~keep]
        loss = loss[keep]
    assert rel_err(loss, expected) < 1e-5
    expected.sum().backward()
    assert torch.equal(ours[0].grad[~keep], torch.zeros_like(ours[0].grad[~keep]))
    # dW and db would be NaN had a NaN reached them; dX of the counted rows matches
    assert rel_err(ours[0].grad[keep], ref[0].grad) < 1e-5
    assert torch.isfinite(ours[2].grad).all() and rel_err(ours[2].grad, ref[2].grad) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_ignored_rows_with_rank_one_smoothing(device):
    # class weights + label smoothing without softcap: the smoothing terms come from GEMVs over x (plan:
    # rank_one_smoothing on CUDA); an ignored row of x holding inf must not reach them.
    x, w, t, _ = make_problem(64, 16, 40, device=device, ignore_frac=0.0)
    t[5] = -100
    x[5] = float("inf")
    cw = torch.rand(40, device=device) + 0.5
    ours = leaves(x, w)
    loss = fused_ce.linear_cross_entropy(*ours, t, weight=cw, label_smoothing=0.2)
    loss.backward()
    keep = torch.arange(64, device=device) != 5
    ref = [v.double().requires_grad_() for v in (x[keep], w)]
    expected = reference_loss(*ref, t[keep], weight=cw, label_smoothing=0.2)
    expected.backward()
    assert rel_err(loss, expected) < 1e-5
    assert rel_err(ours[0].grad[keep], ref[0].grad) < 1e-5
    assert torch.equal(ours[0].grad[5], torch.zeros_like(ours[0].grad[5]))


@pytest.mark.parametrize("device", DEVICES)
def test_retained_graph_backward_is_reentrant(device):
    x, w, t, b = make_problem(30, 8, 40, device=device, bias=True)
    for reduction in ("mean", "none"):
        ours = leaves(x, w, b)
        loss = fused_ce.linear_cross_entropy(ours[0], ours[1], t, linear_bias=ours[2], reduction=reduction).sum()
        first = torch.autograd.grad(loss, ours, retain_graph=True)
        second = torch.autograd.grad(loss, ours)
        # the scalar path hands its precomputed gradients out once; the second recomputes: same values
        for a, c in zip(first, second):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_gradcheck_float64():
    x, w, t, b = make_problem(6, 5, 7, dtype=torch.float64, bias=True)
    cw = torch.rand(7, dtype=torch.float64) + 0.5
    for reduction in ("mean", "sum", "none"):

        def fn(x, w, b, reduction=reduction):
            return fused_ce.linear_cross_entropy(
                x, w, t, linear_bias=b, weight=cw, reduction=reduction, label_smoothing=0.1, z_loss=1e-2, softcap=3.0
            )

        assert torch.autograd.gradcheck(fn, leaves(x, w, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [1024.0, 2.0**24])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_has_no_cancellation_at_large_logits(device, magnitude, reduction):
    # equal logits of +-magnitude over 8 classes: the loss is log 8 exactly as far as float32 goes; computed as
    # lse - z_target it lost everything below the lse's rounding (2.0 at 2^24, 2.6e-5 off at 1024)
    V = 8
    w = torch.zeros(V, 2, device=device)
    w[:, 0] = 1.0
    x = torch.tensor([[magnitude, 0.0], [-magnitude, 0.0]], device=device)
    t = torch.tensor([3, 5], device=device)
    loss = fused_ce.linear_cross_entropy(x, w, t, reduction=reduction)
    expected = torch.full_like(loss, torch.log(torch.tensor(8.0)).item())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


TorchModule = getattr(torch.nn, "LinearCrossEntropyLoss", None)
needs_torch_module = pytest.mark.skipif(TorchModule is None, reason="torch < 2.13 has no nn.LinearCrossEntropyLoss")


@needs_torch_module
def test_module_takes_torchs_constructor_arguments_and_attributes():
    import inspect

    theirs = inspect.signature(TorchModule.__init__).parameters
    ours = inspect.signature(fused_ce.LinearCrossEntropyLoss.__init__).parameters
    takes_keywords = any(p.kind is p.VAR_KEYWORD for p in ours.values())
    for name, p in theirs.items():
        assert name in ours or (takes_keywords and p.kind is p.KEYWORD_ONLY), name
    cw = torch.rand(30) + 0.5
    kw = dict(bias=True, weight=cw, reduction="sum", ignore_index=3, label_smoothing=0.1, options=None)
    torch.manual_seed(0)
    a = TorchModule(16, 30, **kw)
    b = fused_ce.LinearCrossEntropyLoss(16, 30, **kw)
    for attr in ("num_classes", "out_features", "reduction", "ignore_index", "label_smoothing", "options"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert torch.equal(a.weight, b.weight) and a.state_dict().keys() == b.state_dict().keys()
    b.load_state_dict(a.state_dict())
    x, _, t, _ = make_problem(20, 16, 30)
    t = t.clamp_min(0)
    t[::4] = 3
    assert rel_err(b(x, t), a(x, t)) < 1e-5
    default = fused_ce.LinearCrossEntropyLoss(16, 30)
    # ignore_index None means -100, as in torch
    assert default.ignore_index is None and default(x, t.masked_fill(t == 3, -100)).isfinite()


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(weight=torch.ones(29)), RuntimeError),
        (dict(label_smoothing=1.5), RuntimeError),
        (dict(label_smoothing=-0.5), RuntimeError),
        (dict(no_such_option=1), TypeError),
    ],
)
def test_module_validates_at_construction(kw, exc):
    with pytest.raises(exc):
        fused_ce.LinearCrossEntropyLoss(16, 30, **kw)
    if TorchModule is not None and exc is RuntimeError:
        with pytest.raises(RuntimeError):  # torch's own module raises the same
            TorchModule(16, 30, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("features", [{}, {"bias": True, "class_weights": True, "label_smoothing": 0.1}])
def test_k_dimensional_loss_matches_torch(reduction, features):
    # torch's K-dimensional loss: linear_weight [C, d1, d2, D], target [N, d1, d2], a softmax over C per position
    N, C, D, positions = 9, 7, 12, (2, 3)
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    x = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, *positions, D, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, *positions, generator=g, dtype=torch.float64, requires_grad=True) if features else None
    cw = torch.rand(C, generator=g, dtype=torch.float64) + 0.5 if features else None
    t = torch.randint(0, C, (N, *positions), generator=g)
    t[0, 1, 2] = t[3, 0, 0] = -100
    smoothing = features.get("label_smoothing", 0.0)
    logits = (x @ w.reshape(-1, D).T + (0 if b is None else b.reshape(-1))).reshape(N, C, *positions)
    want = torch.nn.functional.cross_entropy(logits, t, weight=cw, reduction=reduction, label_smoothing=smoothing)
    got = fused_ce.linear_cross_entropy(
        x, w, t, linear_bias=b, weight=cw, reduction=reduction, label_smoothing=smoothing
    )
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    upstream = torch.randn_like(want)
    tensors = [x, w] + ([b] if b is not None else [])
    for got_grad, want_grad in zip(
        torch.autograd.grad((got * upstream).sum(), tensors), torch.autograd.grad((want * upstream).sum(), tensors)
    ):
        torch.testing.assert_close(got_grad, want_grad)
    # the module, as torch's: out_features=
    head = fused_ce.LinearCrossEntropyLoss(
        D,
        C,
        out_features=positions,
        bias=b is not None,
        dtype=torch.float64,
        reduction=reduction,
        weight=cw,
        label_smoothing=smoothing,
    )
    assert head.linear.weight.shape == (C * 6, D) and head.out_features == positions
    with torch.no_grad():
        head.linear.weight.copy_(w.reshape(-1, D))
        if b is not None:
            head.linear.bias.copy_(b.reshape(-1))
    torch.testing.assert_close(head(x, t), want)


def test_k_dimensional_loss_needs_batched_input_and_matching_target():
    w = torch.randn(5, 2, 4)
    with pytest.raises(RuntimeError, match="requires batched input"):
        fused_ce.linear_cross_entropy(torch.randn(4), w, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="target shape"):
        fused_ce.linear_cross_entropy(torch.randn(3, 4), w, torch.zeros(3, dtype=torch.long))


def test_target_shaped_like_the_logits_is_a_runtime_error_as_in_torch():
    x, w, t, _ = make_problem(8, 6, 10)
    with pytest.raises(RuntimeError, match="shape of the logits"):
        fused_ce.linear_cross_entropy(x, w, torch.zeros(8, 10, dtype=torch.long))


# ---- issue 25's adversarial findings, each against torch ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_class_weight_on_a_class_no_row_counts(device, reduction, dtype):
    # inverse-frequency weights with a zero count (1 / bincount): inf on classes no row holds
    x, w, t, _ = make_problem(64, 16, 40, dtype=dtype, device=device)
    t = t.clamp_min(0) % 20  # classes 20..39 are never targets
    cw = 1.0 / torch.bincount(t, minlength=40).float()
    assert torch.isinf(cw).any()
    xl, wl = leaves(x, w)
    got = fused_ce.linear_cross_entropy(xl, wl, t, weight=cw, reduction=reduction)
    xr, wr = leaves(x, w)
    want = reference_loss(xr, wr, t, weight=cw, reduction=reduction)
    torch.testing.assert_close(got, want.float(), rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-4)
    upstream = torch.randn_like(want)
    g = torch.autograd.grad((got * upstream).sum(), [xl, wl])
    e = torch.autograd.grad((want * upstream).sum(), [xr, wr])
    for a, b in zip(g, e):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        assert rel_err(a, b) < (2e-2 if dtype != torch.float32 else 1e-5)


def test_non_finite_class_weight_compiled():
    x, w, t, _ = make_problem(64, 16, 40)
    t = t.clamp_min(0) % 20
    cw = 1.0 / torch.bincount(t, minlength=40).float()
    xl, wl = leaves(x, w)
    fn = torch.compile(lambda x, w: fused_ce.linear_cross_entropy(x, w, t, weight=cw), fullgraph=True)
    fn(xl, wl).backward()
    assert torch.isfinite(xl.grad).all() and torch.isfinite(wl.grad).all()


@pytest.mark.parametrize("which", ["target", "linear_weight", "linear_bias", "weight", "input"])
def test_meta_tensors_mixed_with_cpu_ones_are_an_error_as_in_torch(which):
    x, w, t, b = make_problem(8, 6, 10, bias=True)
    args = dict(input=x, linear_weight=w, target=t, linear_bias=b, weight=torch.rand(10))
    args[which] = args[which].to("meta")
    if which != "linear_weight":  # (torch's F.linear takes a meta weight with a CPU input; fused_ce refuses it too)
        with pytest.raises(RuntimeError, match="device"):
            torch.nn.functional.cross_entropy(
                torch.nn.functional.linear(args["input"], args["linear_weight"], args["linear_bias"]),
                args["target"],
                weight=args["weight"],
            )
    with pytest.raises(RuntimeError, match="device"):
        fused_ce.linear_cross_entropy(
            args["input"],
            args["linear_weight"],
            args["target"],
            linear_bias=args["linear_bias"],
            weight=args["weight"],
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_an_infinite_logit_gives_torchs_nan(device, reduction):
    x, w, t, b = make_problem(16, 8, 30, device=device, bias=True)
    t = t.clamp_min(0)
    t[t == 3] = 4
    b = b.clone()
    b[3] = float("inf")  # +inf in a logit no row targets
    got, lse = fused_ce.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, return_lse=True)
    want = reference_loss(x, w, t, linear_bias=b, reduction=reduction)
    assert torch.isnan(want).all() and torch.isnan(got).all()
    assert torch.isinf(lse).all()  # the lse as logsumexp has it


@pytest.mark.parametrize("device", DEVICES)
def test_class_weights_summing_to_zero_leave_ignored_rows_zero(device):
    x, w, t, _ = make_problem(32, 8, 6, device=device)
    t = t.clamp_min(0)
    t[::4] = -100
    cw = torch.tensor([1.0, -1.0, 2.0, -2.0, 0.5, -0.5], device=device)
    t[~(t == -100)] = torch.tensor([0, 1], device=device).repeat(16)[: int((t != -100).sum())]  # weights sum to 0
    xl = x.detach().clone().requires_grad_()
    loss = fused_ce.linear_cross_entropy(xl, w, t, weight=cw)
    want = reference_loss(x, w, t, weight=cw)
    assert not torch.isfinite(loss) and not torch.isfinite(want)
    loss.backward()
    assert (xl.grad[t == -100] == 0).all()  # as torch gives, and as the README promises


@pytest.mark.parametrize("option", ["softcap", "logit_scale"])
def test_softcap_and_logit_scale_beyond_float32_are_errors(option):
    x, w, t, _ = make_problem(8, 6, 10)
    with pytest.raises(ValueError, match=option):
        fused_ce.linear_cross_entropy(x, w, t, **{option: 1e39})
    if option == "softcap":
        with pytest.raises(ValueError, match=option):
            fused_ce.linear_cross_entropy(x, w, t, softcap=1e-39)


def test_torch_func_transforms_name_fused_ce():
    x, w, t, _ = make_problem(8, 6, 10)
    for transform in (torch.func.grad, lambda f: lambda x: torch.func.vjp(f, x)[1](torch.ones(()))):
        with pytest.raises(NotImplementedError, match="fused_ce.*torch.func"):
            transform(lambda x: fused_ce.linear_cross_entropy(x, w, t))(x)


def test_cpu_workspace_floor_is_one_row_of_logits():
    x, w, t, _ = make_problem(100, 8, 3000, ignore_frac=0.0)
    plan = fused_ce.plan(x, w, t, workspace_bytes=1)
    assert plan.block_rows == 1 and plan.workspace_bytes == 3000 * 4  # one row of float32 logits (the docs' floor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("class_weights", [False, True])
def test_k_dimensional_mean_with_every_target_ignored_has_torchs_zero_gradients(device, class_weights):
    # torch: the loss 0 / 0 = NaN, its gradients 0 (the 2-D op's too); never NaN gradients from 0 * inf
    N, C, D, positions = 6, 5, 8, (3,)
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    x = torch.randn(N, D, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(C, *positions, D, generator=g, dtype=torch.float64).to(device).requires_grad_()
    cw = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(device) if class_weights else None
    t = torch.full((N, *positions), -100, device=device)
    logits = (x @ w.reshape(-1, D).T).reshape(N, C, *positions)
    want = F.cross_entropy(logits, t, weight=cw)
    got = fused_ce.linear_cross_entropy(x, w, t, weight=cw)
    assert torch.isnan(want) and torch.isnan(got)
    want_grads = torch.autograd.grad(want, (x, w))
    got_grads = torch.autograd.grad(got, (x, w))
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert (want_grad == 0).all()
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


@pytest.mark.parametrize("value", [3.5, "3", True])
@pytest.mark.parametrize("function", ["linear_cross_entropy", "linear_log_probs", "linear_policy_loss"])
def test_non_integer_ignore_index_is_a_type_error_as_in_torch(function, value):
    x, w, t, _ = make_problem(8, 6, 10)
    with pytest.raises(TypeError):  # torch's own, so that this test follows torch
        F.cross_entropy(x @ w.T, t, ignore_index=value)
    call = {
        "linear_cross_entropy": lambda: fused_ce.linear_cross_entropy(x, w, t, ignore_index=value),
        "linear_log_probs": lambda: fused_ce.linear_log_probs(x, w, t, ignore_index=value),
        "linear_policy_loss": lambda: fused_ce.linear_policy_loss(x, w, t, torch.ones(8), ignore_index=value),
    }[function]
    with pytest.raises(TypeError, match=f"{function}: ignore_index must be an int"):
        call()


@pytest.mark.parametrize(
    "function, option",
    [
        ("linear_cross_entropy", "grad_filter_eps"),
        ("linear_cross_entropy", "label_smoothing"),
        ("linear_cross_entropy", "z_loss"),
        ("linear_log_probs", "temperature"),
        ("linear_policy_loss", "kl_coef"),
        ("linear_distillation_loss", "beta"),
        ("LinearCrossEntropyLoss", "grad_filter_eps"),
        ("LinearCrossEntropyLoss", "label_smoothing"),
    ],
)
def test_a_string_for_a_float_option_is_a_type_error(function, option):
    # (torch's F.cross_entropy refuses label_smoothing="0.1" too; float("0.001") would parse it)
    x, w, t, _ = make_problem(8, 6, 10)
    with pytest.raises(TypeError):
        F.cross_entropy(x @ w.T, t, label_smoothing="0.1")
    value = {option: "0.001"}
    call = {
        "linear_cross_entropy": lambda: fused_ce.linear_cross_entropy(x, w, t, **value),
        "linear_log_probs": lambda: fused_ce.linear_log_probs(x, w, t, **value),
        "linear_policy_loss": lambda: fused_ce.linear_policy_loss(x, w, t, torch.ones(8), **value),
        "linear_distillation_loss": lambda: fused_ce.linear_distillation_loss(x, w, x, w, t, **value),
        "LinearCrossEntropyLoss": lambda: fused_ce.LinearCrossEntropyLoss(6, 10, **value),
    }[function]
    with pytest.raises(TypeError, match=f"{function}: {option} must be a number, got str '0.001'"):
        call()
    # numbers of other types are taken: numpy's, a 0-dim tensor, an int
    np = pytest.importorskip("numpy")
    if function == "linear_cross_entropy":
        want = fused_ce.linear_cross_entropy(x, w, t, **{option: 0.001})
        for number in (np.float64(0.001), torch.tensor(0.001, dtype=torch.float64)):
            torch.testing.assert_close(fused_ce.linear_cross_entropy(x, w, t, **{option: number}), want)
        fused_ce.linear_cross_entropy(x, w, t, **{option: 0})


def test_a_string_for_a_bool_option_is_a_type_error():
    x, w, t, _ = make_problem(8, 6, 10)
    with pytest.raises(TypeError, match="linear_log_probs: return_entropy must be a bool, got str 'False'"):
        fused_ce.linear_log_probs(x, w, t, return_entropy="False")


def test_integer_like_ignore_index_is_taken_as_in_torch():
    np = pytest.importorskip("numpy")
    x, w, t, _ = make_problem(8, 6, 10, ignore_frac=0.0)  # (no -100: ignore_index is 3 here)
    t[:3] = 3
    want = F.cross_entropy(x @ w.T, t, ignore_index=3)
    for value in (3, np.int64(3), torch.tensor(3)):
        torch.testing.assert_close(fused_ce.linear_cross_entropy(x, w, t, ignore_index=value), want)


def test_errors_name_the_function_called_and_its_argument():
    x, w, t, _ = make_problem(8, 6, 10)
    t = t.clamp_min(0)
    advantages = torch.ones(8)
    # the temperature, not the logit_scale or softcap it makes inside
    with pytest.raises(ValueError, match=r"linear_log_probs: temperature 1e-39 takes the logits' scale beyond"):
        fused_ce.linear_log_probs(x, w, t, temperature=1e-39)
    with pytest.raises(ValueError, match=r"linear_log_probs: temperature 1e\+09 takes softcap 1e-30 beyond"):
        fused_ce.linear_log_probs(x, w, t, softcap=1e-30, temperature=1e9)
    with pytest.raises(ValueError, match=r"linear_policy_loss: temperature 1e-39"):
        fused_ce.linear_policy_loss(x, w, t, advantages, temperature=1e-39)
    with pytest.raises(ValueError, match=r"linear_log_probs: softcap must be"):
        fused_ce.linear_log_probs(x, w, t, softcap=1e-39)
    # a bad class index names the function called
    bad = t.clone()
    bad[2] = 30
    for name, call in {
        "linear_cross_entropy": lambda: fused_ce.linear_cross_entropy(x, w, bad),
        "linear_log_probs": lambda: fused_ce.linear_log_probs(x, w, bad),
        "linear_policy_loss": lambda: fused_ce.linear_policy_loss(x, w, bad, advantages),
    }.items():
        with pytest.raises(IndexError, match=f"^{name}: target 30 is out of bounds"):
            call()
    with pytest.raises(IndexError, match="^linear_log_probs: target 30"):  # compiled, the caller travels with the op
        torch.compile(fused_ce.linear_log_probs, fullgraph=True)(x, w, bad)
    # and the fix, where there is one
    with pytest.raises(RuntimeError, match=r"linear_log_probs: linear_weight dtype .*torch\.autocast"):
        fused_ce.linear_log_probs(x.bfloat16(), w, t)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: linear_weight \[6, 10\].*\[V, D\].*untransposed"):
        fused_ce.linear_cross_entropy(x, w.T.contiguous(), t)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: linear_weight is on meta.*one device"):
        fused_ce.linear_cross_entropy(x, w.to("meta"), t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ignored", [0.05, 0.5])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nan_in_an_ignored_input_row_reaches_dw_only_where_every_row_runs(device, dtype, ignored, reduction):
    # the README's promise: an ignored row is never read where the call runs on the counted rows only (always on
    # the CPU); where it runs on every row, 0 x NaN reaches dW through the GEMM, as in torch
    g = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    N, D, V = 512, 64, 1000
    x = torch.randn(N, D, generator=g).to(device, dtype)
    w = (torch.randn(V, D, generator=g) * D**-0.5).to(device, dtype)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    skipped = torch.rand(N, generator=g).to(device) < ignored
    t[skipped] = -100
    x[skipped.nonzero()[0, 0], 3] = float("nan")
    xl, wl = leaves(x, w)
    loss = fused_ce.linear_cross_entropy(xl, wl, t, reduction=reduction)
    loss.sum().backward()
    pass_ = "backward" if reduction == "none" else "forward_with_grad"
    plan = fused_ce.plan(xl, wl, t, reduction=reduction, pass_=pass_)
    assert torch.isfinite(loss).all() and torch.isfinite(xl.grad[~skipped]).all()
    assert bool(torch.isfinite(wl.grad).all()) == plan.counted_rows_only
    if device == "cpu":
        assert plan.counted_rows_only


def _changed_after_forward(device):
    """x, w and {case: (forward, the argument it reads)} for every op whose backward reads a non-differentiable
    argument."""
    x, w, t, _ = make_problem(13, 8, 21, device=device, seed=3)
    full = t.clamp(min=0)
    cw = torch.rand(21, device=device) + 0.5
    xt, wt = torch.randn(13, 6, device=device), torch.randn(21, 6, device=device)
    adv = torch.randn(13, device=device)
    ce, distill = fused_ce.linear_cross_entropy, fused_ce.linear_distillation_loss
    cases = {
        "target, 'none'": (lambda x, w: ce(x, w, t, reduction="none"), t),
        "class weight, 'none'": (lambda x, w: ce(x, w, t, weight=cw, reduction="none"), cw),
        "target, 'mean'": (lambda x, w: ce(x, w, t), t),
        "class weight, 'mean'": (lambda x, w: ce(x, w, t, weight=cw), cw),
        "linear_log_probs target": (lambda x, w: fused_ce.linear_log_probs(x, w, full), full),
        "linear_policy_loss advantages": (lambda x, w: fused_ce.linear_policy_loss(x, w, full, adv), adv),
        "distillation target, 'none'": (lambda x, w: distill(x, w, xt, wt, t, reduction="none"), t),
        "distillation teacher_input, 'none'": (lambda x, w: distill(x, w, xt, wt, t, reduction="none"), xt),
        "distillation teacher_weight, 'mean'": (lambda x, w: distill(x, w, xt, wt, t), wt),
    }
    return x, w, cases


def _change(t):
    if t.dtype.is_floating_point:
        t.mul_(0.5)
    else:
        t.copy_(t.flip(0))


_CHANGED = list(_changed_after_forward("cpu")[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _CHANGED)
def test_an_argument_changed_in_place_before_backward_is_autograds_error(device, case):
    # torch's own ops save what their backward reads, so that autograd's version check catches a later in-place
    # change; a backward reading the new values would give the gradients of a loss never computed.
    x, w, cases = _changed_after_forward(device)
    forward, changed = cases[case]
    xl, wl = leaves(x, w)
    loss = forward(xl, wl)
    _change(changed)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


@pytest.mark.parametrize("argument", ["target", "weight"])
def test_torch_raises_for_the_same_change(argument):
    # (the behaviour matched above: F.cross_entropy's backward reads its target and class weights)
    logits = torch.randn(5, 7, requires_grad=True)
    t, cw = torch.randint(0, 7, (5,)), torch.rand(7) + 0.5
    loss = F.cross_entropy(logits, t, weight=cw, reduction="none")
    _change(t if argument == "target" else cw)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_saved_arguments_give_the_forwards_gradients(device):
    # unchanged arguments: the gradients as before, and a second backward through a retained graph the same
    x, w, cases = _changed_after_forward(device)
    for name, (forward, _) in cases.items():
        xl, wl = leaves(x, w)
        loss = forward(xl, wl).sum()
        first = torch.autograd.grad(loss, (xl, wl), retain_graph=True)
        second = torch.autograd.grad(loss, (xl, wl))
        assert all(torch.isfinite(g).all() for g in first), name
        assert all(torch.equal(a, b) for a, b in zip(first, second)), name
