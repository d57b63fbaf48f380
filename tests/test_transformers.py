"""fused_ce.integrations.transformers: tiny models of every family built in code (no downloads) give the unpatched
model's loss and gradients, gradient accumulation, a Trainer step, generation and torch.compile."""

import copy
import os
import subprocess
import sys

import pytest
import torch

from helpers import DEVICES

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
import fused_ce  # noqa: E402
from fused_ce.integrations.transformers import FAMILIES, ForCausalLMLoss, apply  # noqa: E402

V = 101  # odd: no alignment to lean on
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=3.0)),  # small cap: its effect is visible
    "gemma3_text": ("Gemma3TextConfig", dict(final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
}


def tiny_model(family, device="cpu", seed=0):
    config_name, extra = CONFIGS[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    # training mode (without dropout): a patched model in evaluation returns its own logits (apply's `logits`)
    return getattr(transformers, FAMILIES[family])(config).to(device).train()


def batch(device, rows=3, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[-1, -3:] = -100  # padding
    return ids.to(device), labels.to(device)


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_loss_and_every_gradient_match(family, device):
    ref = tiny_model(family, device)
    model = apply(copy.deepcopy(ref))
    ids, labels = batch(device)
    expected = ref(input_ids=ids, labels=labels)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # never built
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    expected.loss.backward()
    out.loss.backward()
    want, got = grads(ref), grads(model)
    assert want.keys() == got.keys() and len(want) == len(list(ref.parameters()))  # every parameter (tied: once)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_accumulation_with_num_items_in_batch(family):
    # four micro-batches, each divided by the whole batch's token count: their sum is the one-batch loss
    model = apply(tiny_model(family))
    ids, labels = batch("cpu", rows=8)
    whole = model(input_ids=ids, labels=labels).loss
    whole.backward()
    one_batch = {n: g.clone() for n, g in grads(model).items()}
    model.zero_grad()
    count = (labels[:, 1:] != -100).sum()
    total = 0.0
    for part in range(4):
        rows = slice(2 * part, 2 * part + 2)
        loss = model(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=count).loss
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-5, atol=1e-6)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, one_batch[name], rtol=1e-4, atol=1e-6, msg=name)


def test_shift_labels_and_logits_to_keep():
    ref = tiny_model("llama")
    model = apply(copy.deepcopy(ref))
    ids, labels = batch("cpu")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    expected = ref(input_ids=ids, labels=labels).loss
    # as transformers passes them (context parallel): labels, and shift_labels that the loss uses instead
    got = model(input_ids=ids, labels=labels, shift_labels=shifted).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # logits_to_keep: the loss over the last positions only, as transformers slices the hidden states
    keep = 5
    want = ref(input_ids=ids, logits_to_keep=keep).logits
    got = model(input_ids=ids, labels=ids[:, -keep:], logits_to_keep=keep).loss
    ref_loss = transformers.loss.loss_utils.ForCausalLMLoss(want, ids[:, -keep:], V)
    torch.testing.assert_close(got, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # (gemma2: through its softcap)
def test_token_accuracy_when_asked(family):
    ref = tiny_model(family)
    ids, labels = batch("cpu", rows=4)
    with torch.no_grad():
        predicted = ref(input_ids=ids).logits.argmax(-1)  # position t's most likely next token
    g = torch.Generator().manual_seed(3)
    hit = torch.rand(labels[:, 1:].shape, generator=g) < 0.5  # about half the labels are the model's own guess
    labels[:, 1:] = torch.where((labels[:, 1:] != -100) & hit, predicted[:, :-1], labels[:, 1:])
    counted = labels[:, 1:] != -100
    want = ((predicted[:, :-1] == labels[:, 1:]) & counted).sum() / counted.sum()
    model = apply(copy.deepcopy(ref), token_accuracy=True)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and 0.3 < want < 0.9
    torch.testing.assert_close(out.token_accuracy, want.float())
    torch.testing.assert_close(out.loss, ref(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()  # the accuracy has no gradient, the loss its own
    assert not out.token_accuracy.requires_grad
    assert torch.is_tensor(model(input_ids=ids, labels=labels, return_dict=False)[0])  # a tuple: no accuracy
    assert "token_accuracy" not in apply(copy.deepcopy(ref))(input_ids=ids, labels=labels)  # only when asked
    _, accuracy = ForCausalLMLoss(torch.randn(2, 5, 32), ref.lm_head.weight, labels[:2, :5], return_token_accuracy=True)
    assert accuracy.shape == () and 0 <= accuracy <= 1


def test_loss_function_signature_serves_the_hook():
    # the fused-linear loss transformers' kernel mapping calls: hidden states and the lm_head weight
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 7, 16, generator=g), torch.randn(V, 16, generator=g)
    labels = torch.randint(0, V, (2, 7), generator=g)
    got = ForCausalLMLoss(hidden, weight, labels, hidden_size=16, num_items_in_batch=torch.tensor(9))
    want = transformers.loss.loss_utils.ForCausalLMLoss(hidden @ weight.T, labels, V, num_items_in_batch=9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_generate_and_label_less_forward_unchanged():
    ref = tiny_model("qwen2")
    model = apply(copy.deepcopy(ref))
    ids, _ = batch("cpu", rows=2, length=6)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    # a label-like argument without labels (the model computes no loss from it): unchanged too, logits and all
    shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    got, want = model(input_ids=ids, shift_labels=shifted), ref(input_ids=ids, shift_labels=shifted)
    assert got.loss is None and want.loss is None
    torch.testing.assert_close(got.logits, want.logits)


def test_apply_by_class_and_family_and_detection():
    cls = transformers.MistralForCausalLM
    original = cls.forward
    try:
        assert apply("mistral") is cls and cls.forward is not original
        assert apply(cls) is cls  # once
        model = tiny_model("mistral")
        ids, labels = batch("cpu")
        assert model(input_ids=ids, labels=labels).logits is None
    finally:
        cls.forward = original
    with pytest.raises(ValueError, match="unknown family"):
        apply("gpt-17")
    with pytest.raises(TypeError, match="ForCausalLM"):
        apply(torch.nn.Linear(2, 2))


def test_trainer_step_runs(tmp_path):
    model = apply(tiny_model("llama"))
    ids, labels = batch("cpu", rows=8)
    data = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    before = model.lm_head.weight.detach().clone()
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.lm_head.weight)  # tied to the embedding, trained through the loss


def test_evaluation_returns_the_models_own_logits_and_loss():
    ref = tiny_model("llama")
    ids, labels = batch("cpu")
    ref.eval()
    want = ref(input_ids=ids, labels=labels)
    model = apply(copy.deepcopy(ref), token_accuracy=True)
    out = model(input_ids=ids, labels=labels)  # not training: the model's own forward
    torch.testing.assert_close(out.logits, want.logits)
    torch.testing.assert_close(out.loss, want.loss)
    model.train()
    fused = model(input_ids=ids, labels=labels)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, want.loss)
    torch.testing.assert_close(out.token_accuracy, fused.token_accuracy)  # the same tokens' accuracy either way
    model.eval()
    assert model(input_ids=ids, labels=labels, skip_logits=True).logits is None  # transformers' keyword
    never = apply(copy.deepcopy(ref), logits="never")
    skipped = never(input_ids=ids, labels=labels)
    assert skipped.logits is None
    torch.testing.assert_close(skipped.loss, want.loss)
    assert never(input_ids=ids, labels=labels, skip_logits=False).logits is not None
    with pytest.raises(ValueError, match="logits must be one of"):
        apply(copy.deepcopy(ref), logits="sometimes")


def logits_built_by(model):
    """A list that the lm_head's forward hook fills with the shape of each [B, T, V] output it returns."""
    shapes = []
    model.lm_head.register_forward_hook(
        lambda m, args, out: shapes.append(tuple(out.shape)) if out.dim() == 3 else None
    )
    return shapes


@pytest.mark.parametrize("token_accuracy", [False, True])
def test_trainer_evaluate_with_metrics_as_unpatched(tmp_path, token_accuracy):
    # run_clm's metrics: the argmax of the logits (preprocess_logits_for_metrics), then the accuracy of the shifted
    # predictions over the counted labels
    def preprocess_logits_for_metrics(logits, labels):
        return (logits[0] if isinstance(logits, tuple) else logits).argmax(dim=-1)

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        labels, preds = labels[:, 1:].reshape(-1), preds[:, :-1].reshape(-1)
        counted = labels != -100
        return {"accuracy": float((preds[counted] == labels[counted]).mean())}

    ids, labels = batch("cpu", rows=8)
    data = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                                          use_cpu=True)  # fmt: skip

    def evaluate(model, **metrics):
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=data, **metrics)
        return trainer.evaluate()

    ref = tiny_model("llama")
    metrics = dict(compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    want = evaluate(copy.deepcopy(ref), **metrics)
    model = apply(copy.deepcopy(ref), token_accuracy=token_accuracy)
    built = logits_built_by(model)
    got = evaluate(model, **metrics)
    assert got["eval_accuracy"] == want["eval_accuracy"] and 0.0 <= want["eval_accuracy"] <= 1.0
    torch.testing.assert_close(got["eval_loss"], want["eval_loss"])
    assert built, "evaluation with metrics built no logits"
    # prediction_loss_only (no compute_metrics): the fused loss, no logits built
    built.clear()
    loss_only = evaluate(model)
    assert built == []
    torch.testing.assert_close(loss_only["eval_loss"], want["eval_loss"])


def test_trainer_torch_compile_runs_the_patched_model_without_graph_breaks(tmp_path):
    from torch._dynamo.utils import counters

    ids, labels = batch("cpu", rows=8)
    data = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]
    environ = dict(os.environ)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], save_strategy="no",
        use_cpu=True, torch_compile=True, torch_compile_backend="aot_eager", logging_steps=1,
    )  # fmt: skip
    torch._dynamo.reset()
    counters.clear()
    model = apply(tiny_model("llama"))
    before = model.lm_head.weight.detach().clone()
    try:
        result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    finally:
        # TrainingArguments(torch_compile=True) sets ACCELERATE_DYNAMO_BACKEND in the environment, where every later
        # Trainer of the process would compile its model too (4.x's label smoother, not finding a causal LM's name
        # under the compiled wrapper, then does not shift the labels): leave the environment and accelerate's state
        # as they were
        os.environ.clear()
        os.environ.update(environ)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    assert torch.isfinite(torch.tensor(result.training_loss)) and not torch.equal(before, model.lm_head.weight)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def compiled_graphs(model, dynamic, *args, **kwargs):
    """(output, graph breaks, graphs) of torch.compile(model)'s first call, counted by dynamo."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, dynamic=dynamic)(*args, **kwargs)
    return out, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("how", ["instance", "class"])
def test_compiled_before_any_eager_call_in_one_graph(how, dynamic):
    # a fresh patched model, compiled first: fullgraph, and no graph break without it (the head is switched
    # where the patch is applied, or, for a class, traced where it is first met)
    ref = tiny_model("llama")
    ids, labels = batch("cpu")
    want = ref(input_ids=ids, labels=labels).loss
    cls = transformers.LlamaForCausalLM
    original = cls.forward
    try:
        fresh = lambda: apply(copy.deepcopy(ref)) if how == "instance" else copy.deepcopy(ref)  # noqa: E731
        if how == "class":
            apply(cls)
        torch._dynamo.reset()
        out = torch.compile(fresh(), fullgraph=True, dynamic=dynamic)(input_ids=ids, labels=labels)
        assert out.logits is None
        torch.testing.assert_close(out.loss, want)
        out, breaks, graphs = compiled_graphs(fresh(), dynamic, input_ids=ids, labels=labels)
        assert (breaks, graphs) == (0, 1)
        torch.testing.assert_close(out.loss, want)
        out.loss.backward()
    finally:
        cls.forward = original


def sdpa_calls_compiled(model, *args, **kwargs):
    """(is_causal, attn_mask given) of every SDPA call in the graph torch.compile(fullgraph=True) traces, and the
    loss."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                calls.append((node.kwargs.get("is_causal"), node.kwargs.get("attn_mask") is not None))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
    return calls, out.loss


