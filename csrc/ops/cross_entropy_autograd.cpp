// The cross-entropy ops' autograd formula (C++, so TorchScript and libtorch have it; OpFunction<CrossEntropyOp>,
// op_function.h): a scalar loss's gradients formed in the forward and scaled in the backward, the per-token ones
// from the kept logits or recomputed by the backward ops.
#include <torch/library.h>

#include <string>
#include <utility>

#include "cross_entropy.h"
#include "op_function.h"
#include "plan.h"

namespace fused_ce {
namespace {

// _linear_cross_entropy's (linear_cross_entropy's, linear_log_probs'): loss, lse and entropy differentiable. A
// scalar loss forms its gradients in the forward from the same logits (linear_cross_entropy_with_grad) and the
// backward scales them (gradients_in_forward); otherwise (per-element losses, a gradient on the lse or the
// entropy, a second backward) the backward op takes the logits the forward kept or recomputes them. Every one is
// an op of its own, so torch.compile and TorchScript see them too.
struct CrossEntropyOp : torch::CustomClassHolder {
  variable_list args;  // target, class weights
  LossOptions o;

  CrossEntropyOp(const at::Tensor& target, const std::optional<at::Tensor>& weight, LossOptions o)
      : args{target, weight.value_or(at::Tensor())}, o(std::move(o)) {}

  const at::Tensor& target() const { return args[0]; }
  std::optional<at::Tensor> weight() const { return optional(args[1]); }

  std::string caller() const { return o.caller; }

  bool gradients_in_forward(const at::Tensor& input) const { return fused_ce::gradients_in_forward(o, input); }

  variable_list with_grad(const Linear& l, const Mask& mask, variable_list* grads) const {
    static auto op =
        op_handle("fused_ce::linear_cross_entropy_with_grad").typed<decltype(linear_cross_entropy_with_grad)>();
    auto [loss, lse, entropy, argmax, gx, gw, gb, gw_scale, gu, gb_low_rank] = o.apply([&](auto... options) {
      return op.call(l.input, l.weight, target(), optional(l.bias), weight(), mask, options...,
                     optional(l.low_rank_input), optional(l.low_rank_weight));
    });
    *grads = {gx, gw, gb, gw_scale, gu, gb_low_rank};
    return {loss, lse, entropy, argmax};
  }

  Forward forward(const Linear& l, const Mask& needs) const {
    Forward f;
    if (gradients_in_forward(l.input)) {
      f.outputs = with_grad(l, needs, &f.used_up);
    } else {
      static auto op = op_handle("fused_ce::_linear_cross_entropy_keeping_logits")
                           .typed<decltype(_linear_cross_entropy_keeping_logits)>();
      auto [loss, lse, entropy, argmax, logits] = o.apply([&](auto... options) {
        return op.call(l.input, l.weight, target(), optional(l.bias), weight(), options..., optional(l.low_rank_input),
                       optional(l.low_rank_weight));
      });
      f.outputs = {loss, lse, entropy, argmax};
      if (logits.sym_size(0) != 0) f.used_up = {logits};  // (none kept: the backward recomputes them)
    }
    f.saved = {f.outputs[1], o.return_entropy ? f.outputs[2] : at::Tensor()};
    f.non_differentiable = {f.outputs[3]};
    return f;
  }

  variable_list backward(const Linear& l, const variable_list& saved, const variable_list& grads, const Mask& mask,
                         std::optional<variable_list> used_up) const {
    const at::Tensor &lse = saved[0], &entropy = saved[1];
    const auto as_list = [](const CrossEntropyGrads& g) {
      return variable_list{std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g), std::get<4>(g)};
    };
    at::Tensor grad_loss = grads[0];
    const at::Tensor& grad_lse = grads[1];
    // (an entropy not asked for is an empty output: a gradient on it is no gradient)
    const at::Tensor grad_entropy = o.return_entropy ? grads[2] : at::Tensor();
    if (gradients_in_forward(l.input) && !grad_lse.defined() && !grad_entropy.defined()) {
      const auto recompute = [&] {
        at::AutoDispatchBelowADInplaceOrView guard;
        variable_list again;
        with_grad(l, mask, &again);
        return again;
      };
      return scaled_forward_grads(std::move(used_up), recompute, l, grad_loss, mask);
    }
    if (!grad_loss.defined()) grad_loss = o.scalar() ? at::zeros({}, lse.options()) : at::zeros_like(lse);
    if (used_up && !gradients_in_forward(l.input)) {  // the kept logits, which become their gradient
      static auto op = op_handle("fused_ce::_linear_cross_entropy_backward_from_logits")
                           .typed<decltype(_linear_cross_entropy_backward_from_logits)>();
      at::Tensor& logits = (*used_up)[0];
      return as_list(o.apply([&](auto... options) {
        return op.call(grad_loss, optional(grad_lse), optional(grad_entropy), logits, l.input, l.weight, target(),
                       optional(l.bias), weight(), lse, optional(entropy), mask, options..., optional(l.low_rank_input),
                       optional(l.low_rank_weight));
      }));
    }
    static auto op =
        op_handle("fused_ce::linear_cross_entropy_backward").typed<decltype(linear_cross_entropy_backward)>();
    return as_list(o.apply([&](auto... options) {
      return op.call(grad_loss, optional(grad_lse), optional(grad_entropy), l.input, l.weight, target(),
                     optional(l.bias), weight(), lse, optional(entropy), mask, options..., optional(l.low_rank_input),
                     optional(l.low_rank_weight));
    }));
  }
};

// The Autograd kernel of _linear_cross_entropy (and of linear_cross_entropy: public_loss).
AllOutputs _linear_cross_entropy_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                          const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                          const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                              FUSED_CE_LOW_RANK_PARAMS) {
  LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  const std::string function(o.caller);
  check_not_differentiable(function.c_str(), "weight", weight, " (class weights)");
  const Linear l{input, linear_weight, linear_bias.value_or(at::Tensor()), low_rank_input.value_or(at::Tensor()),
                 low_rank_weight.value_or(at::Tensor())};
  if (!needs_autograd(function.c_str(), l)) {  // no gradient work at all
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_loss_op(input, linear_weight, target, linear_bias, weight, o, low_rank_input, low_rank_weight);
  }
  auto out = OpFunction<CrossEntropyOp>::apply(input, linear_weight, linear_bias, low_rank_input, low_rank_weight,
                                               c10::make_intrusive<CrossEntropyOp>(target, weight, std::move(o)));
  return {out[0], out[1], out[2], out[3]};
}

void cross_entropy_autograd(torch::Library& m) {
  m.impl("linear_cross_entropy", &public_loss<&_linear_cross_entropy_autograd>);
  m.impl("_linear_cross_entropy", &_linear_cross_entropy_autograd);
}

}  // namespace
}  // namespace fused_ce

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  fused_ce::cross_entropy_autograd(m);
}
