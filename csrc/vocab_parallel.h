// Vocabulary parallel: each rank of a process group holds a shard of the
// classes (LossOptions::process_group, vocab_start, vocab_size) and computes
// its shard's row stats and gradients; the row stats are combined over the
// group with torch.distributed's functional collectives (called through the
// dispatcher, so NCCL or gloo, on torch's current stream: no host sync on
// CUDA). Every rank must make the same calls: the plan gives all ranks the same
// row blocks (plan.cpp, from max_shard_rows). The gradient of the input is this shard's part; the
// Python front (fused_ce/distributed.py) sums it over the group.
#pragma once

#include <string>

#include "options.h"
#include "problem.h"

namespace fused_ce {

// t reduced in place over the ranks of the process group named `group` ("sum", "max", "min").
void all_reduce_(const at::Tensor& t, const char* reduce_op, const std::string& group);

// `s` holds the row stats of the rows of `shard` over its classes (views may be
// written); afterwards it holds them over the whole vocabulary, the same on
// every rank: two all-reduces of the rows' values (a max, then five sums).
void combine_vocab_shards(const Problem& shard, const RowStats& s, const LossOptions& o);

}  // namespace fused_ce
