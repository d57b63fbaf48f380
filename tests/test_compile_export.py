"""The op under torch.library.opcheck, torch.compile, TorchScript and torch.export."""

import os

import pytest
import torch

import fused_ce
from helpers import DEVICES
from reference import make_problem, reference_loss, rel_err


def float64_reference(x, w, t, b, **kwargs):
    """Leaves x, w, b in float64 and reference_loss of them."""
    leaves = [v.double().requires_grad_() for v in (x, w, b)]
    return leaves, reference_loss(leaves[0], leaves[1], t, linear_bias=leaves[2], **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kw",
    [
        dict(reduction="mean"),
        dict(reduction="none", linear_bias=True),
        dict(reduction="sum", weight=True, label_smoothing=0.1, z_loss=1e-3, softcap=3.0, logit_scale=0.7),
    ],
    ids=["mean", "none-bias", "sum-features"],
)
def test_opcheck(device, kw):
    x, w, t, b = make_problem(24, 16, 40, device=device, bias=True)
    kwargs = dict(kw)
    bias = b.requires_grad_() if kwargs.pop("linear_bias", False) else None
    weight = torch.rand(40, device=device) if kwargs.pop("weight", False) else None
    args = (x.requires_grad_(), w.requires_grad_(), t, bias, weight)
    torch.library.opcheck(torch.ops.fused_ce.linear_cross_entropy.default, args, kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_opcheck_scale_grad(device, scale):
    g = torch.randn(300, 7, device=device).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.fused_ce._scale_grad_.default, (g, torch.tensor(scale, device=device)))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.head = fused_ce.LinearCrossEntropyLoss(dim, vocab, label_smoothing=0.05)

    def forward(self, tokens, target):
        h = torch.nn.functional.gelu(self.proj(self.embed(tokens)))
        return self.head(h, target)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_dynamic(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM(300, 32).to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    frames_after_first_shape = None
    for batch, seq in [(2, 17), (3, 29), (5, 8)]:
        tokens = torch.randint(0, 300, (batch, seq), device=device)
        target = torch.randint(0, 300, (batch, seq), device=device)
        target[:, 0] = -100
        model.zero_grad()
        eager = model(tokens, target)
        eager.backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        out = compiled(tokens, target)
        out.backward()
        assert rel_err(out, eager) < 1e-5
        for p, g in zip(model.parameters(), eager_grads):
            assert rel_err(p.grad, g) < 1e-4
        frames_after_first_shape = frames_after_first_shape or counter.frame_count
    assert counter.frame_count == frames_after_first_shape, "a new shape recompiled"


def test_compile_caches_keyed_by_the_op_schemas(tmp_path, monkeypatch):
    # A graph inductor cached before an upgrade that changed an op's schema would call the op with the old arguments:
    # fused_ce's schemas' digest joins torch's cache key tag (fused_ce/__init__.py), after the user's own tag.
    import subprocess
    import sys

    from torch._dynamo.utils import counters

    tag = f"fused_ce:{fused_ce._schemas_digest()}"
    assert tag in torch.compiler.config.cache_key_tag.split(";")
    code = "import torch, fused_ce; fused_ce._tag_compile_caches(); print(torch.compiler.config.cache_key_tag)"
    env = {**os.environ, "TORCH_COMPILE_CACHE_KEY_TAG": "mine"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"mine;{tag}"  # the user's tag kept, ours once

    # the tag partitions inductor's FX graph cache: another digest (another schema) misses what this one cached
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w, t, _ = make_problem(24, 16, 40)

    def hits_after_compiling():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(lambda x, w, t: fused_ce.linear_cross_entropy(x, w, t), fullgraph=True)(x, w, t)
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    # (torch's own patching: its config attributes are not plain module attributes)
    with torch._inductor.config.patch(fx_graph_cache=True):
        assert hits_after_compiling() == (0, 1)
        assert hits_after_compiling() == (1, 0)
        with torch.compiler.config.patch(cache_key_tag="fused_ce:0123456789abcdef"):
            assert hits_after_compiling() == (0, 1)
    torch._dynamo.reset()


@torch.jit.script
def scripted_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor):
    loss, lse = torch.ops.fused_ce.linear_cross_entropy(x, w, t, b, None, "mean", -100, 0.1, 1e-3, 5.0, 1.0, None)
    return loss + 0.01 * lse.mean()


@pytest.mark.parametrize("device", DEVICES)
def test_torchscript_save_load_backward(device, tmp_path):
    path = tmp_path / "loss.pt"
    torch.jit.save(scripted_loss, str(path))
    loaded = torch.jit.load(str(path), map_location=device)
    x, w, t, b = make_problem(33, 24, 70, device=device, bias=True)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    out = loaded(leaves[0], leaves[1], t, leaves[2])
    out.backward()
    ref_leaves, (ref_loss, ref_lse) = float64_reference(
        x, w, t, b, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, return_lse=True
    )
    ref = ref_loss + 0.01 * ref_lse.mean()
    ref.backward()
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(leaves, ref_leaves):
        assert rel_err(a.grad, r.grad) < 1e-5


def test_export():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(50, 16) / 4)

        def forward(self, x, t):
            return fused_ce.linear_cross_entropy(x, self.w, t, reduction="none")

    x, _, t, _ = make_problem(12, 16, 50)
    m = Head()
    ep = torch.export.export(m, (x, t))
    assert rel_err(ep.module()(x, t), m(x, t)) < 1e-6


