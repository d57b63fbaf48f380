// The loss and its gradients from the stages (stages.h), with the argument
// checks. The same code serves CPU and CUDA; on CUDA it uses the embedded
// Triton kernels where a cubin fits the device and the ATen stages otherwise.
#include "loss.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda_driver.h"
#include "format.h"
#include "stages.h"

namespace fused_ce {
namespace {

enum class Reduction { None, Mean, Sum };

struct LossOptions {
  Reduction reduction;
  int64_t ignore_index;
  double label_smoothing;
  double z_loss;
  std::optional<double> softcap;
  double logit_scale;
  std::optional<int64_t> workspace_bytes;
};

// 2048 rows of logits at V = 128256 (1024 at V = 256000) in bf16, so that the
// whole workspace stays under 0.5 GiB.
constexpr int64_t kDefaultCudaWorkspace = int64_t{504} << 20;
constexpr int64_t kDefaultCpuWorkspace = int64_t{32} << 20;

Reduction parse_reduction(c10::string_view r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  TORCH_CHECK(false, "linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got '", std::string(r), "'");
  return Reduction::Mean;  // not reached
}

LossOptions make_options(c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap, double logit_scale, std::optional<int64_t> workspace_bytes) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
              "linear_cross_entropy: label_smoothing must be in [0, 1], got ", num(label_smoothing));
  TORCH_CHECK(z_loss >= 0.0 && std::isfinite(z_loss), "linear_cross_entropy: z_loss must be a finite value >= 0, got ",
              num(z_loss));
  TORCH_CHECK(!softcap || (*softcap > 0.0 && std::isfinite(*softcap)),
              "linear_cross_entropy: softcap must be a finite value > 0 (or None), got ", num(softcap.value_or(0.0)));
  TORCH_CHECK(std::isfinite(logit_scale), "linear_cross_entropy: logit_scale must be finite, got ", num(logit_scale));
  TORCH_CHECK(!workspace_bytes || *workspace_bytes > 0,
              "linear_cross_entropy: workspace_bytes must be positive (or None), got ", num(workspace_bytes.value_or(0)));
  return {parse_reduction(reduction), ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes};
}

