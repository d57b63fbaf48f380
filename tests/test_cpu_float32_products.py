"""bfloat16 and float16 on a CPU without dot-product instructions in them: the ATen path forms its products in
float32 (Plan::logits_product_dtype; DeviceFacts::float32_products), within the workspace, its results in the
input dtype and at least as accurate as the input dtype's products. The mode is read once per process
(FUSED_CE_CPU_FLOAT32_PRODUCTS overrides the detection), so each is checked in a process of its own: both run
on every machine."""

import json
import os
import subprocess
import sys

import pytest
import torch

CHECK = r"""
import json, sys
import torch
import torch.nn.functional as F
import fused_ce

dtype = getattr(torch, sys.argv[1])
g = torch.Generator().manual_seed(0)
N, D, V = 96, 64, 3000
x32, w32 = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) / D**0.5
b32 = torch.randn(V, generator=g) * 0.1
t = torch.randint(0, V, (N,), generator=g)
t[::7] = -100
cw = torch.rand(V, generator=g) + 0.5
xt, wt = torch.randn(N, 48, generator=g), torch.randn(V, 48, generator=g) / 48**0.5
adv = torch.randn(N, generator=g)
u, lw = torch.randn(N, 4, generator=g), torch.randn(V, 4, generator=g) * 0.1
full = t.clamp(min=0)
small = dict(workspace_bytes=64 * 1024)  # several row blocks (dW summed in float32, or by vocabulary slices)


def ops(lib):
    # name: loss of (x, w, bias); lib: fused_ce's, or torch's on the logits (the reference, in float64)
    def logits(x, w, b=None, scale=1.0):
        z = x @ w.T + (b if b is not None else 0)
        return (z.double() if z.dtype == torch.float64 else z.float()) * scale

    def log_softmax_at(z, target):
        return z.log_softmax(-1).gather(1, target.unsqueeze(1)).squeeze(1)

    if lib == "fused_ce":
        return {
            "mean": lambda x, w, b: fused_ce.linear_cross_entropy(x, w, t),
            "mean, blocks": lambda x, w, b: fused_ce.linear_cross_entropy(x, w, t, **small),
            "bias, smoothing, weights": lambda x, w, b: fused_ce.linear_cross_entropy(
                x, w, t, linear_bias=b, label_smoothing=0.1, weight=cw),
            "softcap, z-loss": lambda x, w, b: fused_ce.linear_cross_entropy(x, w, t, softcap=3.0, z_loss=1e-3),
            "none": lambda x, w, b: (fused_ce.linear_cross_entropy(x, w, t, reduction="none") * adv).sum(),
            "log_probs": lambda x, w, b: (fused_ce.linear_log_probs(x, w, full) * adv).sum(),
            "policy": lambda x, w, b: fused_ce.linear_policy_loss(x, w, full, adv),
            "distillation": lambda x, w, b: fused_ce.linear_distillation_loss(x, w, xt.to(x.dtype), wt.to(x.dtype), t),
            "low rank": lambda x, w, b: fused_ce.linear_cross_entropy(
                x, w, t, low_rank_input=u.to(x.dtype), low_rank_weight=lw.to(x.dtype)),
        }
    z_of = lambda x, w, b=None: logits(x, w, b)  # noqa: E731
    mean = lambda x, w, b: F.cross_entropy(z_of(x, w), t)  # noqa: E731
    # (None: the reference is fused_ce's own float64 call)
    return {
        "mean": mean,
        "mean, blocks": mean,
        "bias, smoothing, weights": lambda x, w, b: F.cross_entropy(
            z_of(x, w, b), t, label_smoothing=0.1, weight=cw.to(z_of(x, w).dtype)),
        "softcap, z-loss": None,
        "none": lambda x, w, b: (F.cross_entropy(z_of(x, w), t, reduction="none") * adv.to(z_of(x, w).dtype)).sum(),
        "log_probs": lambda x, w, b: (log_softmax_at(z_of(x, w), full) * adv.to(z_of(x, w).dtype)).sum(),
        "policy": None,
        "distillation": None,
        "low rank": lambda x, w, b: F.cross_entropy(
            z_of(x, w) + (u.to(x.dtype) @ lw.to(x.dtype).T).to(z_of(x, w).dtype), t),
    }


def grads(fn, dtype):
    x, w, b = (a.to(dtype).requires_grad_() for a in (x32, w32, b32))
    loss = fn(x, w, b)
    loss.backward()
    return [loss.detach(), x.grad, w.grad], [x.grad.dtype, w.grad.dtype]


def err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


fused, torch_ops = ops("fused_ce"), ops("torch")
out = {"errors": {}, "torch": {}, "dtypes": {}}
for name, fn in fused.items():
    ref_fn = torch_ops[name] or fn
    ref, _ = grads(ref_fn, torch.float64)
    got, dtypes = grads(fn, dtype)
    out["errors"][name] = [err(a, r) for a, r in zip(got, ref)]
    out["dtypes"][name] = [str(d) for d in dtypes]
    if torch_ops[name] is not None:
        mine, _ = grads(torch_ops[name], dtype)
        out["torch"][name] = [err(a, r) for a, r in zip(mine, ref)]
x, w = x32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
out["plans"] = {p: fused_ce.plan(x, w, t, pass_=p, **budget)._asdict()
                for p in ("forward", "backward", "forward_with_grad") for budget in ({}, small)
                if not budget or p == "forward_with_grad"}
print(json.dumps(out, default=str))
"""


