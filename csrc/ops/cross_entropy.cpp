// The cross-entropy ops (cross_entropy.h): their schemas, their CPU and CUDA kernels (each a Call, call.h: options,
// problem, counted rows, plan, the rows run; and its executor), linear_log_probs over _linear_cross_entropy.
#include "cross_entropy.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "call.h"
#include "executors.h"
#include "format.h"
#include "library.h"
#include "loss_terms.h"
#include "op_function.h"
#include "plan.h"
#include "problem.h"
#include "targets.h"
#include "vocab_parallel.h"

namespace fused_ce {
namespace {

// The gradients the row blocks form: dW too unless it comes from vocabulary slices (Plan::weight_grad_slice_classes).
GradMask without_weight_grad(GradMask need, bool slices) {
  if (slices) need[1] = false;
  return need;
}

// The forward's outputs (loss, lse, entropy, argmax): the Forward pipeline.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(const LossInputs& in, LossOptions o) {
  const Call call(in, std::move(o), Pass::Forward, {});
  const Problem shard = call.shard();
  const RowStats s = forward_stats(shard, call.options, call.plan);
  if (call.options.vocab_parallel()) combine_vocab_shards(shard, s, call.options);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax};
}

// The backward ops' upstream gradients (of the loss, the lse, the entropy) and the forward's outputs they need.
struct Upstream {
  const at::Tensor& grad_loss;
  const std::optional<at::Tensor>&grad_lse, &grad_entropy;
  const at::Tensor& lse;
  const std::optional<at::Tensor>& entropy;
};

// The backward ops' gradients: the upstream gradients' coefficients at the forward's lse, the row blocks' gradients
// from `block_grads(shard, coefficients, need)` (recomputed logits, or the kept ones), dW from vocabulary slices
// where the plan takes them.
template <class BlockGrads>
CrossEntropyGrads backward_grads(const Call& call, const Upstream& up, GradMask output_mask,
                                 const BlockGrads& block_grads) {
  GradCoefficients c = grad_coefficients(call.problem, call.options, up.grad_loss, up.grad_lse, up.grad_entropy,
                                         up.entropy ? *up.entropy : at::Tensor());
  c.lse = up.lse.reshape({call.problem.N}).to(loss_dtype(call.problem)).contiguous();
  const Problem shard = call.shard();
  const GradCoefficients run = call.of_run(c);
  const bool slices = output_mask[1] && call.plan.weight_grad_slice_classes > 0;
  Grads g = block_grads(shard, run, without_weight_grad(output_mask, slices));
  if (slices) g.weight = weight_grad_by_slices(shard, call.options, call.plan, run);
  return std::tuple_cat(call.grads(g), call.low_rank_grads(g));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  return forward_outputs({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                         LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)));
}

CrossEntropyGrads linear_cross_entropy_backward(const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
                                                const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input,
                                                const at::Tensor& linear_weight, const at::Tensor& target,
                                                const std::optional<at::Tensor>& linear_bias,
                                                const std::optional<at::Tensor>& weight, const at::Tensor& lse,
                                                const std::optional<at::Tensor>& entropy,
                                                std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                                    FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  // (the forward checked these targets; ignored rows have no gradient unless their lse has one)
  const bool lse_grad = grad_lse && grad_lse->defined();
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                  LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)), Pass::Backward, {/*check=*/false}, -1,
                  /*every_row=*/lse_grad);
  return backward_grads(call, {grad_loss, grad_lse, grad_entropy, lse, entropy}, output_mask,
                        [&](const Problem& shard, const GradCoefficients& run, GradMask need) {
                          return recomputed_grads(shard, call.options, call.plan, run, need);
                        });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_keeping_logits(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  const std::optional<c10::SymInt> kept = kept_logit_rows(input, linear_weight, target, o, device_facts(input));
  if (!kept) {  // none kept: the forward alone
    return std::tuple_cat(
        forward_outputs({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                        std::move(o)),
        std::make_tuple(at::empty({0, linear_weight.size(0)}, input.options())));
  }
  const int64_t capacity = kept->guard_int(__FILE__, __LINE__);
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight}, std::move(o),
                  Pass::ForwardKeepingLogits, {}, capacity);
  const Problem shard = call.shard();
  const int64_t kept_n = std::min(capacity, call.run.N);  // the first rows of the run's order
  at::Tensor logits;
  RowStats s;
  if (kept_n == call.run.N) {
    logits = at::empty({capacity, shard.V}, call.problem.x.options());
    s = forward_stats(shard, call.options, call.plan, logits);
  } else {
    // the other rows first, in blocks of their own workspace, freed before the kept logits take its place
    const Problem rest = shard.row_range(kept_n, call.run.N);
    const RowStats rest_stats =
        forward_stats(rest, call.options, make_plan(rest, call.options, call.plan.device, Pass::Forward));
    logits = at::empty({capacity, shard.V}, call.problem.x.options());
    const Problem kept_part = shard.row_range(0, kept_n);
    const RowStats kept_stats = forward_stats(
        kept_part, call.options,
        make_plan(kept_part, call.options, call.plan.device, Pass::ForwardKeepingLogits, -1, kept_n), logits);
    s = RowStats::allocate(shard, {call.options.smoothing(), call.options.return_entropy, call.options.return_argmax});
    s.block(0, kept_n).copy_(kept_stats);
    s.block(kept_n, call.run.N).copy_(rest_stats);
  }
  if (call.options.vocab_parallel()) combine_vocab_shards(shard, s, call.options);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax, logits};
}