def test_keep_causal_sdpa_when_compiled(monkeypatch):
    # Where transformers drops SDPA's causal flag under compile (4.x and 5.x to 5.17 always; 5.24 where dynamo
    # reads torch.compiler.is_exporting() as true, torch before 2.13: made so here), the helper keeps it
    # where nothing is padded, and only there; the loss is the eager one either way.
    from transformers import masking_utils

    from fused_ce.integrations.transformers import keep_causal_sdpa_when_compiled

    original = masking_utils._ignore_causal_mask_sdpa
    if hasattr(masking_utils, "is_torchdynamo_exporting"):
        monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling)
    model = apply(tiny_model("llama"))
    model.config._attn_implementation = "sdpa"
    ids, labels = batch("cpu")
    want = model(input_ids=ids, labels=labels).loss
    padded = torch.ones_like(ids)
    padded[-1, -3:] = 0
    want_padded = model(input_ids=ids, attention_mask=padded, labels=labels).loss
    try:
        calls, loss = sdpa_calls_compiled(model, input_ids=ids, labels=labels)
        assert calls == [(False, True)] * 2  # the explicit mask: what the helper is for
        torch.testing.assert_close(loss, want)
        keep_causal_sdpa_when_compiled()
        keep_causal_sdpa_when_compiled()  # idempotent
        assert masking_utils._ignore_causal_mask_sdpa._fused_ce_original is original
        calls, loss = sdpa_calls_compiled(model, input_ids=ids, labels=labels)
        assert calls == [(True, False)] * 2
        torch.testing.assert_close(loss, want)
        calls, loss = sdpa_calls_compiled(model, input_ids=ids, attention_mask=padded, labels=labels)
        assert calls == [(False, True)] * 2  # padded: the mask stays
        torch.testing.assert_close(loss, want_padded)
        assert model(input_ids=ids, labels=labels).loss.item() == want.item()  # eager unchanged
    finally:
        keep_causal_sdpa_when_compiled(enabled=False)
    assert masking_utils._ignore_causal_mask_sdpa is original
    torch._dynamo.reset()


