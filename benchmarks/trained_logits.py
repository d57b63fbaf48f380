"""The head's inputs of a trained model against random ones: what decides gradient sparsity, and every method's time.

    python benchmarks/trained_logits.py                       # on a GPU: corpus, BPE, a few minutes' training, table
    python benchmarks/trained_logits.py --minutes 8 --vocab 200000
    python benchmarks/trained_logits.py --device cpu --corpus-mib 1 --vocab 2000 --dim 64 --layers 1 \\
        --seq 64 --batch 8 --minutes 0.2 --rows 512 --methods fused_ce,torch eager   # a smoke run

Random hidden states give a nearly uniform softmax; a trained model's puts almost all of a row's probability on a
few tokens, so that most entries of the logit gradient (softmax - one-hot) fall below bf16's resolution (what Cut
Cross-Entropy's filter_eps skips). This script builds such a head from text available without a network:

1. a corpus of the Python standard library's sources and the installed packages' documentation (README/markdown/
   reStructuredText files and their metadata), every 50th file held out;
2. a byte-level BPE vocabulary trained on it by `tokenizers`, as large as --vocab or as the corpus allows (V is
   reported);
3. a small causal transformer trained for --minutes on the rest (its loss through fused_ce), then its final hidden
   states, head weight and next-token targets for --rows held-out tokens (saved as trained_head.pt);
4. the statistics that decide sparsity: each token's entropy and target probability, and the fraction of
   [rows x classes] tiles of |softmax - one-hot| entirely below 2^-12, in the vocabulary's own order and sorted by
   the tokens' training frequency;
5. every installed method's forward + backward time and workspace on those inputs and on random ones of the same
   shape (x ~ N(0, 1), W ~ N(0, 1/D)), every row counted and 10% ignored, interleaved in rounds.

Prints the tables, writes trained_logits.json and trained_logits.png to --out.
"""

import argparse
import hashlib
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
from bench import available_methods

import fused_ce
from common import cuda_time_ms, environment, grouped_bars, make_inputs, workspace_gib

SPARSE_BELOW = 2.0**-12  # bf16's resolution at 1: gradient entries below it vanish beside the target's


def corpus_files():
    """The standard library's sources, then the installed packages' documentation: (path, text) in a fixed order."""
    paths = sysconfig.get_paths()
    stdlib, site = Path(paths["stdlib"]), {Path(paths["purelib"]), Path(paths["platlib"])}
    sources = sorted(p for p in stdlib.rglob("*.py") if not any(s in p.parents for s in site))
    docs = sorted(
        p
        for root in sorted(site)
        for pattern in ("*.md", "*.rst", "*.txt", "METADATA")
        for p in root.rglob(pattern)
        if "LICENSE" not in p.name.upper() and "RECORD" not in p.name
    )
    for path in sources + docs:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield path, text


def load_corpus(mib):
    """(training texts, held-out texts) of about `mib` MiB in all; a file is held out by its path's hash (1 in 50)."""
    train, held_out, size = [], [], 0
    for path, text in corpus_files():
        held = int(hashlib.sha1(str(path).encode()).hexdigest(), 16) % 50 == 0
        (held_out if held else train).append(text)
        size += len(text)
        if size >= mib * 2**20:
            break
    return train, held_out, size


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer, texts):
    ids = [i for enc in tokenizer.encode_batch(texts) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.long)


