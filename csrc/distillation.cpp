// linear_distillation_loss's kernels (distillation.h): the op, its with-grad op, its autograd formula; each a Call
// over the problem with the teacher (make_distillation_problem) and the plan's executor (executors.h).
#include "distillation.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "distillation_problem.h"
#include "executors.h"
#include "format.h"
#include "op_function.h"

namespace fused_ce {
namespace {

constexpr const char* kCaller = "linear_distillation_loss";

// (loss, entropy, grad_input, grad_linear_weight, grad_linear_bias): the call over the counted rows (every row
// under CUDA graph capture, the ignored ones weighed 0), the gradients `need` asks for where `with_grad`, each
// row's times row_scale (else the reduction's own).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distill(const DistillationInputs& in,
                                                                               LossOptions o, bool with_grad,
                                                                               const OptionalTensor& row_scale,
                                                                               GradMask need) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // (the dtypes as given)
  Problem problem = make_distillation_problem(in, o);
  const Call call(std::move(problem), std::move(o), with_grad ? Pass::ForwardWithGrad : Pass::Forward,
                  {/*check=*/true, /*unit=*/nullptr, /*given=*/in.target && in.target->defined()},
                  in.input.sizes().slice(0, in.input.dim() - 1), in.input, in.linear_weight.scalar_type());
  const LossOptions& options = call.options;
  const auto acc = call.problem.x.options().dtype(loss_dtype(call.problem));
  // the rows run are the counted ones where their count was read, else (CUDA graph capture) every row, with this
  // mask of the counted ones
  const at::Tensor counts = call.counted_rows.known() ? at::Tensor() : call.run.target.ge(0).to(acc.dtype());
  const auto counted = [&]() { return counts.sum(); };
  std::optional<RowScale> scale;
  if (with_grad) {
    RowScale s;
    if (row_scale && row_scale->defined()) {
      TORCH_CHECK_VALUE(row_scale->numel() == call.problem.N, kCaller, ": row_scale must hold one value per row (",
                        num(call.problem.N), "), got ", num(row_scale->numel()));
      s.per_row = call.of_run(row_scale)->to(acc.dtype());
      if (counts.defined()) s.per_row = s.per_row * counts;
    } else if (options.reduction_kind == Reduction::Mean) {  // an upstream gradient of 1 on the scalar loss
      if (counts.defined()) {
        s.per_row = counts / counted().clamp_min(1);
      } else {
        s.uniform = 1.0 / static_cast<double>(std::max<int64_t>(call.counted_rows.counted, 1));
      }
    } else if (counts.defined()) {
      s.per_row = counts;
    }
    scale = s;
  }
  const Problem shard = call.shard();
  DistillationRows r = call.plan.strategy == Strategy::AtenChunks
                           ? distillation_rows(shard, options, call.plan, scale, need)
                           : distillation_rows_from_kernels(shard, options, call.plan, scale, need);
  if (counts.defined()) {
    r.loss.mul_(counts);
    if (r.entropy.defined()) r.entropy.mul_(counts);
  }
  at::Tensor loss;
  switch (options.reduction_kind) {
    case Reduction::None: loss = call.per_target(r.loss.unsqueeze(0))[0]; break;
    case Reduction::Sum: loss = r.loss.sum(); break;
    case Reduction::Mean:  // (no counted row: NaN, as torch's mean)
      loss =
          counts.defined() ? r.loss.sum() / counted() : r.loss.sum() / static_cast<double>(call.counted_rows.counted);
      break;
  }
  const at::Tensor entropy =
      options.return_entropy ? call.per_target(r.entropy.unsqueeze(0))[0] : at::empty({0}, r.loss.options());
  const auto [gx, gw, gb] = call.grads(r.grads);
  return {call.flagged(loss), entropy, gx, gw, gb};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_distillation_loss(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  const auto out = distill({FUSED_CE_DISTILLATION_TENSOR_ARGS},
                           distillation_options(FUSED_CE_ARG_LIST(FUSED_CE_DISTILLATION_OPTIONS)), false, std::nullopt,
                           {false, false, false});
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_distillation_with_grad(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS, const OptionalTensor& row_scale,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  return distill({FUSED_CE_DISTILLATION_TENSOR_ARGS},
                 distillation_options(FUSED_CE_ARG_LIST(FUSED_CE_DISTILLATION_OPTIONS)), true, row_scale, output_mask);
}

namespace {

// linear_distillation_loss's autograd: a scalar loss's gradients formed in the forward (the backward scales
// them); 'none' forms them in the backward for its upstream gradient, one pass over both heads again.
struct DistillationOp : torch::CustomClassHolder {
  // teacher_input, teacher_weight, target, teacher_bias, teacher top-k indices and log-probabilities
  variable_list args;
  std::vector<c10::IValue> options;  // in schema order
  bool scalar = true;

  DistillationOp(const std::array<OptionalTensor, 6>& others, std::vector<c10::IValue> options_in_order,
                 bool scalar_loss)
      : options(std::move(options_in_order)), scalar(scalar_loss) {
    for (const auto& t : others) args.push_back(t.value_or(at::Tensor()));
  }

  std::string caller() const { return kCaller; }

  // _linear_distillation_with_grad below autograd: (loss, entropy, grad_input, grad_weight, grad_bias).
  variable_list with_grad(const Linear& l, const at::Tensor& row_scale, const Mask& mask) const {
    static const auto op = op_handle("fused_ce::_linear_distillation_with_grad");
    torch::jit::Stack stack{l.input,
                            l.weight,
                            optional(args[0]),
                            optional(args[1]),
                            optional(args[2]),
                            optional(l.bias),
                            optional(args[3]),
                            optional(args[4]),
                            optional(args[5]),
                            optional(row_scale),
                            std::vector<bool>(mask.begin(), mask.end())};
    stack.insert(stack.end(), options.begin(), options.end());
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(&stack);
    variable_list out;
    for (const auto& v : stack) out.push_back(v.toTensor());
    return out;
  }

  Forward forward(const Linear& l, const Mask& needs) const {
    Forward f;
    const variable_list all = with_grad(l, at::Tensor(), scalar ? needs : Mask{false, false, false});
    f.outputs = {all[0], all[1]};
    f.non_differentiable = {all[1]};
    if (scalar) f.used_up = {all[2], all[3], all[4]};
    return f;
  }

  variable_list backward(const Linear& l, const variable_list&, const variable_list& grads, const Mask& mask,
                         std::optional<variable_list> used_up) const {
    if (scalar) {
      const auto recompute = [&] {
        const variable_list all = with_grad(l, at::Tensor(), mask);
        return variable_list{all[2], all[3], all[4]};
      };
      return scaled_forward_grads(std::move(used_up), recompute, l, grads[0], mask);
    }
    const at::Tensor upstream = grads[0].defined() ? grads[0]
                                                   : at::zeros(l.input.sizes().slice(0, l.input.dim() - 1),
                                                               l.input.options().dtype(at::kFloat));
    const variable_list all = with_grad(l, upstream, mask);
    return {all[2], all[3], all[4]};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_distillation_loss_autograd(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  for (const auto& [argument, t] : {std::pair<const char*, const OptionalTensor*>{"teacher_input", &teacher_input},
                                    {"teacher_weight", &teacher_weight},
                                    {"teacher_bias", &teacher_bias},
                                    {"teacher_top_k log_probs", &teacher_top_log_probs}}) {
    check_not_differentiable(kCaller, argument, *t, " (the teacher gets no gradient)");
  }
  const Linear l{input, linear_weight, linear_bias.value_or(at::Tensor())};
  if (!needs_autograd(kCaller, l)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return linear_distillation_loss(FUSED_CE_DISTILLATION_TENSOR_ARGS FUSED_CE_ARGS(FUSED_CE_DISTILLATION_OPTIONS));
  }
#define FUSED_CE_IVALUE_ITEM(cpp_type, name, ...) , c10::IValue(name)
  auto options = detail::call_without_first([](auto... v) { return std::vector<c10::IValue>{v...}; },
                                            0 FUSED_CE_DISTILLATION_OPTIONS(FUSED_CE_IVALUE_ITEM));
#undef FUSED_CE_IVALUE_ITEM
  const auto op = c10::make_intrusive<DistillationOp>(
      std::array<OptionalTensor, 6>{teacher_input, teacher_weight, target, teacher_bias, teacher_top_indices,
                                    teacher_top_log_probs},
      std::move(options), reduction != "none");
  const variable_list out =
      OpFunction<DistillationOp>::apply(input, linear_weight, linear_bias, std::nullopt, std::nullopt, op);
  return {out[0], out[1]};
}

}  // namespace fused_ce
