// What the build embeds in the library: the AOT-compiled kernel variants and the
// plan's per-architecture constants. The tables themselves are generated at
// build time by fused_ce/_build/aot.py (kernel_table.cpp).
#pragma once
#include <cstddef>

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

// The plan's per-architecture constants (fused_ce/kernels/configs.py,
// ARCH_CONSTANTS; plan.cpp): measured rates and thresholds. arch 0 is the
// entry for architectures without one of their own.
struct ArchConstants {
  int arch;
  double memory_bytes_per_s;  // sustained device-memory bandwidth of the passes over stored logits
  double gemm_flops_per_s;    // sustained GEMM rate at our shapes
  int min_stored_rows;        // fewer rows per block and the forward's cuBLAS blocks lose to tl.dot tiles
  int gemm_tile_rows;         // cuBLAS's row tile: blocks in whole tiles waste none
  int vocab_tile_rows;        // rows of a VocabTiles tile: enough for the dW GEMM to stay compute-bound
  int filter_tile_rows;       // grad_filter_eps's tiles of a block's gradient: rows
  int filter_tile_cols;       // ... and classes
};

extern const ArchConstants kArchConstants[];
extern const int kNumArchConstants;

}  // namespace fused_ce
