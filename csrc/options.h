// The options of the ops' schemas, declared once, and LossOptions: their values parsed and checked once,
// the one value every later step takes whole.
//
// Each option is declared once, FUSED_CE_OPTION_<name>: X(C++ parameter type, name, schema type, default), the
// default written once for both the schema and C++ (None, True and False are C++ names too, below); each op's
// list names its options in its schema's order. From them come the schema text of every op (csrc/ops/), the C++
// parameters and arguments of the ops' functions (FUSED_CE_PARAMS / _ARGS), LossOptions' fields, its parse from
// a boxed call's values (_plan's), and the Python front's arguments
// (fused_ce/_options.py builds them from the op's schema and fails at import when an option of it has no keyword in
// its front).
//
// Where a new option goes:
//   - a loss option every op takes (a logit transform like softcap, a loss term like z_loss): a
//     FUSED_CE_OPTION_<name>, and its name appended to FUSED_CE_LOSS_OPTIONS (it becomes an argument of the
//     public op linear_cross_entropy too: graphs saved with the old schema keep loading; never reorder a list).
//   - an option of the internal ops only: FUSED_CE_OUTPUT_OPTIONS or FUSED_CE_SHARD_OPTIONS.
//   Then check its value in LossOptions::check (errors name the argument), make the stages that need it read
//   it (a Problem field, a kernel argument), and add the keyword to the Python front.
//
// What a new output of the op (a per-row value such as the entropy) needs: a RowStats field (problem.h) that
// the forward stages fill when a FUSED_CE_OUTPUT_OPTIONS flag asks for it (logit_partials/combine_partials,
// row_stats, aten_stages), its combination over vocabulary shards (vocab_parallel.cpp), a return of
// _linear_cross_entropy (ops/cross_entropy.cpp and the fake kernel in fused_ce/_fake.py), and, if it is
// differentiable, a gradient input of linear_cross_entropy_backward and its term in the gradient
// coefficients (GradCoefficients, loss_terms.cpp). The entropy and the argmax were added this way.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

// Each option, declared once: X(C++ parameter type, name, schema type, default).
#define FUSED_CE_OPTION_reduction(X) X(c10::string_view, reduction, "str", "mean")
#define FUSED_CE_OPTION_ignore_index(X) X(int64_t, ignore_index, "int", -100)
#define FUSED_CE_OPTION_label_smoothing(X) X(double, label_smoothing, "float", 0.0)
#define FUSED_CE_OPTION_z_loss(X) X(double, z_loss, "float", 0.0)
#define FUSED_CE_OPTION_softcap(X) X(std::optional<double>, softcap, "float?", None)
#define FUSED_CE_OPTION_logit_scale(X) X(double, logit_scale, "float", 1.0)
#define FUSED_CE_OPTION_workspace_bytes(X) X(std::optional<int64_t>, workspace_bytes, "int?", None)
// the lse of ignored rows too (a forward-only pass over them)
#define FUSED_CE_OPTION_lse_of_ignored_rows(X) X(bool, lse_of_ignored_rows, "bool", True)
// Opt-in gradient filtering (filtered_grads.h): 0 is exact
#define FUSED_CE_OPTION_grad_filter_eps(X) X(double, grad_filter_eps, "float", 0.0)
#define FUSED_CE_OPTION_return_entropy(X) X(bool, return_entropy, "bool", False)
#define FUSED_CE_OPTION_return_argmax(X) X(bool, return_argmax, "bool", False)
// Vocabulary parallel (vocab_parallel.h): linear_weight (and linear_bias) hold classes [vocab_start,
// vocab_start + rows) of vocab_size, the other shards (at most max_shard_rows rows each) being on the ranks
// of the process group of this name (c10d's registry). "Not sharded" is "" and zeros (AOTInductor's proxy
// executor mishandles str? and int[] arguments left at None or []).
#define FUSED_CE_OPTION_process_group(X) X(c10::string_view, process_group, "str", "")
#define FUSED_CE_OPTION_vocab_start(X) X(int64_t, vocab_start, "int", 0)
#define FUSED_CE_OPTION_vocab_size(X) X(int64_t, vocab_size, "int", 0)
#define FUSED_CE_OPTION_max_shard_rows(X) X(int64_t, max_shard_rows, "int", 0)
// The function the user called, which the errors name: linear_log_probs runs _linear_cross_entropy, whose
// errors (a bad target, a temperature beyond float32) must still name linear_log_probs and its arguments.
#define FUSED_CE_OPTION_caller(X) X(c10::string_view, caller, "str", "linear_cross_entropy")
#define FUSED_CE_OPTION_temperature(X) X(double, temperature, "float", 1.0)
#define FUSED_CE_OPTION_clip_low(X) X(double, clip_low, "float", 0.2)
#define FUSED_CE_OPTION_clip_high(X) X(double, clip_high, "float", 0.2)
#define FUSED_CE_OPTION_kl_coef(X) X(double, kl_coef, "float", 0.0)
#define FUSED_CE_OPTION_kl_times_ratio(X) X(bool, kl_times_ratio, "bool", False)
#define FUSED_CE_OPTION_entropy_coef(X) X(double, entropy_coef, "float", 0.0)
#define FUSED_CE_OPTION_return_stats(X) X(bool, return_stats, "bool", False)
#define FUSED_CE_OPTION_beta(X) X(double, beta, "float", 0.0)
#define FUSED_CE_OPTION_hard_label_weight(X) X(double, hard_label_weight, "float", 0.0)
#define FUSED_CE_OPTION_teacher_softcap(X) X(std::optional<double>, teacher_softcap, "float?", None)
#define FUSED_CE_OPTION_teacher_logit_scale(X) X(double, teacher_logit_scale, "float", 1.0)

