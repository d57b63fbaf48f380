"""A Megatron-Core GPTModel's training step with fused_ce's loss against Megatron's own, on one GPU.

    python benchmarks/bench_megatron.py [--layers 1] [--seq 2048] [--batch 8] [--rounds 3] [--out DIR]

The model: Llama-3-8B's head (hidden 4096, vocabulary 128256, untied), `--layers` decoder layers on Megatron's
local layer spec, bf16 parameters, batch x seq tokens (16384 by default), tensor parallel 1. Each method's step is
the forward with labels and the backward of the mean of the per-token loss (no optimizer); three methods, one model
for Megatron's two losses and one patched copy from the same seed, interleaved round by round:

- Megatron, `cross_entropy_loss_fusion=True, cross_entropy_fusion_impl='native'` (its fused, torch.compile'd loss
  on the float32 logits);
- Megatron, unfused (`tensor_parallel.vocab_parallel_cross_entropy`);
- fused_ce (`fused_ce.integrations.megatron.apply(model)`).

Prints a table (median ms per step, peak GiB allocated during the step beyond what the step starts with, the loss
and its difference from Megatron's), writes bench_megatron.{json,png} to --out.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def build(args, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=128256,
        max_sequence_length=args.seq,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model.cuda()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import fused_ce
    from common import cuda_time_ms, environment
    from fused_ce.integrations.megatron import apply

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    megatron_model, fused_model = build(args), build(args)
    with torch.no_grad():  # (the same weights: CUDA initialization draws from the tracker's running state)
        for mine, theirs in zip(fused_model.parameters(), megatron_model.parameters(), strict=True):
            mine.copy_(theirs)
    apply(fused_model)
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=g)
    labels = torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=g)
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, args.seq)
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda"), 1).expand(
        args.batch, 1, args.seq, args.seq
    )

    def step_of(model, fusion):
        def step():
            model.config.cross_entropy_loss_fusion = fusion
            model.config.cross_entropy_fusion_impl = "native"
            model.zero_grad(set_to_none=True)
            loss = model(tokens, positions, causal, labels=labels)
            loss.mean().backward()
            return loss

        return step

    methods = {
        "Megatron, native fused cross-entropy": step_of(megatron_model, True),
        "Megatron, unfused": step_of(megatron_model, False),
        "fused_ce": step_of(fused_model, False),
    }
    times = {name: [] for name in methods}
    peaks, losses = {}, {}
    for r in range(args.rounds):
        for name, step in methods.items() if r % 2 == 0 else reversed(methods.items()):
            times[name].append(cuda_time_ms(step, args.warmup, args.repeat))
    for name, step in methods.items():
        step()
        megatron_model.zero_grad(set_to_none=True)
        fused_model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        losses[name] = step().detach().float().mean().item()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    reference = losses["Megatron, unfused"]
    tokens_n = args.batch * args.seq
    device = torch.cuda.get_device_name()
    print(f"\nMegatron-Core GPTModel, {args.layers} layer(s), hidden 4096, V 128256, {tokens_n} tokens")
    print(f"({args.batch} x {args.seq}), bf16, one {device}, fused_ce {fused_ce.__file__}")
    print("| method | ms per step (median of rounds) | peak GiB in the step | mean loss | loss - Megatron's |")
    print("|---|---|---|---|---|")
    rows = {}
    for name in methods:
        ms = statistics.median(times[name])
        rows[name] = dict(ms=ms, rounds=times[name], peak_gib=peaks[name], loss=losses[name])
        print(f"| {name} | {ms:.2f} | {peaks[name]:.2f} | {losses[name]:.6f} | {losses[name] - reference:+.2e} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(environment=environment(), args=vars(args), methods=rows)
    (out / "bench_megatron.json").write_text(json.dumps(record, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
    names = list(rows)
    a.barh(names, [rows[n]["ms"] for n in names])
    a.set_xlabel("ms per training step (fwd+bwd)")
    b.barh(names, [rows[n]["peak_gib"] for n in names])
    b.set_xlabel("peak GiB allocated in the step")
    b.set_yticks([])
    fig.suptitle(f"Megatron GPTModel, hidden 4096, V 128256, {tokens_n} tokens, {device}")
    fig.tight_layout()
    fig.savefig(out / "bench_megatron.png", dpi=120)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