class CausalLM(nn.Module):
    """A pre-norm transformer: embeddings, causal self-attention blocks (torch's own), a final norm, the head."""

    def __init__(self, V, dim, layers, heads, seq):
        super().__init__()
        self.embed = nn.Embedding(V, dim)
        self.position = nn.Embedding(seq, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, V, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)

    def hidden(self, ids):
        T = ids.shape[1]
        h = self.embed(ids) + self.position(torch.arange(T, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=ids.device)
        return self.norm(self.blocks(h, mask=mask, is_causal=True))


def train_model(stream, V, args, device):
    """The model after --minutes of AdamW on random windows of the stream; (model, steps, last losses)."""
    torch.manual_seed(0)
    model = CausalLM(V, args.dim, args.layers, args.heads, args.seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    start, steps, losses = time.perf_counter(), 0, []
    g = torch.Generator().manual_seed(0)
    while time.perf_counter() - start < args.minutes * 60:
        begins = torch.randint(0, len(stream) - args.seq - 1, (args.batch,), generator=g)
        window = torch.stack([stream[b : b + args.seq + 1] for b in begins.tolist()]).to(device)
        warm = min(1.0, (steps + 1) / 100)  # a short warm-up of the learning rate
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm
        with autocast:
            h = model.hidden(window[:, :-1])
            loss = fused_ce.linear_cross_entropy(h.flatten(0, 1), model.head.weight, window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        steps += 1
        losses.append(loss.item())
    return model, steps, losses[-20:]


@torch.no_grad()
def held_out_head(model, stream, rows, seq, device, dtype):
    """(x [rows, D], W [V, D], targets [rows]) of held-out windows: the final hidden states and next tokens."""
    xs, ts = [], []
    for b in range(0, len(stream) - seq - 1, seq):
        window = stream[b : b + seq + 1].to(device)[None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            xs.append(model.hidden(window[:, :-1])[0].to(dtype))
        ts.append(window[0, 1:])
        if sum(len(t) for t in ts) >= rows:
            break
    x, t = torch.cat(xs)[:rows].contiguous(), torch.cat(ts)[:rows].contiguous()
    if len(t) < rows:
        print(f"held-out text gives {len(t)} rows, not {rows}", file=sys.stderr)
    return x, model.head.weight.detach().to(dtype).contiguous(), t


@torch.no_grad()
def sparsity(x, w, t, order, tile_rows, tile_cols, chunk=1024):
    """Per-token entropy and target probability, and the fraction of [tile_rows x tile_cols] tiles of
    |softmax - one-hot| entirely below SPARSE_BELOW, with the classes in their own order and in `order`."""
    V = w.shape[0]
    chunk = max(tile_rows, chunk // tile_rows * tile_rows)
    entropies, target_probs = [], []
    sparse = {"vocabulary order": 0, "by frequency": 0}
    tiles = 0
    cols = math.ceil(V / tile_cols) * tile_cols
    for r0 in range(0, x.shape[0], chunk):
        xs, ts = x[r0 : r0 + chunk], t[r0 : r0 + chunk]
        logp = torch.log_softmax((xs @ w.T).float(), dim=-1)
        p = logp.exp()
        entropies.append(-(p * logp).sum(-1))
        target_probs.append(p.gather(1, ts[:, None]).squeeze(1))
        g = p.clone()
        g[torch.arange(len(ts), device=g.device), ts] -= 1.0
        rows = math.ceil(len(ts) / tile_rows) * tile_rows
        for name, perm in (("vocabulary order", None), ("by frequency", order)):
            big = (g if perm is None else g[:, perm]).abs() >= SPARSE_BELOW
            padded = torch.zeros(rows, cols, dtype=torch.bool, device=g.device)
            padded[: len(ts), :V] = big
            any_big = padded.view(rows // tile_rows, tile_rows, cols // tile_cols, tile_cols).any(3).any(1)
            sparse[name] += int((~any_big).sum())
        tiles += (rows // tile_rows) * (cols // tile_cols)
    entropy, target_prob = torch.cat(entropies), torch.cat(target_probs)
    quantiles = torch.tensor([0.1, 0.5, 0.9], device=entropy.device)
    return {
        "entropy_mean": entropy.mean().item(),
        "entropy_q10_q50_q90": torch.quantile(entropy, quantiles).tolist(),
        "target_prob_mean": target_prob.mean().item(),
        "target_prob_median": target_prob.median().item(),
        "tile": [tile_rows, tile_cols],
        "tiles_below": {name: count / tiles for name, count in sparse.items()},
    }


def time_method(method, x, w, t, device, warmup, repeat):
    """(ms, GiB beyond inputs and gradients) of forward + backward; CPU: wall time, no workspace."""
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        xl.grad = wl.grad = None
        method(xl, wl, t).backward()

    step()
    if device.type == "cuda":
        return cuda_time_ms(step, warmup, repeat), workspace_gib(step, (xl, wl))
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), float("nan")


def reference_grads(x, w, t, chunk=1024):
    """float32 dX and dW of the mean loss (no TF32), a chunk of rows at a time."""
    wf = w.float()
    counted = (t >= 0).sum().clamp_min(1)
    dx, dw = torch.zeros(x.shape, dtype=torch.float32, device=x.device), torch.zeros_like(wf)
    for r0 in range(0, len(t), chunk):
        xc, tc = x[r0 : r0 + chunk].float(), t[r0 : r0 + chunk]
        g = torch.softmax(xc @ wf.T, -1)
        rows = (tc >= 0).nonzero()[:, 0]
        g[rows, tc[rows]] -= 1
        g[tc < 0] = 0
        g /= counted
        dx[r0 : r0 + chunk] = g @ wf
        dw += g.T @ xc
    return dx, dw


def gradient_errors(methods, inputs, device):
    """Each method's dX and dW error (relative norm) against float32 on each kind of inputs, 10% of rows ignored."""
    errors = {}
    for kind, (x, w, t) in inputs.items():
        t = with_ignored(t, 0.1)
        ref = reference_grads(x, w, t)
        for name, method in methods.items():
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            try:
                method(xl, wl, t).backward()
            except Exception as exc:  # (reported with the times)
                print(f"{name} on {kind}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            errors[(name, kind)] = [((g.float() - r).norm() / r.norm()).item() for g, r in zip((xl.grad, wl.grad), ref)]
            del xl, wl
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return errors


def with_ignored(t, fraction, seed=1):
    if fraction == 0:
        return t
    g = torch.Generator(device=t.device).manual_seed(seed)
    masked = t.clone()
    masked[torch.rand(len(t), device=t.device, generator=g) < fraction] = -100
    return masked


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    methods = sorted({r["method"] for r in results})
    ms = {(r["method"], r["inputs"], r["ignored"]): r["ms"] for r in results}
    series = {
        f"{inputs}, {ignored:.0%} ignored": [ms.get((m, inputs, ignored), 0) for m in methods]
        for inputs in ("trained", "random")
        for ignored in (0.0, 0.1)
    }
    fig, ax = plt.subplots(figsize=(10, 4.5))
    grouped_bars(ax, methods, series, fontsize=8)
    ax.set_ylabel("forward + backward, ms")
    ax.set_title("trained-model head inputs against random ones")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--corpus-mib", type=float, default=48.0)
    parser.add_argument("--vocab", type=int, default=131072, help="BPE vocabulary asked for (the corpus may stop it)")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--minutes", type=float, default=3.0, help="training time")
    parser.add_argument("--rows", type=int, default=16384, help="held-out tokens: the head's N")
    parser.add_argument("--tile", default="64x128", help="rows x classes of a gradient tile")
    parser.add_argument("--methods", default=None, help="comma-separated, of bench.py's (default: every installed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    begin = time.perf_counter()
    train_texts, held_texts, size = load_corpus(args.corpus_mib)
    tokenizer = train_tokenizer(train_texts, args.vocab)
    V = tokenizer.get_vocab_size()
    stream, held = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)
    print(f"corpus {size / 2**20:.1f} MiB ({len(train_texts)} files, {len(held_texts)} held out): V {V}, "
          f"{len(stream):,} training tokens, {len(held):,} held out ({time.perf_counter() - begin:.0f} s)")  # fmt: skip
    model, steps, last = train_model(stream, V, args, device)
    print(f"trained {steps} steps of {args.batch} x {args.seq} tokens: loss {statistics.mean(last):.3f}")
    x, w, t = held_out_head(model, held, args.rows, args.seq, device, dtype)
    frequency = torch.bincount(stream, minlength=V).to(device)
    order = torch.argsort(frequency, descending=True)
    torch.save({"x": x.cpu(), "w": w.cpu(), "target": t.cpu(), "frequency": frequency.cpu()}, out / "trained_head.pt")
    tile_rows, tile_cols = map(int, args.tile.split("x"))
    N, D = x.shape
    xr, wr, _ = make_inputs(N, D, V, device, dtype=dtype, ignored=0.0)
    stats = {
        "trained": sparsity(x, w, t, order, tile_rows, tile_cols),
        "random": sparsity(xr, wr, t, order, tile_rows, tile_cols),
    }
    print(f"\nhead N {N} x D {D} x V {V}; gradient tiles {args.tile} with every |softmax - one-hot| < 2^-12")
    print(f"{'inputs':<8} {'entropy (nats)':>15} {'q10/q50/q90':>20} {'p(target)':>10} {'tiles, vocab order':>19} "
          f"{'by frequency':>13}")  # fmt: skip
    for name, s in stats.items():
        q = "/".join(f"{v:.2f}" for v in s["entropy_q10_q50_q90"])
        below = s["tiles_below"]
        print(f"{name:<8} {s['entropy_mean']:>15.3f} {q:>20} {s['target_prob_mean']:>10.3f} "
              f"{below['vocabulary order']:>19.1%} {below['by frequency']:>13.1%}")  # fmt: skip

    methods = available_methods()
    if args.methods:
        methods = {name: methods[name] for name in args.methods.split(",") if name in methods}
    inputs = {"trained": (x, w, t), "random": (xr, wr, t)}
    samples = {}
    for _ in range(args.rounds):  # interleaved: every method on every input in each round
        for name, method in methods.items():
            for kind, (xi, wi, ti) in inputs.items():
                for ignored in (0.0, 0.1):
                    try:
                        ms, gib = time_method(method, xi, wi, with_ignored(ti, ignored), device, args.warmup,
                                              args.repeat)  # fmt: skip
                    except Exception as exc:  # a peer that cannot run this shape or dtype: reported, not fatal
                        print(f"{name} on {kind}: {type(exc).__name__}: {exc}", file=sys.stderr)
                        ms, gib = float("nan"), float("nan")
                    samples.setdefault((name, kind, ignored), []).append((ms, gib))
    results = [
        {"method": m, "inputs": k, "ignored": ig, "ms": statistics.median(s[0] for s in v), "gib": v[-1][1]}
        for (m, k, ig), v in samples.items()
    ]
    print(f"\nforward + backward, ms (GiB beyond inputs and gradients), median of {args.rounds} rounds")
    print(f"{'method':<22} {'trained':>16} {'trained 10% ign.':>17} {'random':>16} {'random 10% ign.':>17}")
    for name in methods:
        cells = []
        for kind in inputs:
            for ignored in (0.0, 0.1):
                r = next(r for r in results if (r["method"], r["inputs"], r["ignored"]) == (name, kind, ignored))
                cells.append(f"{r['ms']:.2f} ({r['gib']:.2f})")
        print(f"{name:<22} {cells[0]:>16} {cells[1]:>17} {cells[2]:>16} {cells[3]:>17}")
    errors = gradient_errors(methods, inputs, device)
    print("\ngradient error against float32 (relative norm), 10% ignored: dX / dW")
    print(f"{'method':<26} {'trained':>22} {'random':>22}")
    for name in methods:
        cells = [errors.get((name, kind)) for kind in inputs]
        print(f"{name:<26} " + " ".join(f"{e[0]:>10.2e} / {e[1]:.2e}" if e else f"{'-':>22}" for e in cells))
    env = environment() if device.type == "cuda" else {"device": "cpu", "torch": torch.__version__}
    error_rows = [{"method": m, "inputs": k, "dX": e[0], "dW": e[1]} for (m, k), e in errors.items()]
    record = {"env": env, "args": vars(args), "V": V, "steps": steps, "loss": statistics.mean(last),
              "stats": stats, "results": results, "gradient_errors": error_rows}  # fmt: skip
    (out / "trained_logits.json").write_text(json.dumps(record, indent=1))
    plot(results, out / "trained_logits.png")


if __name__ == "__main__":
    main()
