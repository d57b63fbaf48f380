// grad_filter_eps's stages on CUDA (cuda_stages.h): the tile mask of a block's gradient and the products over its
// live tiles (grad_tile_mask.py, sparse_grad_input.py, sparse_grad_weight.py).
#include <ATen/ATen.h>

#include <algorithm>

#include "cuda_driver.h"
#include "cuda_stages.h"
#include "kernel_args.h"

namespace fused_ce {
namespace {

// 16-byte aligned rows: the "aligned" variants' assumption on a 2-D operand
bool aligned16_rows(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 16 == 0;
}

// The kernel's variant for g's dtype: "aligned" where g, every tensor of `rest`, V and D fit its assumptions.
const KernelVariant& grad_tiles_variant(const char* kernel, const at::Tensor& g, std::initializer_list<at::Tensor> rest,
                                        int64_t D) {
  const char* dtype = cuda_kernel_dtype(g.scalar_type());
  TORCH_CHECK(dtype != nullptr, "fused_ce: ", kernel, " has no kernel for ", g.scalar_type());
  const int arch = device_arch(g.device().index());
  bool fits = aligned16_rows(g) && g.size(1) % 16 == 0 && D % 16 == 0;
  for (const at::Tensor& t : rest) fits = fits && aligned16_rows(t);
  const KernelVariant* aligned = fits ? find_variant(kernel, dtype, "aligned", arch) : nullptr;
  const KernelVariant* v = aligned != nullptr ? aligned : find_variant(kernel, dtype, "general", arch);
  TORCH_CHECK(v != nullptr, "fused_ce: no embedded ", kernel, " kernel for this device and ", dtype);
  return *v;
}

void check_block(const at::Tensor& g) {
  TORCH_CHECK(g.dim() == 2 && g.stride(1) == 1, "fused_ce: bad gradient block");
}

}  // namespace

void cuda_grad_tile_mask(const at::Tensor& g, const at::Tensor& threshold, const at::Tensor& target,
                         const at::Tensor& mask, int64_t tile_rows, int64_t tile_cols) {
  check_block(g);
  const KernelVariant& v = grad_tiles_variant("grad_tile_mask", g, {}, 16);
  TORCH_CHECK(v.block_n == tile_rows && v.block_v == tile_cols, "fused_ce: the embedded grad_tile_mask's tiles (",
              v.block_n, " x ", v.block_v, ") are not the plan's (", tile_rows, " x ", tile_cols, ")");
  TORCH_CHECK(mask.scalar_type() == at::kInt && mask.is_contiguous() &&
                  mask.size(0) == launch_cdiv(g.size(0), tile_rows) &&
                  mask.size(1) == launch_cdiv(g.size(1), tile_cols),
              "fused_ce: bad tile mask");
  GradTileMaskArgs a;
  a.g_ptr = g;
  a.thr_ptr = threshold;
  a.tgt_ptr = target;
  a.mask_ptr = mask;
  a.N = g.size(0);
  a.V = g.size(1);
  a.stride_gn = g.stride(0);
  a.mask_cols = mask.size(1);
  launch(v, g.device(), a);
}

int64_t cuda_sparse_grad_input_rows(const at::Tensor& g, int64_t D) {
  return grad_tiles_variant("sparse_grad_input", g, {}, D).block_n;
}

void cuda_sparse_grad_input(const at::Tensor& g, const at::Tensor& w, const at::Tensor& out, const LiveTiles& live,
                            double alpha) {
  check_block(g);
  const KernelVariant& v = grad_tiles_variant("sparse_grad_input", g, {w}, w.size(1));
  TORCH_CHECK(w.stride(1) == 1 && out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == g.size(0) &&
                  live.index.size(0) == launch_cdiv(g.size(0), v.block_n),
              "fused_ce: bad sparse_grad_input operands");
  // A block has few row tiles (32 at 2048 rows): each one's live list in parts, so that the programs fill the GPU
  // (kProgramsPerSm of them an SM, at most kMaxSplits parts, summed here in a fixed order; benchmarks/LOG.md,
  // step 61)
  constexpr int64_t kProgramsPerSm = 4, kMaxSplits = 8;
  const int64_t tiles = launch_cdiv(g.size(0), v.block_n) * launch_cdiv(w.size(1), v.block_d);
  const int64_t splits =
      std::clamp<int64_t>(launch_cdiv(kProgramsPerSm * device_sm_count(g.device().index()), tiles), 1, kMaxSplits);
  const at::Tensor parts = splits == 1 ? out : at::empty({splits, out.size(0), out.size(1)}, out.options());
  SparseGradInputArgs a;
  a.g_ptr = g;
  a.w_ptr = w;
  a.out_ptr = parts;
  a.live_ptr = live.index;
  a.count_ptr = live.count;
  a.N = g.size(0);
  a.V = g.size(1);
  a.D = w.size(1);
  a.stride_gn = g.stride(0);
  a.stride_wv = w.stride(0);
  a.stride_os = splits == 1 ? 0 : parts.stride(0);
  a.stride_on = out.size(1);
  a.live_cols = live.index.size(1);
  a.splits = splits;
  a.alpha = static_cast<float>(alpha);
  launch(v, g.device(), a);
  if (splits > 1) {
    at::Tensor sum = out;
    at::sum_out(sum, parts, 0);
  }
}

void cuda_sparse_grad_weight(const at::Tensor& g, const at::Tensor& x, const at::Tensor& dw, const LiveTiles& live,
                             double alpha, bool accumulate) {
  check_block(g);
  // dW summed in g's dtype is the flavor in_dtype (sparse_grad_weight.py)
  const bool in_dtype = dw.scalar_type() != at::kFloat;
  const KernelVariant& v =
      grad_tiles_variant(in_dtype ? "sparse_grad_weight_in_dtype" : "sparse_grad_weight", g, {x}, x.size(1));
  TORCH_CHECK(x.stride(1) == 1 && (!in_dtype || dw.scalar_type() == g.scalar_type()) && dw.stride(1) == 1 &&
                  dw.size(0) == g.size(1) && live.index.size(0) == launch_cdiv(g.size(1), v.block_v),
              "fused_ce: bad sparse_grad_weight operands");
  SparseGradWeightArgs a;
  a.g_ptr = g;
  a.x_ptr = x;
  a.acc_ptr = in_dtype ? at::Tensor() : dw;
  a.out_ptr = in_dtype ? dw : at::Tensor();
  a.live_ptr = live.index;
  a.count_ptr = live.count;
  a.N = g.size(0);
  a.V = g.size(1);
  a.D = x.size(1);
  a.stride_gn = g.stride(0);
  a.stride_xn = x.stride(0);
  a.stride_an = dw.stride(0);
  a.live_rows = live.index.size(1);
  a.alpha = static_cast<float>(alpha);
  a.accumulate = accumulate ? 1 : 0;
  launch(v, g.device(), a);
}

}  // namespace fused_ce
