"""fused_ce.integrations.trl: TRL's GRPOTrainer with fused_ce's log-probs and policy loss trains as TRL does.

A tiny random Qwen2 model, a byte-level BPE tokenizer trained here, a toy reward: a few steps with TRL unpatched
and patched give the same losses, metrics and parameters.
"""

import copy
from typing import NamedTuple

import pytest
import torch

trl = pytest.importorskip("trl", reason="needs trl (pip install trl)")
transformers = pytest.importorskip("transformers", reason="needs transformers")
datasets = pytest.importorskip("datasets", reason="needs datasets (trl's dependency)")

from fused_ce import linear_policy_loss  # noqa: E402
from fused_ce.integrations import trl as fused_trl  # noqa: E402

TEXT = "the cat sat on the mat and the dog ate the bone while the bird sang a song " * 20


def tokenizer():
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=300, min_frequency=1, special_tokens=["<pad>", "<eos>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>")
    tok.padding_side = "left"
    return tok


def tiny_model(tok, path, seed=0):
    """A tiny random Qwen2 saved at path (returned)."""
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def reward_a_letters(completions, **kwargs):  # a toy reward: how many a's
    return [float(c.count("a")) for c in completions]


LOGGED = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


class Run(NamedTuple):
    losses: list
    metrics: list  # per logging step, what both log of LOGGED
    parameters: dict
    fused_head: bool  # whether the trained model's head was fused_ce's


def train(model, tok, tmp_path, **config):
    """A few GRPO steps from `model`, a directory (TRL loads the reference policy from it)."""
    config.setdefault("bf16", False)  # float32 throughout: the runs agree to rounding (bf16 autocast: below)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=3, learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
        **config,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": ["the cat", "a dog", "the bird", "on the mat"] * 3})
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward_a_letters, args=args, train_dataset=data, processing_class=tok
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return Run(
        [h["loss"] for h in logs],
        [{k: v for k, v in h.items() if k in LOGGED} for h in logs],
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        getattr(trainer.model, "_fused_ce_head", False),
    )


def train_fused(model, tok, tmp_path, **config):
    """train() with fused_ce.integrations.trl applied, and how often each fused_ce function ran."""
    calls = {"linear_policy_loss": 0, "linear_log_probs": 0}
    originals = {name: getattr(fused_trl, name) for name in calls}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(fused_trl, name, counted(name))
    fused_trl.apply()
    try:
        return train(model, tok, tmp_path, **config), calls
    finally:
        fused_trl.restore()
        for name, function in originals.items():
            setattr(fused_trl, name, function)


