// The ops' autograd formulas (C++, so TorchScript and libtorch have them), one Function template over the ops
// (OpFunction<Op>): a scalar loss's and the policy loss's gradients formed in the forward and scaled in the
// backward, the per-token ones from the kept logits or recomputed by the backward ops.
#include "autograd.h"

#include <ATen/FuncTorchTLS.h>

#include <string>
#include <utility>
#include <vector>

#include "cuda_stages.h"
#include "format.h"
#include "loss.h"
#include "op_function.h"

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

// linear_policy_loss's: the gradients formed in the forward (their coefficients need only the forward's row
// stats and the per-token inputs), the backward scales them, as the scalar cross-entropy's.
struct PolicyLossOp : torch::CustomClassHolder {
  variable_list args;                // target, advantages, token_weights, old_log_probs, ref_log_probs
  std::vector<c10::IValue> options;  // in schema order, as the with-grad op takes them

  std::string caller() const { return "linear_policy_loss"; }

  // linear_policy_loss_with_grad below autograd: (loss, stats), the gradients asked for in `mask` in *grads.
  variable_list with_grad(const Linear& l, const Mask& mask, variable_list* grads) const {
    static const auto op = op_handle("fused_ce::linear_policy_loss_with_grad");
    torch::jit::Stack stack{l.input,           l.weight,          args[0],
                            args[1],           optional(args[2]), optional(args[3]),
                            optional(args[4]), optional(l.bias),  std::vector<bool>(mask.begin(), mask.end())};
    stack.insert(stack.end(), options.begin(), options.end());
    stack.insert(stack.end(), {optional(l.low_rank_input), optional(l.low_rank_weight)});
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(&stack);
    if (grads) {
      *grads = {stack[2].toTensor(), stack[3].toTensor(), stack[4].toTensor()};
      if (l.low_rank_input.defined()) {  // (after dW's scale, which the policy loss has not: scaled_forward_grads)
        grads->insert(grads->end(), {at::empty({0}, l.input.options()), stack[5].toTensor(), stack[6].toTensor()});
      }
    }
    return {stack[0].toTensor(), stack[1].toTensor()};
  }

  Forward forward(const Linear& l, const Mask& needs) const {
    Forward f;
    f.outputs = with_grad(l, needs, &f.used_up);
    f.non_differentiable = {f.outputs[1]};
    return f;
  }

  variable_list backward(const Linear& l, const variable_list&, const variable_list& grads, const Mask& mask,
                         std::optional<variable_list> used_up) const {
    const auto recompute = [&] {
      variable_list again;
      with_grad(l, mask, &again);
      return again;
    };
    return scaled_forward_grads(std::move(used_up), recompute, l, grads[0], mask);
  }
};

}  // namespace

AllOutputs call_loss_op(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        const LossOptions& o FUSED_CE_LOW_RANK_PARAMS) {
  static auto op = op_handle("fused_ce::_linear_cross_entropy").typed<decltype(_linear_cross_entropy)>();
  return o.apply([&](auto... options) {
    return op.call(input, linear_weight, target, linear_bias, weight, options..., low_rank_input, low_rank_weight);
  });
}

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

namespace {

// The policy loss's op, its option values in schema order, boxed (they travel to the with-grad op in that order).
#define FUSED_CE_IVALUE_ITEM(cpp_type, name, ...) , c10::IValue(name)
c10::intrusive_ptr<PolicyLossOp> policy_loss_op(
    const at::Tensor& target, const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
    const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
  auto op = c10::make_intrusive<PolicyLossOp>();
  op->args = {target, advantages, token_weights.value_or(at::Tensor()), old_log_probs.value_or(at::Tensor()),
              ref_log_probs.value_or(at::Tensor())};
  op->options = detail::call_without_first([](auto... v) { return std::vector<c10::IValue>{v...}; },
                                           0 FUSED_CE_POLICY_OPTIONS(FUSED_CE_IVALUE_ITEM)
                                               FUSED_CE_SHARD_OPTIONS(FUSED_CE_IVALUE_ITEM));
  return op;
}
#undef FUSED_CE_IVALUE_ITEM

}  // namespace

PolicyOutputs linear_policy_loss(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                 const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                                 const std::optional<at::Tensor>& old_log_probs,
                                 const std::optional<at::Tensor>& ref_log_probs,
                                 const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                     FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const auto op =
      policy_loss_op(target, advantages, token_weights, old_log_probs,
                     ref_log_probs FUSED_CE_ARGS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  const auto out = op->with_grad({input, linear_weight, linear_bias.value_or(at::Tensor()),
                                  low_rank_input.value_or(at::Tensor()), low_rank_weight.value_or(at::Tensor())},
                                 {false, false, false}, nullptr);
  return {out[0], out[1]};
}

PolicyOutputs linear_policy_loss_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const char* caller = "linear_policy_loss";
  for (const auto& [name, t] : {std::pair<const char*, std::optional<at::Tensor>>{"advantages", advantages},
                                {"token_weights", token_weights},
                                {"old_log_probs", old_log_probs},
                                {"ref_log_probs", ref_log_probs}}) {
    check_not_differentiable(caller, name, t);
  }
  const Linear l{input, linear_weight, linear_bias.value_or(at::Tensor()), low_rank_input.value_or(at::Tensor()),
                 low_rank_weight.value_or(at::Tensor())};
  auto op = policy_loss_op(target, advantages, token_weights, old_log_probs,
                           ref_log_probs FUSED_CE_ARGS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  if (!needs_autograd(caller, l)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto out = op->with_grad(l, {false, false, false}, nullptr);
    return {out[0], out[1]};
  }
  auto out = OpFunction<PolicyLossOp>::apply(input, linear_weight, linear_bias, low_rank_input, low_rank_weight, op);
  return {out[0], out[1]};
}

}  // namespace fused_ce
