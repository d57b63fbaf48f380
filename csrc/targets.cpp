#include "targets.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "cuda_stages.h"
#include "format.h"
#include "kernel_args.h"
#include "loss_terms.h"

namespace fused_ce {
namespace {

// Bad class indices counted under CUDA graph capture, per device, for the next call outside capture to report:
// each replay adds its count, the report zeroes it. Made by the first checked call on the device outside capture
// (a captured graph's warm-up), in the driver's memory: a tensor of torch's allocator made under capture, or in
// CUDA graph trees' warm-up, lives in a graph's private pool, which torch.compile's graph trees require to hold
// the graph's outputs alone (mode="reduce-overhead" failed where its capture was the process's first) and whose
// memory a later graph takes over (a spurious report followed). A capture before any call outside it has no
// tally: its replays' losses are still NaN, and nothing is reported.
std::mutex captured_bad_mutex;
std::map<int, at::Tensor> captured_bad;
std::atomic<bool> captured_any{false};

// The class index the check reports: the first bad one of the raw targets.
[[noreturn]] void bad_target_error(const at::Tensor& raw, const LossOptions& o, int64_t V) {
  const at::Tensor bad = raw.ne(o.ignore_index).logical_and_(raw.lt(0).logical_or_(raw.ge(V)));
  const int64_t value = raw.masked_select(bad).flatten()[0].item<int64_t>();
  TORCH_CHECK_INDEX(false, o.caller, ": target ", num(value), " is out of bounds: class indices must be in [0, ",
                    num(V), ") or ignore_index (", num(o.ignore_index), ")");
  __builtin_unreachable();
}

// Outside a capture: the device's tally, allocated at its first call, and its report (one more read, once anything
// was captured).
void report_captured_bad_targets(const Problem& p) {
  std::lock_guard<std::mutex> lock(captured_bad_mutex);
  auto it = captured_bad.find(p.x.device().index());
  if (it == captured_bad.end()) {
    captured_bad.emplace(p.x.device().index(), driver_allocated_counter(p.x.device()));
    return;
  }
  if (captured_any && it->second.item<int>() != 0) {
    it->second.zero_();
    TORCH_CHECK_INDEX(false, "fused_ce: a call replayed from a CUDA graph saw class indices outside [0, ", num(p.V),
                      ") that are not ignore_index (its loss was NaN, those rows counted as ignored); "
                      "reported by the first call outside capture since");
  }
}

// Under capture: the bad-index count goes to the device's tally (where there is one), for the next call outside
// capture to report, and to the problem, to turn this call's loss NaN.
void tally_captured_bad_targets(Problem& p, const at::Tensor& bad) {
  std::lock_guard<std::mutex> lock(captured_bad_mutex);
  auto it = captured_bad.find(p.x.device().index());
  if (it != captured_bad.end()) {
    it->second.add_(bad);
    captured_any = true;
  }
  p.unreported_bad_targets = bad;
}

// The counted rows of prepared targets (-1 where ignored), in ATen: the paths without the row kernels.
CountedRows count_rows(const at::Tensor& target) {
  const at::Tensor counted = target.ge(0);
  CountedRows rows;
  rows.order = at::cat({counted.nonzero().flatten(), counted.logical_not().nonzero().flatten()});
  rows.counted = counted.sum().item<int64_t>();
  return rows;
}

// The values prepare_targets reads back with the counts (its one host read), in this order: x's extremes, then for
// a class-weighted mean the class and target weights' extremes, the target weights' L1 norm and prepare_rows'
// totals (Totals' entries from kTotals on).
enum Extreme : int { kInputLo, kInputHi, kClassLo, kClassHi, kTargetLo, kTargetHi, kTargetWeightNorm, kTotals };
using Totals = PrepareRowsArgs::Totals;
using Counts = PrepareRowsArgs::Counts;

// Problem::coefficient_max and coefficient_sum of a class-weighted mean: a counted row's logit gradients are
// g ((1 - eps) w_t (p - onehot) + eps / V (cw_sum p - cw)) with g = 1 / (the counted rows' weight sum), so each is
// at most |g| ((1 - eps) |w_t| + eps / V (|cw_sum| + max|cw|)) before the logit scale and the z-loss.
void weighted_mean_coefficients(Problem& p, const LossOptions& o, const at::Tensor& read) {
  const auto value = [&](int i) { return read[i].item<double>(); };
  const double largest_class = std::max(-value(kClassLo), value(kClassHi));
  const double largest_target = std::max(-value(kTargetLo), value(kTargetHi));
  const double target_weights = value(kTargetWeightNorm), weight_sum = value(kTotals + Totals::kTargetWeightSum);
  const double counted = value(kTotals + Totals::kCounted), class_weight_sum = value(kTotals + Totals::kClassWeightSum);
  const double eps = o.label_smoothing, g = 1.0 / std::abs(weight_sum);
  const double smoothing = eps / static_cast<double>(p.V) * (std::abs(class_weight_sum) + largest_class);
  const double inf = std::numeric_limits<double>::infinity();
  const double max = g * ((1.0 - eps) * largest_target + smoothing);
  const double sum = g * ((1.0 - eps) * target_weights + counted * smoothing);
  p.coefficient_max = std::isnan(max) ? inf : max;  // (NaN weights: no bound)
  p.coefficient_sum = std::isnan(sum) ? inf : sum;
}

}  // namespace

CountedRows prepare_targets(Problem& p, const LossOptions& o, const DeviceFacts& device, bool check,
                            GradCoefficients* unit, bool order_under_capture, bool input_abs_max) {
  const at::Tensor raw = p.target;
  CountedRows rows;
  if (device.row_kernels(p.N)) {
    // prepare_rows makes bad indices ignored rows (nothing is read out of bounds); no host read under capture.
    const bool capturing = stream_capturing(p.x.device());
    at::Tensor order;
    const bool write_order = !capturing || order_under_capture;
    const at::Tensor counts = cuda_prepare_rows(p, raw, o, unit, write_order ? &order : nullptr);  // (Counts)
    if (capturing) {
      if (check) tally_captured_bad_targets(p, counts.narrow(0, 0, 1));
      rows.order = order;
      return rows;
    }
    if (check) report_captured_bad_targets(p);
    // (queued before the read, so that the read waits for them all)
    at::Tensor extremes;
    const bool weighted_mean = p.class_weight.defined() && o.reduction_kind == Reduction::Mean;
    if (input_abs_max && p.N > 0) {
      const auto [lo, hi] = at::aminmax(p.x);
      std::vector<at::Tensor> parts{lo, hi};  // (in Extreme's order)
      if (weighted_mean) {                    // (weighted_mean_coefficients' inputs)
        const auto [class_lo, class_hi] = at::aminmax(p.class_weight);
        const auto [target_lo, target_hi] = at::aminmax(p.target_weight);
        parts.insert(parts.end(),
                     {class_lo, class_hi, target_lo, target_hi, at::linalg_vector_norm(p.target_weight, 1)});
      }
      TORCH_CHECK(static_cast<int>(parts.size()) == (weighted_mean ? kTotals : kClassLo),
                  "fused_ce: the extremes read back are out of Extreme's order");
      for (at::Tensor& part : parts) part = part.to(at::kFloat);
      extremes = at::stack(parts);
      if (weighted_mean) extremes = at::cat({extremes, p.totals});
    }
    const at::Tensor host = counts.cpu();  // the one host read
    if (check && host[Counts::kBad].item<int>() != 0) bad_target_error(raw, o, p.V);
    rows.counted = host[Counts::kCounted].item<int>();
    if (extremes.defined()) {
      const at::Tensor e = extremes.cpu();  // (done by now: no second wait)
      const double lo = e[kInputLo].item<double>(), hi = e[kInputHi].item<double>();
      p.input_abs_max = std::isnan(lo) || std::isnan(hi) ? lo + hi : std::max(-lo, hi);
      if (weighted_mean) weighted_mean_coefficients(p, o, e);
    }
    rows.order = order;
    return rows;
  }
  const at::Tensor ignored = raw.eq(o.ignore_index);
  if (check && p.N > 0) {
    if (ignored.logical_not().logical_and_(raw.lt(0).logical_or_(raw.ge(p.V))).any().item<bool>()) {
      bad_target_error(raw, o, p.V);
    }
  }
  p.target = at::where(ignored, -1, raw).contiguous();
  if (unit != nullptr) *unit = unit_grad_coefficients(p, o);
  if (!p.x.is_cuda() || !stream_capturing(p.x.device())) rows = count_rows(p.target);
  return rows;
}

void check_teacher_classes(Problem& p, const LossOptions& o) {
  at::Tensor& idx = p.teacher.top_indices;
  if (idx.numel() == 0) return;
  const at::Tensor bad = idx.lt(0).logical_or_(idx.ge(p.V));
  if (p.x.is_cuda() && stream_capturing(p.x.device())) {
    const at::Tensor count = bad.sum().to(at::kInt).reshape({1});
    const at::Tensor targets = p.unreported_bad_targets;
    tally_captured_bad_targets(p, count);
    if (targets.defined()) p.unreported_bad_targets = targets + count;
    idx = at::where(bad, at::zeros({}, idx.options()), idx);
    return;
  }
  TORCH_CHECK_INDEX(!bad.any().item<bool>(), o.caller, ": teacher_top_k holds a class index outside [0, ", num(p.V),
                    ")");
}

}  // namespace fused_ce
