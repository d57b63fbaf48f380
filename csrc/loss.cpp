// fused_ce::linear_cross_entropy: schema, argument checks, the loss and its
// gradient built from the stages (stages.h), and the autograd formula.
//
// The same implementation serves CPU and CUDA; on CUDA it uses the embedded
// Triton kernels where a cubin fits the device and the ATen stages otherwise.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_driver.h"
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

constexpr int64_t kDefaultCudaWorkspace = int64_t{256} << 20;
constexpr int64_t kDefaultCpuWorkspace = int64_t{64} << 20;

Reduction parse_reduction(c10::string_view r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  TORCH_CHECK(false, "linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got '", std::string(r), "'");
}

LossOptions make_options(c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap, double logit_scale, std::optional<int64_t> workspace_bytes) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
              "linear_cross_entropy: label_smoothing must be in [0, 1], got ", label_smoothing);
  TORCH_CHECK(z_loss >= 0.0 && std::isfinite(z_loss), "linear_cross_entropy: z_loss must be a finite value >= 0, got ",
              z_loss);
  TORCH_CHECK(!softcap || (*softcap > 0.0 && std::isfinite(*softcap)),
              "linear_cross_entropy: softcap must be a finite value > 0 (or None), got ", softcap.value_or(0.0));
  TORCH_CHECK(std::isfinite(logit_scale), "linear_cross_entropy: logit_scale must be finite, got ", logit_scale);
  TORCH_CHECK(!workspace_bytes || *workspace_bytes > 0,
              "linear_cross_entropy: workspace_bytes must be positive (or None), got ", workspace_bytes.value_or(0));
  return {parse_reduction(reduction), ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes};
}

// Checks the arguments and builds the 2-D problem. With `check_targets`, a
// class index outside [0, V) that is not ignore_index is an error (one device
// sync); the backward skips that, the forward has checked the same targets.
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     const LossOptions& o, bool check_targets) {
  TORCH_CHECK(input.dim() >= 1, "linear_cross_entropy: input must have at least one dimension [..., D]");
  TORCH_CHECK(linear_weight.dim() == 2, "linear_cross_entropy: linear_weight must be 2-D [V, D], got shape ",
              linear_weight.sizes());
  const int64_t D = input.size(-1);
  const int64_t V = linear_weight.size(0);
  TORCH_CHECK(linear_weight.size(1) == D, "linear_cross_entropy: linear_weight has ", linear_weight.size(1),
              " features but input has ", D);
  TORCH_CHECK(V > 0, "linear_cross_entropy: linear_weight must have at least one class (row)");
  const auto dtype = input.scalar_type();
  TORCH_CHECK(at::isFloatingType(dtype) && dtype != at::kFloat8_e4m3fn,
              "linear_cross_entropy: input must be a floating-point tensor, got ", dtype);
  TORCH_CHECK(linear_weight.scalar_type() == dtype, "linear_cross_entropy: linear_weight dtype ",
              linear_weight.scalar_type(), " does not match input dtype ", dtype);
  TORCH_CHECK(linear_weight.device() == input.device(), "linear_cross_entropy: linear_weight is on ",
              linear_weight.device(), " but input is on ", input.device());
  TORCH_CHECK(!at::isFloatingType(target.scalar_type()),
              "linear_cross_entropy: target must hold class indices (int64 or int32); class-probability targets "
              "are not supported");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "linear_cross_entropy: target must be int64 or int32, got ", target.scalar_type());
  TORCH_CHECK(target.device() == input.device(), "linear_cross_entropy: target is on ", target.device(),
              " but input is on ", input.device());
  const auto batch = input.sizes().slice(0, input.dim() - 1);
  TORCH_CHECK(target.sizes() == batch, "linear_cross_entropy: target shape ", target.sizes(),
              " must equal input shape without its last dimension ", batch);

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
    TORCH_CHECK(b.dim() == 1 && b.size(0) == V, "linear_cross_entropy: linear_bias must have shape [", V,
                "], got ", b.sizes());
    TORCH_CHECK(b.scalar_type() == dtype, "linear_cross_entropy: linear_bias dtype ", b.scalar_type(),
                " does not match input dtype ", dtype);
    TORCH_CHECK(b.device() == input.device(), "linear_cross_entropy: linear_bias is on ", b.device(),
                " but input is on ", input.device());
    p.bias = b.contiguous();
  }
  if (weight && weight->defined()) {
    const at::Tensor& cw = *weight;
    TORCH_CHECK(cw.dim() == 1 && cw.size(0) == V, "linear_cross_entropy: weight (class weights) must have shape [",
                V, "], got ", cw.sizes());
    TORCH_CHECK(at::isFloatingType(cw.scalar_type()), "linear_cross_entropy: weight (class weights) must be "
                "floating point, got ", cw.scalar_type());
    TORCH_CHECK(cw.device() == input.device(), "linear_cross_entropy: weight (class weights) is on ", cw.device(),
                " but input is on ", input.device());
    p.class_weight = cw.to(dtype == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  }
  const at::Tensor t = target.reshape({p.N}).to(at::kLong);
  const at::Tensor ignored = t.eq(o.ignore_index);
  if (check_targets && p.N > 0) {
    const bool bad = ignored.logical_not().logical_and_(t.lt(0).logical_or_(t.ge(V))).any().item<bool>();
    TORCH_CHECK(!bad, "linear_cross_entropy: target holds class indices outside [0, ", V,
                ") that are not ignore_index (", o.ignore_index, ")");
  }
  p.target = at::where(ignored, -1, t).contiguous();
  return p;
}