CrossEntropyGrads _linear_cross_entropy_backward_from_logits(
    const at::Tensor& grad_loss, const std::optional<at::Tensor>& grad_lse,
    const std::optional<at::Tensor>& grad_entropy, at::Tensor& logits, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const std::optional<at::Tensor>& entropy,
    std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  const bool lse_of_ignored = grad_lse && grad_lse->defined();
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight},
                  LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS)), Pass::BackwardFromLogits,
                  {/*check=*/false}, logits.size(0));
  if (lse_of_ignored && !(call.counted_rows.known() && call.counted_rows.counted == call.problem.N)) {
    // the lse of ignored rows has a gradient, and their logits may not have been kept: computed again
    return linear_cross_entropy_backward(grad_loss, grad_lse, grad_entropy, input, linear_weight, target, linear_bias,
                                         weight, lse, entropy, output_mask FUSED_CE_ARGS(FUSED_CE_ALL_OPTIONS),
                                         low_rank_input, low_rank_weight);
  }
  return backward_grads(call, {grad_loss, grad_lse, grad_entropy, lse, entropy}, output_mask,
                        [&](const Problem& shard, const GradCoefficients& run, GradMask need) {
                          return grads_from_kept_logits(shard, call.options, call.plan, run, need, logits);
                        });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
linear_cross_entropy_with_grad(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                               const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                               std::array<bool, 3> output_mask FUSED_CE_PARAMS(FUSED_CE_ALL_OPTIONS)
                                   FUSED_CE_LOW_RANK_PARAMS) {
  const NoAutocast no_autocast;
  LossOptions o = LossOptions::parse(FUSED_CE_ARG_LIST(FUSED_CE_ALL_OPTIONS));
  TORCH_CHECK_VALUE(o.scalar(), "fused_ce::linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum'");
  GradCoefficients unit;
  const Call call({input, linear_weight, target, linear_bias, weight, low_rank_input, low_rank_weight}, std::move(o),
                  Pass::ForwardWithGrad, {/*check=*/true, &unit});
  CoefficientSource source;
  source.fixed = call.of_run(unit);
  const Problem shard = call.shard();
  const bool slices = output_mask[1] && call.plan.weight_grad_slice_classes > 0;
  auto [s, g] = forward_with_grad(shard, call.options, call.plan, source, without_weight_grad(output_mask, slices));
  if (slices) {  // dW from the vocabulary slices, at the forward's lse
    GradCoefficients c = source.fixed;
    c.lse = s.lse;
    g.weight = weight_grad_by_slices(shard, call.options, call.plan, c);
  }
  // float16's dX and db come back in float32, dW in float16 times a power of two (cross_entropy.h): at unit scale,
  // before the upstream gradient, float16 would lose them to underflow.
  const bool half = input.scalar_type() == at::kHalf;
  auto [gx, gw, gb] = call.grads(g, half);
  at::Tensor gw_scale = at::empty({0}, input.options().dtype(at::kFloat));
  if (half) {
    if (gw.numel() > 0) {
      std::tie(gw, gw_scale) = float16_weight_grad(gw, call.plan.grad_weight_scale);
    } else {
      gw = gw.to(at::kHalf);
      gw_scale = at::ones({}, gw_scale.options());
    }
  }
  const auto [gu, gb_low_rank] = call.low_rank_grads(g, half);
  const auto [lse, entropy, argmax] = call.outputs(s);
  return {call.loss(s), lse, entropy, argmax, gx, gw, gb, gw_scale, gu, gb_low_rank};
}

AllOutputs call_loss_op(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        const LossOptions& o FUSED_CE_LOW_RANK_PARAMS) {
  static auto op = op_handle("fused_ce::_linear_cross_entropy").typed<decltype(_linear_cross_entropy)>();
  return o.apply([&](auto... options) {
    return op.call(input, linear_weight, target, linear_bias, weight, options..., low_rank_input, low_rank_weight);
  });
}

