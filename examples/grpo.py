"""GRPO with TRL on a randomly initialised causal LM with Qwen2's 151,936-token vocabulary, three ways.

    pip install trl matplotlib                                  # besides fused_ce (trl brings transformers)
    python examples/grpo.py --device cuda                       # one H200: every setting, the largest batch each fits
    python examples/grpo.py --device cpu --settings trl,fused_ce  # a CPU: a small model, one batch (~2 minutes)
    python examples/grpo.py --settings trl,fused_ce --batches 16 --steps 3   # a fixed batch, no search

The settings: TRL as it comes ("trl": from TRL 1.15 its chunked fused head for the log-probs, the loss in torch;
before, materialised logits), TRL with `use_liger_kernel=True` ("liger": Liger-Kernel's LigerFusedLinearGRPOLoss,
TRL 1.0 to 1.12; 1.13 dropped it, so run that setting with such a TRL), and fused_ce in one line
("fused_ce": `fused_ce.integrations.trl.apply()`, the log-probs from linear_log_probs and the loss from
linear_policy_loss). The model is a small Qwen2 (--layers of --hidden) under the real vocabulary, so the
lm_head is a large part of the work; prompts are random token strings, completions run to
--completion-length (a random model rarely stops), the reward is a toy. Each setting runs at each batch of
--batches (prompts × generations, until one is out of memory), --steps steps each, each run in a process of its
own (none inherits another's warm-up); the first step warms up and is not counted.
The table gives, at the largest batch each setting fits, the time per training step (generation included, and
the part that is not generation), tokens/s and peak memory (on a CPU the run's peak resident memory, the model's
included); a PNG plots them (with matplotlib). Results go to --out.
"""

import argparse
import cProfile
import gc
import io
import json
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SETTINGS = ("trl", "liger", "fused_ce")


def word_tokenizer(vocab):
    """A tokenizer with `vocab` tokens t0 ... (no download): generation decodes whatever the model samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 2)}
    words["<pad>"], words["<eos>"] = vocab - 2, vocab - 1
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def make_model(args, tokenizer, path):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
        max_position_embeddings=args.prompt_length + args.completion_length + 8, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def prompts(args, count):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab - 2, (count, args.prompt_length), generator=g)
    return [" ".join(f"t{i}" for i in row.tolist()) for row in ids]


def reward_low_ids(completions, **kwargs):  # a toy reward: the fraction of tokens among the first thousand
    return [sum(int(w[1:]) < 1000 for w in c.split() if w[1:].isdigit()) / max(1, len(c.split())) for c in completions]


class StepTimer:
    """Wall time of each training step and of its generation (TRL's _generate), synchronised."""

    def __init__(self, device):
        self.device, self.steps, self.generation = device, [], []

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *a, **k):
                timer.sync()
                timer.begin, timer.generation_in_step = time.perf_counter(), 0.0

            def on_step_end(self, *a, **k):
                timer.sync()
                timer.steps.append(time.perf_counter() - timer.begin)
                timer.generation.append(timer.generation_in_step)

        return Callback()

    def wrap_generate(self, trainer):
        generate = trainer._generate

        def timed(*a, **k):
            self.sync()
            begin = time.perf_counter()
            out = generate(*a, **k)
            self.sync()
            self.generation_in_step += time.perf_counter() - begin
            return out

        trainer._generate = timed


def run(setting, batch, args, model_path, tokenizer):
    """One setting at one batch: a dict of figures, or None when it ran out of memory."""
    import datasets
    import trl

    from fused_ce.integrations import trl as fused_trl

    if setting == "fused_ce":
        fused_trl.apply()
    elif hasattr(trl.trainer.utils, "add_fused_lm_head"):
        fused_trl.restore()
    config = trl.GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=batch,
        num_generations=args.generations, max_completion_length=args.completion_length, max_steps=args.steps,
        beta=args.beta, loss_type=args.loss_type, learning_rate=1e-6, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=args.device == "cpu", bf16=args.device == "cuda", seed=0,
        use_liger_kernel=setting == "liger", disable_tqdm=True,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": prompts(args, batch * args.steps // args.generations + 1)})
    timer = StepTimer(args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = trl.GRPOTrainer(model=model_path, reward_funcs=reward_low_ids, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[timer.callback()])  # fmt: skip
        timer.wrap_generate(trainer)
        trainer.train()
    except torch.OutOfMemoryError:
        return None
    finally:
        trainer = None
        gc.collect()
    measured = slice(1, None) if len(timer.steps) > 1 else slice(None)  # the first step warms up
    step = sum(timer.steps[measured]) / len(timer.steps[measured])
    generation = sum(timer.generation[measured]) / len(timer.generation[measured])
    tokens = batch * (args.prompt_length + args.completion_length)
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:  # this run's process's peak resident memory (each run has a process of its own), KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return dict(setting=setting, batch=batch, step_s=step, train_s=step - generation, tokens_per_s=tokens / step,
                train_tokens_per_s=tokens / (step - generation), peak_gib=peak)  # fmt: skip


def one_run(setting, batch, args, model_path):
    """run() in this process (the child of main's loop), cProfiled with --profile."""
    tokenizer = transformers_tokenizer(model_path)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    result = run(setting, batch, args, model_path, tokenizer)
    if profiler:
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(30)
        (Path(args.out) / f"profile_{setting}_{batch}.txt").write_text(text.getvalue())
    return result


