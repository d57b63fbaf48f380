"""Ahead-of-time compilation of the Triton kernels into cubins, at build time.

Runs on a machine with no GPU and no CUDA toolkit: ``triton.compile`` is given an
explicit ``GPUTarget`` per architecture. Writes, under ``out_dir``:

- ``{kernel}_{dtype}_{layout}_sm{arch}.cubin`` for every variant, and
- ``kernel_table.cpp``: the cubins embedded with ``.incbin`` plus a table
  (csrc/kernel_table.h) that the C++ launcher reads: function name, launch
  parameters in order (from the kernel's SPEC), shared memory, warps and tile
  sizes; and the plan's per-architecture constants (configs.ARCH_CONSTANTS).

Usage (as a script: the fused_ce package cannot be imported before its library
is built): ``python fused_ce/_build/aot.py OUT_DIR [--archs 80,90]``.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import typing
from pathlib import Path

_KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


def _kernels_package():
    # Loaded by path: importing the fused_ce package itself needs the extension
    # library that this build is about to produce.
    name = "_fused_ce_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return name


configs = importlib.import_module(f"{_kernels_package()}.configs")


def kernel_module(name):
    return importlib.import_module(f"{_kernels_package()}.{name}")


def kernel_spec(name):
    """The kernel's SPEC (fused_ce/kernels/spec.py), declared beside its @triton.jit."""
    return kernel_module(name).SPEC


def flavor(name):
    """(kernel module, the flavor's constexprs) of a kernel table name: "softmax_grad" or "softmax_grad_entropy"."""
    for kernel in configs.KERNELS:
        for table_name, constexprs in kernel_spec(kernel).kernels():
            if table_name == name:
                return kernel, constexprs
    raise KeyError(f"no kernel {name!r} in configs.KERNELS or their flavors")


def variant_spec(name, dtype, layout, arch):
    """(function, signature, constexprs, attrs, launch params, options, blocks) for one variant of kernel `name`
    (a kernel table name: a module's kernel or one of its flavors)."""
    kernel, flavor_constexprs = flavor(name)
    module = kernel_module(kernel)
    fn, spec = getattr(module, f"{kernel}_kernel"), module.SPEC
    constexpr_names = [n for n in fn.arg_names if n not in spec.param_names()]
    expected = spec.param_names() + constexpr_names
    if list(fn.arg_names) != expected:
        raise RuntimeError(f"{kernel}: kernel arguments {fn.arg_names} do not match its SPEC {expected}")
    aligned = layout == "aligned"
    cfg = configs.config(spec.family, arch, dtype, spec.name)
    if spec.family == "dot_tiles":
        constexprs = {
            "BLOCK_N": cfg.block_n,
            "BLOCK_V": cfg.block_v,
            "BLOCK_D": cfg.block_d,
            "GROUP_N": cfg.group_n,
            "EVEN_D": aligned,
            "DOT_PRECISION": configs.dot_precision(dtype),
        }
        blocks = dict(block_n=cfg.block_n, block_v=cfg.block_v, block_d=cfg.block_d)
    elif spec.family == "grad_tiles":
        constexprs = {"BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v, "BLOCK_D": cfg.block_d,
                      "BLOCK_K": cfg.block_k, "DOT_PRECISION": configs.dot_precision(dtype)}  # fmt: skip
        blocks = dict(block_n=cfg.block_n, block_v=cfg.block_v, block_d=cfg.block_d)
    else:
        constexprs = {"BLOCK": cfg.block}
        if "BLOCK_R" in fn.arg_names:
            constexprs["BLOCK_R"] = cfg.rows
        if "FAST_TANH" in fn.arg_names:
            constexprs["FAST_TANH"] = configs.fast_tanh(dtype)
        if "FILTER_ROWS" in fn.arg_names:  # grad_filter_eps's tiles (the mask's, csrc/filtered_grads.cpp)
            grad_tiles = configs.config("grad_tiles", arch, dtype, "grad_tile_mask")
            constexprs["FILTER_ROWS"], constexprs["FILTER_COLS"] = grad_tiles.block_n, grad_tiles.block_v
        blocks = dict(block_n=cfg.rows, block_v=cfg.block, block_d=0)
    constexprs.update(flavor_constexprs)
    if "BLOCK_R" in flavor_constexprs:  # a flavor with fewer rows per program (its registers)
        blocks["block_n"] = flavor_constexprs["BLOCK_R"]
    signature, attrs, params = {}, {}, []  # params: (name, type) actually passed at launch
    for i, (name, ty) in enumerate(spec.params):
        ty = ty.replace("T", dtype)
        if aligned and name in spec.unit_stride:
            constexprs[name] = 1
            signature[name] = "constexpr"
            continue
        signature[name] = ty
        params.append((name, ty))
        if aligned and name in spec.divisible_by_16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in constexpr_names:
        signature[name] = "constexpr"
    # FP fusion stated explicitly: triton's default for it changes in 3.10.
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    return fn, signature, constexprs, attrs, params, options, blocks