at::ScalarType loss_dtype(const Problem& p) {
  return p.x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

int64_t workspace_bytes(const Problem& p, const LossOptions& o) {
  return o.workspace_bytes.value_or(p.x.is_cuda() ? kDefaultCudaWorkspace : kDefaultCpuWorkspace);
}

bool use_kernels(const Problem& p) {
  if (!p.x.is_cuda() || p.N == 0) return false;
  if (cuda_kernels_available(p)) return true;
  const auto dtype = p.x.scalar_type();
  if (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) {
    TORCH_WARN_ONCE("fused_ce: this build has no kernel for sm_", device_arch(p.x.device().index()),
                    "; using the slower chunked ATen path on CUDA. Rebuild with this architecture in "
                    "FUSED_CE_CUDA_ARCHS (see fused_ce.cuda_archs()).");
  }
  return false;
}

RowStats row_stats(const Problem& p, const LossOptions& o) {
  const bool need_wz = o.label_smoothing > 0.0;
  if (use_kernels(p)) return cuda_row_stats(p, need_wz);
  const int64_t row_bytes = p.V * c10::elementSize(loss_dtype(p));
  return aten_row_stats(p, need_wz, std::max<int64_t>(1, workspace_bytes(p, o) / row_bytes));
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

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes_opt) {
  const LossOptions o =
      make_options(reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes_opt);
  const Problem p = make_problem(input, linear_weight, target, linear_bias, weight, o, /*check_targets=*/true);
  const auto dtype = loss_dtype(p);
  RowStats s = p.N > 0 ? row_stats(p, o)
                       : RowStats{at::empty({0}, p.x.options().dtype(dtype)), at::empty({0}, p.x.options().dtype(dtype)),
                                  at::empty({0}, p.x.options().dtype(dtype))};
  const auto [valid, wt] = row_weights(p);
  const double eps = o.label_smoothing;
  at::Tensor loss = (1.0 - eps) * wt * (s.lse - s.target_logit);
  if (eps > 0.0) {
    loss = loss + (eps / p.V) * valid * (class_weight_sum(p) * s.lse - s.weighted_z_sum);
  }
  at::Tensor z_term = o.z_loss > 0.0 ? o.z_loss * valid * s.lse.square() : at::Tensor();
  switch (o.reduction) {
    case Reduction::None:
      if (z_term.defined()) loss = loss + z_term;
      loss = loss.reshape(target.sizes());
      break;
    case Reduction::Sum:
      loss = loss.sum();
      if (z_term.defined()) loss = loss + z_term.sum();
      break;
    case Reduction::Mean:  // like torch: weighted mean, NaN when nothing is counted
      loss = loss.sum() / wt.sum();
      if (z_term.defined()) loss = loss + z_term.sum() / valid.sum();
      break;
  }
  return {loss, s.lse.reshape(target.sizes())};
}

// How the backward splits the work: blocks of `rows` x `cols` logits.
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

  // Coefficients of the logit gradient (stages.h), folding the upstream
  // gradient and the reduction into per-row scalars.
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
  GradCoefficients c;
  c.lse = lse.reshape({p.N}).to(dtype).contiguous();
  at::Tensor alpha = g_ce * ((1.0 - eps) * wt + (eps / p.V) * class_weight_sum(p) * valid);
  if (o.z_loss > 0.0) alpha = alpha + (2.0 * o.z_loss) * g_z * c.lse * valid;
  if (grad_lse && grad_lse->defined()) alpha = alpha + grad_lse->reshape({p.N}).to(dtype);
  c.alpha = alpha.expand({p.N}).contiguous();
  c.beta = (g_ce * (1.0 - eps) * wt).expand({p.N}).contiguous();
  c.gamma = (g_ce * (eps / p.V) * valid).expand({p.N}).contiguous();

  const bool kernels = use_kernels(p);
  const auto gemm_dtype = kernels ? p.x.scalar_type() : dtype;
  const int64_t elem = c10::elementSize(gemm_dtype);
  const BlockPlan plan = plan_blocks(p, workspace_bytes(p, o), kernels, elem);
  const int64_t row_blocks = (p.N + plan.rows - 1) / std::max<int64_t>(plan.rows, 1);
  const int64_t col_blocks = (p.V + plan.cols - 1) / plan.cols;

  // Gradients accumulate across blocks in float32 where there is more than one
  // block along the reduced dimension.
  const auto opts = p.x.options();
  const auto acc_dtype = [&](int64_t blocks) { return blocks > 1 ? at::promote_types(gemm_dtype, at::kFloat) : gemm_dtype; };
  at::Tensor grad_x = need_x ? at::zeros({p.N, p.D}, opts.dtype(acc_dtype(col_blocks))) : at::Tensor();
  at::Tensor grad_w = need_w ? at::zeros({p.V, p.D}, opts.dtype(acc_dtype(row_blocks))) : at::Tensor();
  at::Tensor grad_b = need_b ? at::zeros({p.V}, opts.dtype(dtype)) : at::Tensor();
  const at::Tensor x = p.x.to(gemm_dtype);
  const at::Tensor w = p.w.to(gemm_dtype);
  at::Tensor block_buffer;
  if (kernels && p.N > 0) {
    const int64_t ld = (plan.cols + 63) / 64 * 64;  // aligned rows for the kernel's stores and for cuBLAS
    block_buffer = at::empty({plan.rows, ld}, opts.dtype(gemm_dtype));
  }
  const auto accumulate = [](at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
    if (out.scalar_type() == a.scalar_type()) {
      out.addmm_(a, b);
    } else {
      out.add_(at::mm(a, b));
    }
  };

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
      if (need_x) accumulate(grad_x.narrow(0, r0, r1 - r0), g, w.narrow(0, v0, v1 - v0));
      if (need_w) accumulate(grad_w.narrow(0, v0, v1 - v0), g.t(), x.narrow(0, r0, r1 - r0));
      if (need_b) grad_b.narrow(0, v0, v1 - v0).add_(g.sum(0, false, dtype));
    }
  }
  const at::Tensor empty = at::empty({0}, opts);
  return {need_x ? grad_x.to(input.scalar_type()).reshape(input.sizes()) : empty,
          need_w ? grad_w.to(linear_weight.scalar_type()) : empty,
          need_b ? grad_b.to(p.bias.scalar_type()) : empty};
}

