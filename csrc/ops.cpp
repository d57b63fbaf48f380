// The op library fused_ce: schemas, the CPU/CUDA kernels (loss.cpp), the
// autograd formula, autocast, and what the build embedded.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "format.h"
#include "kernel_table.h"
#include "loss.h"

namespace fused_ce {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Autograd: loss and lse are differentiable in input, linear_weight and
// linear_bias. For a scalar reduction the gradients are computed in the
// forward, from the same logits (linear_cross_entropy_with_grad), and the
// backward only scales them; otherwise (per-element losses, a gradient on the
// lse, or a second backward) the backward op recomputes the logits. Both are
// ops of their own, so torch.compile and TorchScript see them too.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& linear_weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                               const std::optional<at::Tensor>& weight, c10::string_view reduction,
                               int64_t ignore_index, double label_smoothing, double z_loss,
                               std::optional<double> softcap, double logit_scale,
                               std::optional<int64_t> workspace_bytes) {
    ctx->set_materialize_grads(false);  // an unused lse must not look like a zero gradient
    const bool has_bias = linear_bias && linear_bias->defined();
    const std::array<bool, 3> needs{input.requires_grad(), linear_weight.requires_grad(),
                                    has_bias && linear_bias->requires_grad()};
    ctx->saved_data["needs_grad"] = std::vector<bool>(needs.begin(), needs.end());
    ctx->saved_data["reduction"] = std::string(reduction);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["label_smoothing"] = label_smoothing;
    ctx->saved_data["z_loss"] = z_loss;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["logit_scale"] = logit_scale;
    ctx->saved_data["workspace_bytes"] = workspace_bytes;
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor loss, lse;
    if (reduction != "none") {
      static auto op = op_handle("fused_ce::linear_cross_entropy_with_grad")
                           .typed<decltype(linear_cross_entropy_with_grad)>();
      auto [l, s, gx, gw, gb] = op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                        label_smoothing, z_loss, softcap, logit_scale, workspace_bytes, needs);
      loss = l;
      lse = s;
      // Not saved with save_for_backward: the backward consumes them (scales in place and hands them on).
      ctx->saved_data["grads"] = std::vector<at::Tensor>{gx, gw, gb};
    } else {
      static auto op = op_handle("fused_ce::linear_cross_entropy").typed<decltype(linear_cross_entropy)>();
      std::tie(loss, lse) = op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                    label_smoothing, z_loss, softcap, logit_scale, workspace_bytes);
    }
    ctx->save_for_backward({input, linear_weight, target, has_bias ? *linear_bias : at::Tensor(),
                            weight ? *weight : at::Tensor(), lse});
    return {loss, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    const std::array<bool, 3> mask{needs[0], needs[1], needs[2]};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& lse = saved[5];
    at::Tensor grad_loss = grads[0];
    const at::Tensor& grad_lse = grads[1];
    at::Tensor gx, gw, gb;
    auto precomputed = ctx->saved_data.find("grads");
    if (precomputed != ctx->saved_data.end()) {
      auto list = precomputed->second.toTensorVector();
      ctx->saved_data.erase(precomputed);  // once: a second backward recomputes
      if (!grad_lse.defined()) {
        if (!grad_loss.defined()) grad_loss = at::zeros({}, lse.options());
        static auto scale_op = op_handle("fused_ce::_scale_grad_").typed<decltype(scale_grad_)>();
        const auto scale = [&](at::Tensor& g, bool needed) {
          if (needed) scale_op.call(g, grad_loss);
        };
        gx = list[0];
        gw = list[1];
        gb = list[2];
        scale(gx, mask[0]);
        scale(gw, mask[1]);
        scale(gb, mask[2]);
        list.clear();
        return {mask[0] ? gx : at::Tensor(), mask[1] ? gw : at::Tensor(), at::Tensor(), mask[2] ? gb : at::Tensor(),
                at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor()};
      }
    }
    const std::string reduction = ctx->saved_data["reduction"].toStringRef();
    if (!grad_loss.defined()) {
      grad_loss = reduction == "none" ? at::zeros_like(lse) : at::zeros({}, lse.options());
    }
    static auto op = op_handle("fused_ce::linear_cross_entropy_backward")
                         .typed<decltype(linear_cross_entropy_backward)>();
    const auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    std::tie(gx, gw, gb) = op.call(
        grad_loss, opt(grad_lse), saved[0], saved[1], saved[2], opt(saved[3]), opt(saved[4]), lse, reduction,
        ctx->saved_data["ignore_index"].toInt(), ctx->saved_data["label_smoothing"].toDouble(),
        ctx->saved_data["z_loss"].toDouble(), ctx->saved_data["softcap"].toOptional<double>(),
        ctx->saved_data["logit_scale"].toDouble(), ctx->saved_data["workspace_bytes"].toOptional<int64_t>(), mask);
    return {mask[0] ? gx : at::Tensor(), mask[1] ? gw : at::Tensor(), at::Tensor(), mask[2] ? gb : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes) {
  const bool differentiable = input.requires_grad() || linear_weight.requires_grad() ||
                              (linear_bias && linear_bias->defined() && linear_bias->requires_grad());
  if (!at::GradMode::is_enabled() || !differentiable) {  // no gradient work at all
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = op_handle("fused_ce::linear_cross_entropy").typed<decltype(linear_cross_entropy)>();
    return op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
                   z_loss, softcap, logit_scale, workspace_bytes);
  }
  auto out = LinearCrossEntropyFunction::apply(input, linear_weight, target, linear_bias, weight, reduction,
                                               ignore_index, label_smoothing, z_loss, softcap, logit_scale,
                                               workspace_bytes);
  return {out[0], out[1]};
}