namespace {

// fused_ce::linear_log_probs: log softmax(softcap(logit_scale * z) / temperature)[target] per row (0 where
// ignored), the entropy and the argmax of that distribution, as _linear_cross_entropy with reduction 'none'
// (minus its loss; at_temperature). Composite, so autograd, torch.compile and export see the op it calls.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias FUSED_CE_PARAMS(FUSED_CE_LOG_PROB_OPTIONS)
        FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_PARAMS) {
  const TemperedLogits tempered = at_temperature("linear_log_probs", temperature, softcap, logit_scale);
  const LossOptions o = log_prob_options("linear_log_probs", "none", tempered, ignore_index, workspace_bytes,
                                         return_entropy, return_argmax FUSED_CE_ARGS(FUSED_CE_SHARD_OPTIONS));
  const auto [loss, lse, entropy, argmax] =
      call_loss_op(input, linear_weight, target, linear_bias, std::nullopt, o, low_rank_input, low_rank_weight);
  return {loss.neg(), entropy, argmax};
}

void cross_entropy_kernels(torch::Library& m) {
  m.impl("linear_cross_entropy", &public_loss<&_linear_cross_entropy>);
  m.impl("_linear_cross_entropy", &_linear_cross_entropy);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward);
  m.impl("_linear_cross_entropy_keeping_logits", &_linear_cross_entropy_keeping_logits);
  m.impl("_linear_cross_entropy_backward_from_logits", &_linear_cross_entropy_backward_from_logits);
  m.impl("linear_cross_entropy_with_grad", &linear_cross_entropy_with_grad);
}

}  // namespace
}  // namespace fused_ce

// The tensor arguments every loss op begins with.
#define FUSED_CE_TENSORS \
  "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None"
// The backward ops': the upstream gradients, then (after the kept logits, where they are) the forward's arguments
// and outputs.
#define FUSED_CE_UPSTREAM_GRADS "Tensor grad_loss, Tensor? grad_lse, Tensor? grad_entropy, "
#define FUSED_CE_BACKWARD_TENSORS                                                                                \
  "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, Tensor lse, Tensor? " \
  "entropy, bool[3] output_mask"
// Their gradients (CrossEntropyGrads).
#define FUSED_CE_GRADS "Tensor, Tensor, Tensor, Tensor, Tensor"

TORCH_LIBRARY_FRAGMENT(fused_ce, m) {
  // The public op: graphs saved with it (TorchScript, torch.export, AOTInductor) keep loading as long as its
  // options are only ever appended, with defaults (options.h).
  m.def("linear_cross_entropy(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_LOSS_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax)",
        {at::Tag::pt2_compliant_tag});
  m.def("linear_cross_entropy_backward(" FUSED_CE_UPSTREAM_GRADS FUSED_CE_BACKWARD_TENSORS FUSED_CE_SCHEMA(
            FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA ") -> (" FUSED_CE_GRADS ")",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy_keeping_logits(" FUSED_CE_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS)
            FUSED_CE_LOW_RANK_SCHEMA ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax, Tensor logits)",
        {at::Tag::pt2_compliant_tag});
  m.def("_linear_cross_entropy_backward_from_logits(" FUSED_CE_UPSTREAM_GRADS
        "Tensor(a!) logits, " FUSED_CE_BACKWARD_TENSORS FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (" FUSED_CE_GRADS ")",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "linear_cross_entropy_with_grad(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, "
      "Tensor? weight, bool[3] output_mask" FUSED_CE_SCHEMA(FUSED_CE_ALL_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
      ") -> (Tensor loss, Tensor lse, Tensor entropy, Tensor argmax, Tensor, Tensor, "
      "Tensor, Tensor grad_weight_scale, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("linear_log_probs(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None" FUSED_CE_SCHEMA(
            FUSED_CE_LOG_PROB_OPTIONS) FUSED_CE_SCHEMA(FUSED_CE_SHARD_OPTIONS) FUSED_CE_LOW_RANK_SCHEMA
        ") -> (Tensor log_probs, Tensor entropy, Tensor argmax)",
        {at::Tag::pt2_compliant_tag});
}

FUSED_CE_CPU_AND_CUDA(fused_ce::cross_entropy_kernels)
FUSED_CE_AUTOCAST("linear_cross_entropy", "_linear_cross_entropy")

TORCH_LIBRARY_IMPL(fused_ce, CompositeImplicitAutograd, m) {
  m.impl("linear_log_probs", &fused_ce::linear_log_probs);
}
