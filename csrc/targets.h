// The targets prepared, before the plan: ignored rows marked, the class indices checked, and the rows that
// count found, so that the plan can run the executors on those rows only (Problem::select_rows).
#pragma once

#include <ATen/ATen.h>

#include "device.h"
#include "options.h"
#include "problem.h"

namespace fused_ce {

// Which rows count: their number and the rows in the order the executors take them.
struct CountedRows {
  // Rows whose target counts, read with the class-index check; -1 where nothing is read (the check made no
  // host read: under CUDA graph capture, or without `check`).
  int64_t counted = -1;
  // [N] int64: the counted rows in ascending order, then the ignored ones; undefined where counted is -1 (but
  // with prepare_targets' order_under_capture).
  at::Tensor order;

  bool known() const { return counted >= 0; }
  at::Tensor counted_index() const { return order.narrow(0, 0, counted); }
  at::Tensor ignored_index() const { return order.narrow(0, counted, order.numel() - counted); }
};

// Marks ignored rows (-1 in p.target) and, where the row kernels run (DeviceFacts::row_kernels: the
// plan's rows_on_device), sets p.target_weight and p.totals in one launch (cuda_prepare_rows). With `check`, a class
// index outside [0, V) that is not ignore_index is an IndexError naming it, found by one host read, which also brings
// the count of counted rows; under CUDA graph capture no read (the count stays unknown, and bad indices make the loss
// NaN and are reported by the next call outside capture). With `unit`, also the gradient coefficients of the scalar
// loss for an upstream gradient of 1. Without `check` (the backward's preparation of targets the forward checked) the
// count is read all the same, outside capture. With `order_under_capture` (and the row kernels), the order is written
// under capture too, where the count is not read. With `input_abs_max` (and the row kernels, outside capture), the same
// read brings p.input_abs_max.
CountedRows prepare_targets(Problem& p, const LossOptions& o, const DeviceFacts& device, bool check,
                            GradCoefficients* unit, bool order_under_capture = false, bool input_abs_max = false);

// A distillation's teacher top-k class indices (Problem::teacher) checked as prepare_targets checks the targets:
// outside CUDA graph capture, one that is not in [0, p.V) is an IndexError naming it (a host read); under capture
// none, the bad ones counted toward the loss's NaN (Problem::unreported_bad_targets) and read as class 0.
void check_teacher_classes(Problem& p, const LossOptions& o);

}  // namespace fused_ce