// Autograd: the loss and the lse are differentiable in input, linear_weight
// and linear_bias; the backward is its own op so that torch.compile and
// TorchScript see it too.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& linear_weight,
      const at::Tensor& target, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
      c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
      std::optional<double> softcap, double logit_scale, std::optional<int64_t> workspace_bytes) {
    const bool has_bias = linear_bias && linear_bias->defined();
    ctx->saved_data["needs_grad"] = std::vector<bool>{input.requires_grad(), linear_weight.requires_grad(),
                                                      has_bias && linear_bias->requires_grad()};
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["logit_scale"] = logit_scale;
    ctx->saved_data["workspace_bytes"] = workspace_bytes;
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fused_ce::linear_cross_entropy", "")
                         .typed<decltype(linear_cross_entropy)>();
    auto [loss, lse] = op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                               label_smoothing, z_loss, softcap, logit_scale, workspace_bytes);
    ctx->save_for_backward({input, linear_weight, target, has_bias ? *linear_bias : at::Tensor(),
                            weight ? *weight : at::Tensor(), lse});
    return {loss, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const auto& lse = saved[5];
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    at::Tensor grad_loss = grads[0];
    if (!grad_loss.defined()) {
      grad_loss = reduction == "none" ? at::zeros_like(lse) : at::zeros({}, lse.options());
    }
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fused_ce::linear_cross_entropy_backward", "")
                         .typed<decltype(linear_cross_entropy_backward)>();
    const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    auto [grad_x, grad_w, grad_b] = op.call(
        grad_loss, opt(grads[1]), input, saved[1], saved[2], opt(saved[3]), opt(saved[4]), lse, reduction,
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["label_smoothing"].toDouble(),
        ctx->saved_data["z_loss"].toDouble(), ctx->saved_data["softcap"].toOptional<double>(),
        ctx->saved_data["logit_scale"].toDouble(), ctx->saved_data["workspace_bytes"].toOptional<int64_t>(),
        {needs[0], needs[1], needs[2]});
    return {needs[0] ? grad_x : at::Tensor(), needs[1] ? grad_w : at::Tensor(), at::Tensor(),
            needs[2] ? grad_b : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes) {
  auto out = LinearCrossEntropyFunction::apply(input, linear_weight, target, linear_bias, weight, reduction,
                                               ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                                               workspace_bytes);
  return {out[0], out[1]};
}

// What the build embedded: architectures, and one cubin's bytes (for tests).
std::vector<int64_t> embedded_archs() {
  std::vector<int64_t> archs;
  for (int i = 0; i < kNumKernelVariants; ++i) {
    if (std::find(archs.begin(), archs.end(), kKernelVariants[i].arch) == archs.end()) {
      archs.push_back(kKernelVariants[i].arch);
    }
  }
  std::sort(archs.begin(), archs.end());
  return archs;
}

at::Tensor embedded_cubin(int64_t arch, c10::string_view kernel, c10::string_view dtype, c10::string_view layout) {
  for (int i = 0; i < kNumKernelVariants; ++i) {
    const KernelVariant& v = kKernelVariants[i];
    if (v.arch == arch && kernel == v.kernel && dtype == v.dtype && layout == v.layout) {
      const auto size = static_cast<int64_t>(v.cubin_end - v.cubin_begin);
      return at::from_blob(const_cast<unsigned char*>(v.cubin_begin), {size}, at::kByte).clone();
    }
  }
  TORCH_CHECK(false, "fused_ce: no embedded cubin for sm_", arch, " ", std::string(kernel), "/", std::string(dtype),
              "/", std::string(layout));
}

}  // namespace

TORCH_LIBRARY(fused_ce, m) {
  m.def(
      "linear_cross_entropy(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, "
      "Tensor? weight=None, str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, "
      "float z_loss=0.0, float? softcap=None, float logit_scale=1.0, int? workspace_bytes=None) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor? grad_lse, Tensor input, Tensor linear_weight, "
      "Tensor target, Tensor? linear_bias, Tensor? weight, Tensor lse, str reduction, int ignore_index, "
      "float label_smoothing, float z_loss, float? softcap, float logit_scale, int? workspace_bytes, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("_embedded_archs() -> int[]", &embedded_archs);
  m.def("_embedded_cubin(int arch, str kernel, str dtype, str layout) -> Tensor", &embedded_cubin);
}

TORCH_LIBRARY_IMPL(fused_ce, CPU, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
}

TORCH_LIBRARY_IMPL(fused_ce, CUDA, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
}

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
}

}  // namespace fused_ce
