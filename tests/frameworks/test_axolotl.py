"""fused_ce.integrations.axolotl's plugin with axolotl installed (its own CI stage: axolotl 0.21 needs Python >= 3.12
and pins torch and transformers of its own). On the CPU: a tiny Llama trained by axolotl from a config, with and
without the plugin (also with LoRA on the lm_head, dropout included), gives the same losses, its lm_head never
returning logits with it; a config that also enables Liger's fused linear cross-entropy or Cut Cross-Entropy is
refused, naming both; examples/axolotl.yml validates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

# axolotl's telemetry would try the network (none here) at every config it loads
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEXT = "the cat sat on the mat and the dog ate the bone while the bird sang a song " * 20


class LogitsCounterPlugin:
    """A second plugin (loaded by axolotl as ``test_axolotl.LogitsCounterPlugin``): counts the lm_head calls that
    return [batch, seq, V] logits, in a file the test reads."""

    def __new__(cls):
        from axolotl.integrations.base import BasePlugin

        class Counter(BasePlugin):
            def post_model_load(self, cfg, model):
                path = Path(cfg.output_dir) / "logits_calls.json"
                calls = []

                def hook(module, args, out):
                    if torch.is_tensor(out) and out.dim() == 3:
                        calls.append(list(out.shape))
                        path.write_text(json.dumps(calls))

                model.get_output_embeddings().register_forward_hook(hook)
                path.write_text("[]")

        return Counter()


def _model_and_data(root):
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT], vocab_size=300, min_frequency=1, special_tokens=["<pad>", "<eos>", "<bos>"])
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    words = TEXT.split()
    with open(root / "data.jsonl", "w") as f:
        for i in range(32):
            f.write(json.dumps({"text": " ".join(words[i : i + 12 + i % 5])}) + "\n")


def _config(root, run, plugins, **extra):
    return dict(
        base_model=str(root / "model"), sequence_len=64,
        datasets=[dict(path=str(root / "data.jsonl"), ds_type="json", type="completion")], micro_batch_size=4,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2,
        optimizer="adamw_torch", lr_scheduler="constant", output_dir=str(root / run), val_set_size=0,
        dataset_prepared_path=str(root / run / "prepared"), logging_steps=1, dataset_num_proc=1,
        save_strategy="no", bf16=False, fp16=False, tf32=False, seed=0, dataloader_num_workers=0, plugins=plugins,
        **extra,
    )  # fmt: skip


TRAIN = """
import json, sys
from axolotl.cli.args import TrainerCliArgs
from axolotl.cli.config import load_cfg
from axolotl.common.datasets import load_datasets
from axolotl.train import train
cfg = load_cfg(sys.argv[1])
model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg, cli_args=TrainerCliArgs()))
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # (a PEFT model's, with adapters)
print("RESULT " + json.dumps(dict(losses=losses, switched=hasattr(causal_lm.forward, "_fused_ce_original"))))
"""


def _train(root, run, plugins, **extra):
    """axolotl's own training (load_cfg, load_datasets, train) from a config file, in a process of its own (axolotl's
    plugin manager is one per process): (losses, whether the model's forward was switched, logits calls)."""
    path = root / f"{run}.yml"
    path.write_text(yaml.dump(_config(root, run, plugins, **extra)))
    env = dict(
        os.environ, AXOLOTL_DO_NOT_TRACK="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run([sys.executable, "-c", TRAIN, str(path)], capture_output=True, text=True, env=env, cwd=root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    return result["losses"], result["switched"], json.loads((root / run / "logits_calls.json").read_text())


# LoRA as axolotl sets it up, on the lm_head too, with dropout: the head's adapter is the loss's low-rank term, its
# dropout masks drawn where the head's own call draws them (both runs seeded alike)
LORA = dict(
    adapter="lora", lora_r=4, lora_alpha=8, lora_dropout=0.1, lora_target_modules=["q_proj", "v_proj", "lm_head"]
)


@pytest.mark.parametrize("extra", [{}, LORA], ids=["full", "lora-with-lm-head"])
def test_plugin_trains_as_axolotl_does(tmp_path, extra):
    _model_and_data(tmp_path)
    counter = "test_axolotl.LogitsCounterPlugin"
    want, switched, want_logits = _train(tmp_path, "axolotl", [counter], **extra)
    plugins = ["fused_ce.integrations.axolotl.FusedCEPlugin", counter]
    got, fused, got_logits = _train(tmp_path, "fused_ce", plugins, **extra)
    assert not switched and fused
    assert len(want) == 3 and want_logits, "axolotl's own run built no logits: the counter is not counting"
    assert got_logits == [], got_logits
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "other",
    [
        ("axolotl.integrations.liger.LigerPlugin", dict(liger_fused_linear_cross_entropy=True), "Liger"),
        ("axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin", dict(bf16=True), "Cut Cross-Entropy"),
    ],
    ids=["liger", "cut_cross_entropy"],
)
def test_another_fused_head_is_refused_naming_both(tmp_path, other):
    from axolotl.cli.config import load_cfg
    from axolotl.integrations.base import PluginManager

    plugin, keys, name = other
    config = _config(tmp_path, "run", ["fused_ce.integrations.axolotl.FusedCEPlugin", plugin])
    config.update(keys)
    _model_and_data(tmp_path)
    path = tmp_path / "config.yml"
    path.write_text(yaml.dump(config))
    cfg = load_cfg(str(path))
    with pytest.raises(ValueError, match=f"FusedCEPlugin.*{name}"):
        PluginManager.get_instance().pre_model_load(cfg)


def test_example_config_validates():
    # examples/axolotl.yml: axolotl's own validation accepts it, the plugin's keys included
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    from fused_ce.integrations.axolotl import FusedCEArgs

    example = yaml.safe_load((REPO / "examples" / "axolotl.yml").read_text())
    assert "fused_ce.integrations.axolotl.FusedCEPlugin" in example["plugins"]
    FusedCEArgs(**{k: v for k, v in example.items() if k.startswith("fused_ce_")})
    from axolotl.cli.config import prepare_plugins

    cfg = DictDefault(example)
    prepare_plugins(cfg)
    validated = validate_config(cfg)
    assert validated.fused_ce_logits == example.get("fused_ce_logits", "eval")
