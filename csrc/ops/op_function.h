// The autograd template of every op (OpFunction<Op>) and what the ops' Autograd kernels share: their checks, the
// scaling of gradients formed in the forward (_scale_grad_), the dispatcher's handles. Each op family's Op type is
// in its own file (cross_entropy_autograd.cpp, policy_loss.cpp, distillation.cpp); op_function.cpp defines the rest.
#pragma once

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <array>
#include <functional>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace fused_ce {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Mask = std::array<bool, 3>;

inline std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

inline c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The differentiable arguments of every op: the linear's (bias undefined where there is none), and the
// cross-entropy ops' low-rank term of the logits (undefined where there is none).
struct Linear {
  at::Tensor input, weight, bias;
  at::Tensor low_rank_input, low_rank_weight;
};

// What an op's forward hands its Function: the outputs; the tensors its backward reads (saved with
// save_for_backward, so outputs among them make no reference cycle); those the first backward uses up (the
// gradients formed at unit scale, or the kept logits: kept in the context, handed on once without a copy); and
// the outputs with no gradient.
struct Forward {
  variable_list outputs, saved, used_up, non_differentiable;
};

// One autograd Function for every op. Op (a CustomClassHolder: the context keeps it as a capsule) holds the op's
// options, parsed once by the Autograd kernel, and its other tensor arguments in `args` (undefined where absent);
// Op::forward(linear, needs) runs below autograd, Op::backward(linear, saved, grads, mask, used_up) returns the
// linear's gradients (input, linear_weight, linear_bias, then the low-rank term's where it has one). Only those
// are differentiable; `mask` and `needs` are the linear's three, the low-rank term's follow its requires_grad. The
// backward reads `args` from the saved variables (the capsule keeps none), so that a tensor changed in place after the
// forward raises autograd's error, as torch's own ops do, instead of giving gradients of its new values.
template <class Op>
class OpFunction : public torch::autograd::Function<OpFunction<Op>> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& linear_weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& low_rank_input,
                               const std::optional<at::Tensor>& low_rank_weight, const c10::intrusive_ptr<Op>& op) {
    ctx->set_materialize_grads(false);  // an unused output must not look like a zero gradient
    const Linear l{input, linear_weight, bias.value_or(at::Tensor()), low_rank_input.value_or(at::Tensor()),
                   low_rank_weight.value_or(at::Tensor())};
    const auto wants_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
    const Mask needs{wants_grad(input), wants_grad(linear_weight), wants_grad(l.bias)};
    Forward f;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      f = op->forward(l, needs);
    }
    ctx->saved_data["op"] = c10::IValue::make_capsule(op);
    ctx->saved_data["needs_grad"] =
        std::vector<bool>{needs[0], needs[1], needs[2], wants_grad(l.low_rank_input), wants_grad(l.low_rank_weight)};
    if (!f.used_up.empty()) ctx->saved_data["used_up"] = f.used_up;
    variable_list saved{input, linear_weight, l.bias, l.low_rank_input, l.low_rank_weight};
    saved.insert(saved.end(), op->args.begin(), op->args.end());
    saved.insert(saved.end(), f.saved.begin(), f.saved.end());
    ctx->saved_data["args"] = static_cast<int64_t>(op->args.size());
    op->args.clear();
    ctx->save_for_backward(saved);
    ctx->mark_non_differentiable(f.non_differentiable);
    return f.outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto parsed = c10::static_intrusive_pointer_cast<Op>(ctx->saved_data["op"].toCapsule());
    const auto op = c10::make_intrusive<Op>(*parsed);  // the options, with the saved args below
    // The gradients come from kernels with no derivative of their own: a graph of them (create_graph=True,
    // torch.autograd.functional.hessian, gradient penalties) would be silently wrong, so it is an error.
    TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(), "fused_ce.", op->caller(),
                                ": double backward (create_graph=True, torch.autograd.functional.hessian, ...) is not "
                                "supported; use torch.nn.functional.cross_entropy on the logits for higher-order "
                                "gradients");
    const auto needs = ctx->saved_data["needs_grad"].toBoolList();
    const Mask mask{needs[0], needs[1], needs[2]};
    variable_list saved = ctx->get_saved_variables();
    const Linear linear{saved[0], saved[1], saved[2], saved[3], saved[4]};
    const int64_t args = ctx->saved_data["args"].toInt();
    op->args.assign(saved.begin() + 5, saved.begin() + 5 + args);
    saved.erase(saved.begin(), saved.begin() + 5 + args);
    std::optional<variable_list> used_up;
    auto kept = ctx->saved_data.find("used_up");
    if (kept != ctx->saved_data.end()) {  // a second backward through a retained graph finds none
      used_up = kept->second.toTensorVector();
      ctx->saved_data.erase(kept);
    }
    const variable_list g = op->backward(linear, saved, grads, mask, std::move(used_up));
    variable_list out(6);  // (the op's capsule last: no gradient)
    for (size_t i = 0; i < 5; ++i) {
      if (needs[i] && i < g.size()) out[i] = g[i];
    }
    return out;
  }
};

// fused_ce::_scale_grad_: grad *= scale in place, for gradients computed in the forward; on CUDA a kernel
// (cuda_scale_) that reads scale on the device, so `loss.backward()` costs no pass and no synchronisation;
// elsewhere a multiply.
void _scale_grad_(const at::Tensor& grad, const at::Tensor& scale);

// The checks every Autograd kernel makes; false where no gradient is asked for (the op runs below autograd).
bool needs_autograd(const char* caller, const Linear& l);

// An error naming the argument where a tensor that has no gradient requires one (`what` adds to its name).
void check_not_differentiable(const char* caller, const char* name, const std::optional<at::Tensor>& t,
                              const char* what = "");

// The gradients a forward formed at unit scale (used_up; computed again by `recompute` for a second backward
// through a retained graph, deterministically, so that it gives bitwise the same: gradcheck's reentrance check)
// times the upstream gradient where asked for: in place in their argument's dtype, else (float16's float32 ones,
// cross_entropy.h) scaled and then rounded once to it. The list: input's, linear_weight's, linear_bias's, then
// float16's dW scale ([] or empty) and the low-rank term's two where there is one; the result: the linear's three, then
// those two.
variable_list scaled_forward_grads(std::optional<torch::autograd::variable_list> used_up,
                                   const std::function<torch::autograd::variable_list()>& recompute, const Linear& l,
                                   at::Tensor grad_loss, const Mask& mask);

}  // namespace fused_ce
