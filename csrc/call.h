// One op call's pipeline, made once: its options and problem, the counted rows, the plan (the kept rows
// included), the rows the executors run on and their vocabulary shard; then the loss, the per-row outputs and
// the gradients in the arguments' shapes. Each op (csrc/ops/) is a few lines over it.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "executors.h"
#include "options.h"
#include "plan.h"
#include "problem.h"
#include "targets.h"

namespace fused_ce {

// The tensor arguments every loss op begins with.
struct LossInputs {
  const at::Tensor& input;
  const at::Tensor& linear_weight;
  const at::Tensor& target;
  const std::optional<at::Tensor>& linear_bias;
  const std::optional<at::Tensor>& weight;
  // the cross-entropy ops' low-rank term of the logits (Problem::low_rank), where given
  const std::optional<at::Tensor>& low_rank_input = kNone;
  const std::optional<at::Tensor>& low_rank_weight = kNone;
  static inline const std::optional<at::Tensor> kNone;
};

class Call {
 public:
  // What preparing the targets does beyond marking ignored rows (prepare_targets).
  struct Targets {
    bool check = true;                 // check the class indices (the forward's; the backward's were checked)
    GradCoefficients* unit = nullptr;  // also the scalar loss's unit gradient coefficients
    bool given = true;                 // false: no target (a distillation's is optional), every row counts
  };

  // The pipeline up to the plan. The kept-logits passes run the kept rows' order (CountedRows::order) and plan for
  // `kept` rows of kept logits (the forward's capacity, the backward's kept tensor); every_row (the backward
  // with a gradient on every row's lse) plans for all rows.
  Call(const LossInputs& in, LossOptions loss_options, Pass pass, const Targets& targets, int64_t kept = -1,
       bool every_row = false);
  // The same over a problem made elsewhere (a distillation's: make_distillation_problem), of `input`'s rows
  // shaped `row_shape` (the targets' shape), its linear weight in `weight_dtype`.
  Call(Problem made, LossOptions loss_options, Pass pass, const Targets& targets, at::IntArrayRef row_shape,
       const at::Tensor& input, at::ScalarType weight_dtype);

  const LossOptions options;
  Problem problem;           // every row
  CountedRows counted_rows;  // which rows count, in the executors' order (the kept order for the kept passes)
  Plan plan;
  Problem run;  // the rows the executors take: the counted ones where the plan says so (or the kept order)

  Problem shard() const { return vocab_shard(run, options); }
  // c of the run's rows (the counted ones where they are selected)
  GradCoefficients of_run(const GradCoefficients& c) const;
  // A per-token tensor shaped like the target, as [run.N] rows
  std::optional<at::Tensor> of_run(const std::optional<at::Tensor>& t) const;
  // The loss shaped like the target (of every row for 'none', 0 at rows not run, else the scalar); NaN where
  // a CUDA graph capture saw bad class indices.
  at::Tensor loss(const RowStats& run_stats) const;
  // A scalar loss made NaN where a CUDA graph capture saw bad class indices (the policy loss's).
  at::Tensor flagged(const at::Tensor& loss) const;
  // Values per run row ([K, run.N]) as [K, the target's shape], 0 at rows not run (the policy loss's per-token
  // stats).
  at::Tensor per_target(const at::Tensor& run_rows) const;
  // (lse, entropy, argmax) of every row shaped like the target (the entropy 0 and the argmax -1 at ignored rows;
  // empty where not asked for): the run's stats, the ignored rows' lse from a forward pass where asked for.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> outputs(const RowStats& run_stats) const;
  // The executors' gradients in the arguments' shapes and dtypes; with `keep_dtypes` in their own.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> grads(const Grads& g, bool keep_dtypes = false) const;
  // The low-rank term's gradients shaped as its arguments (empty without one), in their dtype; with `keep_dtypes`
  // in the loss dtype.
  std::tuple<at::Tensor, at::Tensor> low_rank_grads(const Grads& g, bool keep_dtypes = false) const;

 private:
  void prepare(Pass pass, const Targets& targets, int64_t kept, bool every_row);

  std::vector<int64_t> target_shape_, input_shape_, low_rank_shape_;
  at::ScalarType input_dtype_, weight_dtype_;
};

}  // namespace fused_ce
