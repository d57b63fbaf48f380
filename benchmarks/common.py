"""What the benchmark scripts share: the shapes, the H200's rate, inputs, timing, the environment, the plan.

Run the scripts as ``python benchmarks/NAME.py``: their own folder is then on sys.path.
"""

import argparse
import math
import platform
import statistics
import threading
import time
from datetime import date
from pathlib import Path

import torch

SHAPES = {  # name: (N, D, V)
    "A": (16384, 4096, 128256),  # Llama-3 8B
    "B": (8192, 2304, 256000),  # Gemma-2 2B
    "C": (4096, 4096, 128256),
    "Q": (98304, 1024, 151936),  # a GRPO batch of examples/grpo.py: 512 sequences of 192 tokens, Qwen2's vocabulary
    # the small heads most fine-tuning runs have, at 16384 tokens
    "Qwen2.5-0.5B": (16384, 896, 151936),
    "Qwen2.5-1.5B": (16384, 1536, 151936),
    "Qwen2.5-3B": (16384, 2048, 151936),
    "Llama-3.2-1B": (16384, 2048, 128256),
    "Llama-3.2-3B": (16384, 3072, 128256),
    "D1024": (16384, 1024, 131072),  # the head of trained_logits.py (and issue 64's trained-head figures)
}
PEAK_TFLOPS = 790.0  # bf16 GEMM rate measured on the H200 (device/KINDS.md)


SEQUENCE = 2048  # tokens per sequence of the prompt mask


def zipf_targets(N, V, exponent, generator):
    """N targets with text's token frequencies, p(k) ~ 1 / (k + 1)^exponent, the frequent ones at random ids."""
    device = generator.device
    weights = 1.0 / torch.arange(1, V + 1, device=device, dtype=torch.float64) ** exponent
    ranks = torch.multinomial(weights, N, replacement=True, generator=generator)
    return torch.randperm(V, device=device, generator=generator)[ranks]


def make_inputs(N, D, V, device, dtype=torch.bfloat16, seed=0, ignored=0.1, mask="scattered", zipf=0.0):
    """x ~ N(0, 1), W ~ N(0, 1/D), targets uniform (or, zipf > 0, by zipf_targets) with a fraction `ignored` set to
    -100: at random rows ("scattered") or the first part of every 2048-token sequence ("prompt", as supervised
    fine-tuning masks the prompt)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    x = torch.randn(N, D, device=device, dtype=dtype, generator=g)
    w = (torch.randn(V, D, device=device, generator=g) / math.sqrt(D)).to(dtype)
    t = torch.randint(0, V, (N,), device=device, generator=g)
    if zipf:
        t = zipf_targets(N, V, zipf, g)
    if mask == "prompt":
        seq = min(SEQUENCE, N)
        t.view(-1, seq)[:, : round(ignored * seq)] = -100
    else:
        t[torch.rand(N, device=device, generator=g) < ignored] = -100
    return x, w, t


def peaked_inputs(N, D, V, scale, device, dtype=torch.bfloat16, seed=0, ignored=0.1, others=7, zipf=1.1):
    """Inputs whose softmax is peaked as a trained model's: W ~ N(0, 1/D) (rows of norm ~1), targets by
    zipf_targets, each row's hidden state `scale` times its target's row of W plus `others` other tokens' rows (drawn
    by the same law) at weights U(0, 1), plus N(0, 0.3^2) noise per feature; a fraction `ignored` of
    targets set to -100 (at random rows). The larger the scale, the more of the softmax sits on the target and on
    the few others: a trained head's shape of gradient (../shared notes: 2026-12-04's construction)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    w = torch.randn(V, D, device=device, generator=g) / math.sqrt(D)
    t = zipf_targets(N, V, zipf, g)
    other = zipf_targets(N * others, V, zipf, g).view(N, others)
    weight = torch.rand(N, others, device=device, generator=g)
    x = scale * (w[t] + torch.einsum("no,nod->nd", weight, w[other]))
    x += 0.3 * torch.randn(N, D, device=device, generator=g)
    t[torch.rand(N, device=device, generator=g) < ignored] = -100
    return x.to(dtype), w.to(dtype), t


def cuda_time_ms(fn, warmup, repeat):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class ClockSampler:
    """The SM clock and the power drawn, sampled in a thread while the `with` block runs."""

    def __enter__(self):
        self.clocks, self.watts, self._stop = [], [], threading.Event()

        def sample():
            while not self._stop.is_set():
                try:
                    self.clocks.append(torch.cuda.clock_rate())
                    self.watts.append(torch.cuda.power_draw() / 1e3)
                except Exception:  # no NVML: no samples
                    return
                time.sleep(0.005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def summary(self):
        med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
        return dict(sm_mhz=med(self.clocks), sm_mhz_min=min(self.clocks, default=float("nan")), watts=med(self.watts))


def back_to_back_ms(fn, calls, repeat):
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def logits_gemms(x, w, t):
    """The logits GEMMs alone of fused_ce's no-grad forward, as a function of no arguments: its row blocks
    (fused_ce.plan) of the counted rows, each into one reused buffer, as the pass writes them before reading them
    once (the floor of a pass that reads nothing but its GEMMs' output)."""
    import fused_ce

    plan = fused_ce.plan(x, w, t, reduction="none", pass_="forward")
    counted = x[t >= 0] if plan.counted_rows_only else x
    buffer = torch.empty(plan.block_rows, w.shape[0], dtype=x.dtype, device=x.device)

    def gemms():
        for r0 in range(0, counted.shape[0], plan.block_rows):
            block = counted[r0 : r0 + plan.block_rows]
            torch.mm(block, w.T, out=buffer[: block.shape[0]])
        return buffer[0, 0].float()

    return gemms


def grouped_bars(ax, labels, series, fontsize=None):
    """One bar of each series ({name: a value per label}) side by side at each label, and the legend."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([j + offset for j in range(len(labels))], values, width=width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=fontsize)
    ax.legend()


def workspace_gib(step, leaves):
    """GiB that one call of ``step`` (fwd+bwd) allocates at its peak beyond what was allocated before it, less the
    gradients it leaves in ``leaves``' ``.grad``: what the method holds besides inputs and results."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = sum(leaf.grad.numel() * leaf.grad.element_size() for leaf in leaves if leaf.grad is not None)
    workspace = max(0, torch.cuda.max_memory_allocated() - base - grads)
    for leaf in leaves:
        leaf.grad = None
    return workspace / 2**30


def environment():
    import triton  # only to report the version the peers use

    return dict(
        date=str(date.today()),
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
    )


def plan_summary(x, w, t, **kwargs):
    """fused_ce's plan of a training step with these inputs, in one line (fused_ce.plan)."""
    import fused_ce

    p = fused_ce.plan(x.detach().requires_grad_(), w.detach().requires_grad_(), t, **kwargs)
    tiles = f" x {p.tile_cols} cols" if p.tile_cols != w.shape[0] else ""
    stats = f", stats pass {p.stats_block_rows} rows" if p.stats_block_rows else ""
    return (
        f"{p.pass_}: {p.strategy}, {p.block_rows} rows{tiles}{stats}, workspace "
        f"{p.workspace_bytes / 2**20:.0f}/{p.budget_bytes / 2**20:.0f} MiB"
    )


def shape_parser(doc, repeat):
    """An argument parser with --shape, --warmup, --repeat and --out (by default benchmarks/results/)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--shape", default="A")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return parser
