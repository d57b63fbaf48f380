"""verl's fused forward with ``fused_kernel_options.impl_backend=fused_ce`` (fused_ce.integrations.verl), against
verl's own ``torch`` backend, with verl installed (its own CI stage: verl 0.9 pins transformers below the test
command's). On the CPU: the backend's log-probs, entropy and gradients, a dense and a vision-language model patched
by verl's ``apply_monkey_patch`` as its FSDP engine does, and the plugin entry point that registers the backend in a
fresh process."""

import subprocess
import sys
import types

import pytest
import torch
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils.experimental.torch_functional import FusedLinearForPPO

import fused_ce.integrations.verl as fused_verl  # (registers the backend, as verl's plugin loader does)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
from reference import rel_err  # noqa: E402


def _heads(backend, hidden, weight, ids, temperature, upstream):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_probs, entropy = FusedLinearForPPO(impl_backend=backend).forward(h, w, ids, temperature=temperature)
    terms = [(log_probs * upstream[0]).sum()] + (
        [(entropy.float() * upstream[1]).sum()] if upstream[1] is not None else []
    )
    sum(terms).backward()
    return log_probs, entropy, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy_grad", [True, False], ids=["entropy_grad", "log_probs_grad"])
def test_backend_matches_verls_torch_backend(dtype, with_entropy_grad):
    g = torch.Generator().manual_seed(0)
    B, T, D, V, temperature = 2, 37, 64, 1000, 0.7
    hidden = torch.randn(B, T, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    upstream = (torch.randn(B, T, generator=g), torch.randn(B, T, generator=g) if with_entropy_grad else None)
    ours = _heads("fused_ce", hidden, weight, ids, temperature, upstream)
    verls = _heads("torch", hidden, weight, ids, temperature, upstream)
    assert ours[0].dtype == verls[0].dtype == torch.float32 and ours[1].dtype == verls[1].dtype == dtype
    assert ours[0].shape == verls[0].shape == ids.shape and ours[1].shape == ids.shape
    if dtype == torch.float32:
        for a, b in zip(ours, verls):
            assert rel_err(a, b) < 1e-5
        return
    # bfloat16: within 1.5x verl's own error against a float64 reference of the same computation
    exact = _heads("torch", hidden.double(), weight.double(), ids, temperature, upstream)
    for a, b, e in zip(ours, verls, exact):
        assert rel_err(a, e) <= 1.5 * rel_err(b, e) + 1e-6, (rel_err(a, e), rel_err(b, e))


def _qwen2(vocab):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    return Qwen2ForCausalLM(config), {}


def _qwen2_vl(vocab):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, mlp_ratio=2),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1,
    )  # fmt: skip
    # one 56 x 56 image: a 4 x 4 grid of 14-pixel patches, 4 tokens after the 2 x 2 merge
    image = torch.randn(16, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1))
    return Qwen2VLForConditionalGeneration(config), {"pixel_values": image, "image_grid_thw": torch.tensor([[1, 4, 4]])}


def _inputs(model, vocab, pixels):
    """input_ids [1, T] and the position ids verl's dataset gives (text positions, and Qwen-VL's 3-D ones below
    them from verl's own get_rope_index: [4, 1, T])."""
    g = torch.Generator().manual_seed(2)
    text = torch.randint(3, vocab - 4, (20,), generator=g)
    if getattr(model.config, "image_token_id", None) is None:
        return {"input_ids": text.unsqueeze(0), "position_ids": torch.arange(20).unsqueeze(0)}
    from verl.models.transformers.qwen2_vl import get_rope_index

    c = model.config
    ids = torch.cat([text[:6], torch.tensor([c.vision_start_token_id] + [c.image_token_id] * 4), text[6:]])
    names = {"<|image_pad|>": c.image_token_id, "<|video_pad|>": c.video_token_id,
             "<|vision_start|>": c.vision_start_token_id}  # fmt: skip
    processor = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(merge_size=2),
        tokenizer=types.SimpleNamespace(convert_tokens_to_ids=names.get),
    )
    vision = get_rope_index(processor, input_ids=ids, image_grid_thw=pixels["image_grid_thw"])
    position_ids = torch.cat([torch.arange(len(ids)).unsqueeze(0), vision]).unsqueeze(1)
    return {"input_ids": ids.unsqueeze(0), "position_ids": position_ids}