def test_pickle_and_torch_save_of_a_called_patched_model():
    # a bound method pickles by name: the head's `_head_forward` failed to load and the model's forward would
    # have loaded as the class's own, unpatched
    import io
    import pickle

    ref = tiny_model("llama")
    model = apply(copy.deepcopy(ref))
    ids, labels = batch("cpu")
    want = ref(input_ids=ids, labels=labels).loss
    model(input_ids=ids, labels=labels).loss.backward()  # called: the head switched
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for loaded in (pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)):
        out = loaded(input_ids=ids, labels=labels)
        assert out.logits is None  # still fused_ce's
        torch.testing.assert_close(out.loss, want)
        assert loaded.lm_head.forward.head is loaded.lm_head  # its own head, not the pickled model's


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_return_dict_false_keeps_every_field_at_its_place(family):
    ref = tiny_model(family)
    model = apply(copy.deepcopy(ref))
    ids, labels = batch("cpu")
    for keywords in (dict(return_dict=False), dict(return_dict=False, output_hidden_states=True)):
        want = ref(input_ids=ids, labels=labels, **keywords)
        got = model(input_ids=ids, labels=labels, **keywords)
        assert isinstance(got, tuple) and len(got) == len(want), (len(got), len(want))
        torch.testing.assert_close(got[0], want[0])  # the loss
        assert got[1] is None and want[1].shape[-1] == V  # the logits' place
        assert [type(v) for v in got[2:]] == [type(v) for v in want[2:]]