def assert_same_run(fused, reference, rtol=1e-4, atol=1e-5, parameters=True):
    assert fused.fused_head and not reference.fused_head
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(reference.losses), rtol=rtol, atol=atol)
    for got, want in zip(fused.metrics, reference.metrics, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            assert abs(got[k] - want[k]) <= 10 * atol + rtol * abs(want[k]), (k, got[k], want[k])
    if parameters:
        for name, p in reference.parameters.items():
            torch.testing.assert_close(fused.parameters[name], p, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(
    "config",
    [
        dict(loss_type="dapo", beta=0.0),
        dict(loss_type="grpo", beta=0.04),
        dict(loss_type="bnpo", beta=0.04, num_iterations=2),  # off-policy: old log-probs, clipped ratios
        dict(loss_type="dr_grpo", beta=0.0, epsilon_high=0.28),
        dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False, gradient_accumulation_steps=2),
    ],
    ids=["dapo", "grpo-kl", "bnpo-off-policy", "dr_grpo", "dapo-accumulated"],
)
def test_grpo_trains_as_trl_does(config, tmp_path):
    tok = tokenizer()
    model = tiny_model(tok, tmp_path / "model")
    reference = train(model, tok, tmp_path / "trl", **config)
    fused, calls = train_fused(model, tok, tmp_path / "fused", **config)
    assert calls["linear_policy_loss"] > 0  # the loss went through fused_ce.linear_policy_loss
    assert_same_run(fused, reference)


def test_bf16_autocast_trains_as_trl_does(tmp_path):
    # both compute the head in bfloat16 under autocast (TRL: bf16 logits tiles; fused_ce: bf16 operands, float32
    # accumulation), so they agree to bfloat16's rounding
    tok = tokenizer()
    model = tiny_model(tok, tmp_path / "model")
    config = dict(loss_type="grpo", beta=0.04, bf16=True)
    reference = train(model, tok, tmp_path / "trl", **config)
    fused, calls = train_fused(model, tok, tmp_path / "fused", **config)
    assert calls["linear_policy_loss"] > 0
    assert_same_run(fused, reference, rtol=2e-2, atol=1e-3, parameters=False)


def test_unmapped_loss_keeps_trls_loss_on_fused_log_probs(tmp_path):
    tok = tokenizer()
    model = tiny_model(tok, tmp_path / "model")
    config = dict(loss_type="cispo", beta=0.0)
    reference = train(model, tok, tmp_path / "trl", **config)
    fused, calls = train_fused(model, tok, tmp_path / "fused", **config)
    assert calls["linear_policy_loss"] == 0 and calls["linear_log_probs"] > 0  # TRL's loss on fused_ce's head
    assert_same_run(fused, reference)


@pytest.mark.parametrize("family", ["qwen2", "mixtral", "gemma2"])
def test_fused_head_outputs_match_trls(family, tmp_path):
    # the head alone, against TRL's own fused head: per-token outputs, the loss, a MoE model's auxiliary loss, a
    # softcapped head, and the gradients
    from trl.trainer.utils import add_fused_lm_head as trls_head

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=True, router_aux_loss_coef=0.1)  # fmt: skip
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(config)
    torch.manual_seed(0)
    reference, fused = copy.deepcopy(model), copy.deepcopy(model)
    outputs = ("log_probs", "entropy", "is_top1")
    trls_head(reference, temperature=0.8, outputs=outputs)
    assert fused_trl.add_fused_lm_head(fused, temperature=0.8, outputs=outputs, _original=trls_head)
    ids = torch.randint(0, 300, (3, 10))
    labels = ids.clone()
    labels[:, :4] = -100
    attention = torch.ones_like(ids)
    attention[0, :2] = 0
    got = fused(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    want = reference(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
    for name in ("log_probs", "entropy", "loss", "aux_loss"):
        if getattr(want, name) is None:
            assert getattr(got, name) is None, name
            continue
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(got.is_top1, want.is_top1) and torch.equal(got.label_mask, want.label_mask)
    (got.loss + got.entropy.sum()).backward()
    (want.loss + want.entropy.sum()).backward()
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("policy", [False, True])
def test_fp32_head_stays_float32_under_autocast(policy):
    # GRPOConfig's cast_lm_head_to_fp32: the head in float32 outside autocast, as TRL's own head computes it
    # (fused_ce's autocast kernel would cast it back to bfloat16: 4e-3 against a float64 head, TRL's 6e-7)
    from trl.trainer.utils import add_fused_lm_head as trls_head

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    reference, fused = copy.deepcopy(model), copy.deepcopy(model)
    trls_head(reference, cast_lm_head_to_fp32=True)
    assert fused_trl.add_fused_lm_head(fused, cast_lm_head_to_fp32=True, _original=trls_head)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 24), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = fused.model(input_ids=ids).last_hidden_state[:, :-1]
        want = reference(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
        if policy:  # GRPOTrainer's fused loss: its per-token log-probs are the policy gradient's coefficients
            advantages = torch.randn(2, 23, generator=g)
            out, _ = fused(input_ids=ids, labels=ids, fused_lm_head=True, fused_policy=dict(advantages=advantages))
            got = None
        else:
            got = fused(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    w = fused.lm_head.weight.detach().double()
    exact = torch.log_softmax(hidden.double() @ w.T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    trl_error = (want.double() - exact).norm() / exact.norm()
    assert trl_error < 1e-5  # TRL's own head: float32
    if policy:
        # on-policy, the loss is -sum(w A) (ratio 1), its gradient through the float32 log-probs: compare the
        # lm_head's gradient with the float64 one's
        out.loss.backward()
        wd = w.clone().requires_grad_()
        logp = torch.log_softmax(hidden.double().detach() @ wd.T, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(advantages.double() * torch.exp(logp - logp.detach())).sum() / logp.numel()).backward()
        error = (fused.lm_head.weight.grad.double() - wd.grad).norm() / wd.grad.norm()
        assert error < 1e-5, error
    else:
        error = (got.double() - exact).norm() / exact.norm()
        assert error <= 10 * trl_error + 1e-7, (error, trl_error)


# SFT, DPO, KTO and RLOO: TRL's fused head is fused_ce's for the policy and the reference (every output).
PROMPTS = ["the cat", "a dog", "the bird", "on the mat"]
PAIRS = dict(
    chosen=[" sat on the mat", " ate the bone", " sang a song", " and the dog"],
    rejected=[" the the the", " a a a", " bird bird", " mat mat"],
)
NOT_COMPARED = ("epoch", "step", "learning_rate", "step_time")  # (and every other timing)


def trainer_of(kind, model, tok, tmp_path):
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-3,
                  logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False)  # fmt: skip
    if kind.startswith("dpo"):
        data = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, **{k: v * 2 for k, v in PAIRS.items()}})
        args = trl.DPOConfig(**common, use_weighting=kind == "dpo-wpo")
        return trl.DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    if kind == "kto":
        completions = PAIRS["chosen"] + PAIRS["rejected"]
        data = datasets.Dataset.from_dict(
            {"prompt": PROMPTS * 2, "completion": completions, "label": [True] * 4 + [False] * 4}
        )
        return trl.KTOTrainer(model=model, args=trl.KTOConfig(**common), train_dataset=data, processing_class=tok)
    if kind == "sft":  # prompt-completion: the loss on the completions only
        data = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "completion": PAIRS["chosen"] * 2})
        return trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), train_dataset=data, processing_class=tok)
    data = datasets.Dataset.from_dict({"prompt": PROMPTS * 3})
    args = trl.RLOOConfig(**common, num_generations=4, max_completion_length=6, beta=0.04)
    return trl.RLOOTrainer(
        model=model, reward_funcs=reward_a_letters, args=args, train_dataset=data, processing_class=tok
    )


