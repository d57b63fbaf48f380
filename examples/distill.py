"""On-policy distillation with TRL's DistillationTrainer: a small random student from a larger random teacher,
TRL's own loss beside fused_ce's, on one machine.

    pip install trl matplotlib                                  # besides fused_ce (trl brings transformers)
    python examples/distill.py                                  # CPU: a small vocabulary, a few steps
    python examples/distill.py --device cuda --vocab 128256 --student-hidden 1024 --teacher-hidden 2048 --batch 32

Both models are Qwen2s under one vocabulary (the student --student-layers of --student-hidden, the teacher twice
as deep and --teacher-hidden wide), random: the teacher is a fixed random distribution (its head scaled by
--teacher-sharpness, so far from uniform) that the student is trained towards on its own completions of random
prompts (TRL's on-policy distillation: the student generates, then the divergence, generalised JSD at --beta, is
taken on the completion tokens). Each setting trains the same student for --steps steps from the same seed, in
this one process: "trl" with TRL's ChunkedDivergenceFunction, "fused_ce" with `fused_ce.integrations.trl.apply()`
(fused_ce.linear_distillation_loss). Prints each one's first and last loss, the time per step (generation
included, the first step too) and the peak memory (CUDA), writes the losses to --out/distill.json and plots them
to --out/distill.png.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from grpo import word_tokenizer


def save_model(path, tokenizer, vocab, hidden, layers, seed, length, head_scale=1.0):
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=1, max_position_embeddings=length,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # a teacher far from uniform: a divergence worth learning
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train(setting, args, student, teacher, tokenizer):
    import datasets
    import trl

    from fused_ce.integrations import trl as fused_trl

    if setting == "fused_ce":
        fused_trl.apply()
    try:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, args.vocab - 2, (args.batch * args.steps, args.prompt_length), generator=g)
        data = datasets.Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row.tolist()) for row in ids]})
        config = trl.DistillationConfig(
            output_dir=str(args.out / setting), per_device_train_batch_size=args.batch, max_steps=args.steps,
            learning_rate=args.lr, logging_steps=1, report_to=[], use_cpu=args.device == "cpu", seed=0,
            save_strategy="no", bf16=args.device == "cuda", beta=args.beta,
            max_completion_length=args.completion_length,
        )  # fmt: skip
        trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=data,
                                          processing_class=tokenizer)  # fmt: skip
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - begin
    finally:
        if setting == "fused_ce":
            fused_trl.restore()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    return dict(losses=losses, seconds_per_step=seconds / args.steps, peak_gib=peak)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--student-hidden", type=int, default=64)
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--teacher-hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--teacher-sharpness", type=float, default=4.0, help="the teacher's head scaled by this")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--settings", default="trl,fused_ce")
    parser.add_argument("--out", type=Path, default=Path("distill_out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(args.vocab)
    length = args.prompt_length + args.completion_length + 8
    results = {}
    with tempfile.TemporaryDirectory() as models:
        student = save_model(Path(models) / "student", tokenizer, args.vocab, args.student_hidden,
                             args.student_layers, 0, length)  # fmt: skip
        teacher = save_model(Path(models) / "teacher", tokenizer, args.vocab, args.teacher_hidden,
                             2 * args.student_layers, 1, length, head_scale=args.teacher_sharpness)  # fmt: skip
        for setting in args.settings.split(","):
            results[setting] = train(setting, args, student, teacher, tokenizer)
    print("| setting | first loss | last loss | s per step | peak GiB |\n|---|---|---|---|---|")
    for setting, r in results.items():
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {setting} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {r['seconds_per_step']:.3f} | {peak} |")
    (args.out / "distill.json").write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()},
                                                           results=results), indent=1))  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for setting, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=setting)
    ax.set_xlabel("step")
    ax.set_ylabel(f"generalised JSD (beta {args.beta})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "distill.png", dpi=120)
    print(f"plot: {args.out / 'distill.png'}")


if __name__ == "__main__":
    main()
