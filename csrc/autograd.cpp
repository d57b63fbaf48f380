// The ops' autograd formulas (C++, so TorchScript and libtorch have them): a scalar loss's and the policy loss's
// gradients formed in the forward and scaled in the backward, the others recomputed by the backward ops.
#include "autograd.h"

#include <ATen/FuncTorchTLS.h>
#include <torch/autograd.h>

#include <string>
#include <utility>
#include <vector>

#include "cuda_stages.h"
#include "format.h"
#include "loss.h"
#include "plan.h"

namespace fused_ce {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The tensor arguments before the options: input, linear_weight, target, linear_bias, weight.
constexpr int kNumTensorArguments = 5;

std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// torch.func's transforms (grad, vjp, jacrev, vmap) cannot run a C++ autograd function: say so in our words
// (torch's own message names no op).
void check_no_functorch_transform() {
  const auto& functorch = at::functorch::functorchTLSAccessor();
  if (!functorch) return;
  try {
    functorch->checkSupportsCppAutogradFunction();
  } catch (const c10::Error&) {
    TORCH_CHECK_NOT_IMPLEMENTED(false,
                                "fused_ce.linear_cross_entropy does not support torch.func transforms (grad, vjp, "
                                "jacrev, vmap): its gradient is a C++ autograd function. Use loss.backward() or "
                                "torch.autograd.grad, or torch.nn.functional.cross_entropy on the logits inside "
                                "torch.func");
  }
}

}  // namespace

// _linear_cross_entropy through the dispatcher, below autograd.
AllOutputs call_loss_op(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        const LossOptions& o) {
  static auto op = op_handle("fused_ce::_linear_cross_entropy").typed<decltype(linear_cross_entropy_all)>();
  return o.apply(
      [&](auto... options) { return op.call(input, linear_weight, target, linear_bias, weight, options...); });
}

