// What the ops' Autograd kernels share (op_function.h): their checks, and the gradients a forward formed scaled by
// the upstream gradient.
#include "op_function.h"

#include <ATen/FuncTorchTLS.h>

#include <utility>

#include "cuda_stages.h"
#include "format.h"

namespace fused_ce {

bool needs_autograd(const char* caller, const Linear& l) {
  // Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) has no formula here: an error, never a zero tangent.
  const auto dual = [](const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); };
  TORCH_CHECK_NOT_IMPLEMENTED(
      !dual(l.input) && !dual(l.weight) && !dual(l.bias) && !dual(l.low_rank_input) && !dual(l.low_rank_weight),
      "fused_ce.", caller, ": forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not supported");
  const auto wants_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  const bool differentiable = wants_grad(l.input) || wants_grad(l.weight) || wants_grad(l.bias) ||
                              wants_grad(l.low_rank_input) || wants_grad(l.low_rank_weight);
  if (!at::GradMode::is_enabled() || !differentiable) return false;
  // torch.func's transforms (grad, vjp, jacrev, vmap) cannot run a C++ autograd function: say so in our words
  // (torch's own message names no op).
  const auto& functorch = at::functorch::functorchTLSAccessor();
  if (functorch) {
    try {
      functorch->checkSupportsCppAutogradFunction();
    } catch (const c10::Error&) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "fused_ce.", caller,
                                  " does not support torch.func transforms (grad, vjp, jacrev, vmap): its gradient "
                                  "is a C++ autograd function. Use loss.backward() or torch.autograd.grad, or "
                                  "torch.nn.functional.cross_entropy on the logits inside torch.func");
    }
  }
  return true;
}

void check_not_differentiable(const char* caller, const char* name, const std::optional<at::Tensor>& t,
                              const char* what) {
  TORCH_CHECK(!at::GradMode::is_enabled() || !t || !t->defined() || !t->requires_grad(), caller,
              ": not differentiable with respect to argument '", name, "'", what,
              "; it cannot have requires_grad=True (detach it)");
}

variable_list scaled_forward_grads(std::optional<variable_list> used_up,
                                   const std::function<variable_list()>& recompute, const Linear& l,
                                   at::Tensor grad_loss, const Mask& mask) {
  variable_list list = used_up ? std::move(*used_up) : recompute();
  static auto scale_op = op_handle("fused_ce::_scale_grad_").typed<decltype(_scale_grad_)>();
  if (!grad_loss.defined()) grad_loss = at::zeros({}, l.input.options().dtype(at::kFloat));
  // float16's dW comes times a power of two (linear_cross_entropy_with_grad's grad_weight_scale)
  const bool weight_scaled = list.size() > 3 && list[3].numel() == 1;
  const bool low_rank = list.size() > 5 && l.low_rank_input.defined();
  variable_list out{list[0], list[1], list[2]};
  const at::Tensor arguments[5] = {l.input, l.weight, l.bias, l.low_rank_input, l.low_rank_weight};
  for (int i = 0; i < (low_rank ? 5 : 3); ++i) {
    at::Tensor& g = i < 3 ? out[i] : out.emplace_back(list[i + 1]);  // (the low-rank term's after dW's scale)
    if (i < 3 && !mask[i]) continue;
    const at::ScalarType dtype = arguments[i].defined() ? arguments[i].scalar_type() : at::kFloat;
    if (i == 1 && weight_scaled) {
      scale_op.call(g, grad_loss / list[3]);
    } else if (g.scalar_type() == dtype) {
      scale_op.call(g, grad_loss);
    } else {
      at::Tensor rounded = at::empty_like(g, g.options().dtype(dtype));
      g = at::mul_out(rounded, g, grad_loss);
    }
  }
  return out;
}

void _scale_grad_(const at::Tensor& grad, const at::Tensor& scale) {
  TORCH_CHECK(scale.numel() == 1, "fused_ce::_scale_grad_: scale must hold one value, got shape ",
              shape(scale.sizes()));
  TORCH_CHECK(scale.device() == grad.device() || (scale.is_cpu() && scale.dim() == 0),
              "fused_ce::_scale_grad_: scale is on ", scale.device().str(), " but grad is on ", grad.device().str());
  if (grad.numel() == 0) return;
  const at::Tensor s = scale.reshape({});
  if (grad.is_cuda() && cuda_scale_(grad, s)) return;
  grad.mul_(s);
}

}  // namespace fused_ce