at::ScalarType loss_dtype(const Problem& p) {
  return p.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

bool use_kernels(const Problem& p);
GradCoefficients grad_coefficients(const Problem& p, const LossOptions& o, const at::Tensor& grad_loss,
                                   const std::optional<at::Tensor>& grad_lse);

// Checks the arguments and builds the 2-D problem. With `check_targets`, a
// class index outside [0, V) that is not ignore_index is an error (one device
// sync); the backward skips that, the forward has checked the same targets.
// With `unit`, also the gradient coefficients of the (scalar) loss for an
// upstream gradient of 1. On the kernel path one launch does all of that
// (cuda_prepare_rows).
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o, bool check_targets, GradCoefficients* unit = nullptr) {
  TORCH_CHECK(input.dim() >= 1, "linear_cross_entropy: input must have at least one dimension [..., D]");
  TORCH_CHECK(linear_weight.dim() == 2, "linear_cross_entropy: linear_weight must be 2-D [V, D], got shape ",
              shape(linear_weight.sizes()));
  const int64_t D = input.size(-1);
  const int64_t V = linear_weight.size(0);
  TORCH_CHECK(linear_weight.size(1) == D, "linear_cross_entropy: linear_weight has ", num(linear_weight.size(1)),
              " features but input has ", num(D));
  TORCH_CHECK(V > 0, "linear_cross_entropy: linear_weight must have at least one class (row)");
  const auto dtype = input.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype) && dtype != at::kFloat8_e4m3fn,
              "linear_cross_entropy: input must be a floating-point tensor, got ", name(dtype));
  TORCH_CHECK(linear_weight.scalar_type() == dtype, "linear_cross_entropy: linear_weight dtype ",
              name(linear_weight.scalar_type()), " does not match input dtype ", name(dtype));
  TORCH_CHECK(linear_weight.device() == input.device(), "linear_cross_entropy: linear_weight is on ",
              linear_weight.device().str(), " but input is on ", input.device().str());
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()),
              "linear_cross_entropy: target must hold class indices (int64 or int32); class-probability targets "
              "are not supported");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "linear_cross_entropy: target must be int64 or int32, got ", name(target.scalar_type()));
  TORCH_CHECK(target.device() == input.device(), "linear_cross_entropy: target is on ", target.device().str(),
              " but input is on ", input.device().str());
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK(target.sizes() == batch, "linear_cross_entropy: target shape ", shape(target.sizes()),
              " must equal input shape without its last dimension ", shape(batch));

  Problem p;
  p.N = input.numel() / std::max<int64_t>(D, 1);
  if (D == 0) p.N = target.numel();
  p.V = V;
  p.D = D;
  p.x = input.reshape({p.N, D});
  p.w = linear_weight;
  p.logit_scale = o.logit_scale;
  p.softcap = o.softcap;
  if (linear_bias && linear_bias->defined()) {
    const at::Tensor& b = *linear_bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == V, "linear_cross_entropy: linear_bias must have shape [", num(V),
                "], got ", shape(b.sizes()));
    TORCH_CHECK(b.scalar_type() == dtype, "linear_cross_entropy: linear_bias dtype ", name(b.scalar_type()),
                " does not match input dtype ", name(dtype));
    TORCH_CHECK(b.device() == input.device(), "linear_cross_entropy: linear_bias is on ", b.device().str(),
                " but input is on ", input.device().str());
    p.bias = b.contiguous();
  }
  if (weight && weight->defined()) {
    const at::Tensor& cw = *weight;
    TORCH_CHECK(cw.dim() == 1 && cw.size(0) == V, "linear_cross_entropy: weight (class weights) must have shape [",
                num(V), "], got ", shape(cw.sizes()));
    TORCH_CHECK(at::isFloatingType(cw.scalar_type()), "linear_cross_entropy: weight (class weights) must be "
                "floating point, got ", name(cw.scalar_type()));
    TORCH_CHECK(cw.device() == input.device(), "linear_cross_entropy: weight (class weights) is on ", cw.device().str(),
                " but input is on ", input.device().str());
    p.class_weight = cw.to(dtype == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  }
  const at::Tensor t = target.reshape({p.N}).to(at::kLong).contiguous();
  const auto bad_targets_error = [&] {
    TORCH_CHECK(false, "linear_cross_entropy: target holds class indices outside [0, ", num(V),
                ") that are not ignore_index (", num(o.ignore_index), ")");
  };
  if (p.N > 0 && use_kernels(p)) {
    const at::Tensor bad = cuda_prepare_rows(p, t, o.ignore_index, o.label_smoothing, o.z_loss,
                                             o.reduction == Reduction::Mean, unit);
    if (check_targets && bad.item<int>() != 0) bad_targets_error();
    return p;
  }
  const at::Tensor ignored = t.eq(o.ignore_index);
  if (check_targets && p.N > 0) {
    if (ignored.logical_not().logical_and_(t.lt(0).logical_or_(t.ge(V))).any().item<bool>()) bad_targets_error();
  }
  p.target = at::where(ignored, -1, t).contiguous();
  if (unit != nullptr) *unit = grad_coefficients(p, o, at::ones({}, p.x.options().dtype(loss_dtype(p))), std::nullopt);
  return p;
}

int64_t workspace_bytes(const Problem& p, const LossOptions& o) {
  return o.workspace_bytes.value_or(p.x.is_cuda() ? kDefaultCudaWorkspace : kDefaultCpuWorkspace);
}

bool use_kernels(const Problem& p) {
  if (!p.x.is_cuda() || p.N == 0) return false;
  if (cuda_kernels_available(p)) return true;
  const auto dtype = p.x.scalar_type();
  const bool kernel_dtype = dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat;
  if (kernel_dtype && !cuda_kernels_disabled()) {
    TORCH_WARN_ONCE("fused_ce: this build has no kernel for sm_", num(device_arch(p.x.device().index())),
                    "; using the slower chunked ATen path on CUDA. Rebuild with this architecture in "
                    "FUSED_CE_CUDA_ARCHS (see fused_ce.cuda_archs()).");
  }
  return false;
}

// Per-row validity and target class weight, in the loss dtype.
std::pair<at::Tensor, at::Tensor> row_weights(const Problem& p) {
  const auto dtype = loss_dtype(p);
  const at::Tensor valid = p.target.ge(0).to(dtype);
  if (!p.class_weight.defined()) return {valid, valid};
  return {valid, p.class_weight.to(dtype).index_select(0, p.target.clamp_min(0)) * valid};
}

