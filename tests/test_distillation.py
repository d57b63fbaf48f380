"""fused_ce.linear_distillation_loss against a float64 reference: every divergence (beta 0, 1, between), the
teacher's top k, temperatures, the heads' logit transforms, the hard-label mix, the entropy, ignored rows,
reductions, biases, blocks of rows, dtypes, compile, vocabulary parallel on gloo (2 and 4 ranks), errors."""

import math

import pytest
import torch
import torch.nn.functional as F

import fused_ce
from helpers import DEVICES, needs_profiler

N, D, DT, V = 37, 16, 24, 50


def problem(device="cpu", dtype=torch.float32, seed=0, ignored=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, D, generator=g)
    ws = torch.randn(V, D, generator=g) / math.sqrt(D) * 2
    xt = torch.randn(N, DT, generator=g)
    wt = torch.randn(V, DT, generator=g) / math.sqrt(DT) * 2
    target = torch.randint(0, V, (N,), generator=g)
    if ignored:
        target[torch.rand(N, generator=g) < 0.3] = -100
    bs = torch.randn(V, generator=g) if bias else None
    bt = torch.randn(V, generator=g) if bias else None
    move = lambda t: None if t is None else t.to(device, dtype)  # noqa: E731
    return move(xs), move(ws), move(xt), move(wt), target.to(device), move(bs), move(bt)


def transformed(z, logit_scale=1.0, softcap=None):
    z = z * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def reference(xs, ws, xt, wt, target, bs=None, bt=None, beta=0.0, temperature=1.0, hard_label_weight=0.0,
              reduction="mean", softcap=None, logit_scale=1.0, teacher_softcap=None, teacher_logit_scale=1.0,
              teacher_top_k=None, return_entropy=False):  # fmt: skip
    """The loss (and entropy) in float64 from materialised logits."""
    z1 = transformed(xs.double() @ ws.double().T + (0 if bs is None else bs.double()), logit_scale, softcap)
    s = F.log_softmax(z1 / temperature, -1)
    if teacher_top_k is not None:
        idx, lp = teacher_top_k
        log_q = torch.log_softmax(lp.double(), -1)
        divergence = (log_q.exp() * (log_q - s.gather(-1, idx))).sum(-1)
    else:
        zt = xt.double() @ wt.double().T + (0 if bt is None else bt.double())
        t = F.log_softmax(transformed(zt, teacher_logit_scale, teacher_softcap) / temperature, -1)
        if beta == 0:
            divergence = (t.exp() * (t - s)).sum(-1)
        elif beta == 1:
            divergence = (s.exp() * (s - t)).sum(-1)
        else:
            m = torch.logaddexp(s + math.log(1 - beta), t + math.log(beta))
            divergence = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    counted = torch.ones(xs.shape[:-1], dtype=torch.bool, device=xs.device) if target is None else target != -100
    loss = (1 - hard_label_weight) * divergence
    if hard_label_weight:
        ce = F.cross_entropy(z1.reshape(-1, z1.shape[-1]), target.reshape(-1).clamp(min=0), reduction="none")
        loss = loss + hard_label_weight * ce.reshape(loss.shape)
    loss = torch.where(counted, loss, 0.0)
    if reduction != "none":
        loss = loss.sum() if reduction == "sum" else loss.sum() / counted.sum()
    if return_entropy:
        return loss, torch.where(counted, -(s.exp() * s).sum(-1), 0.0)
    return loss


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_both(args, upstream=None, **keywords):
    """(loss, grads) of fused_ce and of the float64 reference, for the student's input, weight and bias."""
    xs, ws, xt, wt, target, bs, bt = args
    leaves = [t.detach().clone().requires_grad_() for t in (xs, ws) + ((bs,) if bs is not None else ())]
    bias = leaves[2] if bs is not None else None
    got = fused_ce.linear_distillation_loss(leaves[0], leaves[1], xt, wt, target, linear_bias=bias, teacher_bias=bt,
                                            **keywords)  # fmt: skip
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    keywords.pop("workspace_bytes", None)
    want = reference(ref_leaves[0], ref_leaves[1], xt, wt, target, ref_leaves[2] if bs is not None else None, bt,
                     **keywords)  # fmt: skip
    if upstream is None:
        upstream = torch.ones_like(want)
    (got * upstream.to(got.dtype)).sum().backward()
    (want * upstream.double()).sum().backward()
    return got, want, [t.grad for t in leaves], [t.grad for t in ref_leaves]