namespace {

// The gradients a forward formed at unit scale (a scalar loss's, the policy loss's), kept in the autograd context
// (not with save_for_backward: the backward consumes them): handed on once, without a copy, else (a second
// backward through a retained graph, which computes them again) nullopt.
std::optional<std::vector<at::Tensor>> take_forward_grads(AutogradContext* ctx) {
  auto kept = ctx->saved_data.find("grads");
  if (kept == ctx->saved_data.end()) return std::nullopt;
  std::vector<at::Tensor> list = kept->second.toTensorVector();
  ctx->saved_data.erase(kept);
  return list;
}

// Those gradients times the upstream gradient where asked for (mask): in place in their argument's dtype, else
// (float16's float32 ones, loss.h) scaled and then rounded once to it.
void scale_forward_grads(std::vector<at::Tensor>& list, const at::Tensor& grad_loss,
                         const std::array<at::ScalarType, 3>& dtypes, const std::array<bool, 3>& mask) {
  static auto scale_op = op_handle("fused_ce::_scale_grad_").typed<decltype(scale_grad_)>();
  for (int i = 0; i < 3; ++i) {
    if (!mask[i]) continue;
    if (list[i].scalar_type() == dtypes[i]) {
      scale_op.call(list[i], grad_loss);
    } else {
      at::Tensor rounded = at::empty_like(list[i], list[i].options().dtype(dtypes[i]));
      list[i] = at::mul_out(rounded, list[i], grad_loss);
    }
  }
}

// Whether a scalar loss forms its gradients in the forward (linear_cross_entropy_with_grad). Not float16's on the
// CPU: at unit scale they are float32 (loss.h), twice the gradients float16 holds, held until the backward, which
// rounds them beside that: the backward recomputes them at the upstream gradient's scale instead, in float16.
bool gradients_in_forward(const at::Tensor& input, const LossOptions& o) {
  return o.scalar() && !(input.scalar_type() == at::kHalf && input.device().is_cpu());
}

// Autograd: loss, lse and entropy are differentiable in input, linear_weight and
// linear_bias. For a scalar reduction the gradients are computed in the
// forward, from the same logits (linear_cross_entropy_with_grad), and the
// backward only scales them (gradients_in_forward); otherwise (per-element losses,
// a gradient on the lse or the entropy, or a second backward) the backward op
// recomputes the logits. Both are ops of their own, so torch.compile and TorchScript see them too.
class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& linear_weight,
                               const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                               const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
    ctx->set_materialize_grads(false);  // an unused lse must not look like a zero gradient
    const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
    const bool has_bias = linear_bias && linear_bias->defined();
    const std::array<bool, 3> needs{input.requires_grad(), linear_weight.requires_grad(),
                                    has_bias && linear_bias->requires_grad()};
    ctx->saved_data["needs_grad"] = std::vector<bool>(needs.begin(), needs.end());
    ctx->saved_data["options"] = o.to_ivalue();
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor loss, lse, entropy, argmax;
    if (gradients_in_forward(input, o)) {
      static auto op =
          op_handle("fused_ce::linear_cross_entropy_with_grad").typed<decltype(linear_cross_entropy_with_grad)>();
      auto [l, s, e, a, gx, gw, gb] = o.apply([&](auto... options) {
        return op.call(input, linear_weight, target, linear_bias, weight, needs, options...);
      });
      std::tie(loss, lse, entropy, argmax) = std::tie(l, s, e, a);
      // Not saved with save_for_backward: the backward consumes them (scales in place and hands them on).
      ctx->saved_data["grads"] = std::vector<at::Tensor>{gx, gw, gb};
    } else if (kept_logit_rows(input, linear_weight, target, o)) {
      static auto op = op_handle("fused_ce::_linear_cross_entropy_keeping_logits")
                           .typed<decltype(linear_cross_entropy_keeping_logits)>();
      at::Tensor logits;
      std::tie(loss, lse, entropy, argmax, logits) = o.apply(
          [&](auto... options) { return op.call(input, linear_weight, target, linear_bias, weight, options...); });
      // Not saved with save_for_backward: the first backward uses them up (turns them into their gradient).
      ctx->saved_data["logits"] = logits;
    } else {
      std::tie(loss, lse, entropy, argmax) = call_loss_op(input, linear_weight, target, linear_bias, weight, o);
    }
    ctx->mark_non_differentiable({argmax});
    ctx->save_for_backward({input, linear_weight, target, has_bias ? *linear_bias : at::Tensor(),
                            weight ? *weight : at::Tensor(), lse, o.return_entropy ? entropy : at::Tensor()});
    return {loss, lse, entropy, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The gradients come from kernels with no derivative of their own: a graph of them (create_graph=True,
    // torch.autograd.functional.hessian, gradient penalties) would be silently wrong, so it is an error.
    TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(),
                                "fused_ce.linear_cross_entropy: double backward (create_graph=True, "
                                "torch.autograd.functional.hessian, ...) is not supported; use "
                                "torch.nn.functional.cross_entropy on the logits for higher-order gradients");
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    const std::array<bool, 3> mask{needs[0], needs[1], needs[2]};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& lse = saved[5];
    at::Tensor grad_loss = grads[0];
    const at::Tensor& grad_lse = grads[1];
    const at::Tensor& grad_entropy = grads[2];
    const auto result = [&](const at::Tensor& gx, const at::Tensor& gw, const at::Tensor& gb) -> variable_list {
      // one per op argument; only input, linear_weight and linear_bias get one
      variable_list out(kNumTensorArguments + kNumOptions);
      out[0] = mask[0] ? gx : at::Tensor();
      out[1] = mask[1] ? gw : at::Tensor();
      out[3] = mask[2] ? gb : at::Tensor();
      return out;
    };
    const LossOptions o = LossOptions::from_ivalue(ctx->saved_data["options"]);
    if (gradients_in_forward(saved[0], o) && !grad_lse.defined() && !grad_entropy.defined()) {
      std::vector<at::Tensor> list;
      if (auto kept = take_forward_grads(ctx)) {
        list = std::move(*kept);
      } else {
        // A second backward through a retained graph: the first one's computation again (deterministic),
        // so that it gives bitwise the same gradients (gradcheck's reentrance check).
        at::AutoDispatchBelowADInplaceOrView guard;
        static auto op =
            op_handle("fused_ce::linear_cross_entropy_with_grad").typed<decltype(linear_cross_entropy_with_grad)>();
        const auto all = o.apply([&](auto... options) {
          return op.call(saved[0], saved[1], saved[2], optional(saved[3]), optional(saved[4]), mask, options...);
        });
        list = {std::get<4>(all), std::get<5>(all), std::get<6>(all)};
      }
      if (!grad_loss.defined()) grad_loss = at::zeros({}, lse.options());
      const auto dtype = [](const at::Tensor& t) { return t.defined() ? t.scalar_type() : at::kFloat; };
      scale_forward_grads(list, grad_loss, {dtype(saved[0]), dtype(saved[1]), dtype(saved[3])}, mask);
      return result(list[0], list[1], list[2]);
    }
    if (!grad_loss.defined()) grad_loss = o.scalar() ? at::zeros({}, lse.options()) : at::zeros_like(lse);
    auto kept = ctx->saved_data.find("logits");
    if (kept != ctx->saved_data.end()) {
      at::Tensor logits = kept->second.toTensor();
      ctx->saved_data.erase(kept);  // used up; a second backward through a retained graph recomputes them
      static auto op = op_handle("fused_ce::_linear_cross_entropy_backward_from_logits")
                           .typed<decltype(linear_cross_entropy_backward_from_logits)>();
      const auto [gx, gw, gb] = o.apply([&](auto... options) {
        return op.call(grad_loss, optional(grad_lse), optional(grad_entropy), logits, saved[0], saved[1], saved[2],
                       optional(saved[3]), optional(saved[4]), lse, optional(saved[6]), mask, options...);
      });
      return result(gx, gw, gb);
    }
    static auto op =
        op_handle("fused_ce::linear_cross_entropy_backward").typed<decltype(linear_cross_entropy_backward)>();
    const auto [gx, gw, gb] = o.apply([&](auto... options) {
      return op.call(grad_loss, optional(grad_lse), optional(grad_entropy), saved[0], saved[1], saved[2],
                     optional(saved[3]), optional(saved[4]), lse, optional(saved[6]), mask, options...);
    });
    return result(gx, gw, gb);
  }
};

}  // namespace