def run_mode(mode, dtype):
    env = dict(os.environ, FUSED_CE_CPU_FLOAT32_PRODUCTS=mode)
    out = subprocess.run([sys.executable, "-c", CHECK, dtype], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def both_modes(request):
    return request.param, run_mode("1", request.param), run_mode("0", request.param)


def test_float32_products_planned_within_the_workspace(both_modes):
    dtype, wide, narrow = both_modes
    for plan in wide["plans"].values():
        assert plan["strategy"] == "aten_chunks" and plan["logits_product_dtype"] == "torch.float32", plan
        assert plan["logits_dtype"] == "torch.float32", plan
        assert plan["workspace_bytes"] <= plan["budget_bytes"], plan
        if plan["pass_"] == "backward":  # the gradients keep the input dtype's plan (float16 with gradient: float32)
            assert plan["grad_input_dtype"] == f"torch.{dtype}", plan
    for plan in narrow["plans"].values():
        assert plan["logits_product_dtype"] == f"torch.{dtype}", plan
    # the same blocks and gradient dtypes as the input dtype's products, a few rows fewer for the float32 x and dX
    for key, plan in wide["plans"].items():
        other = narrow["plans"][key]
        gradient_dtypes = ("grad_input_dtype", "grad_weight_dtype")
        assert [plan[k] for k in gradient_dtypes] == [other[k] for k in gradient_dtypes], (plan, other)
        assert 0.9 * other["block_rows"] <= plan["block_rows"] <= other["block_rows"], (plan, other)


def test_float32_products_as_accurate_as_the_input_dtypes(both_modes):
    dtype, wide, narrow = both_modes
    for name, errors in wide["errors"].items():
        assert wide["dtypes"][name] == [f"torch.{dtype}"] * 2, (name, wide["dtypes"][name])
        for got, own in zip(errors, narrow["errors"][name]):  # loss, dX, dW
            assert got <= 1.1 * own + 1e-6, (name, errors, narrow["errors"][name])
        for got, torchs in zip(errors, wide["torch"].get(name, errors)):
            assert got <= 1.5 * torchs + 1e-6, (name, errors, wide["torch"][name])


DETECTED = r"""
import torch, fused_ce
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x, w, t = torch.randn(8, 16, dtype=dtype), torch.randn(32, 16, dtype=dtype), torch.zeros(8, dtype=torch.long)
    print(fused_ce.plan(x, w, t).logits_product_dtype)
"""


def test_detected_from_the_cpus_instructions():
    # x86 without AVX512-BF16 / AMX-BF16 (AVX512-FP16 / AMX-FP16): float32 products; with them the input dtype's
    # (a process without the override)
    capabilities = torch._C._cpu._get_cpu_capability()
    x86 = capabilities.get("architecture") == "x86_64"
    wide = {
        torch.bfloat16: x86 and not (capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")),
        torch.float16: x86 and not (capabilities.get("avx512_fp16") or capabilities.get("amx_fp16")),
        torch.float32: False,
    }
    env = {k: v for k, v in os.environ.items() if k != "FUSED_CE_CPU_FLOAT32_PRODUCTS"}
    out = subprocess.run([sys.executable, "-c", DETECTED], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = [str(torch.float32 if w else dtype) for dtype, w in wide.items()]
    assert out.stdout.split() == expected, (out.stdout, capabilities)
