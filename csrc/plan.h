// What a call will do, decided in one place (make_plan) from the problem, the
// options, the device's facts (device.h, read by the caller), the workspace budget and the number of counted
// rows; the executors (executors.h) carry it out and decide nothing. torch.ops.fused_ce._plan
// shows it to Python (fused_ce.plan), so tests and benchmarks see the path a call takes.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "options.h"
#include "plan_types.h"
#include "problem.h"

namespace fused_ce {

// `counted`: the rows whose target counts (CountedRows::counted, targets.h), -1 where not known. A problem
// of selected rows (Problem::row_index) is planned as one. Pass::BackwardFromLogits: `kept` is the kept
// tensor's rows (kept_logit_rows); where fewer than p.N, the plan's blocks and tiles are those of the other
// rows, [kept, N), recomputed within the kept tensor's bytes.
Plan make_plan(const Problem& p, const LossOptions& o, const DeviceFacts& device, Pass pass, int64_t counted = -1,
               int64_t kept = -1);
// The rows of logits a differentiated call of the per-token loss (reduction 'none') with these arguments keeps
// between forward and backward (Pass::ForwardKeepingLogits, then Pass::BackwardFromLogits), on CUDA with the
// row kernels: every row (target.numel()) where all their logits (in the input dtype, and their partials) fit
// in the workspace budget, so that the backward multiplies them back instead of computing them again (6NDV,
// not 8NDV); else as many as fit with room for their gathered rows of x and dX (at least kMinKeptRows): the
// first rows of the counted-first order, whose logits the backward then needs no GEMM for, and whose storage
// holds its workspace for the other rows. nullopt where none are kept (the call keeps_logits where there is a
// value). Decided from shapes, dtypes and options alone (guarded symbolic sizes under torch.compile), so that the
// fake kernels know the shapes.
std::optional<c10::SymInt> kept_logit_rows(const at::Tensor& input, const at::Tensor& linear_weight,
                                           const at::Tensor& target, const LossOptions& o, const DeviceFacts& device);
// Whether a differentiated call of _linear_cross_entropy forms its gradients in its forward (Pass::ForwardWithGrad,
// the autograd formula's choice): a scalar loss, but not float16's on the CPU (at unit scale its gradients are
// float32, twice what float16 holds, held until the backward: it recomputes them at the upstream gradient's scale
// instead, in float16). The other differentiated calls keep their logits where kept_logit_rows says.
bool gradients_in_forward(const LossOptions& o, const at::Tensor& input);
// kept_logit_rows' constants, for the fake kernel (fused_ce/_fake.py): the default CUDA workspace, the fewest
// rows a partial keep takes, and the bytes of partials per 1024 columns.
std::vector<int64_t> _kept_logit_rows_constants();
// The same sizing on plain numbers (-1: none kept), for the fake kernel's import-time check against its own.
int64_t _kept_logit_rows_of(int64_t rows, int64_t V, int64_t D, int64_t elem, std::optional<int64_t> workspace_bytes);

// The plan's fields as (name, value): what _plan returns, in this order, and what its schema declares.
std::vector<std::pair<const char*, c10::IValue>> plan_fields(const Plan& plan);

const char* strategy_name(Strategy s);
const char* pass_name(Pass pass);
Pass parse_pass(c10::string_view name);

}  // namespace fused_ce