AllOutputs linear_cross_entropy_all_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                             const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                             const std::optional<at::Tensor>& weight
                                                 FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)) {
  const bool differentiable = input.requires_grad() || linear_weight.requires_grad() ||
                              (linear_bias && linear_bias->defined() && linear_bias->requires_grad());
  // Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) has no formula here: an error, never a zero tangent.
  const auto dual = [](const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); };
  TORCH_CHECK_NOT_IMPLEMENTED(!dual(input) && !dual(linear_weight) && !(linear_bias && dual(*linear_bias)),
                              "fused_ce.linear_cross_entropy: forward-mode AD (torch.func.jvp, "
                              "torch.autograd.forward_ad) is not supported");
  TORCH_CHECK(!at::GradMode::is_enabled() || !weight || !weight->defined() || !weight->requires_grad(),
              "linear_cross_entropy: not differentiable with respect to argument 'weight' (class weights); it "
              "cannot have requires_grad=True (detach it)");
  const LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  if (!at::GradMode::is_enabled() || !differentiable) {  // no gradient work at all
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_loss_op(input, linear_weight, target, linear_bias, weight, o);
  }
  check_no_functorch_transform();
  auto out = LinearCrossEntropyFunction::apply(input, linear_weight, target, linear_bias,
                                               weight FUSED_CE_ARGS(FUSED_CE_ALL_OPTIONS));
  return {out[0], out[1], out[2], out[3]};
}