def train_with(kind, model, tok, tmp_path, fused):
    """A few steps of TRL's `kind` trainer, TRL's own head or fused_ce's, and the [B, T, V] outputs any lm_head
    module returned meanwhile, but generation's (none: neither head builds logits)."""
    calls = {"linear_log_probs": 0}
    original = fused_trl.linear_log_probs

    def counted(*args, **kwargs):
        calls["linear_log_probs"] += 1
        return original(*args, **kwargs)

    if fused:
        fused_trl.linear_log_probs = counted
        fused_trl.apply()
    try:
        trainer = trainer_of(kind, model, tok, tmp_path)
        built = []
        heads = [trainer.model.get_output_embeddings()]
        if getattr(trainer, "ref_model", None) is not None:
            heads.append(trainer.ref_model.get_output_embeddings())
        for head in heads:
            # (generation's logits, of one position per step, are the model's own)
            head.register_forward_hook(
                lambda m, a, out: built.append(out.shape) if out.dim() == 3 and out.shape[1] > 1 else None
            )
        trainer.train()
    finally:
        if fused:
            fused_trl.restore()
            fused_trl.linear_log_probs = original
    logs = [h for h in trainer.state.log_history if "loss" in h]
    heads = [getattr(trainer.model, "_fused_ce_head", False)]
    if getattr(trainer, "ref_model", None) is not None:
        heads.append(getattr(trainer.ref_model, "_fused_ce_head", False))
    run = Run(
        [h["loss"] for h in logs],
        [
            {k: v for k, v in h.items() if k not in NOT_COMPARED and "time" not in k and isinstance(v, float)}
            for h in logs
        ],
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        all(heads),
    )
    return run, calls["linear_log_probs"], built


