// The loss options of the op's schema, parsed and checked once into one value
// (LossOptions) that every later step takes whole.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>

// The options in schema order. The op signatures (ops.cpp, loss.h) expand these
// instead of spelling the options out; adding an option touches these,
// LossOptions (below and options.cpp) and the kernels that use it.
// linear_cross_entropy takes the loss options; vocab_parallel_linear_cross_entropy
// and the internal ops take them and the shard's (FUSED_CE_OPTION_*). The
// public op's schema stays as it was, so that graphs saved with it (TorchScript,
// torch.export, AOTInductor packages) keep loading.
#define FUSED_CE_LOSS_OPTION_SCHEMA                                                              \
  "str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, " \
  "float? softcap=None, float logit_scale=1.0, int? workspace_bytes=None"
#define FUSED_CE_LOSS_OPTION_PARAMS                                                        \
  c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss, \
      std::optional<double> softcap, double logit_scale, std::optional<int64_t> workspace_bytes
#define FUSED_CE_LOSS_OPTION_ARGS \
  reduction, ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes
#define FUSED_CE_SHARD_OPTION_SCHEMA "str process_group=\"\", int vocab_start=0, int vocab_size=0, int max_shard_rows=0"
#define FUSED_CE_SHARD_OPTION_PARAMS \
  c10::string_view process_group, int64_t vocab_start, int64_t vocab_size, int64_t max_shard_rows
#define FUSED_CE_SHARD_OPTION_ARGS process_group, vocab_start, vocab_size, max_shard_rows
// The shard options' schema defaults: the whole vocabulary on one rank.
#define FUSED_CE_NO_SHARD_ARGS "", 0, 0, 0
#define FUSED_CE_OPTION_SCHEMA FUSED_CE_LOSS_OPTION_SCHEMA ", " FUSED_CE_SHARD_OPTION_SCHEMA
#define FUSED_CE_OPTION_PARAMS FUSED_CE_LOSS_OPTION_PARAMS, FUSED_CE_SHARD_OPTION_PARAMS
#define FUSED_CE_OPTION_ARGS FUSED_CE_LOSS_OPTION_ARGS, FUSED_CE_SHARD_OPTION_ARGS

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
  // Vocabulary parallel (vocab_parallel.h): linear_weight (and linear_bias) hold
  // classes [vocab_start, vocab_start + rows) of vocab_size, the other shards
  // (at most max_shard_rows rows each) being on the ranks of the process group
  // of this name (c10d's registry); targets and class weights stay global. The
  // schema spells "not sharded" as "" and zeros (AOTInductor's proxy executor
  // mishandles str? and int[] arguments left at None or []).
  std::optional<std::string> process_group;
  int64_t vocab_start = 0;
  int64_t vocab_size = 0;
  int64_t max_shard_rows = 0;

  // Checks every value; errors name the argument.
  static LossOptions parse(FUSED_CE_OPTION_PARAMS);
  // Autograd keeps the options as one saved entry.
  c10::IValue to_ivalue() const;
  static LossOptions from_ivalue(const c10::IValue& value);

  // Label smoothing needs each row's (class-weighted) sum of logits and adds
  // the gamma term to the gradient: the one flag for both.
  bool smoothing() const { return label_smoothing > 0.0; }
  bool scalar() const { return reduction != Reduction::None; }
  bool vocab_parallel() const { return process_group.has_value(); }
  const char* reduction_name() const;

  // f(reduction, ignore_index, ..., workspace_bytes): the schema's arguments, to call an op with.
  template <typename F>
  decltype(auto) apply(F&& f) const {
    return f(c10::string_view(reduction_name()), ignore_index, label_smoothing, z_loss, softcap, logit_scale,
             workspace_bytes, c10::string_view(process_group.value_or("")), vocab_start, vocab_size, max_shard_rows);
  }
};

}  // namespace fused_ce
