"""The RL workloads of the lm_head: per-token log-probs and entropy, and a policy-gradient loss, on a GPU.

    python benchmarks/bench_rl.py                      # shape A, every workload, fused_ce and torch.compile
    python benchmarks/bench_rl.py --shapes A,C --workloads nll,nll_entropy

Workloads (bf16, x ~ N(0, 1), W ~ N(0, 1/D), per-token advantages ~ N(0, 1); --ignored: the fractions of targets
ignored, each a row set of its own, by default 0 (every row a response token, as in an RL batch packed with
completions) and 10%):
  nll           fwd+bwd of sum(adv * nll), nll per token (fused_ce: reduction='none')
  nll_entropy   fwd+bwd of sum(adv * log_probs) + 0.01 * sum(entropy)
  forward       log-probs and entropy without grad (old / reference policies)
  log_probs     log-probs alone without grad
                (both forwards also time "cuBLAS logits alone": the logits GEMMs of fused_ce's row blocks into one
                buffer, the floor of a pass that reads nothing but its GEMMs' output)
  grpo          fwd+bwd of a GRPO step: 8 sequences x 2048 tokens, the first 512 of each prompt, PPO-clip 0.2
                against old log-probs, k3 KL at 0.04 against reference log-probs, token mean over the batch
                (fused_ce.linear_policy_loss, and its log-probs + the objective in torch)
  grpo_entropy  the same with an entropy bonus of 0.01
Peers: torch.compile, Liger-Kernel's fused linear cross-entropy (Triton) and, where the CUTLASS DSL imports on an
sm_90 GPU, its fused linear scaled cross-entropy (per-token NLL and entropy, CuTe DSL kernels).
fused_ce runs in its default workspace (0.5 GiB: the backward computes the logits again, 8NDV) and, as "keeping
logits", with workspace_bytes=6 GiB, room for the bf16 logits, which the per-token losses then keep for the
backward (6NDV).
Time: median of CUDA-event-timed runs after warm-up. Workspace: peak allocated during the call minus the inputs
and the gradients it returns. Prints a table and writes bench_rl.json and bench_rl.png to --out.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common import PEAK_TFLOPS, SHAPES, cuda_time_ms, environment, logits_gemms, make_inputs, workspace_gib


def torch_log_probs(x, w, t, entropy=False):
    """Materialised logits, float32 softmax: what torch.compile fuses."""
    log_p = (x @ w.T).float().log_softmax(-1)
    lp = log_p.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (t >= 0)
    if not entropy:
        return lp, None
    return lp, -(log_p.exp() * log_p).sum(-1) * (t >= 0)


_compiled = {}


def compiled(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def policy_objective(lp, adv, old, ref, weights, clip=0.2, beta=0.04, entropy=None, entropy_coef=0.0):
    """The GRPO/PPO-clip loss with a k3 KL, written in torch (the formula linear_policy_loss fuses)."""
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token = pg + beta * kl
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
    return (weights * per_token).sum()


# A workspace with room for the bf16 logits at A and C (4.2 and 1.1 GB): the per-token losses keep them for
# their backward ("memory buys speed": fused_ce.plan(...).keeps_logits).
KEEP_LOGITS = 6 << 30


LIGER_SCALED = "liger-kernel scaled CE (CuTe DSL, SM90)"


def liger_scaled_cross_entropy():
    """Liger's fused linear scaled cross-entropy (per-token NLL and entropy) where it runs its SM90 CuTe DSL
    kernels: Liger installed, the CUTLASS DSL importable, an sm_90 device. Else None (its fallback on other
    devices is a chunked torch loop, not the kernel the issue compares with)."""
    try:
        import cutlass.cute  # noqa: F401
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction
    except ImportError as e:
        print(f"({LIGER_SCALED} not measured: {e})")
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        return None

    def apply(x, w, t, return_entropy=False):
        return LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, t, return_entropy=return_entropy)

    return apply


def methods_for(workload):
    import fused_ce

    def fused_nll(x, w, t, adv):
        return (adv * fused_ce.linear_cross_entropy(x, w, t, reduction="none")).sum()

    def fused_nll_kept(x, w, t, adv):
        return (adv * fused_ce.linear_cross_entropy(x, w, t, reduction="none", workspace_bytes=KEEP_LOGITS)).sum()

    def torch_nll(x, w, t, adv):
        return (adv * -torch_log_probs(x, w, t)[0]).sum()

    def fused_nll_entropy(x, w, t, adv):
        out = fused_ce.linear_log_probs(x, w, t, return_entropy=True)
        return (adv * out.log_probs).sum() + 0.01 * out.entropy.sum()

    def fused_nll_entropy_kept(x, w, t, adv):
        out = fused_ce.linear_log_probs(x, w, t, return_entropy=True, workspace_bytes=KEEP_LOGITS)
        return (adv * out.log_probs).sum() + 0.01 * out.entropy.sum()

    def torch_nll_entropy(x, w, t, adv):
        lp, entropy = torch_log_probs(x, w, t, entropy=True)
        return (adv * lp).sum() + 0.01 * entropy.sum()

    def fused_forward(x, w, t, adv):
        out = fused_ce.linear_log_probs(x, w, t, return_entropy=True)
        return out.log_probs.sum() + out.entropy.sum()

    def torch_forward(x, w, t, adv):
        lp, entropy = torch_log_probs(x, w, t, entropy=True)
        return lp.sum() + entropy.sum()

    def fused_log_probs(x, w, t, adv):
        return fused_ce.linear_log_probs(x, w, t).sum()

    def torch_log_probs_only(x, w, t, adv):
        return torch_log_probs(x, w, t)[0].sum()

    table = {
        "nll": {
            "fused_ce": fused_nll,
            "fused_ce keeping logits": fused_nll_kept,
            "torch.compile": compiled(torch_nll),
        },
        "nll_entropy": {
            "fused_ce": fused_nll_entropy,
            "fused_ce keeping logits": fused_nll_entropy_kept,
            "torch.compile": compiled(torch_nll_entropy),
        },
        "forward": {"fused_ce": fused_forward, "torch.compile": compiled(torch_forward)},
        "log_probs": {"fused_ce": fused_log_probs, "torch.compile": compiled(torch_log_probs_only)},
    }
    if workload == "grpo_entropy" and hasattr(fused_ce, "linear_policy_loss"):  # the step with an entropy bonus

        def fused_policy_entropy(x, w, t, rl):
            return fused_ce.linear_policy_loss(
                x, w, t, rl["adv"], old_log_probs=rl["old"], ref_log_probs=rl["ref"], kl_coef=0.04, entropy_coef=0.01
            )

        def fused_log_probs_entropy_then_torch(x, w, t, rl):
            out = fused_ce.linear_log_probs(x, w, t, return_entropy=True)
            return policy_objective(
                out.log_probs, rl["adv"], rl["old"], rl["ref"], rl["weights"], entropy=out.entropy, entropy_coef=0.01
            )

        def torch_policy_entropy(x, w, t, rl):
            lp, entropy = torch_log_probs(x, w, t, entropy=True)
            return policy_objective(
                lp, rl["adv"], rl["old"], rl["ref"], rl["weights"], entropy=entropy, entropy_coef=0.01
            )

        table["grpo_entropy"] = {
            "fused_ce linear_policy_loss": fused_policy_entropy,
            "fused_ce log-probs + torch": fused_log_probs_entropy_then_torch,
            "torch.compile": compiled(torch_policy_entropy),
        }  # (Liger's GRPO loss has no entropy bonus)
    if workload == "grpo" and hasattr(fused_ce, "linear_policy_loss"):

        def fused_policy(x, w, t, rl):
            return fused_ce.linear_policy_loss(
                x, w, t, rl["adv"], old_log_probs=rl["old"], ref_log_probs=rl["ref"], kl_coef=0.04
            )

        def fused_log_probs_then_torch(x, w, t, rl):
            lp = fused_ce.linear_log_probs(x, w, t)
            return policy_objective(lp, rl["adv"], rl["old"], rl["ref"], rl["weights"])

        def torch_policy(x, w, t, rl):
            return policy_objective(torch_log_probs(x, w, t)[0], rl["adv"], rl["old"], rl["ref"], rl["weights"])

        table["grpo"] = {
            "fused_ce linear_policy_loss": fused_policy,
            "fused_ce log-probs + torch": fused_log_probs_then_torch,
            "torch.compile": compiled(torch_policy),
        }
        try:  # what TRL's use_liger_loss runs
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            liger_grpo = LigerFusedLinearGRPOLoss(beta=0.04, use_ref_model=True, loss_type="bnpo")

            def liger_policy(x, w, t, rl):
                B = rl["sequences"]
                mask = (t >= 0).view(B, -1)
                loss, _ = liger_grpo(
                    x.view(B, -1, x.shape[-1]),
                    w,
                    t.clamp_min(0).view(B, -1),
                    mask.int(),
                    rl["sequence_adv"],
                    ref_per_token_logps=rl["ref"].view(B, -1),
                    old_per_token_logps=rl["old"].view(B, -1),
                )
                return loss

            table["grpo"]["liger-kernel LigerFusedLinearGRPOLoss"] = liger_policy
        except ImportError:
            pass
    scaled_ce = liger_scaled_cross_entropy()
    if scaled_ce is not None and workload in ("nll", "nll_entropy", "forward", "log_probs"):
        entropy = workload != "nll" and workload != "log_probs"

        def liger_scaled(x, w, t, adv):
            out = scaled_ce(x, w, t, return_entropy=entropy)
            nll, ent = out if entropy else (out, None)
            if workload == "nll":
                return (adv * nll).sum()
            if workload == "nll_entropy":
                return (adv * -nll).sum() + 0.01 * ent.float().sum()
            return -nll.sum() + (ent.float().sum() if entropy else 0)

        table[workload][LIGER_SCALED] = liger_scaled
    if workload == "nll":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            def liger_nll(x, w, t, adv):
                out = liger_fused_linear_cross_entropy(x, w, t, reduction="none")
                return (adv * (out[0] if isinstance(out, tuple) else out)).sum()

            table["nll"]["liger-kernel (Triton, reduction='none')"] = liger_nll
        except ImportError:
            pass
    return table.get(workload, {})


def rl_inputs(t, sequences=8, seed=0):
    """Advantages (per token, and per sequence for GRPO: one per completion, broadcast to its tokens), old and
    reference log-probs near the policy's, and the token-mean weights."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    counted = t >= 0
    sequence_adv = torch.randn(sequences, device=t.device, generator=g)
    old = -torch.rand(t.shape, device=t.device, generator=g) * 12
    ref = old + 0.1 * torch.randn(t.shape, device=t.device, generator=g)
    weights = counted.float() / counted.sum()
    return dict(
        adv=sequence_adv.repeat_interleave(t.numel() // sequences),
        sequence_adv=sequence_adv,
        old=old,
        ref=ref,
        weights=weights,
        sequences=sequences,
        per_token_adv=torch.randn(t.shape, device=t.device, generator=g),
    )


def measure(fn, x, w, t, extra, warmup, repeat, grad):
    xl, wl = x.detach().requires_grad_(grad), w.detach().requires_grad_(grad)

    def step():
        xl.grad = wl.grad = None
        if grad:
            out = fn(xl, wl, t, extra)
            out.backward()
        else:
            with torch.no_grad():
                out = fn(xl, wl, t, extra)
        return out

    torch.cuda.synchronize()
    begin = time.perf_counter()
    value = step().detach()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - begin) * 1e3  # this shape's first call (compilation, for torch.compile)
    ms = cuda_time_ms(step, warmup, repeat)
    return ms, workspace_gib(step, (xl, wl)), value, first_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="A")
    parser.add_argument("--workloads", default="nll,nll_entropy,forward,log_probs,grpo,grpo_entropy")
    parser.add_argument("--methods", default="", help="only methods whose name contains one of these (comma list)")
    parser.add_argument("--ignored", default="0,0.1", help="fractions of targets ignored (comma list; not GRPO's)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rl.py times CUDA kernels")
    rows = []
    cases = [
        (shape, workload, ignored)
        for shape in args.shapes.split(",")
        for workload in args.workloads.split(",")
        for ignored in ([0.25] if workload.startswith("grpo") else [float(f) for f in args.ignored.split(",")])
    ]
    for shape, workload, ignored in cases:
        N, D, V = SHAPES[shape]
        if workload.startswith("grpo"):  # 8 x 2048 tokens, the first 512 of each the prompt
            x, w, t = make_inputs(N, D, V, "cuda", ignored=0.25, mask="prompt")
            extra = rl_inputs(t)
        else:
            x, w, t = make_inputs(N, D, V, "cuda", ignored=ignored)
            extra = rl_inputs(t)["per_token_adv"]
        grad = workload not in ("forward", "log_probs")
        flops = (8 if grad else 2) * N * D * V
        methods = methods_for(workload)
        if not grad:
            gemms = logits_gemms(x, w, t)
            methods["cuBLAS logits alone"] = lambda *_, gemms=gemms: gemms()
        for method, fn in methods.items():
            if args.methods and not any(m in method for m in args.methods.split(",")):
                continue
            try:
                ms, ws, value, first_ms = measure(fn, x, w, t, extra, args.warmup, args.repeat, grad)
            except torch.cuda.OutOfMemoryError:
                print(f"{shape} {workload} {method}: out of memory", file=sys.stderr)
                continue
            finally:
                torch.cuda.empty_cache()
            rows.append(
                dict(
                    shape=shape,
                    workload=workload,
                    ignored=ignored,
                    method=method,
                    ms=ms,
                    first_call_ms=first_ms,
                    workspace_gib=ws,
                    value=value.item(),
                    floor_ms=flops / (PEAK_TFLOPS * 1e12) * 1e3,
                )
            )
            print(
                f"{shape} {workload:>12} {ignored:4.0%} {method:>28} {ms:8.2f} ms (first call {first_ms:.0f} ms) "
                f"{ws:6.2f} GiB "
                f"value {value.item():.6f}",
                flush=True,
            )
        del x, w, t, extra
        torch.cuda.empty_cache()
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rl.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    plot(rows, out / "bench_rl.png")
    print(f"\n{env['date']} {env['device']} torch {env['torch']} triton {env['triton']}, bf16")
    print(
        "| shape | workload | ignored | method | ms | x floor (8NDV with grad, 2NDV without, at 790 TFLOP/s) | "
        "workspace GiB | first call ms | value |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['workload']} | {r['ignored']:.0%} | {r['method']} | {r['ms']:.2f} | "
            f"{r['ms'] / r['floor_ms']:.2f} | "
            f"{r['workspace_gib']:.2f} | {r['first_call_ms']:.0f} | {r['value']:.6g} |"
        )


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    labels = [f"{r['shape']} {r['workload']} {r['ignored']:.0%}\n{r['method']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["ms"] for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set(ylabel="ms", title="lm_head RL workloads (bf16, H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
