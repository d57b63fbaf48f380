"""The plan (csrc/plan.cpp) decides what each call does; these tests assert it directly.

Plans depend on shapes, dtypes, strides and the device, not on values, so the big
shapes are expanded one-element tensors.
"""

import pytest
import torch

import fused_ce

A, B, C = (16384, 4096, 128256), (8192, 2304, 256000), (4096, 4096, 128256)
MiB = 1 << 20


def expanded(N, D, V, dtype=torch.float32, device="cpu", grad=False):
    x = torch.empty(1, 1, dtype=dtype, device=device).expand(N, D)
    w = torch.empty(1, 1, dtype=dtype, device=device).expand(V, D)
    t = torch.zeros(1, dtype=torch.long, device=device).expand(N)
    if grad:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    return x, w, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("pass_", ["forward", "backward", "forward_with_grad"])
def test_cpu_takes_aten_chunks_within_budget(dtype, pass_):
    N, D, V = 1000, 64, 16000
    plan = fused_ce.plan(*expanded(N, D, V, dtype), pass_=pass_)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    assert plan.pass_ == pass_ and plan.strategy == "aten_chunks"
    assert plan.budget_bytes == 32 * MiB and not plan.rows_on_device and not plan.rank_one_smoothing
    # the products in the input dtype, as torch's F.linear, but float32 on a CPU without bf16 dot-product
    # instructions (tests/test_cpu_float32_products.py): x and dX in float32 too
    wide = plan.logits_product_dtype == torch.float32 and dtype == torch.bfloat16
    assert plan.logits_product_dtype == (torch.float32 if wide else dtype)
    assert plan.logits_dtype == (torch.float32 if wide else dtype)
    # a row's logits in the loss dtype, and bf16's product (or a float32 slice of the weight) beside them
    row_bytes = V * (compute.itemsize + (dtype.itemsize if dtype.itemsize < compute.itemsize else 0))
    row_bytes += (4 * D if pass_ == "forward" else 8 * D) if wide else 0
    # bf16's dW past 2 row blocks: summed in a float32 accumulator within the budget (the blocks take the rest)
    accumulator = V * D * 4 if dtype == torch.bfloat16 and pass_ != "forward" else 0
    assert plan.block_rows == min(N, (32 * MiB - accumulator) // row_bytes) and plan.tile_cols == V
    assert plan.workspace_bytes == plan.block_rows * row_bytes + accumulator <= plan.budget_bytes
    if pass_ == "forward":
        assert plan.grad_input_dtype is None and plan.grad_weight_dtype is None
    else:
        assert plan.grad_input_dtype == dtype
        assert plan.grad_weight_dtype == (torch.float32 if accumulator else dtype)
        assert accumulator == 0 or -(-N // plan.block_rows) > 2, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_precision_dw_accumulator_only_within_the_budget(dtype):
    N, D, V = 20000, 64, 3000  # 11 row blocks of the default budget
    pass_ = "forward_with_grad" if dtype == torch.bfloat16 else "backward"  # (float16: csrc/plan.h)
    plan = fused_ce.plan(*expanded(N, D, V, dtype), pass_=pass_)
    accumulator = V * D * 4
    assert plan.grad_weight_dtype == torch.float32 and plan.grad_input_dtype == dtype
    assert plan.workspace_bytes <= plan.budget_bytes and plan.workspace_bytes >= accumulator
    lean = fused_ce.plan(*expanded(N, D, V, dtype), pass_=pass_, workspace_bytes=accumulator)  # not in half of it
    assert lean.grad_weight_dtype == dtype and lean.workspace_bytes <= accumulator
    unit = fused_ce.plan(*expanded(N, D, V, torch.float16), pass_="forward_with_grad")  # at unit scale: float32
    assert unit.logits_dtype == unit.grad_input_dtype == unit.grad_weight_dtype == torch.float32


def test_budget_bounds_the_blocks():
    x, w, t = expanded(1000, 32, 5000)
    plan = fused_ce.plan(x, w, t, workspace_bytes=5000 * 4 * 7)
    assert plan.block_rows == 7 and plan.workspace_bytes == 7 * 5000 * 4
    assert fused_ce.plan(x, w, t, workspace_bytes=1).block_rows == 1  # at least one row


def test_pass_follows_the_call():
    x, w, t = expanded(64, 16, 100, grad=True)
    assert fused_ce.plan(x, w, t).pass_ == "forward_with_grad"
    assert fused_ce.plan(x, w, t, reduction="none").pass_ == "forward"
    with torch.no_grad():
        assert fused_ce.plan(x, w, t).pass_ == "forward"
    assert fused_ce.plan(x.detach(), w.detach(), t).pass_ == "forward"


def test_plan_checks_its_arguments():
    x, w, t = expanded(64, 16, 100)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        fused_ce.plan(x, w, t, reduction="none", pass_="forward_with_grad")
    with pytest.raises(ValueError, match="pass must be"):
        fused_ce.plan(x, w, t, pass_="sideways")
    with pytest.raises(RuntimeError, match=r"linear_weight \[100, 17\] has 17 features"):
        fused_ce.plan(x, torch.empty(100, 17), t)


# ---- CUDA: the strategies of the embedded kernels ----

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("shape, rows", [(A, 8192), (B, 4096), (C, 2048)])
def test_default_bf16_training_stores_logits(shape, rows):
    # 2 row blocks, dW summed in bf16: A's and B's 8 blocks of the budget grown to 2 within the budget plus the
    # float32 dW sum's bytes that more blocks would hold (strategies.cpp)
    plan = fused_ce.plan(*expanded(*shape, torch.bfloat16, "cuda", grad=True))
    assert (plan.pass_, plan.strategy, plan.block_rows, plan.tile_cols) == (
        "forward_with_grad",
        "stored_logits",
        rows,
        shape[2],
    )
    assert plan.logits_dtype == plan.grad_input_dtype == plan.grad_weight_dtype == torch.bfloat16
    assert plan.rows_on_device and plan.budget_bytes == 504 * MiB
    assert plan.workspace_bytes <= plan.budget_bytes + shape[1] * shape[2] * 4


@cuda
def test_float16_stores_scaled_logits():
    # float16 logits could overflow past 65504: cuBLAS stores them times 2^-8 (alpha), the row blocks as large
    # as bfloat16's; a scalar loss's gradient blocks hold the gradient times 2^14 (no underflow at ~p / N),
    # dX comes back in float32 for the backward to scale, dW in float16 times a power of two from max|x|
    _, w, t = expanded(*C, torch.float16, "cuda", grad=True)
    x = torch.full((1, 1), 1.0, dtype=torch.float16, device="cuda").expand(C[0], C[1]).requires_grad_()  # max|x| 1
    loss_only = fused_ce.plan(x, w, t, pass_="forward")
    assert (loss_only.strategy, loss_only.block_rows, loss_only.logits_scale) == ("stored_logits", 2048, 2.0**-8)
    plan = fused_ce.plan(x, w, t)
    assert (plan.pass_, plan.strategy, plan.block_rows, plan.logits_dtype, plan.logits_scale) == (
        "forward_with_grad",
        "stored_logits",
        2048,
        torch.float16,
        2.0**-8,
    )
    assert plan.grad_input_dtype == torch.float32 and plan.grad_scale == 2.0**14
    assert plan.grad_weight_dtype == torch.float16 and plan.grad_weight_scale == 2.0**14  # 2^14 / max|x|
    assert fused_ce.plan(x, w, t, reduction="sum", weight=torch.ones(C[2], device="cuda")).grad_scale == 1.0
    assert fused_ce.plan(x, w, t, z_loss=1e-2).grad_scale == 2.0**12  # room for 2 z |lse| up to |lse| = 100
    recompute = fused_ce.plan(x, w, t, pass_="backward")  # the upstream gradient in its coefficients: unit scale
    assert recompute.strategy == "vocab_tiles" and recompute.grad_scale == 1.0
    assert recompute.logits_scale == 2.0**-8 and recompute.grad_input_dtype == torch.float16
    bf16 = fused_ce.plan(*expanded(*C, torch.bfloat16, "cuda", grad=True))
    assert bf16.grad_scale == bf16.logits_scale == bf16.grad_weight_scale == 1.0


@cuda
def test_lean_workspace_chooses_by_cost_model():
    # Row blocks re-read dW once per block: where that traffic costs more than one more GEMM pass, 2-D
    # vocabulary tiles instead (plan.cpp). 64 MiB: 128-row blocks at B, 256 at A: tiles for both (at A the
    # measurements favour row blocks by ~3%: LOG.md, step 15). 128 MiB at A: 512-row blocks, row blocks.
    lean = dict(workspace_bytes=64 * MiB)
    b = fused_ce.plan(*expanded(*B, torch.bfloat16, "cuda", grad=True), **lean)
    assert (b.strategy, b.block_rows, b.stats_block_rows) == ("vocab_tiles", 2048, 128)
    assert b.tile_cols == 64 * MiB // (2048 * 2) // 128 * 128 and b.workspace_bytes <= b.budget_bytes
    a = fused_ce.plan(*expanded(*A, torch.bfloat16, "cuda", grad=True), **lean)
    assert (a.strategy, a.stats_block_rows) == ("vocab_tiles", 256)
    a = fused_ce.plan(*expanded(*A, torch.bfloat16, "cuda", grad=True), workspace_bytes=128 * MiB)
    assert (a.strategy, a.block_rows) == ("stored_logits", 512)
    loss_only = fused_ce.plan(*expanded(*A, torch.bfloat16, "cuda"), workspace_bytes=16 * MiB)
    assert loss_only.strategy == "dot_tiles"  # fewer than 512 rows of logits fit


@cuda
def test_per_row_losses_recompute_in_the_backward():
    x, w, t = expanded(*C, torch.bfloat16, "cuda", grad=True)
    assert fused_ce.plan(x, w, t, reduction="none").strategy == "stored_logits"
    back = fused_ce.plan(x, w, t, reduction="none", pass_="backward")
    # cuBLAS logits again, turned into their gradient in place, all rows in three vocabulary slices (dX summed
    # twice more in float32, 268 MB moved, instead of dW once more in two row blocks, 2.1 GB: backward_tiles)
    assert (back.strategy, back.block_rows, back.tile_cols) == ("vocab_tiles", C[0], C[2] // 3)
    assert back.grad_input_dtype == back.grad_weight_dtype == torch.bfloat16
    # a lean budget keeps the tl.dot tiles: all rows in one block, vocabulary slices, dX accumulated in float32
    lean = fused_ce.plan(x, w, t, reduction="none", pass_="backward", workspace_bytes=64 * MiB)
    assert (lean.strategy, lean.block_rows) == ("dot_tiles", C[0]) and lean.tile_cols < C[2]
    assert lean.grad_input_dtype == torch.float32 and lean.grad_weight_dtype == torch.bfloat16


@cuda
def test_per_row_losses_keep_the_first_rows_logits():
    # shape A within the default 504 MiB: 1925 rows' logits (with room for their gathered x and dX rows) kept
    # from the forward, the other rows first in its usual blocks; the backward computes the other 14459 rows'
    # again in five vocabulary slices of two row blocks within the kept tensor's 494 MB (dX summed 4 times more
    # in float32: backward_tiles' fewest bytes); dW over 3 blocks, past bf16's 2, summed in float32
    x, w, t = expanded(*A, torch.bfloat16, "cuda", grad=True)
    forward = fused_ce.plan(x, w, t, reduction="none")
    assert (forward.pass_, forward.keeps_logits, forward.kept_rows, forward.block_rows) == (
        "forward_keeping_logits",
        True,
        1925,
        1920,
    )
    assert forward.workspace_bytes <= forward.budget_bytes
    back = fused_ce.plan(x, w, t, reduction="none", pass_="backward_from_logits")
    assert (back.strategy, back.kept_rows, back.block_rows, back.tile_cols) == ("vocab_tiles", 1925, 7232, 25664)
    assert back.grad_input_dtype == torch.bfloat16 and back.grad_weight_dtype == torch.float32
    # room for every row's logits: all kept (6NDV), one block
    everything = fused_ce.plan(x, w, t, reduction="none", workspace_bytes=8 << 30)
    assert everything.kept_rows == everything.block_rows == A[0]
    # room for fewer than 512 rows: none kept, the recomputing backward
    assert not fused_ce.plan(x, w, t, reduction="none", workspace_bytes=64 * MiB).keeps_logits


@cuda
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_rank_one_smoothing_needs_class_weights_and_no_softcap(softcap):
    x, w, t = expanded(*C, torch.bfloat16, "cuda", grad=True)
    cw = torch.ones(C[2], device="cuda")
    plan = fused_ce.plan(x, w, t, weight=cw, label_smoothing=0.1, softcap=softcap)
    assert plan.rank_one_smoothing == (softcap is None)
    assert not fused_ce.plan(x, w, t, label_smoothing=0.1).rank_one_smoothing


@pytest.mark.parametrize(
    "rows, blocks, dw_dtype",
    [
        (600, 2, torch.bfloat16),  # 2 blocks: bf16
        (240, 3, torch.float32),  # 3 blocks at 0.12 rows a class: float32 (whatever the targets)
        (600, 3, torch.float32),  # 3 blocks: float32
        (2000, 25, torch.float32),  # past 8 blocks: float32
    ],
)
def test_bf16_weight_gradient_sums_in_bf16_over_two_blocks_at_most(rows, blocks, dw_dtype):
    # bf16's running dW sum is rounded once a block at its classes' size so far, which depends on how the targets
    # fall over the blocks: past 2 blocks it sums in a float32 accumulator where that fits in half the budget
    # (strategies.h, sums_weight_grad_in_input_dtype)
    D, V = 8, 2000
    x, w, t = expanded(rows, D, V, torch.bfloat16, grad=True)
    # a row: float32 logits and their bf16 copy (and x and dX in float32 where the products are: Plan's
    # logits_product_dtype); past 2 blocks the float32 accumulator beside them
    row = V * 6 + (8 * D if fused_ce.plan(x, w, t).logits_product_dtype == torch.float32 else 0)
    budget = -(-rows // blocks) * row + (V * D * 4 if blocks > 2 else 0)
    plan = fused_ce.plan(x, w, t, workspace_bytes=budget)
    assert (plan.strategy, -(-rows // plan.block_rows), plan.grad_weight_dtype) == ("aten_chunks", blocks, dw_dtype)


@pytest.mark.cuda
def test_bf16_weight_gradient_at_32000_classes():
    # Llama-2's and Mistral's head (D 4096, V 32000): dW in bf16 over 2 row blocks at most, in float32 past them;
    # the blocks grow to 2 where 2 fit in the budget plus the float32 sum's bytes (A below)
    V, D = 32000, 4096
    for n in (16384, 32768, 65536):
        plan = fused_ce.plan(*expanded(n, D, V, torch.bfloat16, "cuda", grad=True))
        blocks = -(-n // plan.block_rows)
        assert plan.strategy == "stored_logits", plan
        assert plan.grad_weight_dtype == (torch.bfloat16 if blocks <= 2 else torch.float32), plan
        assert plan.workspace_bytes <= plan.budget_bytes + V * D * 4, plan
    assert -(-16384 // fused_ce.plan(*expanded(16384, D, V, torch.bfloat16, "cuda", grad=True)).block_rows) == 2


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_sums_in_float32_past_the_input_dtypes_blocks(dtype):
    # dW adds up to 2 row blocks in bf16 (4 in float16); more sum in a float32 V x D accumulator beside the budget.
    # The blocks grow to 2 (4) instead where they fit in the budget plus the accumulator's bytes (strategies.cpp:
    # no more memory, no float32 read-modify-write per block); past that (2 x 16384 rows at A in bf16, 4 x 16384 in
    # float16: 4 GiB) dW accumulates in float32; an explicit workspace smaller than that buffer asks for a lean call.
    N, D, V = A
    # rows: (blocks, dW's dtype)
    expected = {
        torch.bfloat16: {
            N: (2, dtype),
            2 * N: (16, torch.float32),
            4 * N: (32, torch.float32),
            8 * N: (64, torch.float32),
        },
        torch.float16: {N: (4, dtype), 2 * N: (4, dtype), 4 * N: (32, torch.float32), 8 * N: (64, torch.float32)},
    }[dtype]
    one = torch.full((1, 1), 1.0, dtype=dtype, device="cuda")  # (float16's dW scale needs a finite max|x|)
    for n, (blocks, dw_dtype) in expected.items():
        _, w, t = expanded(n, D, V, dtype, "cuda", grad=True)
        plan = fused_ce.plan(one.expand(n, D).requires_grad_(), w, t)
        assert (plan.strategy, -(-n // plan.block_rows), plan.grad_weight_dtype) == (
            "stored_logits",
            blocks,
            dw_dtype,
        ), plan
        assert plan.workspace_bytes <= plan.budget_bytes + V * D * 4, plan  # (no more than the float32 accumulator's)
    _, w, t = expanded(8 * N, D, V, dtype, "cuda", grad=True)
    lean = fused_ce.plan(one.expand(8 * N, D).requires_grad_(), w, t, workspace_bytes=256 * MiB)
    assert lean.strategy == "stored_logits" and lean.grad_weight_dtype == dtype