def test_import_fused_ce_does_not_import_transformers():
    code = "import sys, fused_ce; assert 'transformers' not in sys.modules; print('ok')"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_training_example_runs(tmp_path):
    # examples/train_causal_lm.py on a tiny setting: both runs train and print the comparison table
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [
        "--device",
        "cpu",
        "--steps",
        "12",
        "--vocab",
        "600",
        "--corpus-mib",
        "0.5",
        "--dim",
        "64",
        "--layers",
        "1",
        "--seq",
        "64",
        "--batch",
        "2",
        "--out",
        str(tmp_path),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (the source tree's fused_ce, as this process imports it, however the package was installed)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "train_causal_lm.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| transformers") or line.startswith("| fused")]
    assert len(rows) == 2, out.stdout


def _train(model, tmp_path, **args):
    """A few Trainer steps on a fixed batch: (logged losses, trained parameters)."""
    ids, labels = batch("cpu", rows=8)
    data = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]
    # (SGD: Adam's normalisation would scale float32's rounding of near-zero gradients up to the step size)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        optim="sgd", learning_rate=0.5, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, seed=0, **args,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_label_smoothing_through_the_fused_loss(tmp_path):
    # TrainingArguments(label_smoothing_factor): the Trainer's LabelSmoother would smooth the model's full logits;
    # switched, the fused loss's label_smoothing gives its loss (normalisation over the accumulated batch included)
    ref = tiny_model("llama")
    want_losses, want = _train(copy.deepcopy(ref), tmp_path / "ref", label_smoothing_factor=0.1)
    model = apply(copy.deepcopy(ref))
    built = logits_built_by(model)
    got_losses, got = _train(model, tmp_path / "fused", label_smoothing_factor=0.1)
    assert built == [], "the label smoother's logits were built"
    plain_losses, _ = _train(apply(copy.deepcopy(ref)), tmp_path / "plain")
    assert plain_losses[0] != want_losses[0]  # (the smoothing changes the loss: it is not dropped)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for name, p in want.items():
        difference = (got[name] - p).norm().item()
        assert difference <= 1e-4 * p.norm().item(), (name, difference, p.norm().item())


def test_grad_filter_eps_reaches_the_loss():
    # apply(grad_filter_eps=...): the training loss is the op's with filtering (its loss exact, its gradients those of
    # the live tiles); at 0.5 every non-target entry here is below it, so the gradients are far from the exact ones
    ref = tiny_model("llama")
    ids, labels = batch("cpu")
    model = apply(copy.deepcopy(ref), grad_filter_eps=0.5)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    hidden = ref.model(input_ids=ids).last_hidden_state
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = fused_ce.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), ref.lm_head.weight, shifted.reshape(-1), grad_filter_eps=0.5
    )
    loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-6)
    want, got = grads(ref), grads(model)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    filtered = got["lm_head.weight"].clone()
    model.zero_grad()
    apply(model, grad_filter_eps=0.0)  # (applied again: the setting replaced)
    model(input_ids=ids, labels=labels).loss.backward()
    exact = model.lm_head.weight.grad
    assert (exact - filtered).norm() > 0.1 * exact.norm()
    with pytest.raises(ValueError, match="apply: grad_filter_eps must be a number in"):
        apply(tiny_model("llama"), grad_filter_eps=1.0)


