"""Demo: the fused loss against PyTorch's on this machine's device.

    python -m fused_ce.demo            # GPU if there is one, else CPU
    python -m fused_ce.demo --device cpu --n 2048 --d 512 --v 32000

Runs forward + backward of the mean loss both ways on the same random inputs and
prints the loss agreement, the gradients' agreement, the time and the peak
memory beyond the inputs and gradients of each. On CUDA the peak comes from torch's
allocator; on CPU from the process's peak resident memory, each method in a
fresh process.
"""

import argparse
import io
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def worker_command(method, n, d, v, repeat):
    """The command that measures one method on the CPU in a fresh process (peak resident memory is per process)."""
    return [
        sys.executable,
        "-m",
        "fused_ce.demo",
        "--worker",
        method,
        "--device",
        "cpu",
        "--n",
        str(n),
        "--d",
        str(d),
        "--v",
        str(v),
        "--repeat",
        str(repeat),
    ]


def inputs(n, d, v, device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g).to(device, dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.1] = -100
    return x.requires_grad_(), w.requires_grad_(), t.to(device)


def loss_fn(name):
    if name == "fused_ce":
        import fused_ce

        return lambda x, w, t: fused_ce.linear_cross_entropy(x, w, t)
    return lambda x, w, t: F.cross_entropy((x @ w.T).float(), t)


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_one(name, n, d, v, device, dtype, repeat):
    """Loss, gradients, median seconds and peak bytes beyond inputs and gradients, of one method."""
    x, w, t = inputs(n, d, v, device, dtype)
    fn = loss_fn(name)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_bytes()
    for i in range(repeat + 1):
        x.grad = w.grad = None
        sync(device)
        start = time.perf_counter()
        loss = fn(x, w, t)
        loss.backward()
        sync(device)
        if i > 0:  # the first run is warm-up
            times.append(time.perf_counter() - start)
    grads = x.grad.nbytes + w.grad.nbytes
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base - grads
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base - grads
    times.sort()
    return loss.detach().float().cpu(), x.grad.float().cpu(), w.grad.float().cpu(), times[len(times) // 2], peak


def main():
    parser = argparse.ArgumentParser(prog="python -m fused_ce.demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run both losses (default: cuda where there is a GPU, else cpu)",
    )
    parser.add_argument("--n", type=int, default=None, help="tokens (default 16384 on GPU, 2048 on CPU)")
    parser.add_argument("--d", type=int, default=None, help="hidden size (default 4096 on GPU, 512 on CPU)")
    parser.add_argument("--v", type=int, default=None, help="vocabulary (default 128256 on GPU, 32000 on CPU)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls of each loss, median shown (default 3)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gpu = args.device == "cuda"
    n = args.n or (16384 if gpu else 2048)
    d = args.d or (4096 if gpu else 512)
    v = args.v or (128256 if gpu else 32000)
    dtype = torch.bfloat16 if gpu else torch.float32

    if args.worker:  # one method in this process (CPU peak memory is per process)
        loss, gx, gw, sec, peak = run_one(args.worker, n, d, v, args.device, dtype, args.repeat)
        torch.save(dict(loss=loss, gx=gx, gw=gw, sec=sec, peak=peak), sys.stdout.buffer)
        return

    print(
        f"device {args.device}{' (' + torch.cuda.get_device_name() + ')' if gpu else ''}, "
        f"N={n} D={d} V={v} {str(dtype).replace('torch.', '')}, forward + backward of the mean loss"
    )
    results = {}
    for name in ("pytorch", "fused_ce"):
        if gpu:
            results[name] = dict(
                zip(("loss", "gx", "gw", "sec", "peak"), run_one(name, n, d, v, args.device, dtype, args.repeat))
            )
            torch.cuda.empty_cache()
        else:
            cmd = worker_command(name, n, d, v, args.repeat)
            out = subprocess.run(cmd, capture_output=True, check=True)
            results[name] = torch.load(io.BytesIO(out.stdout))

    ref, ours = results["pytorch"], results["fused_ce"]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    print(
        f"loss: pytorch {ref['loss'].item():.6f}  fused_ce {ours['loss'].item():.6f}  "
        f"(relative difference {rel(ours['loss'], ref['loss']):.1e}; dX {rel(ours['gx'], ref['gx']):.1e}, "
        f"dW {rel(ours['gw'], ref['gw']):.1e})"
    )
    print(f"{'':10} {'time ms':>10} {'peak MiB':>10}")
    for name in ("pytorch", "fused_ce"):
        r = results[name]
        print(f"{name:10} {r['sec'] * 1e3:10.1f} {r['peak'] / 2**20:10.0f}")
    print(
        f"fused_ce: {ours['sec'] / ref['sec']:.2f}x pytorch's time, "
        f"{ours['peak'] / max(ref['peak'], 1):.3f}x its extra memory"
    )
    print(json.dumps({k: dict(ms=r["sec"] * 1e3, peak_mib=r["peak"] / 2**20) for k, r in results.items()}))


if __name__ == "__main__":
    main()