@pytest.mark.parametrize("kind", ["sft", "dpo", "dpo-wpo", "kto", "rloo"])
def test_sft_preference_and_rloo_trainers_train_as_trl_does(kind, tmp_path):
    tok = tokenizer()
    model = tiny_model(tok, tmp_path / "model")
    reference, _, _ = train_with(kind, model, tok, tmp_path / "trl", fused=False)
    fused, calls, built = train_with(kind, model, tok, tmp_path / "fused", fused=True)
    assert calls > 0 and built == []
    assert any("logits" in k for k in reference.metrics[0]) or kind in ("sft", "rloo")  # (mean logits compared)
    assert_same_run(fused, reference, parameters=False)
    for name, want in reference.parameters.items():  # float32's rounding, as Adam's steps carry it (by norm)
        error = ((fused.parameters[name] - want).norm() / want.norm()).item()
        assert error < 1e-4, (name, error)


def test_mean_logits_and_wpo_weights_match_trls():
    from trl.trainer.utils import add_fused_lm_head as trls_head

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.add_(0.05)  # a head whose logits' mean is far from 0
    reference, fused = copy.deepcopy(model), copy.deepcopy(model)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    trls_head(reference, temperature=0.7, outputs=outputs)
    assert fused_trl.add_fused_lm_head(fused, temperature=0.7, outputs=outputs, _original=trls_head)
    ids = torch.randint(0, 300, (3, 10))
    labels = ids.clone()
    labels[:, :3] = -100
    got = fused(input_ids=ids, labels=labels, fused_lm_head=True)
    want = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    assert want.mean_logits.abs().max() > 0.1
    torch.testing.assert_close(got.mean_logits, want.mean_logits, rtol=1e-5, atol=1e-6)
    assert want.log_sum_sq_probs.min() < -1.0  # (0 at the ignored rows)
    torch.testing.assert_close(got.log_sum_sq_probs, want.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
    # a softcapped head's mean logits and WPO weights are TRL's own head's
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**config.to_diff_dict(), "head_dim": 8,
                                                                       "final_logit_softcapping": 3.0}))  # fmt: skip
    assert not fused_trl.add_fused_lm_head(gemma, outputs=outputs, _original=trls_head)
    assert fused_trl.add_fused_lm_head(copy.deepcopy(gemma), outputs=("log_probs", "entropy"), _original=trls_head)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_head_takes_a_lora_lm_head(dropout):
    """LoRA on the lm_head (which TRL's own head leaves out, reading the base weight): the head's logits as the model
    computes them, the adapters a low-rank term (the dropout masks its call would draw); log-probs, entropy, mean
    logits, WPO weights, GRPO's fused loss and the adapters' gradients as the model's own head gives them."""
    peft = pytest.importorskip("peft", reason="needs peft")
    from trl.trainer.utils import add_fused_lm_head as trls_head

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=dropout, init_lora_weights=False)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config), lora).get_base_model().train()
    reference, fused = copy.deepcopy(model), copy.deepcopy(model)
    outputs = ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs")
    assert fused_trl.add_fused_lm_head(fused, temperature=0.7, outputs=outputs, _original=trls_head)
    ids = torch.randint(0, 300, (3, 10))
    labels = ids.clone()
    labels[:, :3] = -100
    torch.manual_seed(1)
    got = fused(input_ids=ids, labels=labels, fused_lm_head=True)
    torch.manual_seed(1)
    logits = reference.lm_head(reference.model(input_ids=ids).last_hidden_state[:, :-1]) / 0.7
    mask = labels[:, 1:] != -100
    log_p = logits.log_softmax(-1)
    want = torch.where(mask, log_p.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0], 0)
    entropy = torch.where(mask, -(log_p.exp() * log_p).sum(-1), 0)
    torch.testing.assert_close(got.log_probs, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.mean_logits, torch.where(mask, logits.mean(-1), 0).detach(), rtol=1e-5, atol=1e-5)
    log_sum_sq = torch.where(mask, (2 * log_p).logsumexp(-1), 0).detach()  # (DPO's WPO weights)
    torch.testing.assert_close(got.log_sum_sq_probs, log_sum_sq, rtol=1e-5, atol=1e-5)
    (got.log_probs.sum() + got.entropy.sum()).backward()
    (want.sum() + entropy.sum()).backward()
    lora_grads = 0
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        if q.grad is not None:
            lora_grads += "lora_" in name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert lora_grads == 2
    # GRPO's fused loss: the same term (linear_policy_loss takes it too), its gradients reaching A and B
    policy = dict(advantages=torch.randn(3, 9))
    fused.zero_grad()
    torch.manual_seed(2)
    out, _ = fused(input_ids=ids, labels=labels, fused_lm_head=True, fused_policy=policy)
    out.loss.backward()
    reference.zero_grad()
    torch.manual_seed(2)
    head = reference.lm_head
    hidden = reference.model(input_ids=ids).last_hidden_state[:, :-1]
    u = head.lora_A["default"](head.lora_dropout["default"](hidden)) * head.scaling["default"]
    want_loss = linear_policy_loss(
        hidden, head.base_layer.weight, labels[:, 1:], policy["advantages"], temperature=0.7, low_rank_input=u,
        low_rank_weight=head.lora_B["default"].weight,
    )  # fmt: skip
    want_loss.backward()
    torch.testing.assert_close(out.loss, want_loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def teacher_model(tok, path):
    """A tiny random Qwen2 teacher, wider and deeper than tiny_model's student, sharing its vocabulary."""
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def distill(student, teacher, tok, tmp_path, fused, beta):
    """A few on-policy steps of TRL's DistillationTrainer, TRL's own loss or fused_ce's: (run, fused_ce's calls,
    the [B, T, V] outputs either lm_head returned, but generation's)."""
    calls = []
    original = fused_trl.linear_distillation_loss

    def counted(*args, **kwargs):
        calls.append(kwargs["beta"])
        return original(*args, **kwargs)

    if fused:
        fused_trl.linear_distillation_loss = counted
        fused_trl.apply()
    try:
        args = trl.DistillationConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-3, logging_steps=1,
            report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False, beta=beta, temperature=1.5,
            max_completion_length=6,
        )  # fmt: skip
        data = datasets.Dataset.from_dict({"prompt": PROMPTS * 3})
        trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=args, train_dataset=data,
                                          processing_class=tok)  # fmt: skip
        built = []
        for head in (trainer.model.get_output_embeddings(), trainer.teacher_model.get_output_embeddings()):
            head.register_forward_hook(
                lambda m, a, out: built.append(out.shape) if out.dim() == 3 and out.shape[1] > 1 else None
            )
        trainer.train()
    finally:
        if fused:
            fused_trl.restore()
            fused_trl.linear_distillation_loss = original
    logs = [h for h in trainer.state.log_history if "loss" in h]
    metrics = [{k: v for k, v in h.items() if k not in NOT_COMPARED and "time" not in k and isinstance(v, float)}
               for h in logs]  # fmt: skip
    run = Run([h["loss"] for h in logs], metrics,
              {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, fused)  # fmt: skip
    return run, calls, built


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_trainer_trains_as_trl_does(beta, tmp_path):
    tok = tokenizer()
    student = tiny_model(tok, tmp_path / "student")
    teacher = teacher_model(tok, tmp_path / "teacher")
    reference, _, _ = distill(student, teacher, tok, tmp_path / "trl", fused=False, beta=beta)
    fused, calls, built = distill(student, teacher, tok, tmp_path / "fused", fused=True, beta=beta)
    assert calls == [beta] * 3 and built == []  # each step's loss through fused_ce, no logits built
    assert "entropy" in reference.metrics[0]
    assert_same_run(fused, reference, parameters=False)
    for name, want in reference.parameters.items():
        error = ((fused.parameters[name] - want).norm() / want.norm()).item()
        assert error < 1e-4, (name, error)


def _vlm_processor(tok):
    """A LLaVA processor over the test's tokenizer: "<image>" expands to the 4 tokens of a 28 x 28 image in 14-pixel
    patches (the CLS feature dropped: "default" selection)."""
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return transformers.LlavaProcessor(
        image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1,
    )  # fmt: skip


def test_sft_of_a_vision_language_model_trains_as_trl_does(tmp_path):
    # TRL's SFT of a LLaVA model on image-text examples: its fused head is fused_ce's (every position of the batch
    # but the image's, prompts included: the standard "text" format), the same losses, metrics and parameters
    from PIL import Image

    tok = tokenizer()
    tok.padding_side = "right"
    processor = _vlm_processor(tok)
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False),
        image_token_id=tok.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    pictures = [Image.fromarray((torch.rand(28, 28, 3, generator=g) * 255).byte().numpy()) for _ in range(4)]
    texts = [f"<image>{p}{c}" for p, c in zip(PROMPTS, PAIRS["chosen"])]
    data = datasets.Dataset.from_dict({"text": texts * 2, "images": [[p] for p in pictures] * 2})
    runs = []
    for fused in (False, True):
        if fused:
            fused_trl.apply()
        try:
            args = trl.SFTConfig(output_dir=str(tmp_path / str(fused)), per_device_train_batch_size=4, max_steps=3,
                                 learning_rate=5e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                 save_strategy="no", bf16=False, dataset_kwargs={"skip_prepare_dataset": True},
                                 remove_unused_columns=False)  # fmt: skip
            model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "model")
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=processor)
            towers = [p for n, p in trainer.model.named_parameters() if "vision_tower" in n or "projector" in n]
            before = [p.detach().clone() for p in towers]
            trainer.train()
        finally:
            if fused:
                fused_trl.restore()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        runs.append(
            Run(
                [h["loss"] for h in logs],
                [{k: v for k, v in h.items() if k in ("entropy", "mean_token_accuracy")} for h in logs],
                {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                getattr(trainer.model, "_fused_ce_head", False),
            )
        )
        assert any(not torch.equal(b, p) for b, p in zip(before, towers)), "the vision tower did not train"
    reference, fused = runs
    assert reference.metrics[0].keys() == {"entropy", "mean_token_accuracy"}
    assert_same_run(fused, reference, parameters=False)
    for name, want in reference.parameters.items():
        if (
            "k_proj.bias" in name
        ):  # its gradient is 0 but for rounding (softmax ignores it), which Adam's steps scale up
            continue
        difference = (fused.parameters[name] - want).norm().item()
        assert difference <= 1e-4 * want.norm().item() + 1e-6, (name, difference)  # (unused layers' biases are 0)


def test_gkd_trainer_is_not_marked_fused(tmp_path):
    # GKDTrainer (trl.experimental) inherits SFTTrainer's fused head but computes its loss on full logits: under
    # apply() its student is not marked as fused_ce's, it says so, and it trains as TRL's own
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDConfig, GKDTrainer

    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    path = tiny_model(tok, tmp_path / "model")
    data = datasets.Dataset.from_dict(
        {"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                      for p, c in zip(PROMPTS, PAIRS["chosen"])] * 2}
    )  # fmt: skip
    args = GKDConfig(output_dir=str(tmp_path / "gkd"), per_device_train_batch_size=4, max_steps=2, lmbda=0.0,
                     report_to=[], use_cpu=True, save_strategy="no", bf16=False, max_length=32)  # fmt: skip
    fused_trl.apply()
    try:
        with pytest.warns(UserWarning, match="GKDTrainer computes its generalised JSD"):
            trainer = GKDTrainer(model=path, teacher_model=path, args=args, train_dataset=data, processing_class=tok)
        assert trainer.model._fused_ce_head is False
        trainer.train()
    finally:
        fused_trl.restore()
    assert not hasattr(GKDTrainer.__init__, "_fused_ce_original")  # restored
