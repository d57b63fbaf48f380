#include "options.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <string>

#include "format.h"

namespace fused_ce {
namespace {

Reduction parse_reduction(c10::string_view r) {
  if (r == "mean") return Reduction::Mean;
  if (r == "sum") return Reduction::Sum;
  if (r == "none") return Reduction::None;
  TORCH_CHECK_VALUE(false, "linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got '", std::string(r),
                    "'");
  return Reduction::Mean;  // not reached
}

}  // namespace

// Exception classes as torch raises them: ValueError for a bad reduction, RuntimeError for label_smoothing;
// ValueError for the options of our own.
LossOptions LossOptions::parse(FUSED_CE_OPTION_PARAMS) {
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0,
              "linear_cross_entropy: label_smoothing must be in [0, 1], got ", num(label_smoothing));
  TORCH_CHECK_VALUE(z_loss >= 0.0 && std::isfinite(z_loss),
                    "linear_cross_entropy: z_loss must be a finite value >= 0, got ", num(z_loss));
  TORCH_CHECK_VALUE(!softcap || (*softcap > 0.0 && std::isfinite(*softcap)),
                    "linear_cross_entropy: softcap must be a finite value > 0 (or None), got ",
                    num(softcap.value_or(0.0)));
  TORCH_CHECK_VALUE(std::isfinite(logit_scale), "linear_cross_entropy: logit_scale must be finite, got ",
                    num(logit_scale));
  TORCH_CHECK_VALUE(!workspace_bytes || *workspace_bytes > 0,
                    "linear_cross_entropy: workspace_bytes must be positive (or None), got ",
                    num(workspace_bytes.value_or(0)));
  const bool sharded = !process_group.empty();
  TORCH_CHECK_VALUE(sharded || (vocab_start == 0 && vocab_size == 0 && max_shard_rows == 0),
                    "linear_cross_entropy: vocab_start, vocab_size and max_shard_rows describe a vocabulary shard and "
                    "need a process_group");
  LossOptions o{
      parse_reduction(reduction), ignore_index, label_smoothing, z_loss, softcap, logit_scale, workspace_bytes};
  if (sharded) {
    TORCH_CHECK_VALUE(vocab_start >= 0 && vocab_size > 0 && max_shard_rows > 0,
                      "linear_cross_entropy: a vocabulary shard needs vocab_start >= 0, vocab_size > 0 and "
                      "max_shard_rows > 0, got ",
                      num(vocab_start), ", ", num(vocab_size), ", ", num(max_shard_rows));
    o.process_group = std::string(process_group);
    o.vocab_start = vocab_start;
    o.vocab_size = vocab_size;
    o.max_shard_rows = max_shard_rows;
  }
  return o;
}

const char* LossOptions::reduction_name() const {
  switch (reduction) {
    case Reduction::None: return "none";
    case Reduction::Sum: return "sum";
    case Reduction::Mean: break;
  }
  return "mean";
}

c10::IValue LossOptions::to_ivalue() const {
  return apply([](auto... values) { return c10::ivalue::Tuple::create({c10::IValue(values)...}); });
}

LossOptions LossOptions::from_ivalue(const c10::IValue& value) {
  const auto& v = value.toTupleRef().elements();
  TORCH_CHECK(v.size() == 11, "fused_ce: saved loss options have ", num(v.size()), " entries, expected 11");
  return parse(v[0].toStringRef(), v[1].toInt(), v[2].toDouble(), v[3].toDouble(), v[4].toOptional<double>(),
               v[5].toDouble(), v[6].toOptional<int64_t>(), v[7].toStringRef(), v[8].toInt(), v[9].toInt(),
               v[10].toInt());
}

}  // namespace fused_ce