at::Tensor class_weight_sum(const Problem& p) {
  return p.class_weight.defined() ? p.class_weight.sum().to(loss_dtype(p))
                                  : at::scalar_tensor(static_cast<double>(p.V), p.x.options().dtype(loss_dtype(p)));
}

at::Tensor safe_reciprocal(const at::Tensor& s) {
  return at::where(s.gt(0), s.reciprocal(), at::zeros_like(s));
}

RowStats empty_stats(const Problem& p) {
  const auto opts = p.x.options().dtype(loss_dtype(p));
  return {at::empty({0}, opts), at::empty({0}, opts), at::empty({0}, opts)};
}

// The loss from the row stats (torch's semantics for weights and smoothing).
at::Tensor assemble_loss(const Problem& p, const LossOptions& o, const RowStats& s, at::IntArrayRef target_shape) {
  if (p.totals.defined()) {  // rows prepared on the device: one kernel
    const int code = o.reduction == Reduction::None ? 0 : o.reduction == Reduction::Mean ? 1 : 2;
    const at::Tensor loss = cuda_assemble_loss(p, s, o.label_smoothing, o.z_loss, code);
    return code == 0 ? loss.reshape(target_shape) : loss.reshape({});
  }
  const auto [valid, wt] = row_weights(p);
  const double eps = o.label_smoothing;
  at::Tensor loss = (1.0 - eps) * wt * (s.lse - s.target_logit);
  if (eps > 0.0) {
    loss = loss + (eps / p.V) * valid * (class_weight_sum(p) * s.lse - s.weighted_z_sum);
  }
  const at::Tensor z_term = o.z_loss > 0.0 ? o.z_loss * valid * s.lse.square() : at::Tensor();
  switch (o.reduction) {
    case Reduction::None:
      if (z_term.defined()) loss = loss + z_term;
      return loss.reshape(target_shape);
    case Reduction::Sum:
      loss = loss.sum();
      return z_term.defined() ? loss + z_term.sum() : loss;
    case Reduction::Mean:  // like torch: weighted mean, NaN when nothing is counted
      loss = loss.sum() / wt.sum();
      return z_term.defined() ? loss + z_term.sum() / valid.sum() : loss;
  }
  return loss;
}

// The coefficients of the logit gradient (stages.h) for an upstream gradient
// `grad_loss` (0-dim for 'mean'/'sum', [N] for 'none') and optionally one on
// the lse; `lse` is left for the caller.
GradCoefficients grad_coefficients(const Problem& p, const LossOptions& o, const at::Tensor& grad_loss,
                                   const std::optional<at::Tensor>& grad_lse) {
  const auto dtype = loss_dtype(p);
  const auto [valid, wt] = row_weights(p);
  const double eps = o.label_smoothing;
  at::Tensor g_ce, g_z;
  if (o.reduction == Reduction::None) {
    g_ce = g_z = grad_loss.reshape({p.N}).to(dtype);
  } else {
    const at::Tensor g = grad_loss.to(dtype).reshape({});
    g_ce = o.reduction == Reduction::Mean ? g * safe_reciprocal(wt.sum()) : g;
    g_z = o.reduction == Reduction::Mean ? g * safe_reciprocal(valid.sum()) : g;
  }
  const auto per_row = [&](const at::Tensor& t) { return t.expand({p.N}).contiguous(); };
  at::Tensor alpha = g_ce * ((1.0 - eps) * wt + (eps / p.V) * class_weight_sum(p) * valid);
  if (grad_lse && grad_lse->defined()) alpha = alpha + grad_lse->reshape({p.N}).to(dtype);
  GradCoefficients c;
  c.alpha = per_row(alpha);
  c.alpha_lse = per_row((2.0 * o.z_loss) * g_z * valid);
  c.beta = per_row(g_ce * (1.0 - eps) * wt);
  c.gamma = per_row(g_ce * (eps / p.V) * valid);
  return c;
}