namespace {

// The policy loss's op below autograd: its forward with gradient (the gradients asked for in `mask`).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_policy_with_grad(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs, const std::optional<at::Tensor>& linear_bias,
    std::array<bool, 3> mask, const std::vector<c10::IValue>& options) {
  static const auto op = op_handle("fused_ce::linear_policy_loss_with_grad");
  torch::jit::Stack stack{input,         linear_weight, target,
                          advantages,    token_weights, old_log_probs,
                          ref_log_probs, linear_bias,   std::vector<bool>(mask.begin(), mask.end())};
  stack.insert(stack.end(), options.begin(), options.end());
  at::AutoDispatchBelowADInplaceOrView guard;
  op.callBoxed(&stack);
  return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(), stack[3].toTensor(), stack[4].toTensor()};
}

// Autograd of linear_policy_loss: the gradients are formed in the forward (their coefficients need only the
// forward's row stats and the per-token inputs), the backward scales them, as the scalar cross-entropy's.
class PolicyLossFunction : public torch::autograd::Function<PolicyLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& linear_weight,
                               const at::Tensor& target, const at::Tensor& advantages,
                               const std::optional<at::Tensor>& token_weights,
                               const std::optional<at::Tensor>& old_log_probs,
                               const std::optional<at::Tensor>& ref_log_probs,
                               const std::optional<at::Tensor>& linear_bias, const std::vector<c10::IValue>& options) {
    const bool has_bias = linear_bias && linear_bias->defined();
    const std::array<bool, 3> needs{input.requires_grad(), linear_weight.requires_grad(),
                                    has_bias && linear_bias->requires_grad()};
    auto [loss, stats, gx, gw, gb] = call_policy_with_grad(input, linear_weight, target, advantages, token_weights,
                                                           old_log_probs, ref_log_probs, linear_bias, needs, options);
    ctx->saved_data["grads"] = std::vector<at::Tensor>{gx, gw, gb};
    ctx->saved_data["needs_grad"] = std::vector<bool>(needs.begin(), needs.end());
    ctx->saved_data["options"] = c10::ivalue::Tuple::create(options);
    ctx->saved_data["dtypes"] = std::vector<int64_t>{static_cast<int64_t>(input.scalar_type()),
                                                     static_cast<int64_t>(linear_weight.scalar_type()),
                                                     has_bias ? static_cast<int64_t>(linear_bias->scalar_type()) : 0};
    ctx->save_for_backward({input, linear_weight, target, advantages, token_weights.value_or(at::Tensor()),
                            old_log_probs.value_or(at::Tensor()), ref_log_probs.value_or(at::Tensor()),
                            linear_bias.value_or(at::Tensor())});
    ctx->mark_non_differentiable({stats});
    return {loss, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(),
                                "fused_ce.linear_policy_loss: double backward is not supported");
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    const std::array<bool, 3> mask{needs[0], needs[1], needs[2]};
    std::vector<at::Tensor> list;
    if (auto kept = take_forward_grads(ctx)) {
      list = std::move(*kept);
    } else {  // a second backward through a retained graph: the same computation again
      const auto saved = ctx->get_saved_variables();
      const auto& elements = ctx->saved_data["options"].toTupleRef().elements();
      const auto all = call_policy_with_grad(saved[0], saved[1], saved[2], saved[3], optional(saved[4]),
                                             optional(saved[5]), optional(saved[6]), optional(saved[7]), mask,
                                             std::vector<c10::IValue>(elements.begin(), elements.end()));
      list = {std::get<2>(all), std::get<3>(all), std::get<4>(all)};
    }
    at::Tensor grad_loss = grads[0].defined() ? grads[0] : at::zeros({}, list[0].options().dtype(at::kFloat));
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const auto dtype = [&](int i) { return static_cast<at::ScalarType>(dtypes[i]); };
    scale_forward_grads(list, grad_loss, {dtype(0), dtype(1), dtype(2)}, mask);
    variable_list out(9);  // input, linear_weight, target, advantages, token_weights, old, ref, bias, options
    const int slot[3] = {0, 1, 7};
    for (int i = 0; i < 3; ++i) {
      if (mask[i]) out[slot[i]] = list[i];
    }
    return out;
  }
};

}  // namespace