def top_k_of(xt, wt, k=8, temperature=1.0, seed=0):
    """A teacher's top k classes and their log-probs from its full softmax at the temperature, as an offline
    teacher would store them."""
    log_p = F.log_softmax((xt.double() @ wt.double().T) / temperature, -1)
    lp, idx = log_p.topk(k, -1)
    return idx, lp.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.3])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_divergences_match_float64(device, beta, temperature, reduction):
    args = problem(device)
    upstream = torch.randn(N, device=device) if reduction == "none" else None
    got, want, grads, ref_grads = run_both(args, upstream, beta=beta, temperature=temperature, reduction=reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel(got, want) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-5
    if reduction == "none":
        assert (got[args[4] == -100] == 0).all()  # ignored rows: 0


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_hard_label_mix_biases_and_blocks(beta):
    args = problem(bias=True, seed=3)
    # a workspace of 4 rows a block: 10 blocks, the last short
    for workspace in (None, 8 * 4 * V * 4):
        got, want, grads, ref_grads = run_both(args, beta=beta, temperature=1.5, hard_label_weight=0.4,
                                               workspace_bytes=workspace)  # fmt: skip
        assert rel(got, want) < 1e-5, workspace
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) < 1e-5, workspace


def test_without_target_every_row_counts():
    xs, ws, xt, wt, _, _, _ = problem()
    got, want, grads, ref_grads = run_both((xs, ws, xt, wt, None, None, None), beta=0.5)
    assert rel(got, want) < 1e-5
    assert all(rel(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


def test_every_row_ignored_is_nan_for_the_mean_as_torch():
    xs, ws, xt, wt, target, _, _ = problem()
    target[:] = -100
    x = xs.clone().requires_grad_()
    loss = fused_ce.linear_distillation_loss(x, ws, xt, wt, target)
    assert loss.isnan()
    assert fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, reduction="sum") == 0
    loss = fused_ce.linear_distillation_loss(x, ws, xt, wt, target, reduction="sum")
    loss.backward()
    assert loss == 0 and (x.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_torchs_own_error(dtype):
    # torch eager on the same half-precision inputs, its logits in that dtype: fused_ce's error against float64 no
    # worse than 1.5x torch's (the products in the input dtype, as F.linear)
    xs, ws, xt, wt, target, _, _ = problem(dtype=dtype, seed=5)
    want = reference(xs, ws, xt, wt, target, beta=0.5)
    zs, zt = (xs @ ws.T).float(), (xt @ wt.T).float()
    s, t = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    m = torch.logaddexp(s + math.log(0.5), t + math.log(0.5))
    per_row = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
    torchs = per_row[target != -100].mean()
    got = fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, beta=0.5)
    assert abs(got.double() - want).item() <= 1.5 * abs(torchs.double() - want).item() + 1e-6


def test_second_backward_through_a_retained_graph_is_the_same():
    xs, ws, xt, wt, target, _, _ = problem()
    w = ws.clone().requires_grad_()
    loss = fused_ce.linear_distillation_loss(xs, w, xt, wt, target, beta=0.3)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, first)