// Rows of stored logits that fit in the workspace, for the paths that store
// logits (cuBLAS GEMMs); 0 when they must not be stored: float16 logits could
// overflow, so float16 uses the tl.dot tiles (fp32 accumulators) instead.
constexpr int64_t kMinCublasRows = 512;  // below this the logits GEMM loses efficiency
constexpr int64_t kGemmTileRows = 128;   // cuBLAS's row tile: blocks in whole tiles waste none

int64_t max_logits_rows(const Problem& p, const LossOptions& o) {
  if (p.x.scalar_type() == at::kHalf) return 0;
  return std::clamp<int64_t>(workspace_bytes(p, o) / cuda_logits_row_bytes(p), 1, std::max<int64_t>(p.N, 1));
}

// The rows per block actually used: at most `capacity`, in whole GEMM tiles,
// and balanced so that the last block is not a short tail (a thin block runs
// its GEMMs below their rate).
int64_t balanced_block_rows(int64_t N, int64_t capacity) {
  if (capacity >= N) return std::max<int64_t>(N, 1);
  const int64_t quantum = capacity >= kGemmTileRows ? kGemmTileRows : 1;
  const int64_t limit = capacity / quantum * quantum;
  const int64_t blocks = (N + limit - 1) / limit;
  const int64_t rows = (N + blocks - 1) / blocks;
  return (rows + quantum - 1) / quantum * quantum;  // <= limit
}

// raw logits x @ w.T + b of the rows of `p` into `out`
void logits_into(const Problem& p, at::Tensor& out) {
  if (p.bias.defined()) {
    at::addmm_out(out, p.bias, p.x, p.w.t());
  } else {
    at::mm_out(out, p.x, p.w.t());
  }
}

// Label smoothing's class-weighted logit sum is linear in the logits when there
// is no softcap: sum_c cw_c z_c = logit_scale * (x @ u + b . cw) with
// u = w.T @ cw, two GEMVs instead of a class-weight load per logit in the row
// kernel (which costs several % at V = 128K); the gradient's matching term
// -gamma * cw is rank one too (linear_cross_entropy_with_grad).
bool rank_one_smoothing(const Problem& p, bool need_wz) {
  return need_wz && p.class_weight.defined() && !p.softcap.has_value();
}

at::Tensor class_weighted_w(const Problem& p) {  // u = w.T @ cw, [D]
  return at::mv(p.w.t(), p.class_weight.to(p.w.scalar_type()));
}

at::Tensor weighted_z_sum(const Problem& p, const at::Tensor& u) {  // [N] float32
  at::Tensor wz = at::mv(p.x, u).to(at::kFloat);
  if (p.bias.defined()) wz.add_((p.bias.to(at::kFloat) * p.class_weight).sum());
  return wz.mul_(p.logit_scale);
}

RowStats stats_from_logit_blocks(const Problem& p, int64_t rows, bool need_wz) {
  const auto opts = p.x.options().dtype(at::kFloat);
  const bool rank_one = rank_one_smoothing(p, need_wz);
  if (rank_one) need_wz = false;  // not from the kernel
  RowStats s{at::empty({p.N}, opts), at::empty({p.N}, opts), need_wz ? at::empty({p.N}, opts) : at::Tensor()};
  if (rank_one) s.weighted_z_sum = weighted_z_sum(p, class_weighted_w(p));
  at::Tensor buffer = at::empty({rows, p.V}, p.x.options());
  for (int64_t r0 = 0; r0 < p.N; r0 += rows) {
    const int64_t r1 = std::min(p.N, r0 + rows);
    const Problem pr = p.rows(r0, r1);
    at::Tensor logits = buffer.narrow(0, 0, r1 - r0);
    logits_into(pr, logits);
    cuda_stats_from_logits(pr, logits, s.rows(r0, r1), need_wz);
  }
  return s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes_opt) {
  const LossOptions o =
      make_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes_opt);
  const Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o, /*check_targets=*/true);
  const bool need_wz = o.label_smoothing > 0.0;
  RowStats s;
  if (p.N == 0) {
    s = empty_stats(p);
  } else if (use_kernels(p)) {
    const int64_t capacity = max_logits_rows(p, o);
    if (capacity >= kMinCublasRows || capacity == p.N) {
      // cuBLAS writes blocks of logits, a row pass reduces them
      s = stats_from_logit_blocks(p, balanced_block_rows(p.N, capacity), need_wz);
    } else {
      s = cuda_row_stats(p, need_wz);  // no room for logits: tl.dot tiles reduced in registers
    }
  } else {
    const int64_t row_bytes = p.V * c10::elementSize(loss_dtype(p));
    s = aten_row_stats(p, need_wz, std::max<int64_t>(1, workspace_bytes(p, o) / row_bytes));
  }
  return {assemble_loss(p, o, s, target.sizes()), s.lse.reshape(target.sizes())};
}

