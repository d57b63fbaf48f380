"""Every causal LM of the installed transformers that builds from a tiny config, and the vision-language models of
vlm_models.py (a real image through each), patched with
fused_ce.integrations.transformers.apply, against an unpatched copy: loss, every gradient, the MoE auxiliary
loss and router logits, num_items_in_batch, return_dict=False and a tensor logits_to_keep are equal, or apply
refuses the model. Logits are scaled to a standard deviation of about 4 so that a dropped scale shows.

FUSED_CE_SWEEP_REPORT=path writes the families and what happened to each (the README's list).
"""

import copy
import inspect
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
import vlm_models  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from fused_ce.integrations.transformers import Refused, apply  # noqa: E402

V = 101
# Small sizes under the names configs use; only those a config knows are set.
TINY = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, n_embd=32, n_layer=2, n_head=4, n_positions=128,
    d_model=32, num_layers=2, ffn_dim=64, n_inner=64, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, shared_expert_intermediate_size=32,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rnn_hidden_size=32, lru_width=32,
    attention_window_size=16, sliding_window=16, num_kv_heads=2, output_router_logits=True, dim_model_base=16,
    rotary_dim=8, use_cache=False,
)  # fmt: skip
MAX_PARAMETERS = 3_000_000


def tiny_config(config_class):
    accepted = inspect.signature(config_class.__init__).parameters
    aliases = getattr(config_class, "attribute_map", {})
    config = config_class(**{k: v for k, v in TINY.items() if k in accepted or k in aliases})
    for k, v in TINY.items():
        if hasattr(config, k):
            try:
                setattr(config, k, v)
            except Exception:  # a read-only or derived field
                pass
    return config


def families():
    """(model type, class) of every causal LM class transformers maps, in order."""
    out = []
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, name, None)
        if cls is not None and model_type in CONFIG_MAPPING_NAMES:
            out.append((model_type, cls))
    return out


def build(model_type, cls):
    """A tiny model with logits of std ~4, or None where it does not build small."""
    try:
        config = tiny_config(getattr(transformers, CONFIG_MAPPING_NAMES[model_type]))
        with torch.device("meta"):
            if sum(p.numel() for p in cls(config).parameters()) > MAX_PARAMETERS:
                return None
        torch.manual_seed(0)
        model = cls(config).eval()
        ids, labels = batch(model)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            scale = 4.0 / logits.float().std().clamp_min(1e-6)
            model.get_output_embeddings().weight.mul_(scale)
        return model
    except Exception:
        return None


def batch(model, rows=3, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    vocab = min(V, model.get_output_embeddings().weight.shape[0])
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    return ids, labels


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare(ref, model):
    """Every check of one family: raises AssertionError naming what differs."""
    ids, labels = batch(ref)
    kw = dict(input_ids=ids, labels=labels, use_cache=False)
    want, got = ref(**kw), model(**kw)
    assert got.logits is None, "logits were built"
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6, msg="loss")
    for field in ("aux_loss", "router_logits"):
        w, g = getattr(want, field, None), getattr(got, field, None)
        assert (w is None) == (g is None), field
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=field)
    want.loss.backward()
    got.loss.backward()
    w_grads, g_grads = grads(ref), grads(model)
    assert w_grads.keys() == g_grads.keys(), sorted(w_grads.keys() ^ g_grads.keys())
    for name in w_grads:  # by norm: float32 rounding (and gradients that are 0 but for it, like key biases')
        difference, size = (g_grads[name] - w_grads[name]).norm().item(), w_grads[name].norm().item()
        assert difference <= 1e-4 * size + 1e-6, (name, difference, size)
    # num_items_in_batch: the sum over tokens divided by it (gradient accumulation)
    items = torch.tensor(7)
    torch.testing.assert_close(
        model(**kw, num_items_in_batch=items).loss, ref(**kw, num_items_in_batch=items).loss, rtol=1e-5, atol=1e-6
    )
    # return_dict=False: the model's own tuple, without the logits (where the unpatched model has one)
    try:
        want_tuple = ref(**kw, return_dict=False)
    except Exception:  # the unpatched model's own return_dict=False fails (some 4.x MoE models)
        want_tuple = None
    if isinstance(want_tuple, tuple):
        got_tuple = model(**kw, return_dict=False)
        assert isinstance(got_tuple, tuple), "return_dict=False"
        at = [i for i, v in enumerate(want_tuple) if torch.is_tensor(v) and v.shape == want.logits.shape]
        # the logits left out (a ModelOutput's tuple drops None) or None in their place (a tuple of its own)
        expected = [v for i, v in enumerate(want_tuple) if i not in at[:1]]
        if len(got_tuple) == len(want_tuple):
            assert got_tuple[at[0]] is None, "return_dict=False: the logits' place"
            got_items = [v for i, v in enumerate(got_tuple) if i != at[0]]
        else:
            got_items = list(got_tuple)
        assert len(got_items) == len(expected), "return_dict=False: the tuple's length"
        for g, w in zip(got_items, expected):
            if torch.is_tensor(w):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg="return_dict=False")
    # a tensor logits_to_keep: the loss over those positions, with labels for them
    if "logits_to_keep" in inspect.signature(ref.forward).parameters:
        keep = torch.tensor([2, 5, 9])
        with torch.no_grad():
            kept = dict(input_ids=ids, labels=labels[:, keep], logits_to_keep=keep, use_cache=False)
            want_loss, got_loss = ref(**kept).loss, model(**kept).loss
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6, msg="tensor logits_to_keep")