def test_autocast_casts_both_heads():
    xs, ws, xt, wt, target, _, _ = problem()
    x = xs.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_ce.linear_distillation_loss(x, ws, xt, wt, target)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert rel(loss.detach(), reference(xs, ws, xt, wt, target)) < 2e-2  # bfloat16's rounding


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_dynamic(reduction):
    xs, ws, xt, wt, target, _, _ = problem()
    x = xs.clone().requires_grad_()

    def f(x, target):
        loss = fused_ce.linear_distillation_loss(x, ws, xt, wt, target, beta=0.3, reduction=reduction)
        return loss.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    got = compiled(x, target)
    got.backward()
    want_x = xs.clone().requires_grad_()
    want = f(want_x, target)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, want_x.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_logit_transforms_of_each_head(device, beta):
    # Gemma's softcap on the student, Cohere's logit scale on the teacher (and the other way round)
    args = problem(device, seed=7)
    for keywords in (dict(softcap=3.0, teacher_logit_scale=0.5), dict(logit_scale=2.0, teacher_softcap=2.0)):
        got, want, grads, ref_grads = run_both(args, beta=beta, temperature=1.3, hard_label_weight=0.25, **keywords)
        assert rel(got, want) < 1e-5, keywords
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) < 1e-5, keywords


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_teacher_top_k(device, reduction):
    xs, ws, xt, wt, target, bs, _ = problem(device, seed=11, bias=True)
    idx, lp = top_k_of(xt, wt, k=8, temperature=2.0)
    upstream = torch.randn(N, device=device) if reduction == "none" else None
    for workspace in (None, 8 * 4 * V * 5):
        got, want, grads, ref_grads = run_both((xs, ws, None, None, target, bs, None), upstream,
                                               teacher_top_k=(idx, lp), temperature=2.0, reduction=reduction,
                                               hard_label_weight=0.3, workspace_bytes=workspace)  # fmt: skip
        assert rel(got, want) < 1e-5
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) < 1e-5
    # every class in the top k: the full forward KL
    idx, lp = top_k_of(xt, wt, k=V)
    full = fused_ce.linear_distillation_loss(xs, ws, xt, wt, target)
    assert rel(fused_ce.linear_distillation_loss(xs, ws, target=target, teacher_top_k=(idx, lp)), full) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_is_the_students_at_the_temperature(device):
    xs, ws, xt, wt, target, _, _ = problem(device, seed=2)
    x = xs.clone().requires_grad_()
    loss, entropy = fused_ce.linear_distillation_loss(x, ws, xt, wt, target, beta=0.5, temperature=2.0,
                                                      return_entropy=True)  # fmt: skip
    want_loss, want_entropy = reference(xs, ws, xt, wt, target, beta=0.5, temperature=2.0, return_entropy=True)
    assert entropy.shape == target.shape and not entropy.requires_grad
    assert rel(entropy, want_entropy) < 1e-5 and rel(loss, want_loss) < 1e-5
    loss.backward()  # the entropy takes no part in the gradient
    x2 = xs.clone().requires_grad_()
    fused_ce.linear_distillation_loss(x2, ws, xt, wt, target, beta=0.5, temperature=2.0).backward()
    assert torch.equal(x.grad, x2.grad)


def test_leading_dimensions_and_any_integer_target():
    xs, ws, xt, wt, target, _, _ = problem()
    x3, xt3, t3 = xs[:36].reshape(4, 9, D), xt[:36].reshape(4, 9, DT), target[:36].reshape(4, 9).int()
    got = fused_ce.linear_distillation_loss(x3, ws, xt3, wt, t3, reduction="none", hard_label_weight=0.5)
    want = reference(x3, ws, xt3, wt, t3.long(), reduction="none", hard_label_weight=0.5)
    assert got.shape == (4, 9) and rel(got, want) < 1e-5


def test_float64_inputs_give_a_float64_loss():
    xs, ws, xt, wt, target, _, _ = problem(dtype=torch.float64)
    got, want, grads, ref_grads = run_both((xs, ws, xt, wt, target, None, None), beta=0.5)
    assert got.dtype == torch.float64 and rel(got, want) < 1e-12
    assert all(rel(g, r) < 1e-12 for g, r in zip(grads, ref_grads))


