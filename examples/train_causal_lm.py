"""Train a small Llama-architecture model from scratch, with and without fused_ce, and compare.

    pip install transformers matplotlib                      # besides fused_ce: the model, the plot
    python examples/train_causal_lm.py                      # CPU: 40 steps of a small model (README: 27 s, 2 cores)
    python examples/train_causal_lm.py --sft                # the same, the first part of every sequence a prompt
    python examples/train_causal_lm.py --sft --pretrain-steps 300 --steps 300 --grad-filter-eps 0.000244140625
                                                             # fine-tuning, exact and with gradient filtering
    python examples/train_causal_lm.py --device cuda --vocab 128256 --seq 4096 --find-max-batch
    torchrun --nproc_per_node 2 examples/train_causal_lm.py --fsdp --device cuda --vocab 128256 --dim 2048 \
        --layers 16 --seq 4096 --batch 2 --steps 20 --find-max-batch   # FSDP2, a ~1.5B Llama, two GPUs

The text is the Python standard library's own sources (on every machine, no download), tokenised with a
byte-level BPE tokenizer trained on them by the `tokenizers` library. The same model (same initialisation,
same batches) is trained twice: with transformers' loss, and switched to fused_ce in one line
(`fused_ce.integrations.transformers.apply`). A progress bar shows loss, tokens/s and peak memory; at the
end a table (tokens/s, peak memory, final loss) and a PNG of both loss curves (with matplotlib). On a GPU,
`--find-max-batch` also finds the largest batch that fits each way: the memory headroom as a user sees it.
`--sft` trains as supervised fine-tuning does: each sequence begins with a prompt (30-70% of it, at random)
whose labels are -100, so the loss counts the response only (fused_ce then computes the response rows only).
`--pretrain-steps K` first trains the model K steps (fused_ce, other sequences), then each run fine-tunes that
checkpoint; `--grad-filter-eps EPS` adds a run of fused_ce with its opt-in gradient filtering (`apply(model,
grad_filter_eps=EPS)`, meant for fine-tuning: docs/usage.md) and, as the noise it is measured against, an exact
fused_ce run that sees the same number of sequences in another order. The table gives each run's mean distance
from fused_ce's loss per step, and each trained model's loss on 32 other sequences with its difference from
fused_ce's model there (± twice the standard error of that difference over the sequences).
`--fsdp` (under torchrun) trains data-parallel with FSDP2 as torchtitan shards a Llama: each decoder layer, the
lm_head apart, then the root (bf16 parameters, float32 gradient reduction on a GPU); --batch is per rank, tokens/s
the ranks' total, peak memory the largest rank's.
Results go to --out (examples/results/ by default, ignored by git).
"""

import argparse
import copy
import functools
import math
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch


def corpus_files(limit_bytes):
    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return files


def tokenize(vocab, limit_bytes):
    from tokenizers import ByteLevelBPETokenizer

    files = corpus_files(limit_bytes)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train(files, vocab_size=vocab, min_frequency=2, show_progress=False)
    text = "\n".join(Path(f).read_text(errors="replace") for f in files)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    return ids, tokenizer.get_vocab_size()