// The lists: which options an op takes, in its schema's order (a schema's order is kept: saved graphs pass
// options by position).
// The loss options, in the public op's schema order.
#define FUSED_CE_LOSS_OPTIONS(X)                                                                  \
  FUSED_CE_OPTION_reduction(X) FUSED_CE_OPTION_ignore_index(X) FUSED_CE_OPTION_label_smoothing(X) \
      FUSED_CE_OPTION_z_loss(X) FUSED_CE_OPTION_softcap(X) FUSED_CE_OPTION_logit_scale(X)         \
          FUSED_CE_OPTION_workspace_bytes(X) FUSED_CE_OPTION_lse_of_ignored_rows(X) FUSED_CE_OPTION_grad_filter_eps(X)

// Per-row outputs besides the loss and the lse, computed only when asked for.
#define FUSED_CE_OUTPUT_OPTIONS(X) FUSED_CE_OPTION_return_entropy(X) FUSED_CE_OPTION_return_argmax(X)

#define FUSED_CE_SHARD_OPTIONS(X)                                                               \
  FUSED_CE_OPTION_process_group(X) FUSED_CE_OPTION_vocab_start(X) FUSED_CE_OPTION_vocab_size(X) \
      FUSED_CE_OPTION_max_shard_rows(X)

#define FUSED_CE_CALLER_OPTIONS(X) FUSED_CE_OPTION_caller(X)

// The options of linear_log_probs (its own schema; it calls _linear_cross_entropy with reduction 'none' and the
// temperature as a logit scale), followed by the shard options.
#define FUSED_CE_LOG_PROB_OPTIONS(X)                                                                     \
  FUSED_CE_OPTION_temperature(X) FUSED_CE_OPTION_softcap(X) FUSED_CE_OPTION_logit_scale(X)               \
      FUSED_CE_OPTION_ignore_index(X) FUSED_CE_OPTION_return_entropy(X) FUSED_CE_OPTION_return_argmax(X) \
          FUSED_CE_OPTION_workspace_bytes(X)

// The options of linear_policy_loss (policy.h), followed by the shard options.
#define FUSED_CE_POLICY_OPTIONS(X)                                                                     \
  FUSED_CE_OPTION_clip_low(X) FUSED_CE_OPTION_clip_high(X) FUSED_CE_OPTION_kl_coef(X)                  \
      FUSED_CE_OPTION_kl_times_ratio(X) FUSED_CE_OPTION_entropy_coef(X) FUSED_CE_OPTION_temperature(X) \
          FUSED_CE_OPTION_softcap(X) FUSED_CE_OPTION_logit_scale(X) FUSED_CE_OPTION_ignore_index(X)    \
              FUSED_CE_OPTION_return_stats(X) FUSED_CE_OPTION_workspace_bytes(X)

