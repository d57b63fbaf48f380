// fused_ce::linear_distillation_loss: a student's head distilled from a teacher's, both heads' logits formed row
// block by row block (never [N, V] at once), the student's gradients formed in the same pass from the same
// blocks. Each head's logits are transformed as its model does (logit_scale, then softcap: c tanh(z / c)).
// Per counted row, with s = log_softmax(student logits / T) and t = log_softmax(teacher logits / T):
//   beta 0: KL(t || s); beta 1: KL(s || t); in between the generalised JSD
//   beta KL(t || m) + (1 - beta) KL(s || m), m = (1 - beta) p_s + beta p_t (TRL's convention; no T^2 factor);
//   offline (teacher_top_indices / teacher_top_log_probs [..., k] instead of the teacher's head): the teacher's
//   k log-probs renormalised over those k, q, and KL(q || s) = sum_k q_k (log q_k - s[idx_k]);
// with hard_label_weight w, (1 - w) divergence + w cross-entropy of the student's logits (at T = 1) on target.
// Rows whose target is ignore_index are not counted and not computed; without target every row counts.
// 'mean' over the counted rows, 'sum', 'none' (per row, 0 at ignored rows). return_entropy: each row's student
// entropy at T (0 at ignored rows), no gradient. Vocabulary parallel (the shard options): both heads hold the
// same shard of the classes; the row statistics are combined over the group, so every rank gets the loss.
// A call of the ops is a Call (call.h) over a problem whose teacher is part of it (make_distillation_problem:
// distillation_problem.h): its targets prepared as every op's (CUDA graph capture included), its blocks planned
// (plan_distillation) and run by its executor (executors.h: ATen's stages, or cuBLAS's products swept by the
// distill_rows kernel).
// Here: the ops' schemas, their CPU and CUDA kernels, their autograd formula (OpFunction<DistillationOp>,
// op_function.h).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "call.h"
#include "distillation_problem.h"
#include "executors.h"
#include "format.h"
#include "library.h"
#include "op_function.h"
#include "options.h"

// The tensor arguments of the distillation ops, in schema order.
#define FUSED_CE_DISTILLATION_TENSORS(DEFAULT)                                                           \
  "Tensor input, Tensor linear_weight, Tensor? teacher_input" DEFAULT ", Tensor? teacher_weight" DEFAULT \
  ", Tensor? target" DEFAULT ", Tensor? linear_bias" DEFAULT ", Tensor? teacher_bias" DEFAULT            \
  ", Tensor? teacher_top_indices" DEFAULT ", Tensor? teacher_top_log_probs" DEFAULT

namespace fused_ce {
namespace {

using OptionalTensor = std::optional<at::Tensor>;
#define FUSED_CE_DISTILLATION_TENSOR_PARAMS                                                                  \
  const at::Tensor &input, const at::Tensor &linear_weight, const OptionalTensor &teacher_input,             \
      const OptionalTensor &teacher_weight, const OptionalTensor &target, const OptionalTensor &linear_bias, \
      const OptionalTensor &teacher_bias, const OptionalTensor &teacher_top_indices,                         \
      const OptionalTensor &teacher_top_log_probs
#define FUSED_CE_DISTILLATION_TENSOR_ARGS                                                                      \
  input, linear_weight, teacher_input, teacher_weight, target, linear_bias, teacher_bias, teacher_top_indices, \
      teacher_top_log_probs

constexpr const char* kCaller = "linear_distillation_loss";

// (loss, entropy, grad_input, grad_linear_weight, grad_linear_bias): the call over the counted rows (every row
// under CUDA graph capture, the ignored ones weighed 0), the gradients `need` asks for where `with_grad`, each
// row's times row_scale (else the reduction's own).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distill(const DistillationInputs& in,
                                                                               LossOptions o, bool with_grad,
                                                                               const OptionalTensor& row_scale,
                                                                               GradMask need) {
  const NoAutocast no_autocast;
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

// The public op's CPU and CUDA kernel (no gradient): (loss, entropy): the loss a scalar or (reduction 'none')
// shaped like the rows of input; the entropy shaped so where asked for, else empty.
std::tuple<at::Tensor, at::Tensor> linear_distillation_loss(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  const auto out = distill({FUSED_CE_DISTILLATION_TENSOR_ARGS},
                           distillation_options(FUSED_CE_ARG_LIST(FUSED_CE_DISTILLATION_OPTIONS)), false, std::nullopt,
                           {false, false, false});
  return {std::get<0>(out), std::get<1>(out)};
}

// fused_ce::_linear_distillation_with_grad: (loss, entropy, grad_input, grad_linear_weight, grad_linear_bias) of
// the student, the gradients asked for in output_mask (else empty), formed from the same logit blocks as the
// loss, each row's gradient times row_scale (one value per row of input; None: the reduction's own, i.e. an
// upstream gradient of 1 on a 'mean' or 'sum' loss).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_distillation_with_grad(
    FUSED_CE_DISTILLATION_TENSOR_PARAMS, const OptionalTensor& row_scale,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_DISTILLATION_OPTIONS)) {
  return distill({FUSED_CE_DISTILLATION_TENSOR_ARGS},
                 distillation_options(FUSED_CE_ARG_LIST(FUSED_CE_DISTILLATION_OPTIONS)), true, row_scale, output_mask);
}

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

// The public op's Autograd kernel: differentiable in input, linear_weight and linear_bias (the teacher gets no
// gradient).
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
  std::vector<c10::IValue> options{FUSED_CE_IVALUE_LIST(FUSED_CE_DISTILLATION_OPTIONS)};
  const auto op = c10::make_intrusive<DistillationOp>(
      std::array<OptionalTensor, 6>{teacher_input, teacher_weight, target, teacher_bias, teacher_top_indices,
                                    teacher_top_log_probs},
      std::move(options), reduction != "none");
  const variable_list out =
      OpFunction<DistillationOp>::apply(input, linear_weight, linear_bias, std::nullopt, std::nullopt, op);
  return {out[0], out[1]};
}

void distillation_kernels(torch::Library& m) {
  m.impl("linear_distillation_loss", &linear_distillation_loss);
  m.impl("_linear_distillation_with_grad", &_linear_distillation_with_grad);
}

}  // namespace
}  // namespace fused_ce

TORCH_LIBRARY_FRAGMENT(fused_ce, m) {
  m.def("linear_distillation_loss(" FUSED_CE_DISTILLATION_TENSORS("=None")
            FUSED_CE_SCHEMA(FUSED_CE_DISTILLATION_OPTIONS) ") -> (Tensor loss, Tensor entropy)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_distillation_with_grad(" FUSED_CE_DISTILLATION_TENSORS("") ", Tensor? row_scale, bool[3] output_mask"
            FUSED_CE_SCHEMA(FUSED_CE_DISTILLATION_OPTIONS) ") -> (Tensor loss, Tensor entropy, Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
}

FUSED_CE_CPU_AND_CUDA(fused_ce::distillation_kernels)
FUSED_CE_AUTOCAST("linear_distillation_loss")

TORCH_LIBRARY_IMPL(fused_ce, Autograd, m) {
  m.impl("linear_distillation_loss", &fused_ce::linear_distillation_loss_autograd);
}