void scale_grad_(const at::Tensor& grad, const at::Tensor& scale) {
  TORCH_CHECK(scale.numel() == 1, "fused_ce::_scale_grad_: scale must hold one value, got shape ",
              shape(scale.sizes()));
  TORCH_CHECK(scale.device() == grad.device() || (scale.is_cpu() && scale.dim() == 0),
              "fused_ce::_scale_grad_: scale is on ", scale.device().str(), " but grad is on ", grad.device().str());
  if (grad.numel() == 0) return;
  const at::Tensor s = scale.reshape({});
  if (grad.is_cuda() && cuda_scale_(grad, s)) return;
  grad.mul_(s);
}

// The policy loss's option values in schema order, boxed (they travel to the with-grad op by name order).
#define FUSED_CE_IVALUE_ITEM(cpp_type, name, ...) , c10::IValue(name)
#define FUSED_CE_POLICY_IVALUES                                                        \
  detail::call_without_first([](auto... v) { return std::vector<c10::IValue>{v...}; }, \
                             0 FUSED_CE_POLICY_OPTIONS(FUSED_CE_IVALUE_ITEM)           \
                                 FUSED_CE_SHARD_OPTIONS(FUSED_CE_IVALUE_ITEM))

PolicyOutputs linear_policy_loss(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                 const at::Tensor& advantages, const std::optional<at::Tensor>& token_weights,
                                 const std::optional<at::Tensor>& old_log_probs,
                                 const std::optional<at::Tensor>& ref_log_probs,
                                 const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
                                     FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
  const auto [loss, stats, gx, gw, gb] =
      call_policy_with_grad(input, linear_weight, target, advantages, token_weights, old_log_probs, ref_log_probs,
                            linear_bias, {false, false, false}, FUSED_CE_POLICY_IVALUES);
  return {loss, stats};
}

PolicyOutputs linear_policy_loss_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& advantages,
    const std::optional<at::Tensor>& token_weights, const std::optional<at::Tensor>& old_log_probs,
    const std::optional<at::Tensor>& ref_log_probs,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_POLICY_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
  for (const auto& [name, t] : {std::pair<const char*, std::optional<at::Tensor>>{"advantages", advantages},
                                {"token_weights", token_weights},
                                {"old_log_probs", old_log_probs},
                                {"ref_log_probs", ref_log_probs}}) {
    TORCH_CHECK(!at::GradMode::is_enabled() || !t || !t->defined() || !t->requires_grad(),
                "linear_policy_loss: not differentiable with respect to ", name,
                "; it cannot have "
                "requires_grad=True (detach it)");
  }
  const bool differentiable = input.requires_grad() || linear_weight.requires_grad() ||
                              (linear_bias && linear_bias->defined() && linear_bias->requires_grad());
  if (!at::GradMode::is_enabled() || !differentiable) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return linear_policy_loss(input, linear_weight, target, advantages, token_weights, old_log_probs, ref_log_probs,
                              linear_bias FUSED_CE_ARGS(FUSED_CE_POLICY_OPTIONS) FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  }
  check_no_functorch_transform();
  auto out = PolicyLossFunction::apply(input, linear_weight, target, advantages, token_weights, old_log_probs,
                                       ref_log_probs, linear_bias, FUSED_CE_POLICY_IVALUES);
  return {out[0], out[1]};
}

}  // namespace fused_ce