def test_every_causal_lm_is_reproduced_or_refused():
    outcomes = {}
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    for model_type, cls in families():
        ref = build(model_type, cls)
        if ref is None:
            outcomes[cls.__name__] = "does not build from a tiny config"
            continue
        try:
            model = apply(copy.deepcopy(ref), logits="never")  # (in eval: no dropout)
        except Refused as exc:
            outcomes[cls.__name__] = f"refused: {exc}"
            continue
        try:
            ref(**dict(zip(("input_ids", "labels"), batch(ref)), use_cache=False))
        except Exception:
            outcomes[cls.__name__] = "the unpatched tiny model does not run"
            continue
        try:
            compare(ref, model)
            outcomes[cls.__name__] = "equal"
        except Exception as exc:  # a difference, or the patched model failing
            outcomes[cls.__name__] = f"DIFFERS: {type(exc).__name__}: {str(exc)[:300]}"
    report = os.environ.get("FUSED_CE_SWEEP_REPORT")
    if report:
        with open(report, "w") as f:
            f.write(f"transformers {transformers.__version__}\n")
            for name, outcome in sorted(outcomes.items()):
                f.write(f"{name}: {outcome}\n")
    differs = {n: o for n, o in outcomes.items() if o.startswith("DIFFERS")}
    assert not differs, differs
    equal = [n for n, o in outcomes.items() if o == "equal"]
    assert len(equal) >= 40, outcomes  # the sweep itself must not quietly stop building models
    # what the issue found silently wrong, now equal or refused
    for name in (
        "GraniteForCausalLM",
        "CohereForCausalLM",
        "MixtralForCausalLM",
        "PhimoeForCausalLM",
        "GPT2LMHeadModel",
        "DoryForCausalLM",
        "RobertaForCausalLM",
    ):
        if name in outcomes:
            assert outcomes[name] == "equal" or outcomes[name].startswith(("refused", "does not", "the unpatched")), (
                name,
                outcomes[name],
            )


def test_refused_heads_name_the_reason():
    # a head module with a forward of its own (RoBERTa's): refused at apply, naming it
    config = transformers.RobertaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, is_decoder=True
    )
    with pytest.raises(Refused, match="not an nn.Linear"):
        apply(transformers.RobertaForCausalLM(config))


@pytest.mark.parametrize("family", vlm_models.FAMILIES)
def test_vision_language_model_is_reproduced(family):
    # a real image through the vision tower and projector: the loss and every gradient (theirs included) equal to
    # the unpatched model's, the logits never built, num_items_in_batch as transformers divides by it
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    ref, inputs = vlm_models.build(transformers, family)
    with torch.no_grad():
        scale = 4.0 / ref(**inputs).logits.float().std().clamp_min(1e-6)
        ref.get_output_embeddings().weight.mul_(scale)
    try:
        model = apply(copy.deepcopy(ref), logits="never")
    except Refused as exc:  # Gemma 3's forward before transformers 5 computes a loss of its own on sliced logits
        major = int(transformers.__version__.split(".")[0])
        assert family == "gemma3" and major < 5 and type(ref).__name__ in str(exc), exc
        return
    labels = inputs["input_ids"].clone()
    labels[:, :3] = -100  # a prompt
    labels[labels == vlm_models.IMAGE] = -100  # the image's placeholders, as trainers' collators mask them
    want, got = ref(**inputs, labels=labels), model(**inputs, labels=labels)
    assert got.logits is None, "logits were built"
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    w_grads, g_grads = grads(ref), grads(model)
    assert w_grads.keys() == g_grads.keys(), sorted(w_grads.keys() ^ g_grads.keys())
    towers = [n for n in w_grads if any(k in n for k in ("vision", "visual", "projector", "connector", "mlp1"))]
    assert towers, sorted(w_grads)  # the image's own parameters have gradients, and they are compared
    for name in w_grads:
        difference, size = (g_grads[name] - w_grads[name]).norm().item(), w_grads[name].norm().item()
        assert difference <= 1e-4 * size + 1e-6, (name, difference, size)
    items = torch.tensor(5)
    with torch.no_grad():
        torch.testing.assert_close(
            model(**inputs, labels=labels, num_items_in_batch=items).loss,
            ref(**inputs, labels=labels, num_items_in_batch=items).loss,
            rtol=1e-5,
            atol=1e-6,
        )


def test_vision_language_model_whose_head_cannot_be_fused_is_refused_by_name():
    # Llama 4's forward takes its logits from its language model's own head call (no head call of its own)
    if not hasattr(transformers, "Llama4ForConditionalGeneration"):
        pytest.fail(f"transformers {transformers.__version__} has no Llama4ForConditionalGeneration")
    with pytest.raises(Refused, match="Llama4ForConditionalGeneration"):
        apply(transformers.Llama4ForConditionalGeneration)
