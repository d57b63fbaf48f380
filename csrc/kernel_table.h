// What the build embeds in the library: the AOT-compiled kernel variants and the
// plan's per-architecture constants. The tables themselves are generated at
// build time by fused_ce/_build/aot.py (kernel_table.cpp).
#pragma once
#include <cstddef>

#include "arch_constants.h"

namespace fused_ce {

struct KernelVariant {
  const char* kernel;  // a kernel of fused_ce/kernels/ (its SPEC): "row_stats", "softmax_grad", ...
  const char* dtype;   // "bf16" | "fp16" | "fp32"
  const char* layout;  // "aligned" | "general"
  int arch;            // compute capability, e.g. 90
  const unsigned char* cubin_begin;
  const unsigned char* cubin_end;
  const char* function;  // entry point in the cubin
  int num_warps;
  int shared_bytes;
  int block_n, block_v, block_d;  // row kernels: rows and columns per program in block_n, block_v
  int num_params;                 // named launch parameters, in order
  const char* const* param_names;
  const char* const* param_types;  // triton types: "*bf16", "i64", "i32", "fp32", ...
  int num_extra_params;            // trailing scratch pointers triton appends (passed as null)
};

extern const KernelVariant kKernelVariants[];
extern const int kNumKernelVariants;

// The plan's per-architecture constants: the struct generated from configs.ArchConstants (arch_constants.h).
extern const ArchConstants kArchConstants[];
extern const int kNumArchConstants;

}  // namespace fused_ce
