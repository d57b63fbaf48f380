"""fused_ce.integrations.megatron against Megatron-Core itself (installed: 0.16 in the test command's environment,
0.17 to 0.19 in CI's Python 3.12 stage): a tiny GPTModel on the local layer spec, built twice from one seed, one
patched by ``apply``; on CPU with gloo at tensor-parallel sizes 1 and 2: plain, sequence parallel, tied embeddings,
multi-token prediction, MuP's output multiplier (0.17 on); the per-token loss and every parameter's gradient within
1e-6 relative (float32), MTP's acceptance counts (0.19 on) equal to Megatron's; without labels the logits as before;
the settings it refuses.

Megatron assumes CUDA in a few places; the spawned test processes alone stub, narrowly:
- ``torch.cuda.current_device`` (its global memory buffer allocates on it): the CPU;
- the model-parallel RNG tracker's CUDA state (``torch.cuda.manual_seed`` / ``get_rng_state`` and
  ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``): the CPU generator;
- sequence parallel only: the local spec's ``WrappedTorchNorm`` asserts against it (it wants Apex or Transformer
  Engine): the plain torch norm is built instead (its weight gradient then is not all-reduced across the group,
  identically in both models).
"""

import inspect
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


def build(tp, sequence_parallel=False, tied=False, mtp=False, mup=False, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    # (MuP: the logits times mup_output_mult, 1 / mup_width_mult = 1/4 here; Megatron 0.17 on)
    config = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        mtp_num_layers=1 if mtp else None, params_dtype=torch.float32,
        **(dict(use_mup=True, mup_base_hidden_size=H // 4) if mup else {}),
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
    options = dict(sequence_parallel="sequence_parallel" in case, tied="tied" in case, mtp="mtp" in case,
                   mup="mup" in case)  # fmt: skip
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
    if options["mtp"] and counts_mtp_acceptance():
        labels = labels_mtp_half_accepts(theirs, tokens, positions, causal, labels)
    logits_formed = []  # (the patched model's output layer forms no logits while labels come)
    form_logits = ours.output_layer._forward_impl
    ours.output_layer._forward_impl = lambda *args, **kwargs: logits_formed.append(1) or form_logits(*args, **kwargs)
    results, accepted = [], []
    for model in (ours, theirs):
        model.train()
        loss = model(tokens, positions, causal, labels=labels)
        assert not logits_formed, case
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        (loss * weights).sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        accepted.append(mtp_acceptance_counts())
    (loss, grads), (want, want_grads) = results
    assert rel(loss, want) < 1e-6, (case, rel(loss, want))
    # Megatron 0.19 on: MTP's accepted tokens, counted from the MTP logits (ours: from the loss's argmax)
    assert accepted[0] == accepted[1] and (accepted[0] is None or sum(accepted[0][1]) > 0), (case, accepted)
    assert accepted[0] is None or sum(accepted[0][0]) >= S * B // 2 - B, (case, accepted)
    if "output_processor" in inspect.signature(type(ours).forward).parameters:  # (0.18 on: a caller's own hook)
        own = ours(tokens, positions, causal, labels=labels, output_processor=lambda **kwargs: "the caller's")
        assert own == "the caller's"
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


def labels_mtp_half_accepts(model, tokens, positions, causal, labels):
    """Labels whose MTP depth's predictions (its logits' argmax: they do not depend on the labels) are right at
    every other token, so that the acceptance counts are not all 0."""
    formed = []
    layer_forward = model.output_layer.forward
    model.output_layer.forward = lambda *args, **kwargs: formed.append(layer_forward(*args, **kwargs)) or formed[-1]
    with torch.no_grad():
        model(tokens, positions, causal, labels=labels)
    del model.output_layer.forward
    mtp_logits = formed[0][0]  # (the MTP depth's come first: [s, b, V / tp], this rank's classes)
    if dist.get_world_size() > 1:
        shards = [torch.empty_like(mtp_logits) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, mtp_logits.contiguous())
        mtp_logits = torch.cat(shards, -1)
    predicted = mtp_logits.argmax(-1).transpose(0, 1)  # [b, s], of the labels rolled one to the left
    accepted = predicted.roll(1, dims=-1)
    labels = labels.clone()
    labels[:, ::2] = accepted[:, ::2]
    mtp_acceptance_counts()  # (cleared)
    return labels


def counts_mtp_acceptance():
    """Whether Megatron counts MTP's accepted tokens (0.19 on)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    return hasattr(mtp, "_compute_mtp_acceptance_counts")


def mtp_acceptance_counts():
    """The (correct, total) MTP acceptance counts Megatron's tracker holds, cleared (None before 0.19)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    if not counts_mtp_acceptance():
        return None
    tracker = mtp.MTPLossLoggingHelper.tracker
    if "correct_values" not in tracker:
        return None
    counts = (tracker["correct_values"].tolist(), tracker["total_values"].tolist())
    mtp.MTPLossLoggingHelper.clean_metrics_in_tracker()
    return counts


def _entry(rank, world, port, case):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        check(rank, world, case)
    finally:
        dist.destroy_process_group()


def _has_mup():
    from megatron.core.transformer import TransformerConfig

    return "use_mup" in TransformerConfig.__dataclass_fields__  # (MuP's output multiplier: Megatron-Core 0.17 on)


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
    ]
    + ([(1, "mup mtp"), (2, "mup")] if _has_mup() else []),
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