def test_errors_name_the_function_and_argument():
    xs, ws, xt, wt, target, _, _ = problem()
    call = fused_ce.linear_distillation_loss
    with pytest.raises(ValueError, match="linear_distillation_loss: beta must be in"):
        call(xs, ws, xt, wt, target, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be positive"):
        call(xs, ws, xt, wt, target, temperature=0.0)
    with pytest.raises(ValueError, match="hard_label_weight > 0 needs a target"):
        call(xs, ws, xt, wt, None, hard_label_weight=0.5)
    with pytest.raises(ValueError, match="share the vocabulary"):
        call(xs, ws, xt, wt[:-1], target)
    with pytest.raises(ValueError, match="teacher_input's rows"):
        call(xs, ws, xt[:-1], wt, target)
    with pytest.raises(ValueError, match="linear_weight .* features but input"):
        call(xs, ws.T.contiguous(), xt, wt, target)
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'teacher_weight'"):
        call(xs.clone().requires_grad_(), ws, xt, wt.clone().requires_grad_(), target)
    with pytest.raises(IndexError, match="linear_distillation_loss: target 50 is out of bounds: .* \\[0, 50\\)"):
        call(xs, ws, xt, wt, torch.full((N,), V))
    with pytest.raises(RuntimeError, match="dtype"):
        call(xs.double(), ws, xt, wt, target)
    with pytest.raises(ValueError, match="linear_distillation_loss: vocab_start needs a process_group"):
        call(xs, ws, xt, wt, target, vocab_start=3)
    with pytest.raises(ValueError, match="softcap must be positive"):
        call(xs, ws, xt, wt, target, teacher_softcap=-1.0)
    idx, lp = top_k_of(xt, wt)
    with pytest.raises(ValueError, match="teacher's hidden states and head"):
        call(xs, ws, target=target)
    with pytest.raises(ValueError, match="not both"):
        call(xs, ws, xt, wt, target, teacher_top_k=(idx, lp))
    with pytest.raises(ValueError, match="forward KL only"):
        call(xs, ws, target=target, teacher_top_k=(idx, lp), beta=0.5)
    with pytest.raises(ValueError, match="differ in shape"):
        call(xs, ws, target=target, teacher_top_k=(idx, lp[:, :-1]))
    with pytest.raises(IndexError, match="teacher_top_k holds a class index outside"):
        call(xs, ws, target=target, teacher_top_k=(idx + V, lp))
    with pytest.raises(ValueError, match="input's rows"):
        call(xs, ws, target=target, teacher_top_k=(idx[:-1], lp[:-1]))


def check_vocabulary_parallel(rank, world, sizes):
    import torch.distributed as dist

    group = dist.group.WORLD
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    xs, ws, xt, wt, target, bs, bt = problem(seed=4, bias=True)
    idx, lp = top_k_of(xt, wt, k=6)
    cases = [
        dict(beta=0.0), dict(beta=1.0, temperature=2.0), dict(beta=0.4, hard_label_weight=0.3, softcap=4.0),
        dict(beta=0.6, reduction="none", return_entropy=True, teacher_logit_scale=0.7),
        dict(teacher_top_k=(idx, lp), hard_label_weight=0.2), dict(beta=0.5, workspace_bytes=8 * 4 * 30 * 3),
    ]  # fmt: skip
    for keywords in cases:
        teacher = {} if "teacher_top_k" in keywords else dict(teacher_input=xt)
        outputs = []
        for shard in (slice(0, V), slice(start, stop)):
            x = xs.clone().requires_grad_()
            w = ws[shard].clone().requires_grad_()
            b = bs[shard].clone().requires_grad_()
            sharded = {} if shard.stop - shard.start == V else dict(process_group=group)
            if teacher:
                teacher.update(teacher_weight=wt[shard], teacher_bias=bt[shard])
            out = fused_ce.linear_distillation_loss(x, w, target=target, linear_bias=b, **teacher, **keywords,
                                                    **sharded)  # fmt: skip
            loss = out[0] if keywords.get("return_entropy") else out
            upstream = torch.linspace(-1, 1, N) if loss.dim() else torch.tensor(1.0)
            (loss * upstream).sum().backward()
            outputs.append((out, x.grad, w.grad, b.grad))
        (want, want_gx, want_gw, want_gb), (got, gx, gw, gb) = outputs
        for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            assert rel(g, r) < 1e-5, keywords
        assert rel(gx, want_gx) < 1e-5, keywords
        assert rel(gw, want_gw[start:stop]) < 1e-5 and rel(gb, want_gb[start:stop]) < 1e-5, keywords


@pytest.mark.parametrize("world, sizes", [(2, [20, 30]), (4, [10, 15, 12, 13])])
def test_vocabulary_parallel_matches_one_process(world, sizes):
    from test_distributed import spawn

    spawn(check_vocabulary_parallel, world, sizes)


def check_dtensor_heads(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    xs, ws, xt, wt, target, _, _ = problem(seed=9)
    x = xs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    want = fused_ce.linear_distillation_loss(x, w, xt, wt, target, beta=0.5)
    want.backward()
    xd = distribute_tensor(xs.clone(), mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
    td = distribute_tensor(wt.clone(), mesh, [Shard(0)])
    got = fused_ce.linear_distillation_loss(xd, wd, xt, td, target, beta=0.5)
    got.backward()
    assert rel(got, want) < 1e-5
    assert rel(wd.grad.full_tensor(), w.grad) < 1e-5 and rel(xd.grad.full_tensor(), x.grad) < 1e-5
    with pytest.raises(ValueError, match="both heads are placed Shard\\(0\\)"):
        fused_ce.linear_distillation_loss(xd, wd, xt, distribute_tensor(wt.clone(), mesh, [Replicate()]), target)


def test_dtensor_heads():
    from test_distributed import spawn

    spawn(check_dtensor_heads, 2)


@pytest.mark.cuda
@needs_profiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, "top_k"])
def test_cuda_runs_the_embedded_kernel_within_the_workspace(beta, dtype):
    # half precision on the GPU: the distill_rows kernel's sweeps (not the ATen stages), blocks within the
    # workspace, the loss and gradients as on the CPU in float32 (float16's small gradients too: the mean's 1 / K
    # is applied in the products)
    n, d, dt, v = 700, 64, 96, 4096
    g = torch.Generator().manual_seed(0)
    xs, xt = torch.randn(n, d, generator=g), torch.randn(n, dt, generator=g)
    ws, wt = torch.randn(v, d, generator=g) / d**0.5 * 3, torch.randn(v, dt, generator=g) / dt**0.5 * 3
    target = torch.randint(0, v, (n,), generator=g)
    target[:100] = -100
    teacher = (xt, wt) if beta != "top_k" else (None, None)
    keywords = dict(beta=beta) if beta != "top_k" else dict(teacher_top_k=top_k_of(xt, wt, k=16))
    keywords.update(hard_label_weight=0.2, softcap=20.0, temperature=1.5)
    want_x, want_w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    want = fused_ce.linear_distillation_loss(want_x, want_w, *teacher, target, **keywords)
    want.backward()
    cuda = lambda t: t.cuda().to(dtype)  # noqa: E731
    x, w = cuda(xs).requires_grad_(), cuda(ws).requires_grad_()
    if beta == "top_k":
        keywords["teacher_top_k"] = tuple(t.cuda() for t in keywords["teacher_top_k"])
    teacher = tuple(None if t is None else cuda(t) for t in teacher)
    workspace = 64 * 2 * v * 2  # 64 rows of both heads' bf16 logits: 10 blocks
    # (a first call outside the measurement: cuBLAS's workspace, allocated at a process's first GEMM, is not ours)
    fused_ce.linear_distillation_loss(x.detach(), w.detach(), *teacher, target.cuda(), workspace_bytes=workspace,
                                      **keywords)  # fmt: skip
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        loss = fused_ce.linear_distillation_loss(x, w, *teacher, target.cuda(), workspace_bytes=workspace,
                                                 **keywords)  # fmt: skip
        loss.backward()
        torch.cuda.synchronize()
    grads = x.grad.numel() * 2 + w.grad.numel() * 4  # (dW summed in float32 over more than 8 blocks)
    assert any("distill_rows" in e.name for e in prof.events())
    assert torch.cuda.max_memory_allocated() - base - grads < 1.5 * workspace + (4 << 20)
    assert rel(loss.float().cpu(), want) < 1e-2
    assert rel(x.grad.float().cpu(), want_x.grad) < 2e-2 and rel(w.grad.float().cpu(), want_w.grad) < 2e-2


def test_torch_export_and_torchscript(tmp_path):
    xs, ws, xt, wt, target, _, _ = problem(seed=6)

    class Student(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Parameter(ws.clone())

        def forward(self, x, teacher_x, target):
            return fused_ce.linear_distillation_loss(x, self.head, teacher_x, wt, target, beta=0.4, temperature=1.5)

    m = Student()
    ep = torch.export.export(m, (xs, xt, target))
    assert any("linear_distillation_loss" in str(n.target) for n in ep.graph.nodes)
    assert rel(ep.module()(xs, xt, target), m(xs, xt, target)) < 1e-6

    @torch.jit.script
    def scripted(x: torch.Tensor, w: torch.Tensor, teacher_x: torch.Tensor, teacher_w: torch.Tensor,
                 target: torch.Tensor):  # fmt: skip
        loss, _ = torch.ops.fused_ce.linear_distillation_loss(x, w, teacher_x, teacher_w, target, beta=0.4,
                                                              temperature=1.5)  # fmt: skip
        return loss

    torch.jit.save(scripted, str(tmp_path / "distill.pt"))
    loaded = torch.jit.load(str(tmp_path / "distill.pt"))
    x = xs.clone().requires_grad_()
    got = loaded(x, ws, xt, wt, target)
    got.backward()
    want_x = xs.clone().requires_grad_()
    want = fused_ce.linear_distillation_loss(want_x, ws, xt, wt, target, beta=0.4, temperature=1.5)
    want.backward()
    assert rel(got, want) < 1e-6 and rel(x.grad, want_x.grad) < 1e-6


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(reduction):
    xs, ws, xt, wt, target, bs, bt = problem(seed=8, bias=True)
    args = (xs.requires_grad_(), ws.requires_grad_(), xt, wt, target, bs.requires_grad_(), bt, None, None)
    torch.library.opcheck(torch.ops.fused_ce.linear_distillation_loss.default, args,
                          dict(beta=0.5, reduction=reduction, return_entropy=True))  # fmt: skip
    idx, lp = top_k_of(xt, wt)
    args = (xs, ws, None, None, target, bs, None, idx, lp)
    torch.library.opcheck(torch.ops.fused_ce.linear_distillation_loss.default, args,
                          dict(hard_label_weight=0.5, reduction=reduction))  # fmt: skip


def check_vocabulary_parallel_kernels(rank, world):
    # the CUDA pipeline's shard combination (log-sum-exps, sums, the label's and the top k's logits): two gloo
    # ranks on one GPU, float32, against one process on the same GPU
    import torch.distributed as dist

    sizes = [20, 30]
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    xs, ws, xt, wt, target, bs, bt = (t.cuda() for t in problem(seed=4, bias=True))
    idx, lp = top_k_of(xt, wt, k=6)
    cases = [
        dict(beta=0.4, hard_label_weight=0.3, softcap=4.0, return_entropy=True),
        dict(beta=1.0, temperature=2.0, reduction="none"),
        dict(teacher_top_k=(idx, lp), hard_label_weight=0.2),
    ]
    for keywords in cases:
        teacher = {} if "teacher_top_k" in keywords else dict(teacher_input=xt)
        outputs = []
        for shard in (slice(0, V), slice(start, stop)):
            x, w = xs.clone().requires_grad_(), ws[shard].clone().requires_grad_()
            if teacher:
                teacher.update(teacher_weight=wt[shard], teacher_bias=bt[shard])
            sharded = {} if shard.stop - shard.start == V else dict(process_group=dist.group.WORLD)
            out = fused_ce.linear_distillation_loss(x, w, target=target, linear_bias=bs[shard], **teacher,
                                                    **keywords, **sharded)  # fmt: skip
            loss = out[0] if keywords.get("return_entropy") else out
            (loss * (torch.linspace(-1, 1, N, device="cuda") if loss.dim() else 1.0)).sum().backward()
            outputs.append((out if isinstance(out, tuple) else (out,), x.grad, w.grad))
        (want, want_gx, want_gw), (got, gx, gw) = outputs
        assert all(rel(g, r) < 1e-5 for g, r in zip(got, want)), keywords
        assert rel(gx, want_gx) < 1e-5 and rel(gw, want_gw[start:stop]) < 1e-5, keywords


@pytest.mark.cuda
def test_cuda_vocabulary_parallel_on_one_gpu():
    from test_distributed import spawn

    spawn(check_vocabulary_parallel_kernels, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_top_k_padded_with_minus_inf_is_probability_zero(device, reduction):
    # top-k lists padded with -inf (a teacher's zero-probability entries): 0 log 0 = 0, as F.kl_div's probability
    # targets; a row of -inf only has no teacher distribution: its divergence and gradient 0
    xs, ws, xt, wt, target, _, _ = problem(device, seed=5, ignored=False)
    idx, lp = top_k_of(xt, wt, k=8)
    lp[:, 5:] = float("-inf")
    lp[3] = float("-inf")
    idx, lp = idx.to(device), lp.to(device)
    x, w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = fused_ce.linear_distillation_loss(x, w, teacher_top_k=(idx, lp), target=target, reduction=reduction)
    xr, wr = xs.double().requires_grad_(), ws.double().requires_grad_()
    s = F.log_softmax(xr @ wr.T, -1).gather(-1, idx)
    q = torch.where(lp == float("-inf"), 0.0, torch.softmax(lp.double(), -1).nan_to_num(0.0))
    rows = torch.xlogy(q, q).sum(-1) - (q * s).sum(-1)
    want = rows if reduction == "none" else rows.mean()
    assert torch.isfinite(got).all()
    assert rel(got, want) < 1e-5
    (got.sum() if reduction == "none" else got).backward()
    (want.sum() if reduction == "none" else want).backward()
    assert rel(x.grad, xr.grad) < 1e-5 and rel(w.grad, wr.grad) < 1e-5
    assert (x.grad[3] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [1e3, 3e4])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "top_k", "hard_label"])
def test_float32_at_large_logits_within_torchs_error(device, magnitude, divergence):
    # |z| up to `magnitude`: each log-probability (z - max) - log sum, never rounded to the max's precision; the
    # loss's error against float64 at most torch float32's own (F.log_softmax's) at the same logits
    xs, ws, xt, wt, target, _, _ = problem(device, seed=7, ignored=False)
    ws, wt = ws / ws.norm(dim=1, keepdim=True) * magnitude / 4, wt / wt.norm(dim=1, keepdim=True) * magnitude / 4
    xs, xt = xs / xs.norm(dim=1, keepdim=True) * 4, xt / xt.norm(dim=1, keepdim=True) * 4
    keywords = (
        dict(beta=0.5) if divergence == "jsd" else dict(hard_label_weight=0.5) if divergence == "hard_label" else {}
    )
    if divergence == "top_k":
        keywords["teacher_top_k"] = tuple(t.to(device) for t in top_k_of(xt.double(), wt.double(), k=8))
        xt = wt = None

    def losses(dtype):  # torch's own at `dtype`, from materialised logits
        s = F.log_softmax(xs.to(dtype) @ ws.to(dtype).T, -1)
        if divergence == "top_k":
            idx, lp = keywords["teacher_top_k"]
            log_q = F.log_softmax(lp.to(dtype), -1)
            return (log_q.exp() * (log_q - s.gather(-1, idx))).sum(-1)
        t = F.log_softmax(xt.to(dtype) @ wt.to(dtype).T, -1)
        if divergence == "jsd":
            m = torch.logaddexp(s + math.log(0.5), t + math.log(0.5))
            return 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
        kl = (t.exp() * (t - s)).sum(-1)
        if divergence == "hard_label":
            return 0.5 * kl + 0.5 * F.nll_loss(s, target, reduction="none")
        return kl

    want, torch32 = losses(torch.float64), losses(torch.float32)
    got = fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, reduction="none", **keywords)
    torch_error = (torch32.double() - want).abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= 2 * torch_error + 1e-6 * want.abs().max().item(), (error, torch_error)


def test_top_k_of_no_class_is_an_error_naming_it():
    xs, ws, *_ = problem()
    idx, lp = torch.zeros(N, 0, dtype=torch.long), torch.zeros(N, 0)
    with pytest.raises(ValueError, match="linear_distillation_loss: teacher_top_k indices must hold at least one"):
        fused_ce.linear_distillation_loss(xs, ws, teacher_top_k=(idx, lp))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_of_another_dtype_is_an_error_as_in_linear_cross_entropy(device):
    xs, ws, xt, wt, target, bs, bt = (None if t is None else t.double() if t.is_floating_point() else t
                                      for t in problem(device, bias=True))  # fmt: skip
    with pytest.raises(RuntimeError, match="linear_bias dtype Float does not match input dtype Double"):
        fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, linear_bias=bs.float())
    with pytest.raises(RuntimeError, match="teacher_bias dtype Float does not match teacher_input dtype Double"):
        fused_ce.linear_distillation_loss(xs, ws, xt, wt, target, teacher_bias=bt.float())
    with pytest.raises(RuntimeError, match="linear_bias dtype"):  # as linear_cross_entropy's
        fused_ce.linear_cross_entropy(xs, ws, target, linear_bias=bs.float())