def _count_ptx_params(ptx, function):
    match = re.search(r"\.entry\s+" + re.escape(function) + r"\s*\((.*?)\)", ptx, re.S)
    if not match:
        raise RuntimeError(f"entry {function} not found in PTX")
    return len(re.findall(r"\.param\s", match.group(1)))


def compile_kernel(kernel, dtype, layout, arch):
    """triton's compiled kernel of one variant (asm: ptx, cubin; metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn, signature, constexprs, attrs, _, options, _ = variant_spec(kernel, dtype, layout, arch)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=backend.parse_options(options).__dict__)


def compile_variant(kernel, dtype, layout, arch, out_dir):
    _, _, _, _, params, options, blocks = variant_spec(kernel, dtype, layout, arch)
    compiled = compile_kernel(kernel, dtype, layout, arch)
    meta = compiled.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, field, 0):
            raise RuntimeError(f"{kernel} sm_{arch}: {field} > 0 is not supported by the launcher")
    if getattr(meta, "num_ctas", 1) != 1:
        raise RuntimeError(f"{kernel} sm_{arch}: clusters are not supported by the launcher")
    total_params = _count_ptx_params(compiled.asm["ptx"], meta.name)
    if total_params < len(params):
        raise RuntimeError(f"{kernel}: PTX has {total_params} parameters, expected at least {len(params)}")
    cubin = compiled.asm["cubin"]
    path = Path(out_dir) / f"{kernel}_{dtype}_{layout}_sm{arch}.cubin"
    path.write_bytes(cubin)
    return {
        "kernel": kernel,
        "dtype": dtype,
        "layout": layout,
        "arch": arch,
        "cubin": str(path.resolve()),
        "function": meta.name,
        "shared": int(meta.shared),
        "num_warps": options["num_warps"],
        **blocks,
        "params": params,
        "extra_params": total_params - len(params),
    }


def requested_archs(explicit=None):
    """Architectures to build: --archs, FUSED_CE_CUDA_ARCHS, TORCH_CUDA_ARCH_LIST, else the defaults."""
    spec = explicit or os.environ.get("FUSED_CE_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not spec:
        return list(configs.DEFAULT_ARCHS)
    archs = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        item = item.replace("+PTX", "").strip()
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_)?(\d+)\.?(\d)?a?", item)
        if not m:
            raise ValueError(f"cannot parse CUDA architecture {item!r} in {spec!r}")
        archs.append(int(m.group(1)) * 10 + int(m.group(2)) if m.group(2) is not None else int(m.group(1)))
    return sorted(set(archs))


def _sources_digest():
    import triton

    h = hashlib.sha256()
    for path in sorted(_KERNEL_DIR.glob("*.py")) + [Path(__file__)]:
        h.update(path.read_bytes())
    h.update(triton.__version__.encode())
    return h.hexdigest()


def progress_stream():
    """Where the build's progress lines go: the terminal where there is one (pip captures the build's output and
    shows it only with -v), else standard output (shown with pip's -v)."""
    if sys.stdout.isatty():
        return sys.stdout
    try:
        return open("/dev/tty", "w")  # noqa: SIM115  (kept open for the build)
    except OSError:
        return sys.stdout


def report(stream, message, end=True, milestone=False):
    """A progress line of a build stage: on a terminal one line redrawn in place, kept at the stage's end; elsewhere
    (pip -v's log) the stage's end and its milestones (each tenth of its work) only."""
    if stream.isatty():
        stream.write(f"\r\033[K{message}" + ("\n" if end else ""))
    elif end or milestone:
        stream.write(message + "\n")
    stream.flush()


def _emit_table(variants, out_dir):
    lines = ["// Generated by fused_ce/_build/aot.py: do not edit.", '#include "kernel_table.h"', ""]
    for i, v in enumerate(variants):
        lines.append(
            f'__asm__(".section .rodata\\n.balign 16\\n.global fce_cubin_{i}\\n.hidden fce_cubin_{i}\\n'
            f'fce_cubin_{i}:\\n.incbin \\"{v["cubin"]}\\"\\n.global fce_cubin_{i}_end\\n'
            f'.hidden fce_cubin_{i}_end\\nfce_cubin_{i}_end:\\n.previous\\n");'
        )
        lines.append(f'extern "C" const unsigned char fce_cubin_{i}[], fce_cubin_{i}_end[];')
        names = ", ".join(f'"{n}"' for n, _ in v["params"])
        types = ", ".join(f'"{t}"' for _, t in v["params"])
        lines.append(f"static const char* const fce_param_names_{i}[] = {{{names}}};")
        lines.append(f"static const char* const fce_param_types_{i}[] = {{{types}}};")
    lines += ["", "namespace fused_ce {", "const KernelVariant kKernelVariants[] = {"]
    for i, v in enumerate(variants):
        lines.append(
            f'  {{"{v["kernel"]}", "{v["dtype"]}", "{v["layout"]}", {v["arch"]}, fce_cubin_{i}, '
            f'fce_cubin_{i}_end, "{v["function"]}", {v["num_warps"]}, {v["shared"]}, {v["block_n"]}, '
            f"{v['block_v']}, {v['block_d']}, {len(v['params'])}, fce_param_names_{i}, "
            f"fce_param_types_{i}, "
            f"{v['extra_params']}}},"
        )
    if not variants:
        lines.append("  {}")
    lines += ["};", f"const int kNumKernelVariants = {len(variants)};", "", "const ArchConstants kArchConstants[] = {"]
    for arch, c in sorted(configs.ARCH_CONSTANTS.items()):  # (in arch_constants.h's order: the dataclass's fields)
        values = ", ".join(repr(getattr(c, f.name)) for f in dataclasses.fields(c))
        lines.append(f"  {{{arch}, {values}}},")
    lines += ["};", f"const int kNumArchConstants = {len(configs.ARCH_CONSTANTS)};", "}  // namespace fused_ce", ""]
    (Path(out_dir) / "kernel_table.cpp").write_text("\n".join(lines))


_ARG_TYPES = {"i64": "LaunchArg<int64_t>", "i32": "LaunchArg<int32_t, bool>", "fp32": "LaunchArg<float>"}
_GRID_NAMES = {"ROWS": "v.block_n", "COLS": "v.block_v", "DEPTH": "v.block_d", "PROGRAMS": "programs", "cdiv": "launch_cdiv",
               "min": "launch_min", "max": "launch_max"}  # fmt: skip


def _grid_name(params, match):
    """A name of a SPEC's grid expression in C++: a launch parameter's value, the variant's block, a helper."""
    name = match[0]
    return _GRID_NAMES.get(name, f'{name}.get(kKernel, "{name}")' if name in params else name)


def _camel(name):
    return "".join(part.title() for part in name.split("_"))


def launch_args_header():
    """kernel_args.h: for each kernel source (configs.KERNELS), a struct of its launch parameters as typed fields
    in its SPEC's order, their packing and its grid (SPEC.grid): a parameter renamed or retyped in a SPEC, or
    assigned a value of another type, fails the C++ build; its order is the SPEC's."""
    lines = ["// Generated by fused_ce/_build/aot.py from the kernels' SPECs (fused_ce/kernels/): do not edit.",
             "#pragma once", "", '#include "cuda_driver.h"', "", "namespace fused_ce {"]  # fmt: skip
    for kernel in configs.KERNELS:
        spec = kernel_spec(kernel)
        struct = _camel(kernel) + "Args"
        grid = re.sub(r"\b[A-Za-z_]\w*\b", functools.partial(_grid_name, spec.param_names()), spec.grid)
        lines += ["", f"// fused_ce/kernels/{kernel}.py", f"struct {struct} {{",
                  f'  static constexpr const char* kKernel = "{kernel}";']  # fmt: skip
        lines += [f"  {_ARG_TYPES.get(t, 'LaunchArg<at::Tensor>')} {n};  // {t}" for n, t in spec.params]
        for pointer, entries in spec.arrays:  # (SPEC.arrays: the entries' indices by name, and the size)
            indices = ", ".join(f"k{_camel(entry)} = {i}" for i, entry in enumerate(entries))
            lines.append(f"  struct {_camel(pointer.removesuffix('_ptr'))} {{  // {pointer}'s entries")
            lines.append(f"    static constexpr int {indices}, kSize = {len(entries)};")
            lines.append("  };")
        lines += ["", "  KernelArgs pack(const KernelVariant& v) const {", "    KernelArgs a;"]
        for n, t in spec.params:
            if t.startswith("*"):
                lines.append(f'    a.ptr("{n}", pointee({n}, "{t}", v, kKernel, "{n}"));')
            else:
                lines.append(f'    a.{"f32" if t == "fp32" else t}("{n}", {n}.get(kKernel, "{n}"));')
        lines += ["    return a;", "  }", "  // SPEC.grid: " + spec.grid,
                  "  int64_t grid(const KernelVariant& v, int64_t programs = 0) const {",
                  "    (void)v;", "    (void)programs;", f"    return {grid};", "  }", "};"]  # fmt: skip
    return "\n".join(lines + ["", "}  // namespace fused_ce", ""])


_C_TYPES = {float: "double", int: "int"}


def arch_constants_header():
    """arch_constants.h: the plan's per-architecture constants as a C++ struct, its fields configs.ArchConstants'
    in their order (kernel_table.cpp fills them in that order), so that the two languages cannot disagree."""
    lines = ["// Generated by fused_ce/_build/aot.py from configs.ArchConstants (fused_ce/kernels/configs.py): do not",
             "// edit.", "#pragma once", "", "namespace fused_ce {", "",
             "// The plan's per-architecture constants (configs.ARCH_CONSTANTS; plan.cpp): measured rates and",
             "// thresholds. arch 0 is the entry for architectures without one of their own.",
             "struct ArchConstants {", "  int arch;  // compute capability, major * 10 + minor"]  # fmt: skip
    types = typing.get_type_hints(configs.ArchConstants)
    for f in dataclasses.fields(configs.ArchConstants):
        lines.append(f"  {_C_TYPES[types[f.name]]} {f.name};  // {f.metadata['doc']}")
    return "\n".join(lines + ["};", "", "}  // namespace fused_ce", ""])


def emit_headers(out_dir):
    """kernel_args.h and arch_constants.h into out_dir, each rewritten only where it changed (ninja then
    recompiles nothing)."""
    for name, text in (("kernel_args.h", launch_args_header()), ("arch_constants.h", arch_constants_header())):
        path = Path(out_dir) / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def build(out_dir, archs=None, jobs=None, log=print):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    emit_headers(out_dir)
    archs = requested_archs(archs)
    stamp = out_dir / "stamp.json"
    digest = hashlib.sha256(f"{_sources_digest()}/{archs}".encode()).hexdigest()
    if (
        stamp.exists()
        and json.loads(stamp.read_text()).get("hash") == digest
        and (out_dir / "kernel_table.cpp").exists()
    ):
        log(f"fused_ce AOT: kernels up to date for sm_{archs}")
        return json.loads(stamp.read_text())["archs"]
    jobs = jobs or max(1, os.cpu_count() or 1)
    work = [
        (name, dtype, layout, arch, str(out_dir))
        for arch in archs
        for kernel in configs.KERNELS
        for name, _ in kernel_spec(kernel).kernels()
        for dtype, layout in kernel_spec(kernel).variants()
    ]
    results, failed = {}, {}
    progress = progress_stream()
    start = time.monotonic()
    tenth = max(1, len(work) // 10)
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(compile_variant, *w): w for w in work}
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            kernel, dtype, layout, arch, _ = futures[fut]
            try:
                results[(arch, kernel, dtype, layout)] = fut.result()
                status = "done"
            except Exception as exc:  # an arch this triton cannot target
                failed.setdefault(arch, f"{kernel}/{dtype}/{layout}: {type(exc).__name__}: {exc}".splitlines()[0])
                status = "failed"
            line = f"fused_ce build: kernels {done}/{len(work)} ({time.monotonic() - start:.0f} s)"
            if status == "failed":
                line += f", sm_{arch} {kernel} {dtype} {layout} failed"
            report(progress, line, end=done == len(work), milestone=done % tenth == 0 or status == "failed")
    built = []
    for a in archs:
        if a in failed:
            msg = f"fused_ce AOT: skipping sm_{a}, triton cannot compile it ({failed[a]})"
            if a in (100, 120) and not (
                os.environ.get("FUSED_CE_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST")
            ):
                log(msg)
                continue
            raise RuntimeError(msg)
        built.append(a)
    variants = [results[key] for key in sorted(results) if key[0] in built]
    _emit_table(variants, out_dir)
    stamp.write_text(json.dumps({"hash": digest, "archs": built}))
    log(
        f"fused_ce AOT: {len(variants)} kernel variants for sm_{built} in {time.monotonic() - start:.0f} s "
        "(triton's cache, ~/.triton/cache, makes a rebuild of unchanged kernels fast)"
    )
    return built


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument(
        "--archs",
        default=None,
        help="e.g. 80,90 (default: $FUSED_CE_CUDA_ARCHS, $TORCH_CUDA_ARCH_LIST, else "
        + ",".join(map(str, configs.DEFAULT_ARCHS))
        + ")",
    )
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    build(args.out_dir, args.archs, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