@pytest.mark.parametrize("family", ["qwen2", "qwen2_vl"])
def test_patched_model_matches_verls_torch_backend(family):
    # verl's FSDP engine patches the model with apply_monkey_patch(use_fused_kernels=True, fused_kernels_backend=...)
    # and calls it with temperature and return_dict (fsdp/transformer_impl.py); the same weights both ways
    vocab = 300
    torch.manual_seed(3)
    build = {"qwen2": _qwen2, "qwen2_vl": _qwen2_vl}[family]
    models, extra = [], None
    for backend in ("torch", "fused_ce"):
        model, extra = build(vocab)
        if models:
            model.load_state_dict(models[0].state_dict())
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend=backend)
        assert model._verl_fused_kernels_backend == backend
        models.append(model)
    inputs = _inputs(models[0], vocab, extra)
    upstream = torch.randn(inputs["input_ids"].shape, generator=torch.Generator().manual_seed(4))
    outs = []
    for model in models:
        out = model(**inputs, **extra, temperature=0.8, return_dict=True)
        (out.log_probs * upstream + out.entropy * upstream.flip(-1)).sum().backward()
        outs.append(out)
    assert rel_err(outs[1].log_probs, outs[0].log_probs) < 1e-5
    assert rel_err(outs[1].entropy, outs[0].entropy) < 1e-5
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in models]
    assert grads[0].keys() == grads[1].keys() and any("visual" in n for n in grads[0]) == (family == "qwen2_vl")
    for name, grad in grads[0].items():
        assert rel_err(grads[1][name], grad) < 1e-5, name


def test_other_backends_unchanged():
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
        FusedLinearForPPO(impl_backend="nonesuch")
    assert FusedLinearForPPO(impl_backend="torch").impl_backend == "torch"


def test_verls_plugin_loader_registers_the_backend():
    # a fresh process that imports verl only: its plugin loader (the `verl.plugins` entry points) imports
    # fused_ce.integrations.verl, which patches verl's modules as they are imported
    code = (
        "import sys, verl\n"
        "assert 'fused_ce.integrations.verl' in sys.modules, 'not loaded by verl'\n"
        "assert 'verl.models.transformers.monkey_patch' not in sys.modules\n"
        "from verl.utils.experimental.torch_functional import FusedLinearForPPO\n"
        "assert FusedLinearForPPO(impl_backend='fused_ce').impl_backend == 'fused_ce'\n"
        "from verl.models.transformers import monkey_patch\n"
        "assert monkey_patch.patch_forward_with_backends._fused_ce_original is not None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_grad_workspace_from_the_environment(monkeypatch):
    # FUSED_CE_VERL_NO_GRAD_WORKSPACE_BYTES is the reference and old policies' workspace (no grad), not the actor's;
    # the same values either way; a bad value is an error naming the variable.
    import fused_ce.functional

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 37, 64, generator=g), torch.randn(1000, 64, generator=g) / 8
    ids = torch.randint(0, 1000, (2, 37), generator=g)
    seen = []
    original = fused_ce.functional.linear_log_probs

    def spy(*args, **kwargs):
        seen.append(kwargs.get("workspace_bytes"))
        return original(*args, **kwargs)

    monkeypatch.setattr(fused_ce.functional, "linear_log_probs", spy)
    head = FusedLinearForPPO(impl_backend="fused_ce")
    with torch.no_grad():
        default = head.forward(hidden, weight, ids, temperature=0.7)
    monkeypatch.setenv(fused_verl.NO_GRAD_WORKSPACE, str(64 * 1000 * 4))  # a few rows' logits at a time
    with torch.no_grad():
        lean = head.forward(hidden, weight, ids, temperature=0.7)
    actor = head.forward(hidden.clone().requires_grad_(), weight, ids, temperature=0.7)
    assert seen == [None, 64 * 1000 * 4, None]
    for a, b in zip(lean + actor, default + default):
        assert rel_err(a.detach(), b) < 1e-6
    monkeypatch.setenv(fused_verl.NO_GRAD_WORKSPACE, "lots")
    with pytest.raises(ValueError, match="FUSED_CE_VERL_NO_GRAD_WORKSPACE_BYTES must be a positive"), torch.no_grad():
        head.forward(hidden, weight, ids, temperature=0.7)