def transformers_tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def plot(best, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    names = [r["setting"] for r in best]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("batch", "train_tokens_per_s", "peak_gib"),
                              ("largest batch that fits", "training tokens/s (generation excluded)",
                               "peak memory at that batch (GiB)")):  # fmt: skip
        ax.bar(names, [r[key] for r in best], color=["#888", "#c66", "#36c"][: len(best)])
        ax.set_title(label, fontsize=10)
    fig.suptitle(f"GRPO with TRL, vocabulary {best[0]['vocab']:,}", fontsize=11)
    fig.tight_layout()
    name = Path(out) / f"grpo_{'_'.join(names)}.png"
    fig.savefig(name, dpi=120)
    print(f"plot: {name}")


# The sizes a setting runs at unless given: on a GPU the batch search up to what fits, on a CPU a small model and one
# batch that takes a minute or two (the vocabulary stays Qwen2's: the head is the point).
DEFAULT_SIZES = {
    "cuda": dict(batches="32,64,128,256,512,1024", hidden=1024, layers=4, prompt_length=64, completion_length=192,
                 generations=8),
    "cpu": dict(batches="8", hidden=64, layers=2, prompt_length=16, completion_length=24, generations=4),
}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="%(default)s")
    parser.add_argument(
        "--batches", help="completions per step, tried in order until one is out of memory (by device: see below)"
    )
    parser.add_argument("--vocab", type=int, default=151936, help="%(default)s (Qwen2's)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--prompt-length", type=int)
    parser.add_argument("--completion-length", type=int)
    parser.add_argument("--generations", type=int, help="per prompt")
    parser.add_argument("--steps", type=int, default=3, help="per batch, the first a warm-up (%(default)s)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (%(default)s)")
    parser.add_argument("--loss-type", default="dapo", help="%(default)s (TRL's default)")
    parser.add_argument("--profile", action="store_true", help="cProfile each run: profile_<setting>_<batch>.txt")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "grpo"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "setting:batch:model path": one run, in this process
    parser.epilog = "Defaults by device: " + "; ".join(
        f"{device}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
        for device, sizes in DEFAULT_SIZES.items()
    )
    args = parser.parse_args()
    for name, value in DEFAULT_SIZES["cpu" if args.device == "cpu" else "cuda"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.one:
        setting, batch, model_path = args.one.split(":", 2)
        print("RESULT " + json.dumps(one_run(setting, int(batch), args, model_path)))
        return
    settings = [s for s in args.settings.split(",") if s]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        sys.exit(f"unknown settings {sorted(unknown)}: choose among {SETTINGS}")
    if "liger" in settings:
        import trl.trainer.grpo_trainer

        if not hasattr(trl.trainer.grpo_trainer, "LigerFusedLinearGRPOLoss"):
            sys.exit(
                f"--settings liger: TRL {__import__('trl').__version__} has no Liger GRPO loss (TRL 1.0-1.12 with "
                "liger-kernel installed have it)"
            )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(args.vocab)
    best, every = [], []
    with tempfile.TemporaryDirectory() as model_path:
        make_model(args, tokenizer, model_path)
        for setting in settings:
            fitted = None
            for batch in (int(b) for b in args.batches.split(",")):
                # each run in a process of its own: none inherits another's warm-up (kernels loaded, cuBLAS's
                # and the allocator's state), whatever the order
                child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one",
                                        f"{setting}:{batch}:{model_path}"], capture_output=True, text=True)  # fmt: skip
                lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
                if child.returncode != 0 or not lines:
                    sys.exit(f"{setting} at batch {batch} failed:\n{child.stderr[-3000:]}")
                result = json.loads(lines[-1][len("RESULT ") :])
                status = "out of memory" if result is None else (
                    f"{result['step_s'] * 1e3:.0f} ms/step ({result['train_s'] * 1e3:.0f} ms training), "
                    f"{result['peak_gib']:.1f} GiB")  # fmt: skip
                print(f"{setting:9s} batch {batch:5d}: {status}", flush=True)
                if result is None:
                    break
                result["vocab"] = args.vocab
                every.append(result)
                fitted = result
            if fitted is not None:
                best.append(fitted)
    results = Path(args.out) / f"grpo_{args.settings.replace(',', '_')}.json"
    results.write_text(json.dumps(dict(args=vars(args), runs=every), indent=1))
    import trl

    print(
        f"\nGRPO, TRL {trl.__version__}, vocab {args.vocab}, Qwen2 {args.layers}x{args.hidden}, "
        f"prompt {args.prompt_length} + completion {args.completion_length} tokens, beta {args.beta}, "
        f"loss {args.loss_type}, {args.device}"
    )
    print("| setting | largest batch | step (ms) | of it training (ms) | tokens/s | training tokens/s | peak (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in best:
        print(
            f"| {r['setting']} | {r['batch']} | {r['step_s'] * 1e3:.0f} | {r['train_s'] * 1e3:.0f} | "
            f"{r['tokens_per_s']:,.0f} | {r['train_tokens_per_s']:,.0f} | {r['peak_gib']:.1f} |"
        )
    if best:
        plot(best, args.out)


if __name__ == "__main__":
    main()
