"""What the build and the launchers know of a kernel, declared beside its ``@triton.jit`` as ``SPEC``.

Pure data (no triton import). The AOT build (fused_ce/_build/aot.py) compiles each
variant from it, writes the launch parameters into the library's kernel table (every
launch is checked against it) and generates from it the C++ launchers' argument struct
and grid (build/aot/kernel_args.h); the JIT launchers (jit.py) pass arguments by these
names on the same grid; configs.py gives each family its tiles.
"""
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")
# "aligned": the parameters in ``divisible_by_16`` are multiples of 16 (pointers: 16-byte aligned) and
# those in ``unit_stride`` are 1 (compiled in as constants); the launcher checks both on the actual tensors.
# "general": anything else.
LAYOUTS = ("aligned", "general")


@dataclass(frozen=True)
class KernelSpec:
    name: str
    # Launch parameters in the kernel's order, with their triton types; "T" stands for the input dtype.
    # The kernel's remaining parameters are its constexprs.
    params: tuple
    # Configuration family in configs.py: "dot_tiles" (logit tiles from tl.dot), "stored_logits" (tiles of
    # stored logits), "combine", "elementwise", "rows" (one program over all rows), "row_sweeps" (one program
    # per row, sweeping its stored logits).
    family: str
    divisible_by_16: frozenset = frozenset()
    unit_stride: frozenset = frozenset()
    dtypes: tuple = DTYPES  # ("fp32",) where the arguments do not depend on the input dtype
    layouts: tuple = LAYOUTS  # ("general",) where aligned accesses gain nothing
    # Kernels compiled from this source besides the plain one: (suffix, ((constexpr, value), ...)) each, in the
    # kernel table as "{name}_{suffix}". Rare features live in a flavor of their own: as runtime branches their
    # registers would slow every call (the stored-logits passes spill with the entropy's terms compiled in).
    # The plain kernel gets False for each flavor's switch; a flavor may also set BLOCK_R, its rows per program.
    flavors: tuple = ()
    # The launch grid (programs, 1-D) as an expression both launchers evaluate (jit.py here, the C++ launchers through
    # the argument struct the build generates from this SPEC: fused_ce/_build/aot.py): the launch parameters by
    # name, ROWS, COLS and DEPTH (a program's rows, columns and features: its BLOCK_N or BLOCK_R, BLOCK_V or BLOCK,
    # and BLOCK_D), PROGRAMS (the launcher's cap on a grid-stride kernel's programs), cdiv, min and max.
    grid: str = "1"
    # Small arrays the kernel writes or reads by index, named once here: ((pointer parameter, (entry, ...)), ...).
    # The kernels index them by these names (their module's constexprs), and the build generates the C++ names
    # from them (kernel_args.h: a struct per array in the kernel's argument struct, its entries' indices and size).
    arrays: tuple = ()

    def variants(self):
        """The (dtype, layout) variants the build compiles."""
        return [(dtype, layout) for dtype in self.dtypes for layout in self.layouts]

    def kernels(self):
        """(table name, constexprs) of every kernel compiled from this source: the plain one, then the flavors."""
        off = {name: False for _, settings in self.flavors for name, _ in settings if name != "BLOCK_R"}
        return [(self.name, off)] + [(f"{self.name}_{suffix}", dict(off, **dict(settings))) for suffix, settings in
                                     self.flavors]

    def param_names(self):
        return [name for name, _ in self.params]

    def grid_size(self, args, rows=None, cols=None, programs=None, depth=None):
        """The grid's programs for launch arguments `args` (by name) and the program's ROWS, COLS, DEPTH (and
        PROGRAMS)."""
        names = dict(args, ROWS=rows, COLS=cols, DEPTH=depth, PROGRAMS=programs, cdiv=lambda a, b: -(-a // b), min=min,
                     max=max)  # fmt: skip
        return int(eval(self.grid, {"__builtins__": {}}, names))  # noqa: S307  (the SPEC's own text)


# x and w of the tl.dot kernels in the aligned layout.
XW_DIVISIBLE_BY_16 = frozenset({"x_ptr", "w_ptr", "D", "stride_xn", "stride_wv"})
XW_UNIT_STRIDE = frozenset({"stride_xd", "stride_wd"})
XW_PARAMS = (
    ("x_ptr", "*T"), ("w_ptr", "*T"), ("b_ptr", "*T"), ("cw_ptr", "*fp32"), ("tgt_ptr", "*i64"),
)
