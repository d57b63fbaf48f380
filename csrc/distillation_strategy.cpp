// A distillation's strategy (strategies.h: plan_distillation): its blocks, dtypes and workspace.
#include <algorithm>

#include "strategies.h"

namespace fused_ce {

void plan_distillation(Plan& plan, const Problem& p, const LossOptions& o) {
  const bool grads = plan.pass != Pass::Forward;
  const bool teacher = p.teacher.x.defined();
  const at::ScalarType dtype = p.x.scalar_type();
  const int64_t rows = std::max<int64_t>(p.N, 1);
  if (grads) plan.grad_input_dtype = dtype;
  // (the kernels read both heads' logits in one dtype)
  if (plan.device.row_kernels(p.N) && (!teacher || p.teacher.x.scalar_type() == dtype)) {
    // a block: both heads' logits in the input dtype, its rows of both inputs and of dX
    plan.strategy = Strategy::StoredLogits;
    plan.rows_on_device = true;
    plan.logits_dtype = dtype;
    const int64_t row_bytes = ((teacher ? 2 : 1) * p.V + 2 * p.D + (teacher ? p.teacher.x.size(1) : 0)) *
                              static_cast<int64_t>(c10::elementSize(dtype));
    plan.block_rows = std::clamp<int64_t>(plan.budget_bytes / row_bytes, 1, rows);
    plan.workspace_bytes = plan.block_rows * row_bytes;
    // dW summed in the input dtype over a few blocks (input_dtype_accumulations), else in float32
    if (grads) {
      plan.grad_weight_dtype = cdiv(p.N, plan.block_rows) <= input_dtype_accumulations(dtype) ? dtype : at::kFloat;
    }
    return;
  }
  // ATen: a block's temporaries are about eight [rows, V] tensors in the loss dtype
  plan.strategy = Strategy::AtenChunks;
  plan.logits_dtype = loss_dtype(p);
  if (plan.device.float32_products) plan.logits_product_dtype = plan.logits_dtype;
  const int64_t row_bytes = 8 * static_cast<int64_t>(c10::elementSize(plan.logits_dtype)) * std::max<int64_t>(p.V, 1);
  const auto rows_within = [&](int64_t bytes) { return std::clamp<int64_t>(bytes / row_bytes, 1, rows); };
  plan.block_rows = rows_within(plan.budget_bytes);
  if (grads) {
    // dW accumulated in place over the blocks: in its own dtype (float32, float64: the gradient itself), or, for
    // bfloat16 and float16 over more than one block, in a float32 accumulator where that fits in half the budget
    // (the blocks take the rest), else in the input dtype
    const int64_t float32_dw = p.V * p.D * int64_t{sizeof(float)};
    const bool half = c10::elementSize(dtype) < 4;
    const bool float32_sum = half && cdiv(p.N, plan.block_rows) > 1 && float32_dw <= plan.budget_bytes / 2;
    if (float32_sum) plan.block_rows = rows_within(plan.budget_bytes - float32_dw);
    plan.grad_weight_dtype = half && !float32_sum ? dtype : plan.logits_dtype;
  }
  plan.workspace_bytes = plan.block_rows * row_bytes;
}

}  // namespace fused_ce
