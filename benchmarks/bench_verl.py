"""verl's actor head step through each of its fused-kernel backends, fused_ce's among them, on a GPU.

    python benchmarks/bench_verl.py                       # Qwen2.5-7B's head, 8 x 4096 tokens, bf16
    python benchmarks/bench_verl.py --rounds 3 --backends fused_ce,triton
    python benchmarks/bench_verl.py --backends fused_ce,triton --no-grad-workspace 134217728   # and the lean row

The step verl's FSDP engine runs for the actor (``use_fused_kernels=True``): per-token log-probs and entropy of the
sampled tokens at the rollout temperature from the last hidden states and the lm_head weight, forward and backward
of ``sum(adv * log_probs) + 0.01 * sum(entropy)`` (advantages ~ N(0, 1); the step differentiates both, as the
policy loss with an entropy bonus does), and the reference policy's forward without grad. Every token counted:
verl's fused forward takes no mask (prompt and padding tokens are computed and masked in the loss).
Backends, each called as verl calls it: ``fused_ce`` (``FusedLinearForPPO(impl_backend="fused_ce")``, this
package's plugin), ``torch`` and ``liger`` (``FusedLinearForPPO``: chunks of 512 rows in torch; Liger-Kernel's fused
linear scaled cross-entropy), ``triton`` (``verl.utils.kernel.linear_cross_entropy``, what Megatron workers use).
Interleaved rounds (every backend once per round, the order rotated), median of CUDA-event-timed steps after
warm-up; memory: peak allocated during the step beyond its inputs and the gradients it returns. Prints a table and
writes bench_verl.json and bench_verl.png to --out.
"""

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch

from common import cuda_time_ms, environment, workspace_gib


def verl_module(name):
    """verl's module ``verl.<name>``; where verl's package itself does not import (its dependencies, Ray and
    tensordict, absent on a bare GPU host), the module with ``verl`` and ``verl.utils`` bare (their __init__ not
    run: the head's modules need neither)."""
    try:
        return importlib.import_module(f"verl.{name}")
    except ImportError:
        spec = importlib.util.find_spec("verl")
        if spec is None:
            raise
        root = Path(spec.origin).parent
        for package, path in (("verl", root), ("verl.utils", root / "utils")):
            bare = types.ModuleType(package)
            bare.__path__ = [str(path)]
            sys.modules[package] = bare
        return importlib.import_module(f"verl.{name}")


