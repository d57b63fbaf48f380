// The AOT-compiled kernel variants embedded in the library. The table itself is
// generated at build time by fused_ce/_build/aot.py (kernel_table.cpp).
#pragma once
#include <cstddef>

namespace fused_ce {

struct KernelVariant {
  const char* kernel;  // a kernel of fused_ce/kernels/configs.py: "row_stats", "softmax_grad", ...
  const char* dtype;   // "bf16" | "fp16" | "fp32"
  const char* layout;  // "aligned" | "general"
  int arch;            // compute capability, e.g. 90
  const unsigned char* cubin_begin;
  const unsigned char* cubin_end;
  const char* function;  // entry point in the cubin
  int num_warps;
  int shared_bytes;
  int block_n, block_v, block_d, group_n;  // row kernels: rows and columns per program in block_n, block_v
  int num_params;                  // named launch parameters, in order
  const char* const* param_names;
  const char* const* param_types;  // triton types: "*bf16", "i64", "i32", "fp32", ...
  int num_extra_params;            // trailing scratch pointers triton appends (passed as null)
};

extern const KernelVariant kKernelVariants[];
extern const int kNumKernelVariants;

}  // namespace fused_ce