def test_peft_modules_to_save_head_trains_its_copy():
    # PEFT's modules_to_save=["lm_head"] (TRL adds it when a chat template adds tokens): the active copy's weight,
    # its gradient, the original head untouched
    peft = pytest.importorskip("peft", reason="needs peft")
    ref = peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                   modules_to_save=["lm_head"]))  # fmt: skip
    model = apply(copy.deepcopy(ref))
    ids, labels = batch("cpu")
    want, got = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    w_grads, g_grads = grads(ref), grads(model)
    assert w_grads.keys() == g_grads.keys() and any("modules_to_save" in n and "lm_head" in n for n in g_grads)
    assert not any("original_module" in n for n in g_grads)
    for name, g in w_grads.items():
        torch.testing.assert_close(g_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    with model.disable_adapter():  # the original head, as the wrapper runs it then
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)


def test_logits_never_with_compute_metrics_names_the_option(tmp_path):
    ids, labels = batch("cpu", rows=4)
    data = [dict(input_ids=i, labels=lab) for i, lab in zip(ids, labels)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[],
                                          use_cpu=True)  # fmt: skip
    model = apply(tiny_model("llama"), logits="never")
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=data, compute_metrics=lambda p: {"x": 1.0})
    with pytest.raises(ValueError, match='logits="never".*logits="eval"'):
        trainer.evaluate()
    assert "eval_loss" in transformers.Trainer(model=model, args=args, eval_dataset=data).evaluate()  # loss only