def backends():
    """name -> fn(hidden, weight, ids, temperature) -> (log_probs, entropy), verl's call of each backend."""
    import fused_ce.integrations.verl  # noqa: F401  (the backend, as verl's plugin loader registers it)

    functional = verl_module("utils.experimental.torch_functional")
    out = {}
    for name in ("fused_ce", "torch", "liger"):
        if name == "liger" and functional._LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY is None:
            continue
        head = functional.FusedLinearForPPO(impl_backend=name)
        out[name] = lambda h, w, ids, temperature, head=head: head.forward(h, w, ids, temperature=temperature)
    try:
        kernel = verl_module("utils.kernel.linear_cross_entropy")

        def triton(h, w, ids, temperature):  # (its rows flattened: verl's caller reshapes them)
            log_probs, entropy = kernel.linear_cross_entropy(h, w, ids, temperature, "none")
            return log_probs.view(ids.shape), entropy.view(ids.shape)

        out["triton"] = triton
    except ImportError as exc:
        print(f"verl's triton backend not importable: {exc}", file=sys.stderr)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=3584)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--backends", default="fused_ce,triton,liger,torch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--no-grad-workspace",
        type=int,
        default=None,
        help="also fused_ce with FUSED_CE_VERL_NO_GRAD_WORKSPACE_BYTES set to this (its reference forward's workspace)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, D, V = args.batch, args.seq, args.dim, args.vocab
    hidden = torch.randn(B, T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda", generator=g) / D**0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (B, T), device="cuda", generator=g)
    advantages = torch.randn(B, T, device="cuda", generator=g)
    entropy_coef = torch.full((B, T), 0.01, device="cuda")  # (a tensor: contiguous gradients, as verl's loss gives)
    available = backends()
    chosen = [b for b in args.backends.split(",") if b in available]
    if args.no_grad_workspace is not None and "fused_ce" in available:
        import fused_ce.integrations.verl as fused_verl

        def lean(h, w, ids, temperature, head=available["fused_ce"]):
            os.environ[fused_verl.NO_GRAD_WORKSPACE] = str(args.no_grad_workspace)
            try:
                return head(h, w, ids, temperature)
            finally:
                del os.environ[fused_verl.NO_GRAD_WORKSPACE]

        name = f"fused_ce, no-grad workspace {args.no_grad_workspace / 2**20:g} MiB"
        available[name] = lean
        chosen.insert(chosen.index("fused_ce") + 1 if "fused_ce" in chosen else 0, name)

    def train_step(fn):
        def step():
            log_probs, entropy = fn(hidden, weight, ids, args.temperature)
            ((log_probs * advantages).sum() + (entropy.float() * entropy_coef).sum()).backward()

        return step

    def reference(fn):
        def step():
            with torch.no_grad():
                fn(hidden, weight, ids, args.temperature)

        return step

    # agreement with fused_ce (log-probs, entropy, dh, dW of the training step)
    def outputs(fn):
        hidden.grad = weight.grad = None
        log_probs, entropy = fn(hidden, weight, ids, args.temperature)
        ((log_probs * advantages).sum() + (entropy.float() * entropy_coef).sum()).backward()
        result = [log_probs.detach().float(), entropy.detach().float(), hidden.grad.float(), weight.grad.float()]
        hidden.grad = weight.grad = None
        return result

    ours = outputs(available["fused_ce"])
    rows = {b: dict(train_ms=[], reference_ms=[]) for b in chosen}
    for b in chosen:
        theirs = ours if b == "fused_ce" else outputs(available[b])
        rows[b]["rel_diff"] = [((a - c).norm() / c.norm()).item() for a, c in zip(theirs, ours)]
        del theirs
        rows[b]["train_gib"] = workspace_gib(train_step(available[b]), [hidden, weight])
        rows[b]["reference_gib"] = workspace_gib(reference(available[b]), [])
    for r in range(args.rounds):
        order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
        for b in order:
            rows[b]["train_ms"].append(cuda_time_ms(train_step(available[b]), args.warmup, args.repeat))
            hidden.grad = weight.grad = None
            rows[b]["reference_ms"].append(cuda_time_ms(reference(available[b]), args.warmup, args.repeat))

    env = environment()
    print(f"# verl's actor head step: {B} x {T} tokens, D {D}, V {V}, bf16, temperature {args.temperature}; {env}")
    print("| backend | fwd+bwd ms (rounds) | memory GiB | reference fwd ms | memory GiB | vs fused_ce: log-probs, "
          "entropy, dh, dW |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for b in chosen:
        row = rows[b]
        train = "/".join(f"{t:.2f}" for t in row["train_ms"])
        reference_ms = statistics.median(row["reference_ms"])
        diffs = ", ".join(f"{d:.1e}" for d in row["rel_diff"])
        print(f"| {b} | {train} | {row['train_gib']:.2f} | {reference_ms:.2f} | {row['reference_gib']:.2f} | "
              f"{diffs} |")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_verl.json").write_text(json.dumps(dict(environment=env, args=vars(args), rows=rows), indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(rows)
    axes[0].bar(names, [statistics.median(rows[b]["train_ms"]) for b in names])
    axes[0].set_ylabel("actor step fwd+bwd, ms")
    axes[1].bar(names, [rows[b]["train_gib"] for b in names])
    axes[1].set_ylabel("memory beyond inputs and gradients, GiB")
    fig.suptitle(f"verl actor head, {B} x {T} tokens, D {D}, V {V}, {env['device']}")
    fig.tight_layout()
    fig.savefig(out / "bench_verl.png", dpi=120)


if __name__ == "__main__":
    main()
