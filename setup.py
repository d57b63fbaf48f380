"""Builds fused_ce._C: the C++ op plus the Triton kernels compiled ahead of time.

The kernels are compiled to cubins by fused_ce/_build/aot.py for the
architectures in FUSED_CE_CUDA_ARCHS (or TORCH_CUDA_ARCH_LIST; default
80,86,89,90,100,120) and embedded in the library. Needs torch, triton and a C++
compiler; no GPU and no CUDA toolkit. Build without isolation so the extension
matches the installed torch: ``pip install --no-build-isolation .``
"""

import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).parent.resolve()


class BuildWithKernels(BuildExtension):
    def build_extensions(self):
        # A fixed place (not build_temp, which editable installs delete) so rebuilds reuse it.
        out_dir = ROOT / "build" / "aot"
        # Run as a script: the fused_ce package itself cannot be imported before _C exists.
        subprocess.check_call([sys.executable, str(ROOT / "fused_ce" / "_build" / "aot.py"), str(out_dir)])
        for ext in self.extensions:
            ext.sources.append(str(out_dir / "kernel_table.cpp"))
        super().build_extensions()


setup(
    name="fused_ce",
    packages=find_packages(include=["fused_ce", "fused_ce.*"]),
    ext_modules=[
        CppExtension(
            "fused_ce._C",
            sources=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp")),
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args=["-O2"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildWithKernels},
)