// The options of linear_distillation_loss (ops/distillation.cpp), the shard options included.
#define FUSED_CE_DISTILLATION_OPTIONS(X)                                                                           \
  FUSED_CE_OPTION_beta(X) FUSED_CE_OPTION_temperature(X) FUSED_CE_OPTION_hard_label_weight(X)                      \
      FUSED_CE_OPTION_ignore_index(X) FUSED_CE_OPTION_reduction(X) FUSED_CE_OPTION_softcap(X)                      \
          FUSED_CE_OPTION_logit_scale(X) FUSED_CE_OPTION_teacher_softcap(X) FUSED_CE_OPTION_teacher_logit_scale(X) \
              FUSED_CE_OPTION_return_entropy(X) FUSED_CE_OPTION_workspace_bytes(X) FUSED_CE_SHARD_OPTIONS(X)

// The teacher's options of linear_distillation_loss beyond the loss's (LossOptions' fields, at their defaults in
// every other op's options).
#define FUSED_CE_TEACHER_OPTIONS(X)                                                           \
  FUSED_CE_OPTION_beta(X) FUSED_CE_OPTION_temperature(X) FUSED_CE_OPTION_hard_label_weight(X) \
      FUSED_CE_OPTION_teacher_softcap(X) FUSED_CE_OPTION_teacher_logit_scale(X)

// Every option, in the internal ops' order.
#define FUSED_CE_ALL_OPTIONS(X) \
  FUSED_CE_LOSS_OPTIONS(X) FUSED_CE_OUTPUT_OPTIONS(X) FUSED_CE_SHARD_OPTIONS(X) FUSED_CE_CALLER_OPTIONS(X)

// Expansions of a list. Each item begins with a comma, so that a list follows the last tensor argument:
// "Tensor? weight=None" FUSED_CE_SCHEMA(FUSED_CE_LOSS_OPTIONS), f(..., const at::Tensor& w
// FUSED_CE_PARAMS(FUSED_CE_LOSS_OPTIONS)).
// The cross-entropy ops' last arguments: a low-rank term of the logits, low_rank_input @ low_rank_weight.T
// (LoRA's on the head: Problem::low_rank), with gradients of its own.
#define FUSED_CE_LOW_RANK_SCHEMA ", Tensor? low_rank_input=None, Tensor? low_rank_weight=None"
#define FUSED_CE_LOW_RANK_PARAMS \
  , const std::optional<at::Tensor>&low_rank_input, const std::optional<at::Tensor>&low_rank_weight

#define FUSED_CE_SCHEMA_ITEM(cpp_type, name, schema_type, default) ", " schema_type " " #name "=" #default
#define FUSED_CE_PARAM_ITEM(cpp_type, name, ...) , cpp_type name
#define FUSED_CE_ARG_ITEM(cpp_type, name, ...) , name
#define FUSED_CE_DEFAULT_ITEM(cpp_type, name, schema_type, default) , cpp_type(default)
#define FUSED_CE_IVALUE_ITEM(cpp_type, name, ...) , c10::IValue(name)
#define FUSED_CE_COUNT_ITEM(...) +1
#define FUSED_CE_SCHEMA(LIST) LIST(FUSED_CE_SCHEMA_ITEM)
#define FUSED_CE_PARAMS(LIST) LIST(FUSED_CE_PARAM_ITEM)
#define FUSED_CE_ARGS(LIST) LIST(FUSED_CE_ARG_ITEM)
#define FUSED_CE_DEFAULTS(LIST) LIST(FUSED_CE_DEFAULT_ITEM)
// The values boxed, for an op called boxed (an Op of op_function.h keeps its options so, in schema order).
#define FUSED_CE_IVALUES(LIST) LIST(FUSED_CE_IVALUE_ITEM)
// The same without the leading comma, for a list that begins a parameter or argument list.
#define FUSED_CE_WITHOUT_FIRST(first, ...) __VA_ARGS__
#define FUSED_CE_LEADING(items) FUSED_CE_WITHOUT_FIRST(items)
#define FUSED_CE_PARAM_LIST(LIST) FUSED_CE_LEADING(0 LIST(FUSED_CE_PARAM_ITEM))
#define FUSED_CE_ARG_LIST(LIST) FUSED_CE_LEADING(0 LIST(FUSED_CE_ARG_ITEM))
#define FUSED_CE_IVALUE_LIST(LIST) FUSED_CE_LEADING(0 LIST(FUSED_CE_IVALUE_ITEM))

