"""End to end: training steps of a Llama-3.2-1B-shaped model with transformers' loss, Liger's and fused_ce's.

The model: 16 layers of width 2048 (intermediate 8192, 32 heads of 64, 8 KV heads), the 128,256-token vocabulary,
tied embeddings, random init, bfloat16 weights, AdamW, SDPA attention. Each setting runs in a process of its own
(the patches and the allocator's state stay apart), one after another in the order given, so that the methods
are side by side in one run:

- ``transformers``: the model as it comes (its logits built, ``F.cross_entropy``);
- ``liger``: Liger-Kernel's patch with its fused linear cross-entropy only (``apply_liger_kernel_to_llama`` with
  every other kernel off: the head is what differs);
- ``fused_ce``: ``fused_ce.integrations.transformers.apply(model)``;

each ``eager`` and ``compiled`` (``torch.compile(model)``, as the Trainer's ``torch_compile=True``: graph breaks
allowed; ``compiled_backbone``: the decoder alone, the head and loss eager; ``compiled_causal``: the whole model
with SDPA's causal flag kept, ``fused_ce.integrations.transformers.keep_causal_sdpa_when_compiled``), with every
token counted (``full``) and with the first half of every sequence a masked prompt (``half``). Tokens/s counts
every input token; the peak is ``torch.cuda.max_memory_allocated`` over the timed steps (weights, gradients and
AdamW's state included); ``--find-max-batch`` doubles the batch until a step runs out of memory and reports the
largest that ran, eager only (a compiled model recompiles at each batch); ``--attention-ms`` profiles one more step
and reports its attention kernels' time, ``--head-ms`` the same step's head: its GEMMs (the products with an operand
of the vocabulary's size) and its passes (the loss's kernels by name).

``--model qwen2-vl-2b``: a Qwen2-VL-2B-shaped vision-language model instead (text 1536 wide, 28 layers, the
151,936-token vocabulary; its 32-layer vision tower), each sequence one 448 x 448 image (256 tokens) and text, an
SFT step as the Trainer and TRL before 1.15 run it (the model's loss from its labels, backward, AdamW); Liger's
setting patches it with ``apply_liger_kernel_to_qwen2_vl``, its fused linear cross-entropy only.

    python benchmarks/bench_e2e.py [--methods transformers,liger,fused_ce] [--modes eager,compiled]
        [--masks full,half] [--batch 4] [--seq 4096] [--steps 4] [--find-max-batch] [--attention-ms] [--head-ms]

Prints a table and writes bench_e2e{tag}.json / .png to --out.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

LLAMA_3_2_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(LLAMA_3_2_1B, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
# --model qwen2-vl-2b: Qwen2-VL-2B's shape (text 28 layers of 1536, 12 heads of 128, 2 KV heads, the 151,936-token
# vocabulary, tied embeddings; its 32-layer 1280-wide vision tower), random init; each sequence one 448 x 448 image
# (32 x 32 patches of 14, 256 tokens after the 2 x 2 merge) and text around it
QWEN2_VL_2B = dict(
    text_config=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, tie_word_embeddings=True),
    vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
    image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
    tie_word_embeddings=True,
)  # fmt: skip
QWEN2_VL_TINY = dict(
    QWEN2_VL_2B, text_config=dict(QWEN2_VL_2B["text_config"], hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
    vision_config=dict(QWEN2_VL_2B["vision_config"], depth=2, embed_dim=32, hidden_size=64, num_heads=2),
)  # fmt: skip
IMAGE_GRID = (1, 32, 32)  # (t, h, w) patches of each sequence's image


def build(method, tiny, device, model_name="llama-3.2-1b"):
    import transformers

    vlm = model_name == "qwen2-vl-2b"
    if vlm:
        config = transformers.Qwen2VLConfig(**(QWEN2_VL_TINY if tiny else QWEN2_VL_2B), attn_implementation="sdpa")
    else:
        config = transformers.LlamaConfig(**(TINY if tiny else LLAMA_3_2_1B), attn_implementation="sdpa")
    if method == "liger":  # its fused linear cross-entropy only: the head is what differs
        from liger_kernel import transformers as liger

        patch = liger.apply_liger_kernel_to_qwen2_vl if vlm else liger.apply_liger_kernel_to_llama
        kernels = dict(rope=False, rms_norm=False, cross_entropy=False, fused_linear_cross_entropy=True)
        patch(**kernels, **(dict(layer_norm=False, swiglu=False) if vlm else dict(swiglu=False)))
    torch.manual_seed(0)
    with torch.device(device):
        cls = transformers.Qwen2VLForConditionalGeneration if vlm else transformers.LlamaForCausalLM
        model = cls(config).to(torch.bfloat16)
    if method == "fused_ce":
        from fused_ce.integrations.transformers import apply

        apply(model)
    return model.train()


def batch_of(batch, seq, vocab, mask, device, seed=1, model=None):
    """(inputs, labels): random text, the first half of each sequence masked with "half"; a vision-language model's
    sequences each begin with one image (its placeholder tokens masked, as collators mask them)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, min(vocab, 151000), (batch, seq), device=device, generator=g)
    inputs = {}
    config = getattr(model, "config", None)
    if getattr(config, "image_token_id", None) is not None:
        t, h, w = IMAGE_GRID
        tokens = t * h * w // config.vision_config.spatial_merge_size**2
        ids[:, 0] = config.vision_start_token_id
        ids[:, 1 : 1 + tokens] = config.image_token_id
        ids[:, 1 + tokens] = config.vision_end_token_id
        patch = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
        inputs["pixel_values"] = torch.randn(batch * t * h * w, patch, device=device, generator=g).bfloat16()
        inputs["image_grid_thw"] = torch.tensor([IMAGE_GRID] * batch, device=device)
        if "mm_token_type_ids" in __import__("inspect").signature(model.forward).parameters:
            inputs["mm_token_type_ids"] = (ids == config.image_token_id).long()
    labels = ids.clone()
    if mask == "half":
        labels[:, : seq // 2] = -100
    if inputs:
        labels[ids == config.image_token_id] = -100
    return dict(input_ids=ids, **inputs), labels


ATTENTION_KERNELS = ("sdpa", "flash", "fmha", "attention")
# the loss's own kernels over logits-sized data: torch's and inductor's softmax / nll / logsumexp kernels, Liger's,
# fused_ce's (its GEMMs are counted by their shapes instead)
HEAD_PASS_KERNELS = ("softmax", "nll_loss", "logsumexp", "cross_entropy", "liger", "element_mul", "logit_partials",
                     "combine_partials", "prepare_rows", "assemble_loss", "scale_kernel")  # fmt: skip
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def profiled_kernel_ms(events, vocab):
    """Where one profiled step's GPU time goes: every kernel, the attention kernels, the head's GEMMs (the products
    with an operand of the vocabulary's size, whoever issues them: torch, inductor, Liger or fused_ce) and the
    head's passes (the loss kernels by name), in ms; the ten longest kernels by name, to check the attribution."""
    from torch.autograd import DeviceType

    # (the GPU-side ranges of compiled graphs and of the optimizer's step are annotations, not kernels)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    by_name = {}
    for k in kernels:
        by_name[k.name] = by_name.get(k.name, 0.0) + k.device_time_total / 1e3
    gemms = [e for e in events if e.device_type == DeviceType.CPU and e.name in GEMM_OPS
             and any(vocab in (shape or []) for shape in e.input_shapes)]  # fmt: skip
    return dict(
        kernel_ms=sum(by_name.values()),
        attention_ms=sum(ms for name, ms in by_name.items() if any(n in name.lower() for n in ATTENTION_KERNELS)),
        head_gemm_ms=sum(e.device_time_total for e in gemms) / 1e3,
        head_gemms=len(gemms),
        head_pass_ms=sum(ms for name, ms in by_name.items() if any(n in name.lower() for n in HEAD_PASS_KERNELS)),
        top_kernels=sorted(((round(ms, 3), name[:120]) for name, ms in by_name.items()), reverse=True)[:10],
    )


def run_one(setting, args):
    """One setting in this process: {tokens_per_s, peak_gib, loss, ...} (or an error), as a JSON line."""
    method, mode, mask = setting.split("/")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(method, args.tiny, device, args.model)
    step_model = model
    if mode == "compiled":
        step_model = torch.compile(model)
    elif mode == "compiled_backbone":  # the decoder compiled, the head and its loss eager (where the time goes)
        model.model = torch.compile(model.model)
    elif mode == "compiled_causal":  # torch.compile(model) with SDPA's is_causal kept, as in eager
        from fused_ce.integrations.transformers import keep_causal_sdpa_when_compiled

        keep_causal_sdpa_when_compiled()
        step_model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.get_text_config().vocab_size

    def step(inputs, labels):
        loss = step_model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def timed(batch, steps, warmup):
        ids, labels = batch_of(batch, args.seq, vocab, mask, device, model=model)
        for _ in range(warmup):
            step(ids, labels)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step(ids, labels)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        return dict(tokens_per_s=batch * args.seq / seconds, ms_per_step=seconds * 1e3, peak_gib=peak,
                    loss=float(loss))  # fmt: skip

    result = dict(setting=setting, batch=args.batch, **timed(args.batch, args.steps, args.warmup))
    if (args.attention_ms or args.head_ms) and device == "cuda":  # one more step, profiled
        ids, labels = batch_of(args.batch, args.seq, vocab, mask, device, model=model)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            step(ids, labels)
            torch.cuda.synchronize()
        result.update(profiled_kernel_ms(prof.events(), vocab))
    if args.find_max_batch and mode == "eager" and device == "cuda":
        largest, batch = args.batch, args.batch * 2
        while batch <= args.max_batch:
            try:
                timed(batch, 1, 1)
                largest, batch = batch, batch * 2
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                break
        result["largest_batch"] = largest
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="transformers,liger,fused_ce")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--masks", default="full,half")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (a compiled model compiles here)")
    parser.add_argument("--find-max-batch", action="store_true")
    parser.add_argument("--attention-ms", action="store_true", help="profile one more step: its attention kernels' ms")
    parser.add_argument("--head-ms", action="store_true", help="profile one more step: the head's GEMMs and passes")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--model", default="llama-3.2-1b", choices=["llama-3.2-1b", "qwen2-vl-2b"])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (to check the script, e.g. on CPU)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per setting")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if args.one:
        return run_one(args.one, args)

    settings = [f"{m}/{mode}/{mask}" for mask in args.masks.split(",") for mode in args.modes.split(",")
                for m in args.methods.split(",")]  # fmt: skip
    forwarded = [f"--model={args.model}", f"--seq={args.seq}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                 f"--batch={args.batch}",
                 f"--max-batch={args.max_batch}", *(["--tiny"] if args.tiny else []),
                 *(["--find-max-batch"] if args.find_max_batch else []),
                 *(["--attention-ms"] if args.attention_ms else []),
                 *(["--head-ms"] if args.head_ms else [])]  # fmt: skip
    results = []
    for setting in settings:
        command = [sys.executable, __file__, *forwarded, "--one", setting]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                results.append(json.loads(lines[-1][len("RESULT ") :]))
            else:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                results.append(dict(setting=setting, error=tail[0][:200]))
        except subprocess.TimeoutExpired:
            results.append(dict(setting=setting, error=f"over {args.timeout} s"))
        print(json.dumps(results[-1]), flush=True)

    print()
    print("| method | mode | labels | batch x seq | tokens/s | ms/step | attention ms | head GEMMs ms | head passes ms "
          "| peak GiB | largest batch | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        method, mode, mask = r["setting"].split("/")
        labels = "every token" if mask == "full" else "half masked"
        if "error" in r:
            print(f"| {method} | {mode} | {labels} | {args.batch} x {args.seq} | {r['error']} | | | | | | | |")
            continue
        largest = r.get("largest_batch", "")
        profiled = [f"{r[k]:.1f}" if k in r else "" for k in ("attention_ms", "head_gemm_ms", "head_pass_ms")]
        print(f"| {method} | {mode} | {labels} | {r['batch']} x {args.seq} | {r['tokens_per_s']:,.0f} | "
              f"{r['ms_per_step']:.0f} | {' | '.join(profiled)} | {r['peak_gib']:.1f} | {largest} | "
              f"{r['loss']:.4f} |")  # fmt: skip
    if args.head_ms:
        config = TINY if args.tiny else LLAMA_3_2_1B
        if args.model == "qwen2-vl-2b":
            config = (QWEN2_VL_TINY if args.tiny else QWEN2_VL_2B)["text_config"]
        flops = 6 * args.batch * args.seq * config["hidden_size"] * config["vocab_size"]
        print(f"\nthe head's 6NDV with every token counted: {flops / 1e12:.1f} TFLOP, {flops / 680e12 * 1e3:.1f} ms "
              "at 680 TFLOP/s (the H200's sustained rate at its power limit)")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    environment = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                       device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    (out / f"bench_e2e{args.tag}.json").write_text(json.dumps(dict(environment=environment, args=vars(args),
                                                                   results=results), indent=1))  # fmt: skip
    plot(results, out / f"bench_e2e{args.tag}.png", args)


def plot(results, path, args):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    done = [r for r in results if "error" not in r]
    if not done:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["setting"].replace("/", "\n") for r in done]
    colors = [{"transformers": "tab:gray", "liger": "tab:orange", "fused_ce": "tab:blue"}.get(
        r["setting"].split("/")[0], "tab:green") for r in done]  # fmt: skip
    axes[0].bar(range(len(done)), [r["tokens_per_s"] for r in done], color=colors)
    axes[0].set_ylabel("tokens/s")
    axes[1].bar(range(len(done)), [r["peak_gib"] for r in done], color=colors)
    axes[1].set_ylabel("peak GiB")
    for ax in axes:
        ax.set_xticks(range(len(done)), names, fontsize=6)
    fig.suptitle(f"Llama-3.2-1B shape, batch {args.batch} x {args.seq}, bf16, AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