// Autocast: like F.linear, the linear part runs in the autocast dtype (the
// loss is float32 inside anyway).
template <c10::DeviceType device_type, c10::DispatchKey autocast_key>
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy_autocast(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap, double logit_scale,
    std::optional<int64_t> workspace_bytes) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(autocast_key);
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, device_type); };
  std::optional<at::Tensor> bias;
  if (linear_bias && linear_bias->defined()) bias = cast(*linear_bias);
  static auto op = op_handle("fused_ce::linear_cross_entropy").typed<decltype(linear_cross_entropy)>();
  return op.call(cast(input), cast(linear_weight), target, bias, weight, reduction, ignore_index, label_smoothing,
                 z_loss, softcap, logit_scale, workspace_bytes);
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
  TORCH_CHECK(false, "fused_ce: no embedded cubin for sm_", num(arch), " ", std::string(kernel), "/", std::string(dtype),
              "/", std::string(layout));
  return at::Tensor();
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
  m.def(
      "linear_cross_entropy_with_grad(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, "
      "Tensor? weight, str reduction, int ignore_index, float label_smoothing, float z_loss, float? softcap, "
      "float logit_scale, int? workspace_bytes, bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("_scale_grad_(Tensor(a!) grad, Tensor scale) -> ()");
  m.def("_embedded_archs() -> int[]", &embedded_archs);
  m.def("_embedded_cubin(int arch, str kernel, str dtype, str layout) -> Tensor", &embedded_cubin);
}

TORCH_LIBRARY_IMPL(fused_ce, CPU, m) {
  m.impl("_scale_grad_", &scale_grad_);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
  m.impl("linear_cross_entropy_with_grad", &linear_cross_entropy_with_grad);
}

TORCH_LIBRARY_IMPL(fused_ce, CUDA, m) {
  m.impl("_scale_grad_", &scale_grad_);
  m.impl("linear_cross_entropy", &linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
  m.impl("linear_cross_entropy_with_grad", &linear_cross_entropy_with_grad);
}

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
}

TORCH_LIBRARY_IMPL(fused_ce, AutocastCUDA, m) {
  m.impl("linear_cross_entropy",
         &linear_cross_entropy_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(fused_ce, AutocastCPU, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}

}  // namespace fused_ce
