// The loss options of the op's schema, parsed and checked once into one value
// (LossOptions) that every later step takes whole.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>

// The options in schema order. The op signatures (ops.cpp, loss.h) expand these
// instead of spelling the options out; adding an option touches these three,
// LossOptions (below and options.cpp) and the kernels that use it.
#define FUSED_CE_OPTION_SCHEMA                                                                   \
  "str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, " \
  "float? softcap=None, float logit_scale=1.0, int? workspace_bytes=None"
#define FUSED_CE_OPTION_PARAMS                                                             \
  c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss, \
      std::optional<double> softcap, double logit_scale, std::optional<int64_t> workspace_bytes
#define FUSED_CE_OPTION_ARGS reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes

namespace fused_ce {

// The values are the kernels' reduction codes (assemble_loss.py).
enum class Reduction { None = 0, Mean = 1, Sum = 2 };

struct LossOptions {
  Reduction reduction = Reduction::Mean;
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  std::optional<double> softcap;
  double logit_scale = 1.0;
  std::optional<int64_t> workspace_bytes;  // the caller's bound; the plan resolves the default

  // Checks every value; errors name the argument.
  static LossOptions parse(FUSED_CE_OPTION_PARAMS);
  // Autograd keeps the options as one saved entry.
  c10::IValue to_ivalue() const;
  static LossOptions from_ivalue(const c10::IValue& value);

  // Label smoothing needs each row's (class-weighted) sum of logits and adds
  // the gamma term to the gradient: the one flag for both.
  bool smoothing() const { return label_smoothing > 0.0; }
  bool scalar() const { return reduction != Reduction::None; }
  const char* reduction_name() const;

  // f(reduction, ignore_index, ..., workspace_bytes): the schema's arguments, to call an op with.
  template <typename F>
  decltype(auto) apply(F&& f) const {
    return f(c10::string_view(reduction_name()), ignore_index, label_smoothing, z_loss, softcap, logit_scale,
             workspace_bytes);
  }
};

}  // namespace fused_ce
