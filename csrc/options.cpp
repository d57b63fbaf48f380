#include "options.h"

#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <string>
#include <tuple>

#include "format.h"

namespace fused_ce {
namespace {

Reduction parse_reduction(const std::string& op, c10::string_view r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  TORCH_CHECK_VALUE(false, op, ": reduction must be 'mean', 'sum' or 'none', got '", std::string(r), "'");
  return Reduction::Mean;  // not reached
}

// An option's value out of a saved IValue.
template <typename T>
T from(const c10::IValue& v) {
  return v.to<T>();
}
template <>
c10::string_view from<c10::string_view>(const c10::IValue& v) {
  return v.toStringView();
}

}  // namespace

LossOptions LossOptions::parse(FUSED_CE_PARAM_LIST(FUSED_CE_ALL_OPTIONS)) {
  LossOptions o;
#define FUSED_CE_ASSIGN_ITEM(cpp_type, name, ...) o.name = detail::Stored<cpp_type>::type(name);
  FUSED_CE_ALL_OPTIONS(FUSED_CE_ASSIGN_ITEM)
#undef FUSED_CE_ASSIGN_ITEM
  o.check();
  return o;
}

// Exception classes as torch raises them: ValueError for a bad reduction, RuntimeError for label_smoothing;
// ValueError for the options of our own.
void LossOptions::check() {
  const std::string& op = caller;
  if (distillation) check_teacher();
  reduction_kind = parse_reduction(op, reduction);
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
              num(label_smoothing));
  TORCH_CHECK_VALUE(z_loss >= 0.0 && std::isfinite(z_loss), op, ": z_loss must be a finite value >= 0, got ",
                    num(z_loss));
  // The kernels compute in float32: a softcap or logit_scale beyond its range would become inf (or 0) inside
  // and turn finite losses into NaN.
  TORCH_CHECK_VALUE(!softcap || (*softcap >= FLT_MIN && *softcap <= FLT_MAX), op,
                    ": softcap must be a value in [1.2e-38, 3.4e38] (float32's normal range) or None, got ",
                    num(softcap.value_or(0.0)));
  TORCH_CHECK_VALUE(std::isfinite(logit_scale) && std::fabs(logit_scale) <= FLT_MAX, op,
                    ": logit_scale must be finite and within float32's range, got ", num(logit_scale));
  TORCH_CHECK_VALUE(grad_filter_eps >= 0.0 && grad_filter_eps < 1.0, op, ": grad_filter_eps must be in [0, 1), got ",
                    num(grad_filter_eps));
  if (grad_filter_eps > 0.0) {
    // (the smoothing's uniform term sits below any threshold in every tile: filtering would drop it)
    TORCH_CHECK_VALUE(label_smoothing == 0.0, op, ": grad_filter_eps does not combine with label_smoothing");
    TORCH_CHECK_VALUE(reduction_kind != Reduction::None, op,
                      ": grad_filter_eps applies to a scalar loss (reduction 'mean' or 'sum')");
  }
  TORCH_CHECK_VALUE(!workspace_bytes || *workspace_bytes > 0, op, ": workspace_bytes must be positive (or None), got ",
                    num(workspace_bytes.value_or(0)));
  if (!vocab_parallel()) {
    TORCH_CHECK_VALUE(vocab_start == 0 && vocab_size == 0 && max_shard_rows == 0, op,
                      ": vocab_start, vocab_size and max_shard_rows describe a vocabulary shard and need a "
                      "process_group");
  } else {
    TORCH_CHECK_VALUE(vocab_start >= 0 && vocab_size > 0 && max_shard_rows > 0, op,
                      ": a vocabulary shard needs vocab_start >= 0, vocab_size > 0 and max_shard_rows > 0, got ",
                      num(vocab_start), ", ", num(vocab_size), ", ", num(max_shard_rows));
  }
}

void LossOptions::check_teacher() const {
  const std::string& op = caller;
  TORCH_CHECK_VALUE(std::isfinite(beta) && beta >= 0.0 && beta <= 1.0, op, ": beta must be in [0, 1], got ", num(beta));
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, op,
                    ": temperature must be positive and finite, got ", num(temperature));
  TORCH_CHECK_VALUE(std::isfinite(hard_label_weight) && hard_label_weight >= 0.0 && hard_label_weight <= 1.0, op,
                    ": hard_label_weight must be in [0, 1], got ", num(hard_label_weight));
  for (const auto& [prefix, scale, cap] :
       {std::make_tuple("", logit_scale, softcap), std::make_tuple("teacher_", teacher_logit_scale, teacher_softcap)}) {
    TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.0, op, ": ", prefix,
                      "logit_scale must be positive and finite, got ", num(scale));
    TORCH_CHECK_VALUE(!cap || (std::isfinite(*cap) && *cap > 0.0), op, ": ", prefix,
                      "softcap must be positive and finite, got ", num(cap.value_or(0.0)));
  }
}