namespace fused_ce {

// The schema's default values, as FUSED_CE_DEFAULTS spells them in C++.
inline namespace schema_values {
constexpr bool True = true;
constexpr bool False = false;
constexpr std::nullopt_t None = std::nullopt;
}  // namespace schema_values

// The number of options of the internal ops.
constexpr int kNumOptions = 0 FUSED_CE_ALL_OPTIONS(FUSED_CE_COUNT_ITEM);

// The values are the kernels' reduction codes (assemble_loss.py).
enum class Reduction { None = 0, Mean = 1, Sum = 2 };

namespace detail {
// A field holds its option's value: a string view's as a string.
template <typename T>
struct Stored {
  using type = T;
};
template <>
struct Stored<c10::string_view> {
  using type = std::string;
};
// f(rest...): a list expansion's items each begin with a comma, so a placeholder comes first.
template <typename F, typename... Args>
decltype(auto) call_without_first(F&& f, int, Args&&... args) {
  return f(std::forward<Args>(args)...);
}
}  // namespace detail

struct LossOptions {
  // One field per option, named as in the schema, at its default. The plan resolves workspace_bytes'.
#define FUSED_CE_FIELD_ITEM(cpp_type, name, schema_type, default) \
  detail::Stored<cpp_type>::type name{cpp_type(default)};
  FUSED_CE_ALL_OPTIONS(FUSED_CE_FIELD_ITEM)
  FUSED_CE_TEACHER_OPTIONS(FUSED_CE_FIELD_ITEM)
#undef FUSED_CE_FIELD_ITEM
  Reduction reduction_kind = Reduction::Mean;  // `reduction` parsed
  // Not an option of a schema: set by linear_policy_loss, whose gradient coefficients have no bound that
  // float16's gradient scale could rely on (plan.cpp).
  bool policy_loss = false;
  // Set by distillation_options: the teacher's options are checked too, the logit transforms' with the
  // distillation's own bounds (both heads' logit_scale and softcap positive).
  bool distillation = false;

  // The options of these values, checked (check()).
  static LossOptions parse(FUSED_CE_PARAM_LIST(FUSED_CE_ALL_OPTIONS));
  // Checks every value and sets reduction_kind; errors name the function called (caller) and the argument.
  void check();
  void check_teacher() const;  // (check's, for distillation)
  // From every option's value in schema order (a boxed call's arguments).
  static LossOptions from_ivalues(c10::ArrayRef<c10::IValue> values);

  // Label smoothing needs each row's (class-weighted) sum of logits and adds
  // the gamma term to the gradient: the one flag for both.
  bool smoothing() const { return label_smoothing > 0.0; }
  bool scalar() const { return reduction_kind != Reduction::None; }
  bool vocab_parallel() const { return !process_group.empty(); }

  // f(reduction, ignore_index, ...): every option in schema order, to call an op with.
  template <typename F>
  decltype(auto) apply(F&& f) const {
#define FUSED_CE_VALUE_ITEM(cpp_type, name, ...) , cpp_type(name)
    return detail::call_without_first(f, 0 FUSED_CE_ALL_OPTIONS(FUSED_CE_VALUE_ITEM));
#undef FUSED_CE_VALUE_ITEM
  }
};

// The logits of the per-token log-probs and the policy loss, softcap(logit_scale * z) / temperature, as the loss's
// options take them: softcap(u) / T is a softcap of s / T on u / T. Checks the temperature and what it makes of
// the softcap and the scale, naming the arguments as `op` (the function called) has them.
struct TemperedLogits {
  std::optional<double> softcap;
  double logit_scale = 1.0;
};
TemperedLogits at_temperature(const char* op, double temperature, const std::optional<double>& softcap,
                              double logit_scale);

// The loss options of linear_log_probs ('none') and linear_policy_loss ('sum'): the log-probs of tempered logits,
// without the lse of ignored rows, the entropy and argmax where asked for; `caller` named by the errors. Checked.
LossOptions log_prob_options(const char* caller, c10::string_view reduction, const TemperedLogits& tempered,
                             int64_t ignore_index, const std::optional<int64_t>& workspace_bytes, bool entropy,
                             bool argmax FUSED_CE_PARAMS(FUSED_CE_SHARD_OPTIONS));

// The loss options of linear_distillation_loss (its schema's), checked; `caller` linear_distillation_loss.
LossOptions distillation_options(FUSED_CE_PARAM_LIST(FUSED_CE_DISTILLATION_OPTIONS));

}  // namespace fused_ce
