"""fused_ce.integrations.torchtitan: torchtitan's Llama 3 debug model trained with torchtitan's own cross-entropy and
with fused_ce's gives the same losses, gradients and parameters: one process, FSDP2 and tensor parallel on gloo.

torchtitan's attention is FlexAttention, which has no CPU backward: the test swaps in causal SDPA (the same
attention for the unmasked sequences used here).
"""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="needs torchtitan (pip install torchtitan==0.3.0)")
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_distributed import spawn  # noqa: E402

from fused_ce.integrations.torchtitan import FusedCrossEntropyLoss  # noqa: E402

B, L = 2, 32


class CausalSDPA(torch.nn.Module):
    """torchtitan's inner attention on (B, L, heads, head_dim), causal, for the CPU."""

    def forward(self, q, k, v, attention_masks=None, scale=None, enable_gqa=False):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa).transpose(
            1, 2
        )


def debug_model(seed=0):
    model = model_registry("debugmodel").model.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()
    torch.manual_seed(seed)
    model.init_states()
    return model


def batches(steps, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (B, L), generator=g)
        labels = torch.randint(0, vocab, (B, L), generator=g)
        labels[0, :9] = IGNORE_INDEX  # a prompt
        labels[1, -5:] = IGNORE_INDEX  # padding
        out.append((tokens, labels))
    return out


def fused_loss(model):
    """The trainer's wiring of a ChunkedLossWrapper (torchtitan/trainer.py): the loss gets the head, the decoder
    skips it."""
    loss = FusedCrossEntropyLoss.Config().build()
    assert isinstance(loss, ChunkedLossWrapper)
    loss.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return loss


def step(model, loss_fn, tokens, labels, global_valid_tokens):
    loss, metrics = loss_fn(model(tokens), labels, global_valid_tokens)
    loss.backward()
    return loss.detach(), metrics


def train(model, loss_fn, data, steps_of=None):
    """A few AdamW steps; the losses, and the first step's gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, first = [], None
    for tokens, labels in data:
        loss, metrics = step(model, loss_fn, tokens, labels, (labels != IGNORE_INDEX).sum())
        assert metrics == {}
        losses.append(loss)
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), first


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_trains_as_torchtitans_cross_entropy():
    model = debug_model()
    vocab = model.lm_head.weight.shape[0]
    data = batches(3, vocab)
    reference = copy.deepcopy(model)
    own = CrossEntropyLoss.Config(global_vocab_size=vocab).build()
    want_losses, want_grads = train(reference, own, data)
    got_losses, got_grads = train(model, fused_loss(model), data)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    for name, want in want_grads.items():
        assert rel(got_grads[name], want) < 1e-4, name
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel(p.detach(), q.detach()) < 1e-4, name
    # validation: hidden states without grad, the loss alone
    tokens, labels = data[0]
    with torch.no_grad():
        loss, _ = fused_loss(model)(model(tokens), labels, (labels != IGNORE_INDEX).sum())
        reference._skip_lm_head = False
        want, _ = own(reference(tokens), labels, (labels != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def check_parallel(rank, world, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = debug_model()
    vocab = model.lm_head.weight.shape[0]
    data = batches(2, vocab)
    reference = copy.deepcopy(model)
    want_loss, _ = step(reference, CrossEntropyLoss.Config(global_vocab_size=vocab).build(), *data[0],
                        (data[0][1] != IGNORE_INDEX).sum())  # fmt: skip
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    if how == "fsdp2":  # torchtitan's wrapping: each layer, the head apart, the root; every rank its own tokens
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for module in (*model.layers.values(), model.lm_head, model):
            # the gradients summed over the ranks, the loss being normalised by the global count (as torchtitan's);
            # as a plain sum (gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        # the batch split over the ranks, normalised by the global count, as torchtitan's data parallel
        tokens, labels = (t[rank::world] for t in data[0])
        total = (data[0][1] != IGNORE_INDEX).sum()
        loss, _ = step(model, fused_loss(model), tokens, labels, total)
        dist.all_reduce(loss)
    else:  # tensor parallel: the head's weight Shard(0) over the vocabulary (torchtitan's ColwiseParallel)
        plan = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model, mesh, {"lm_head": plan})
        tokens, labels = data[0]
        loss, _ = step(model, fused_loss(model), tokens, labels, (labels != IGNORE_INDEX).sum())
        if rank == 0:
            assert type(model.lm_head.weight).__name__ == "DTensor"
    assert abs(loss.item() - want_loss.item()) <= 1e-5 * abs(want_loss.item()), (how, loss, want_loss)
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if type(p.grad).__name__ == "DTensor" else p.grad
        assert rel(grad, want_grads[name]) < 1e-4, (how, name, rel(grad, want_grads[name]))


@pytest.mark.parametrize("how", ["fsdp2", "tp"])
def test_fsdp2_and_tensor_parallel_on_two_ranks(how):
    spawn(check_parallel, 2, how)