FEATURE_KWARGS = [
    dict(weight=True),
    dict(label_smoothing=0.1),
    dict(z_loss=1e-3),
    dict(softcap=5.0),
    dict(logit_scale=0.7),
    dict(return_lse=True),
    dict(reduction="none"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", FEATURE_KWARGS, ids=lambda k: "+".join(k))
def test_compile_each_feature(device, kw):
    """Every keyword under torch.compile(fullgraph=True): forward and backward match eager."""
    kw = dict(kw)
    x, w, t, _ = make_problem(37, 24, 90, device=device)
    if kw.pop("weight", False):
        kw["weight"] = torch.rand(90, device=device) + 0.5

    def step(x, w, t):
        out = fused_ce.linear_cross_entropy(x, w, t, **kw)
        if kw.get("return_lse"):
            out = out[0] + 0.1 * out[1].mean()
        return out.sum() if out.dim() else out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xl, wl, t)
        loss.backward()
        results.append((loss.detach(), xl.grad, wl.grad))
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-6


@torch.jit.script
def scripted_all_keywords(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, b: torch.Tensor, cw: torch.Tensor):
    loss, lse = torch.ops.fused_ce.linear_cross_entropy(x, w, t, b, cw, "none", -100, 0.1, 1e-3, 5.0, 0.7, None)
    return loss.sum() + 0.01 * lse.sum()


@pytest.mark.parametrize("device", DEVICES)
def test_torchscript_all_keywords(device, tmp_path):
    torch.jit.save(scripted_all_keywords, str(tmp_path / "f.pt"))
    loaded = torch.jit.load(str(tmp_path / "f.pt"), map_location=device)
    x, w, t, b = make_problem(33, 24, 70, device=device, bias=True)
    cw = torch.rand(70, device=device) + 0.5
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    out = loaded(leaves[0], leaves[1], t, leaves[2], cw)
    out.backward()
    ref_leaves, (ref_loss, ref_lse) = float64_reference(
        x,
        w,
        t,
        b,
        weight=cw,
        reduction="none",
        label_smoothing=0.1,
        z_loss=1e-3,
        softcap=5.0,
        logit_scale=0.7,
        return_lse=True,
    )
    ref = ref_loss.sum() + 0.01 * ref_lse.sum()
    ref.backward()
    assert rel_err(out, ref) < 1e-5
    for a, r in zip(leaves, ref_leaves):
        assert rel_err(a.grad, r.grad) < 1e-5