def attention_heads(dim):
    """(heads, kv heads): heads of 64 dimensions where dim allows (at least one, dividing dim), a quarter as many
    key-value heads (dividing the heads)."""
    heads = max(1, dim // 64)
    while dim % heads:
        heads -= 1
    kv = max(1, heads // 4)
    while heads % kv:
        kv -= 1
    return heads, kv


def make_model(vocab, args, device, dtype):
    import transformers

    heads, kv_heads = attention_heads(args.dim)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


def batches(ids, batch, seq, steps, sft=False, seed=0):
    """(input ids, labels) per step; with `sft`, the labels of each sequence's prompt (its first 30-70%) are -100."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq] for s in starts])
        labels = x.clone()
        if sft:
            prompt = (seq * (0.3 + 0.4 * torch.rand(batch, generator=g))).long()
            labels[torch.arange(seq) < prompt[:, None]] = -100
        yield x, labels


def peak_memory_mib(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's, so the larger of both


def rank_and_world():
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shard(model, device):
    """FSDP2 as torchtitan wraps a Llama: each decoder layer, the lm_head apart, the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {}
    if device == "cuda":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)
    return model


def all_ranks(value, op):
    """value reduced over the ranks (a no-op in one process)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor(float(value), device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.item()


def train(name, model, ids, args, device, data_seed=0):
    import torch.distributed as dist
    from tqdm import tqdm

    rank, world = rank_and_world()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, tokens, start = [], 0, time.perf_counter()
    steps = batches(ids, args.batch, args.seq, args.steps, args.sft, seed=1000 * data_seed + rank)  # each rank its own
    bar = tqdm(steps, total=args.steps, desc=name, leave=True, disable=rank != 0)
    for step, (x, labels) in enumerate(bar):
        x, labels = x.to(device), labels.to(device)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(all_ranks(loss.item(), dist.ReduceOp.SUM) / world)
        tokens += x.numel() * world
        if step % 10 == 0 or step == args.steps - 1:
            rate = tokens / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", peak_mib=f"{peak_memory_mib(device):,.0f}")
    elapsed = time.perf_counter() - start
    peak = all_ranks(peak_memory_mib(device), dist.ReduceOp.MAX)
    return dict(method=name, losses=losses, tokens_per_s=tokens / elapsed, peak_mib=peak)


@torch.no_grad()
def evaluate(model, ids, args, device, sequences=32):
    """The trained model's loss on each of `sequences` other sequences (a seed of their own), in eval mode."""
    model.eval()
    losses = []
    for x, labels in batches(ids, 1, args.seq, sequences, args.sft, seed=2000):
        losses.append(model(input_ids=x.to(device), labels=labels.to(device)).loss.item())
    model.train()
    return losses


@torch.no_grad()
def tiles_below(model, ids, args, device, eps, rows=64, cols=128, sequences=32):
    """The share of the logits' gradient tiles (rows x cols, over the counted rows of the other sequences) whose
    entries, the targets' aside, are all below eps: the work gradient filtering skips (docs/usage.md)."""
    model.eval()
    row_maxima = []  # each counted row's largest entry in each column tile (a sequence at a time: bounded memory)
    for x, labels in batches(ids, 1, args.seq, sequences, args.sft, seed=2000):
        logits = model(input_ids=x.to(device)).logits[0, :-1].float()
        targets = labels[0, 1:].to(device)
        counted = targets != -100
        p = logits[counted].softmax(-1)
        p[torch.arange(len(p), device=device), targets[counted]] = 0
        p = torch.nn.functional.pad(p, (0, -p.shape[1] % cols))
        row_maxima.append(p.view(len(p), -1, cols).amax(2))
    maxima = torch.cat(row_maxima)
    maxima = torch.nn.functional.pad(maxima, (0, 0, 0, -len(maxima) % rows))
    live = maxima.view(-1, rows, maxima.shape[1]).amax(1) >= eps
    model.train()
    return 1 - live.float().mean().item()


def fits(make, batch, args, device):
    """Whether one training step at this batch fits in the GPU's memory (on every rank: they run alike, so each
    reaches an out-of-memory error at the same allocation, before the collective that would wait for it)."""
    import torch.distributed as dist

    model = make()
    try:
        x, labels = next(
            batches(torch.randint(0, model.config.vocab_size, (4 * args.seq,)), batch, args.seq, 1, args.sft)
        )
        model(input_ids=x.to(device), labels=labels.to(device)).loss.backward()
        torch.cuda.synchronize()
        fitted = True
    except torch.cuda.OutOfMemoryError:
        fitted = False
    finally:
        del model
        torch.cuda.empty_cache()
    return bool(all_ranks(fitted, dist.ReduceOp.MIN))


def max_batch(make, args, device):
    low, high = 0, 1
    while fits(make, high, args, device):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(make, mid, args, device) else (low, mid)
    return low


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size to train")
    parser.add_argument("--corpus-mib", type=float, default=2.0, help="MiB of stdlib sources to tokenise")
    parser.add_argument("--dim", type=int, default=128, help="model width (heads of 64 where it allows)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--sft", action="store_true", help="prompt-masked labels: the loss counts responses only")
    parser.add_argument("--pretrain-steps", type=int, default=0, help="steps trained before the runs fine-tune it")
    parser.add_argument(
        "--grad-filter-eps", type=float, default=0.0, help="also a run of fused_ce with this gradient filtering"
    )
    parser.add_argument("--find-max-batch", action="store_true", help="GPU: the largest batch that fits each way")
    parser.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2, per layer and the lm_head apart")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="table and plot go here")
    args = parser.parse_args()
    if args.fsdp and args.pretrain_steps:
        sys.exit("--pretrain-steps runs in one process (not with --fsdp)")

    from fused_ce.integrations.transformers import apply

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.fsdp:
        import os

        import torch.distributed as dist

        if "LOCAL_RANK" not in os.environ:
            sys.exit("--fsdp runs under torchrun: torchrun --nproc_per_node N examples/train_causal_lm.py --fsdp ...")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        dtype = torch.float32  # (FSDP2's policy computes in bf16 on a GPU; the parameters it keeps stay float32)
    rank, world = rank_and_world()
    ids, learned = tokenize(args.vocab, int(args.corpus_mib * 2**20))
    # A small corpus learns fewer merges than asked for; the model keeps the size asked for (its unused rows
    # are like Llama 3's reserved tokens), so the output layer has the shape being measured.
    vocab = max(learned, args.vocab)
    if rank == 0:
        print(
            f"corpus: {len(ids):,} tokens, BPE vocabulary {learned:,}, model vocabulary {vocab:,}; model dim "
            f"{args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, {device} {dtype}"
            + (", prompt-masked (SFT)" if args.sft else "")
            + (f", fine-tuning from {args.pretrain_steps} steps" if args.pretrain_steps else "")
            + (f", FSDP2 on {world} ranks (per layer, the lm_head apart)" if args.fsdp else "")
        )

    def build(patch):
        model = patch(make_model(vocab, args, device, dtype))
        return shard(model, device) if args.fsdp else model

    heads = [("transformers", lambda m: m, 0), ("fused_ce", apply, 0)]  # (name, switch, the batches' seed)
    if args.grad_filter_eps:
        filtered = functools.partial(apply, grad_filter_eps=args.grad_filter_eps)
        heads.append((f"fused_ce grad_filter_eps={args.grad_filter_eps:g}", filtered, 0))
        heads.append(("fused_ce, the batches in another order", apply, 1))
    if args.fsdp:  # each run builds and shards its own model (the same initialisation)
        runs = [train(name, build(patch), ids, args, device, seed) for name, patch, seed in heads]
    else:
        base = make_model(vocab, args, device, dtype)
        if args.pretrain_steps:  # (other sequences than the runs': a seed of their own)
            pretrained = apply(copy.deepcopy(base))
            steps = argparse.Namespace(**{**vars(args), "steps": args.pretrain_steps, "sft": False})
            train("pretraining", pretrained, ids, steps, device, data_seed=1000)
            base.load_state_dict(pretrained.state_dict())
            del pretrained
        start_tiles = tiles_below(base, ids, args, device, args.grad_filter_eps) if args.grad_filter_eps else None
        runs = []
        for name, patch, seed in heads:
            model = patch(copy.deepcopy(base))
            runs.append(train(name, model, ids, args, device, seed))
            runs[-1]["eval"] = evaluate(model, ids, args, device)
            if args.grad_filter_eps and name == "fused_ce":
                runs[-1]["tiles_below"] = tiles_below(model, ids, args, device, args.grad_filter_eps)
            del model
        del base
    if args.find_max_batch and device == "cuda":
        torch.cuda.empty_cache()
        for run, (_, patch, _) in zip(runs, heads):
            run["max_batch"] = max_batch(lambda p=patch: build(p), args, device)
    if rank != 0:
        return

    table = [
        "| method | tokens/s | peak memory MiB | final loss (mean of last 10) | mean distance from fused_ce's loss "
        "| loss on other sequences | its difference from fused_ce's (± 2 SE) |"
        + (" largest batch |" if args.find_max_batch else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if args.find_max_batch else ""),
    ]
    fused = runs[1]
    for r in runs:
        last = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        distance = sum(abs(a - b) for a, b in zip(r["losses"], fused["losses"])) / len(fused["losses"])
        cells = ["-", "-"]  # (FSDP's runs are not evaluated)
        if "eval" in r:
            difference = torch.tensor(r["eval"]) - torch.tensor(fused["eval"])
            spread = 2 * difference.std().item() / math.sqrt(len(difference))
            cells = [f"{sum(r['eval']) / len(r['eval']):.4f}", f"{difference.mean().item():+.4f} ± {spread:.4f}"]
        if r is fused:
            cells[1], distance = "-", None
        extra = f" {r['max_batch']} |" if "max_batch" in r else ""
        table.append(
            f"| {r['method']} | {r['tokens_per_s']:,.0f} | {r['peak_mib']:,.0f} | {last:.4f} | "
            + ("-" if distance is None else f"{distance:.4f}")
            + f" | {cells[0]} | {cells[1]} |{extra}"
        )
    if args.grad_filter_eps and not args.fsdp:
        table.append(
            f"(gradient tiles of 64 x 128 whose entries, the targets' aside, are all below {args.grad_filter_eps:g} on "
            f"the other sequences: {start_tiles:.1%} before the runs, {runs[1]['tiles_below']:.1%} after fused_ce's)"
        )
    if device == "cpu":
        table.append("(CPU peak memory is the process's resident peak, shared by the runs: see the GPU figures)")
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    header = (
        f"{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}; `{' '.join(sys.argv)}`; "
        f"{len(ids):,} tokens, model vocabulary {vocab:,}, {args.layers} layers, dim {args.dim}, seq {args.seq}, "
        f"batch {args.batch}, {args.steps} steps, {dtype}"
        + (", prompt-masked (SFT: 30-70% of each sequence)" if args.sft else "")
        + (f", fine-tuning from {args.pretrain_steps} steps of fused_ce" if args.pretrain_steps else "")
        + (f", FSDP2 on {world} ranks (batch and peak memory per rank)" if args.fsdp else "")
    )
    print("\n" + header + "\n\n" + "\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (
        f"train_causal_lm_{device}{'_sft' if args.sft else ''}{f'_fsdp{world}' if args.fsdp else ''}"
        + (f"_ft{args.pretrain_steps}" if args.pretrain_steps else "")
        + ("_filtered" if args.grad_filter_eps else "")
    )
    (out / f"{name}.md").write_text(header + "\n\n" + "\n".join(table) + "\n")
    plot(runs, out / f"{name}.png", args)


def plot(runs, path, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(r["losses"], label=r["method"], alpha=0.8)
    ax.set(
        xlabel="step",
        ylabel="loss",
        title=f"Llama-style, {args.layers} layers, dim {args.dim}, seq {args.seq}",
        ylim=(0, math.ceil(max(max(r["losses"]) for r in runs))),
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