namespace {

// How the recomputing backward splits the work: blocks of `rows` x `cols` logits.
struct BlockPlan {
  int64_t rows, cols;
};

BlockPlan plan_blocks(const Problem& p, int64_t budget, bool kernels, int64_t elem) {
  if (kernels) {
    // All rows at once, a slice of the vocabulary per block: each slice's
    // weight gradient is one exact GEMM over every row.
    const int64_t quantum = 256;
    int64_t cols = std::max<int64_t>(quantum, budget / std::max<int64_t>(1, p.N * elem) / quantum * quantum);
    cols = std::min(cols, p.V);
    const int64_t rows = std::clamp<int64_t>(budget / (cols * elem), 1, p.N);
    return {rows, cols};
  }
  // ATen (float32 arithmetic): whole vocabulary rows, as many rows as fit.
  return {std::clamp<int64_t>(budget / (p.V * elem), 1, p.N), p.V};
}

// out (+)= a @ b, accumulating in out's dtype.
void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (out.scalar_type() == a.scalar_type()) {
    if (accumulate) {
      out.addmm_(a, b);
    } else {
      at::mm_out(out, a, b);
    }
  } else if (accumulate) {
    out.add_(at::mm(a, b));
  } else {
    out.copy_(at::mm(a, b));
  }
}

at::Tensor empty_grad(const Problem& p) {
  return at::empty({0}, p.x.options());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, c10::string_view reduction, int64_t ignore_index,
    double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes_opt, std::array<bool, 3> output_mask) {
  const LossOptions o =
      make_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes_opt);
  const Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o, /*check_targets=*/false);
  const auto dtype = loss_dtype(p);
  const bool need_x = output_mask[0], need_w = output_mask[1], need_b = output_mask[2] && p.bias.defined();

  GradCoefficients c = grad_coefficients(p, o, grad_loss, grad_lse);
  c.lse = lse.reshape({p.N}).to(dtype).contiguous();

  const bool kernels = use_kernels(p);
  const auto gemm_dtype = kernels ? p.x.scalar_type() : dtype;
  const int64_t elem = c10::elementSize(gemm_dtype);
  const BlockPlan plan = plan_blocks(p, workspace_bytes(p, o), kernels, elem);
  const int64_t row_blocks = (p.N + plan.rows - 1) / std::max<int64_t>(plan.rows, 1);
  const int64_t col_blocks = (p.V + plan.cols - 1) / plan.cols;

  // Gradients accumulate across blocks in float32 where there is more than one
  // block along the reduced dimension.
  const auto opts = p.x.options();
  const auto acc_dtype = [&](int64_t blocks) {
    return blocks > 1 ? at::promote_types(gemm_dtype, at::kFloat) : gemm_dtype;
  };
  at::Tensor grad_x = need_x ? at::empty({p.N, p.D}, opts.dtype(acc_dtype(col_blocks))) : at::Tensor();
  at::Tensor grad_w = need_w ? at::empty({p.V, p.D}, opts.dtype(acc_dtype(row_blocks))) : at::Tensor();
  at::Tensor grad_b = need_b ? at::zeros({p.V}, opts.dtype(dtype)) : at::Tensor();
  if (need_x && p.V == 0) grad_x.zero_();
  if (need_w && p.N == 0) grad_w.zero_();
  const at::Tensor x = p.x.to(gemm_dtype);
  const at::Tensor w = p.w.to(gemm_dtype);
  at::Tensor block_buffer;
  if (kernels) {
    const int64_t ld = (plan.cols + 63) / 64 * 64;  // aligned rows for the kernel's stores and for cuBLAS
    block_buffer = at::empty({plan.rows, ld}, opts.dtype(gemm_dtype));
  }
  for (int64_t r0 = 0; r0 < p.N && (need_x || need_w || need_b); r0 += plan.rows) {
    const int64_t r1 = std::min(p.N, r0 + plan.rows);
    const Problem pr = p.rows(r0, r1);
    const GradCoefficients cr = c.rows(r0, r1);
    for (int64_t v0 = 0; v0 < p.V; v0 += plan.cols) {
      const int64_t v1 = std::min(p.V, v0 + plan.cols);
      at::Tensor g;
      if (kernels) {
        g = block_buffer.narrow(0, 0, r1 - r0).narrow(1, 0, v1 - v0);
        cuda_logit_grad(pr, cr, v0, v1, g);
      } else {
        g = aten_logit_grad(pr, cr, v0, v1).to(gemm_dtype);
      }
      if (need_x) gemm_into(grad_x.narrow(0, r0, r1 - r0), g, w.narrow(0, v0, v1 - v0), v0 > 0);
      if (need_w) gemm_into(grad_w.narrow(0, v0, v1 - v0), g.t(), x.narrow(0, r0, r1 - r0), r0 > 0);
      if (need_b) grad_b.narrow(0, v0, v1 - v0).add_(g.sum(0, false, dtype));
    }
  }
  return {need_x ? grad_x.to(input.scalar_type()).reshape(input.sizes()) : empty_grad(p),
          need_w ? grad_w.to(linear_weight.scalar_type()) : empty_grad(p),
          need_b ? grad_b.to(p.bias.scalar_type()) : empty_grad(p)};
}

