"""Ahead-of-time compilation of the Triton kernels into cubins, at build time.

Runs on a machine with no GPU and no CUDA toolkit: ``triton.compile`` is given an
explicit ``GPUTarget`` per architecture. Writes, under ``out_dir``:

- ``{kernel}_{dtype}_{layout}_sm{arch}.cubin`` for every variant, and
- ``kernel_table.cpp``: the cubins embedded with ``.incbin`` plus a table
  (csrc/kernel_table.h) that the C++ launcher reads: function name, launch
  parameters in order, shared memory, warps and tile sizes.

Usage: ``python -m fused_ce._build.aot OUT_DIR [--archs 80,90]``.
"""
import argparse
import concurrent.futures
import hashlib
import importlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

_KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"


def _kernels_package():
    # Loaded by path: importing the fused_ce package itself needs the extension
    # library that this build is about to produce.
    name = "_fused_ce_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return name


configs = importlib.import_module(f"{_kernels_package()}.configs")

# Launch parameters of each kernel, in source order, with their Triton types.
# "T" is the input dtype. Checked against the kernel's own argument list below.
_SIGNATURES = {
    "row_stats": [
        ("x_ptr", "*T"), ("w_ptr", "*T"), ("b_ptr", "*T"), ("cw_ptr", "*fp32"), ("tgt_ptr", "*i64"),
        ("m_ptr", "*fp32"), ("s_ptr", "*fp32"), ("zt_ptr", "*fp32"), ("wz_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("D", "i64"),
        ("stride_xn", "i64"), ("stride_xd", "i64"), ("stride_wv", "i64"), ("stride_wd", "i64"),
        ("cols_per_split", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"), ("need_wz", "i32"),
    ],
    "logit_grad": [
        ("x_ptr", "*T"), ("w_ptr", "*T"), ("b_ptr", "*T"), ("cw_ptr", "*fp32"), ("tgt_ptr", "*i64"),
        ("lse_ptr", "*fp32"), ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"),
        ("gamma_ptr", "*fp32"), ("g_ptr", "*T"),
        ("N", "i64"), ("v_begin", "i64"), ("v_end", "i64"), ("D", "i64"),
        ("stride_xn", "i64"), ("stride_xd", "i64"), ("stride_wv", "i64"), ("stride_wd", "i64"),
        ("stride_gn", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_bias", "i32"), ("has_class_weight", "i32"), ("has_softcap", "i32"),
    ],
    "logit_partials": [
        ("logits_ptr", "*T"), ("cw_ptr", "*fp32"), ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"),
        ("R", "i64"), ("V", "i64"), ("stride_ln", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ],
    "combine_partials": [
        ("pm_ptr", "*fp32"), ("ps_ptr", "*fp32"), ("pw_ptr", "*fp32"), ("logits_ptr", "*T"), ("tgt_ptr", "*i64"),
        ("lse_ptr", "*fp32"), ("zt_ptr", "*fp32"), ("wz_ptr", "*fp32"),
        ("R", "i64"), ("stride_ln", "i64"), ("segments", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ],
    "softmax_grad": [
        ("logits_ptr", "*T"), ("cw_ptr", "*fp32"), ("tgt_ptr", "*i64"), ("lse_ptr", "*fp32"),
        ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"), ("gamma_ptr", "*fp32"),
        ("R", "i64"), ("V", "i64"), ("stride_ln", "i64"), ("segments", "i64"), ("col_offset", "i64"),
        ("logit_scale", "fp32"), ("softcap", "fp32"),
        ("has_class_weight", "i32"), ("has_softcap", "i32"), ("has_smoothing", "i32"),
    ],
    "scale": [("g_ptr", "*T"), ("scale_ptr", "*fp32"), ("numel", "i64")],
    "prepare_rows": [
        ("tgt_ptr", "*i64"), ("cw_ptr", "*fp32"), ("tgt_out_ptr", "*i64"), ("wt_ptr", "*fp32"),
        ("totals_ptr", "*fp32"), ("bad_ptr", "*i32"),
        ("alpha_ptr", "*fp32"), ("alpha_lse_ptr", "*fp32"), ("beta_ptr", "*fp32"), ("gamma_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("ignore_index", "i64"), ("label_smoothing", "fp32"), ("z_loss", "fp32"),
        ("has_class_weight", "i32"), ("mean", "i32"), ("write_coefficients", "i32"),
    ],
    "assemble_loss": [
        ("lse_ptr", "*fp32"), ("zt_ptr", "*fp32"), ("wz_ptr", "*fp32"), ("tgt_ptr", "*i64"), ("wt_ptr", "*fp32"),
        ("totals_ptr", "*fp32"), ("loss_ptr", "*fp32"),
        ("N", "i64"), ("V", "i64"), ("label_smoothing", "fp32"), ("z_loss", "fp32"),
        ("has_smoothing", "i32"), ("reduction", "i32"),
    ],
}
# What the "aligned" layout may assume (checked at run time by csrc/cuda_stages.cpp).
_ALIGNED_DIVISIBLE_16 = {"x_ptr", "w_ptr", "D", "stride_xn", "stride_wv", "g_ptr", "stride_gn", "logits_ptr",
                         "stride_ln"}
_ALIGNED_UNIT = {"stride_xd", "stride_wd"}
# Passes over stored logits and elementwise passes: the bound of their mask a multiple of 16 too, else the
# mask keeps the accesses scalar.
_ALIGNED_DIVISIBLE_16_BY_KERNEL = {"logit_partials": {"V"}, "softmax_grad": {"V"}, "scale": {"numel"}}


def kernel_function(name):
    module = importlib.import_module(f"{_kernels_package()}.{name}")
    return getattr(module, f"{name}_kernel")


def variant_spec(kernel, dtype, layout, arch):
    """(signature, constexprs, attrs, launch params, options) for one variant."""
    fn = kernel_function(kernel)
    sig = _SIGNATURES[kernel]
    constexpr_names = [n for n in fn.arg_names if n not in dict(sig)]
    expected = [n for n, _ in sig] + constexpr_names
    if list(fn.arg_names) != expected:
        raise RuntimeError(f"{kernel}: kernel arguments {fn.arg_names} do not match the AOT signature {expected}")
    aligned = layout == "aligned"
    if kernel in configs.GEMM_KERNELS:
        cfg = configs.tile_config(kernel, arch, dtype)
        constexprs = {
            "BLOCK_N": cfg.block_n, "BLOCK_V": cfg.block_v, "BLOCK_D": cfg.block_d, "GROUP_N": cfg.group_n,
            "EVEN_D": aligned, "DOT_PRECISION": configs.dot_precision(dtype),
        }
        blocks = dict(block_n=cfg.block_n, block_v=cfg.block_v, block_d=cfg.block_d, group_n=cfg.group_n)
    else:
        cfg = configs.row_config(arch, dtype, kernel)
        constexprs = {"BLOCK": cfg.block}
        if "BLOCK_R" in fn.arg_names:
            constexprs["BLOCK_R"] = cfg.rows
        if "FAST_TANH" in fn.arg_names:
            constexprs["FAST_TANH"] = configs.fast_tanh(dtype)
        blocks = dict(block_n=cfg.rows, block_v=cfg.block, block_d=0, group_n=0)
    signature, attrs, params = {}, {}, []  # params: (name, type) actually passed at launch
    for i, (name, ty) in enumerate(sig):
        ty = ty.replace("T", dtype)
        if aligned and name in _ALIGNED_UNIT:
            constexprs[name] = 1
            signature[name] = "constexpr"
            continue
        signature[name] = ty
        params.append((name, ty))
        if aligned and (name in _ALIGNED_DIVISIBLE_16 or name in _ALIGNED_DIVISIBLE_16_BY_KERNEL.get(kernel, ())):
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
        "kernel": kernel, "dtype": dtype, "layout": layout, "arch": arch,
        "cubin": str(path.resolve()), "function": meta.name, "shared": int(meta.shared),
        "num_warps": options["num_warps"], **blocks, "params": params, "extra_params": total_params - len(params),
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


def _source_hash(archs):
    import triton
    h = hashlib.sha256()
    for path in sorted(_KERNEL_DIR.glob("*.py")) + [Path(__file__)]:
        h.update(path.read_bytes())
    h.update(repr((triton.__version__, archs)).encode())
    return h.hexdigest()


def _emit_table(variants, out_dir):
    lines = ["// Generated by fused_ce/_build/aot.py: do not edit.", '#include "kernel_table.h"', ""]
    for i, v in enumerate(variants):
        lines.append(
            f'__asm__(".section .rodata\\n.balign 16\\n.global fce_cubin_{i}\\n.hidden fce_cubin_{i}\\n'
            f'fce_cubin_{i}:\\n.incbin \\"{v["cubin"]}\\"\\n.global fce_cubin_{i}_end\\n'
            f'.hidden fce_cubin_{i}_end\\nfce_cubin_{i}_end:\\n.previous\\n");')
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
            f'{v["block_v"]}, {v["block_d"]}, {v["group_n"]}, {len(v["params"])}, fce_param_names_{i}, '
            f'fce_param_types_{i}, '
            f'{v["extra_params"]}}},')
    if not variants:
        lines.append("  {}")
    lines += ["};", f"const int kNumKernelVariants = {len(variants)};", "}  // namespace fused_ce", ""]
    (Path(out_dir) / "kernel_table.cpp").write_text("\n".join(lines))


def build(out_dir, archs=None, jobs=None, log=print):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    archs = requested_archs(archs)
    stamp = out_dir / "stamp.json"
    digest = _source_hash(archs)
    if stamp.exists() and json.loads(stamp.read_text()).get("hash") == digest \
            and (out_dir / "kernel_table.cpp").exists():
        log(f"fused_ce AOT: kernels up to date for sm_{archs}")
        return json.loads(stamp.read_text())["archs"]
    jobs = jobs or max(1, os.cpu_count() or 1)
    work = [(k, d, l, a, str(out_dir)) for a in archs for k in configs.KERNELS
            for d, l in configs.variant_keys(k)]
    results, failed = {}, {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(compile_variant, *w): w for w in work}
        for fut in concurrent.futures.as_completed(futures):
            k, d, l, a, _ = futures[fut]
            try:
                results[(a, k, d, l)] = fut.result()
            except Exception as exc:  # an arch this triton cannot target
                failed.setdefault(a, f"{k}/{d}/{l}: {type(exc).__name__}: {exc}".splitlines()[0])
    built = []
    for a in archs:
        if a in failed:
            msg = f"fused_ce AOT: skipping sm_{a}, triton cannot compile it ({failed[a]})"
            if a in (100, 120) and not (os.environ.get("FUSED_CE_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST")):
                log(msg)
                continue
            raise RuntimeError(msg)
        built.append(a)
    variants = [results[key] for key in sorted(results) if key[0] in built]
    _emit_table(variants, out_dir)
    stamp.write_text(json.dumps({"hash": digest, "archs": built}))
    log(f"fused_ce AOT: compiled {len(variants)} kernel variants for sm_{built}")
    return built


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--archs", default=None, help="e.g. 80,90 (default: $FUSED_CE_CUDA_ARCHS, "
                        "$TORCH_CUDA_ARCH_LIST, else %s)" % ",".join(map(str, configs.DEFAULT_ARCHS)))
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    build(args.out_dir, args.archs, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
