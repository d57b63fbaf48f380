"""fused_ce.integrations.megatron against Megatron-Core itself (installed): a tiny GPTModel on the local layer spec,
built twice from one seed, one patched by ``apply``; on CPU with gloo at tensor-parallel sizes 1 and 2: plain,
sequence parallel, tied embeddings, multi-token prediction; the per-token loss and every parameter's gradient
within 1e-6 relative (float32); without labels the logits as before; the settings it refuses.

Megatron assumes CUDA in a few places; the spawned test processes alone stub, narrowly:
- ``torch.cuda.current_device`` (its global memory buffer allocates on it): the CPU;
- the model-parallel RNG tracker's CUDA state (``torch.cuda.manual_seed`` / ``get_rng_state`` and
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``): the CPU generator;
- sequence parallel only: the local spec's ``WrappedTorchNorm`` asserts against it (it wants Apex or Transformer
  Engine): the plain torch norm is built instead (its weight gradient then is not all-reduced across the group,
  identically in both models).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

from test_distributed import free_port  # noqa: E402

V, S, B, H = 512, 16, 2, 64


def stub_cuda():
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.torch_norm as torch_norm

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    plain_norm = torch_norm.WrappedTorchNorm.__new__

    def norm_without_the_sequence_parallel_check(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return plain_norm(cls, config, hidden_size, eps, **kwargs)
        return torch.nn.LayerNorm(hidden_size, eps=eps)

    torch_norm.WrappedTorchNorm.__new__ = norm_without_the_sequence_parallel_check


def build(tp, sequence_parallel=False, tied=False, mtp=False, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        mtp_num_layers=1 if mtp else None, params_dtype=torch.float32,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec()
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=V,
        max_sequence_length=S,
        share_embeddings_and_output_weights=tied,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None,
    )


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    positions = torch.arange(S).expand(B, S)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).expand(B, 1, S, S)
    weights = torch.rand(B, S, generator=g)  # (an upstream gradient that is not all ones)
    return tokens, positions, causal, labels, weights


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(rank, world, case):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from fused_ce.integrations.megatron import apply

    stub_cuda()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(123)
    options = dict(sequence_parallel="sequence_parallel" in case, tied="tied" in case, mtp="mtp" in case)
    if case == "plain":  # the settings it refuses, named
        for setting in ("gradient_accumulation_fusion", "defer_embedding_wgrad_compute"):
            refused = build(world)
            setattr(refused.config, setting, True)
            with pytest.raises(NotImplementedError, match=f"megatron.apply: {setting}=True is not supported"):
                apply(refused)
    ours, theirs = build(world, **options), build(world, **options)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)  # (one seed: the same model twice)
    assert apply(ours) is ours and apply([ours])[0] is ours  # (again: nothing changes)
    tokens, positions, causal, labels, weights = batch()
    logits_formed = []  # (the patched model's output layer forms no logits while labels come)
    form_logits = ours.output_layer._forward_impl
    ours.output_layer._forward_impl = lambda *args, **kwargs: logits_formed.append(1) or form_logits(*args, **kwargs)
    results = []
    for model in (ours, theirs):
        model.train()
        loss = model(tokens, positions, causal, labels=labels)
        assert not logits_formed, case
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        (loss * weights).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (want, want_grads) = results
    assert rel(loss, want) < 1e-6, (case, rel(loss, want))
    assert grads.keys() == want_grads.keys()
    for name in grads:
        if want_grads[name] is None:  # (a parameter this step does not use: MTP's own embedding copy)
            assert grads[name] is None, (case, name)
            continue
        assert rel(grads[name], want_grads[name]) < 1e-6, (case, name, rel(grads[name], want_grads[name]))
    # without labels: the logits, as before (the vocabulary shard's, [b, s, V / tp]; Megatron 0.16's MTP needs labels)
    with torch.no_grad():
        if options["mtp"]:
            parallel_state.destroy_model_parallel()
            return
        logits = ours(tokens, positions, causal)
        assert logits.shape == (B, S, V // world)
        assert rel(logits, theirs(tokens, positions, causal)) < 1e-6 and logits_formed
    parallel_state.destroy_model_parallel()


def _entry(rank, world, port, case):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        check(rank, world, case)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, case",
    [
        (1, "plain"),
        (1, "tied"),
        (1, "mtp"),
        (2, "plain"),
        (2, "sequence_parallel"),
        (2, "tied"),
        (2, "sequence_parallel tied mtp"),
    ],
)
def test_loss_and_gradients_equal_megatrons(world, case):
    mp.spawn(_entry, args=(world, free_port(), case), nprocs=world, join=True)


def test_refuses_what_it_cannot_reproduce(monkeypatch):
    import megatron.core

    from fused_ce.integrations import megatron as integration

    with pytest.raises(TypeError, match="apply: model must be a megatron GPTModel"):
        integration.apply(torch.nn.Linear(2, 2))
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.raises(NotImplementedError, match="apply: megatron-core 0.99.0 is not supported"):
        integration.apply(torch.nn.Linear(2, 2))