LossOptions distillation_options(FUSED_CE_PARAM_LIST(FUSED_CE_DISTILLATION_OPTIONS)) {
  LossOptions o;
  o.caller = "linear_distillation_loss";
  o.distillation = true;
  o.lse_of_ignored_rows = false;
#define FUSED_CE_ASSIGN_ITEM(cpp_type, name, ...) o.name = detail::Stored<cpp_type>::type(name);
  FUSED_CE_DISTILLATION_OPTIONS(FUSED_CE_ASSIGN_ITEM)
#undef FUSED_CE_ASSIGN_ITEM
  o.check();
  return o;
}

LossOptions LossOptions::from_ivalues(c10::ArrayRef<c10::IValue> v) {
  TORCH_CHECK(v.size() == kNumOptions, "fused_ce: ", num(v.size()), " option values, expected ", num(kNumOptions));
  LossOptions raw;
  size_t i = 0;
#define FUSED_CE_FROM_ITEM(cpp_type, name, ...) raw.name = detail::Stored<cpp_type>::type(from<cpp_type>(v[i++]));
  FUSED_CE_ALL_OPTIONS(FUSED_CE_FROM_ITEM)
#undef FUSED_CE_FROM_ITEM
  raw.check();
  return raw;
}

TemperedLogits at_temperature(const char* op, double temperature, const std::optional<double>& softcap,
                              double logit_scale) {
  TORCH_CHECK_VALUE(temperature > 0.0 && std::isfinite(temperature), op,
                    ": temperature must be a finite value > 0, got ", num(temperature));
  // the arguments as given first, then what the temperature makes of them (the kernels' float32 values)
  TORCH_CHECK_VALUE(!softcap || (*softcap >= FLT_MIN && *softcap <= FLT_MAX), op,
                    ": softcap must be a value in [1.2e-38, 3.4e38] (float32's normal range) or None, got ",
                    num(softcap.value_or(0.0)));
  TORCH_CHECK_VALUE(std::isfinite(logit_scale) && std::fabs(logit_scale) <= FLT_MAX, op,
                    ": logit_scale must be finite and within float32's range, got ", num(logit_scale));
  const TemperedLogits tempered{softcap ? std::optional<double>(*softcap / temperature) : std::nullopt,
                                logit_scale / temperature};
  TORCH_CHECK_VALUE(!tempered.softcap || (*tempered.softcap >= FLT_MIN && *tempered.softcap <= FLT_MAX), op,
                    ": temperature ", num(temperature), " takes softcap ", num(*softcap),
                    " beyond float32's normal range (softcap / temperature = ", num(tempered.softcap.value_or(0.0)),
                    "); use a temperature closer to 1");
  TORCH_CHECK_VALUE(std::fabs(tempered.logit_scale) <= FLT_MAX, op, ": temperature ", num(temperature),
                    " takes the logits' scale beyond float32's range (logit_scale / temperature = ",
                    num(tempered.logit_scale), "); use a larger temperature");
  return tempered;
}

LossOptions log_prob_options(const char* caller, c10::string_view reduction, const TemperedLogits& tempered,
                             int64_t ignore_index, const std::optional<int64_t>& workspace_bytes, bool entropy,
                             bool argmax FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS)) {
  LossOptions o;  // the defaults, then what the log-probs need
  o.caller = caller;
  o.reduction = std::string(reduction);
  o.ignore_index = ignore_index;
  o.softcap = tempered.softcap;
  o.logit_scale = tempered.logit_scale;
  o.workspace_bytes = workspace_bytes;
  o.lse_of_ignored_rows = false;
  o.return_entropy = entropy;
  o.return_argmax = argmax;
#define FUSED_CE_ASSIGN_ITEM(cpp_type, name, ...) o.name = detail::Stored<cpp_type>::type(name);
  FUSED_CE_SHARD_OPTIONS(FUSED_CE_ASSIGN_ITEM)
#undef FUSED_CE_ASSIGN_ITEM
  o.check();
  return o;
}

}  // namespace fused_ce