namespace {

constexpr int64_t kTileRows = 2048;  // rows of a 2-D tile: enough for the dW GEMM to stay compute-bound

// Blocks of whole vocabulary rows re-read and re-write dW once per block beyond
// the first. Where that traffic (at ~3 TB/s) would cost more than one more GEMM
// pass over N x D x V (at ~700 TFLOP/s), as in lean workspaces, the gradients
// come from 2-D tiles instead: kTileRows rows x a vocabulary slice, with the lse
// from a forward pass first. 8NDV of GEMM work instead of 6NDV, but dW is
// re-read only once per kTileRows rows. Returns the slice width, 0 for row blocks.
// Measured at 64 MiB (benchmarks/NOTES.md, step 14): tiles win at B (128-row
// blocks) by a third, lose at A and C (256-row blocks) by ~3%; the threshold
// is not tuned yet.
int64_t vocab_slice_cols(const Problem& p, const LossOptions& o, int64_t block_rows) {
  const int64_t elem = c10::elementSize(p.x.scalar_type());
  const int64_t blocks = (p.N + block_rows - 1) / block_rows;
  const double dw_traffic_s = static_cast<double>(blocks - 1) * 2.0 * p.V * p.D * elem / 3e12;
  const double gemm_pass_s = 2.0 * p.N * p.D * p.V / 700e12;
  if (dw_traffic_s <= gemm_pass_s) return 0;
  const int64_t cols = workspace_bytes(p, o) / (std::min(p.N, kTileRows) * elem) / kGemmTileRows * kGemmTileRows;
  return cols >= 4 * kGemmTileRows && cols < p.V ? cols : 0;
}

// The forward with gradient in 2-D tiles (vocab_slice_cols): the row stats
// from blocks of whole rows as in the loss-only forward, then per tile the
// logits again, their gradient in place and its products with W and X.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> with_grad_in_tiles(
    const Problem& p, const GradCoefficients& c, const LossOptions& o, int64_t cols, std::array<bool, 3> need,
    const at::Tensor& input, const at::Tensor& target) {
  const bool need_wz = o.label_smoothing > 0.0;
  const RowStats s = stats_from_logit_blocks(p, balanced_block_rows(p.N, max_logits_rows(p, o)), need_wz);
  const int64_t rows = balanced_block_rows(p.N, std::min(p.N, kTileRows));
  const auto opts = p.x.options();
  // dX accumulates over slices and dW over row tiles, in the input dtype as
  // cuBLAS's addmm does (a float32 dX or dW would not fit a lean workspace).
  at::Tensor grad_x = need[0] ? at::empty({p.N, p.D}, opts) : at::Tensor();
  at::Tensor grad_w = need[1] ? at::empty({p.V, p.D}, opts) : at::Tensor();
  at::Tensor grad_b = need[2] ? at::zeros({p.V}, opts.dtype(loss_dtype(p))) : at::Tensor();
  const at::Tensor buffer = at::empty({rows * cols}, opts);
  for (int64_t r0 = 0; r0 < p.N; r0 += rows) {
    const int64_t r1 = std::min(p.N, r0 + rows);
    const Problem pr = p.rows(r0, r1);
    const GradCoefficients cr = c.rows(r0, r1);
    const at::Tensor lse = s.lse.narrow(0, r0, r1 - r0);
    for (int64_t v0 = 0; v0 < p.V; v0 += cols) {
      const int64_t v1 = std::min(p.V, v0 + cols);
      const Problem pt = pr.cols(v0, v1);
      at::Tensor g = buffer.narrow(0, 0, pt.N * pt.V).view({pt.N, pt.V});  // contiguous, also the last slice
      logits_into(pt, g);
      cuda_softmax_grad(pt, cr, lse, g, need_wz);
      if (need[0]) gemm_into(grad_x.narrow(0, r0, r1 - r0), g, pt.w, v0 > 0);
      if (need[1]) gemm_into(grad_w.narrow(0, v0, v1 - v0), g.t(), pr.x, r0 > 0);
      if (need[2]) grad_b.narrow(0, v0, v1 - v0).add_(g.sum(0, false, loss_dtype(p)));
    }
  }
  return {assemble_loss(p, o, s, target.sizes()), s.lse.reshape(target.sizes()),
          need[0] ? grad_x.reshape(input.sizes()) : empty_grad(p), need[1] ? grad_w : empty_grad(p),
          need[2] ? grad_b.to(p.bias.scalar_type()) : empty_grad(p)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes_opt, std::array<bool, 3> output_mask) {
  const LossOptions o =
      make_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes_opt);
  TORCH_CHECK(o.reduction != Reduction::None,
              "linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum' (a scalar loss)");
  GradCoefficients c;
  const Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o, /*check_targets=*/true, &c);
  const auto dtype = loss_dtype(p);
  const bool need_x = output_mask[0], need_w = output_mask[1], need_b = output_mask[2] && p.bias.defined();
  const bool need_wz = o.label_smoothing > 0.0;

  const bool kernels = use_kernels(p);
  if (kernels && max_logits_rows(p, o) == 0) {
    // Stored float16 logits could overflow: recompute them in float32 tiles instead.
    auto [loss, lse] = linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                            ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                                            workspace_bytes_opt);
    auto [gx, gw, gb] = linear_cross_entropy_backward(at::ones({}, lse.options()), std::nullopt, input,
                                                      linear_weight, target, linear_bias, weight, lse, reduction,
                                                      ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                                                      workspace_bytes_opt, output_mask);
    return {loss, lse, gx, gw, gb};
  }
  // Blocks of whole vocabulary rows: each row's gradient is final once its
  // block is done, so grad_input is written once; grad_weight accumulates over
  // blocks (float32 on the ATen path; in the weight's dtype with the kernels,
  // as cuBLAS's addmm does, to stay within the workspace).
  const auto gemm_dtype = kernels ? p.x.scalar_type() : dtype;
  const int64_t elem = c10::elementSize(gemm_dtype);
  const int64_t rows = kernels ? balanced_block_rows(p.N, max_logits_rows(p, o))
                               : std::clamp<int64_t>(workspace_bytes(p, o) / (p.V * elem), 1, std::max<int64_t>(p.N, 1));
  if (kernels && p.N > 0) {
    const int64_t cols = vocab_slice_cols(p, o, rows);
    if (cols > 0) return with_grad_in_tiles(p, c, o, cols, {need_x, need_w, need_b}, input, target);
  }
  const int64_t row_blocks = (p.N + rows - 1) / rows;
  const auto opts = p.x.options();
  at::Tensor grad_x = need_x ? at::empty({p.N, p.D}, opts.dtype(gemm_dtype)) : at::Tensor();
  const auto w_acc = kernels || row_blocks <= 1 ? gemm_dtype : at::promote_types(gemm_dtype, at::kFloat);
  at::Tensor grad_w = need_w ? at::empty({p.V, p.D}, opts.dtype(w_acc)) : at::Tensor();
  at::Tensor grad_b = need_b ? at::zeros({p.V}, opts.dtype(dtype)) : at::Tensor();
  if (need_w && p.N == 0) grad_w.zero_();
  // The kernel leaves out the rank-one smoothing terms (rank_one_smoothing):
  // dX -= logit_scale * gamma (x) u, dW -= logit_scale * cw (x) (x.T @ gamma),
  // db -= logit_scale * cw * sum(gamma), and the weighted logit sums come from u.
  const bool rank_one = kernels && rank_one_smoothing(p, need_wz);
  const bool wz_from_rows = need_wz && !rank_one;
  RowStats s = empty_stats(p);
  if (p.N > 0) {
    const auto sopts = opts.dtype(dtype);
    s = {at::empty({p.N}, sopts), at::empty({p.N}, sopts), wz_from_rows ? at::empty({p.N}, sopts) : at::Tensor()};
  }
  const at::Tensor x = p.x.to(gemm_dtype);
  const at::Tensor w = p.w.to(gemm_dtype);
  at::Tensor u, neg_gamma;
  if (rank_one) {
    u = class_weighted_w(p);
    neg_gamma = c.gamma * -p.logit_scale;  // [N] float32
    s.weighted_z_sum = weighted_z_sum(p, u);
    if (need_w) grad_w = at::outer(p.class_weight.to(gemm_dtype), at::mv(x.t(), neg_gamma.to(gemm_dtype)));
    if (need_b) grad_b.add_(p.class_weight * neg_gamma.sum());
  }
  at::Tensor logits_buffer = kernels ? at::empty({rows, p.V}, opts.dtype(gemm_dtype)) : at::Tensor();
  for (int64_t r0 = 0; r0 < p.N; r0 += rows) {
    const int64_t r1 = std::min(p.N, r0 + rows);
    const Problem pr = p.rows(r0, r1);
    const GradCoefficients cr = c.rows(r0, r1);
    const RowStats block_stats = s.rows(r0, r1);
    at::Tensor g;
    if (kernels) {
      g = logits_buffer.narrow(0, 0, r1 - r0);
      logits_into(pr, g);
      cuda_stats_from_logits(pr, g, block_stats, wz_from_rows);
      cuda_softmax_grad(pr, cr, block_stats.lse, g, wz_from_rows);
    } else {
      RowStats part;
      std::tie(part, g) = aten_stats_and_logit_grad(pr, cr, wz_from_rows);
      g = g.to(gemm_dtype);
      block_stats.lse.copy_(part.lse);
      block_stats.target_logit.copy_(part.target_logit);
      if (wz_from_rows) block_stats.weighted_z_sum.copy_(part.weighted_z_sum);
    }
    if (need_x) {
      at::Tensor gx = grad_x.narrow(0, r0, r1 - r0);
      if (rank_one) {
        at::addmm_out(gx, at::outer(neg_gamma.narrow(0, r0, r1 - r0).to(gemm_dtype), u), g, w);
      } else {
        gemm_into(gx, g, w, /*accumulate=*/false);
      }
    }
    if (need_w) gemm_into(grad_w, g.t(), x.narrow(0, r0, r1 - r0), r0 > 0 || rank_one);
    if (need_b) grad_b.add_(g.sum(0, false, dtype));
  }
  return {assemble_loss(p, o, s, target.sizes()), s.lse.reshape(target.sizes()),
          need_x ? grad_x.to(input.scalar_type()).reshape(input.sizes()) : empty_grad(p),
          need_w ? grad_w.to(linear_weight.scalar_type()) : empty_grad(p),
          need_b ? grad_b.to(p.bias.scalar_type()) : empty_grad(p)};
}

void scale_grad_(const at::Tensor& grad, const at::Tensor& scale) {
  TORCH_CHECK(scale.numel() == 1, "fused_ce::_scale_grad_: scale must hold one value, got shape ", shape(scale.sizes()));
  TORCH_CHECK(scale.device() == grad.device() || (scale.is_cpu() && scale.dim() == 0),
              "fused_ce::_scale_grad_: scale is on ", scale.device().str(), " but grad is on ", grad.device().str());
  if (grad.numel() == 0) return;
  const at::Tensor s = scale.reshape({});
  if (grad.is_cuda() && cuda_scale_(grad, s)) return;
  grad.mul_(s);
}

}  // namespace fused_ce
