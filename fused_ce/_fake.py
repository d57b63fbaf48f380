"""Fake (meta) kernels: output shapes and dtypes without computing anything.

They are also the ops' kernels for meta tensors, so they check the devices as the real kernels do: a meta
tensor mixed with others is an error, as in torch, never an uninitialised result. Options pass by name
(csrc/options.h); only ``reduction``, ``return_entropy`` and ``return_argmax`` change a shape, and the kept
logits' rows follow the workspace (``_kept_logit_rows``).
"""

import torch


def _arguments(op, args, kwargs):
    """The call's arguments by schema name, defaults filled in (a fake kernel is called as the op was)."""
    values = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            values[a.name] = args[i]
        elif a.name in kwargs:
            values[a.name] = kwargs[a.name]
        else:
            values[a.name] = a.default_value
    return values


def _loss_dtype(input):
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def _check_devices(caller, input, **tensors):
    """The devices as the real kernels check them: each tensor on input's, else an error naming it."""
    for name, t in tensors.items():
        torch._check(
            t is None or t.device == input.device,
            lambda t=t, name=name: (
                f"{caller}: {name} is on {t.device} but input is on {input.device}: move them to one device"
            ),
        )


def _check_low_rank_pair(caller, a):
    """The op's check (csrc/problem.cpp, with_low_rank), word for word (tests/test_low_rank.py compares them)."""
    has_input, has_weight = a.get("low_rank_input") is not None, a.get("low_rank_weight") is not None
    torch._check_value(
        has_input == has_weight,
        lambda: (
            f"{caller}: low_rank_input and low_rank_weight go together (the logits' term low_rank_input @ "
            f"low_rank_weight.T): {'low_rank_weight' if has_input else 'low_rank_input'} is missing"
        ),
    )


def _outputs(a, return_entropy=False, return_argmax=False):
    """The loss ops' (loss, lse, entropy, argmax) from their arguments by name."""
    caller = a.get("caller", "linear_cross_entropy")
    input, linear_weight, target = a["input"], a["linear_weight"], a["target"]
    reduction = a["reduction"]
    torch._check(input.dim() >= 1, lambda: f"{caller}: input must have at least one dimension")
    torch._check(linear_weight.dim() == 2, lambda: f"{caller}: linear_weight must be 2-D [V, D]")
    torch._check(
        linear_weight.shape[1] == input.shape[-1],
        lambda: (
            f"{caller}: linear_weight {list(linear_weight.shape)} has {linear_weight.shape[1]} features but input "
            f"has {input.shape[-1]}; linear_weight is laid out [V, D] (one row per class, as nn.Linear's weight)"
        ),
    )
    torch._check(
        reduction in ("mean", "sum", "none"),
        lambda: f"{caller}: reduction must be 'mean', 'sum' or 'none', got '{reduction}'",
    )
    _check_devices(caller, input, linear_weight=linear_weight, target=target, linear_bias=a["linear_bias"],
                   weight=a["weight"], low_rank_input=a.get("low_rank_input"),
                   low_rank_weight=a.get("low_rank_weight"))  # fmt: skip
    _check_low_rank_pair(caller, a)
    lse = input.new_empty(target.shape, dtype=_loss_dtype(input))
    loss = lse.new_empty(target.shape) if reduction == "none" else lse.new_empty(())
    entropy = lse.new_empty(target.shape if return_entropy else (0,))
    argmax = input.new_empty(target.shape if return_argmax else (0,), dtype=torch.int64)
    return loss, lse, entropy, argmax


@torch.library.register_fake("fused_ce::linear_cross_entropy")
def _linear_cross_entropy_fake(*args, **kwargs):
    return _outputs(_arguments(torch.ops.fused_ce.linear_cross_entropy.default, args, kwargs))[:2]


@torch.library.register_fake("fused_ce::_linear_cross_entropy")
def _linear_cross_entropy_all_fake(*args, **kwargs):
    a = _arguments(torch.ops.fused_ce._linear_cross_entropy.default, args, kwargs)
    return _outputs(a, return_entropy=a["return_entropy"], return_argmax=a["return_argmax"])


@torch.library.register_fake("fused_ce::_linear_cross_entropy_keeping_logits")
def _linear_cross_entropy_keeping_logits_fake(*args, **kwargs):
    a = _arguments(torch.ops.fused_ce._linear_cross_entropy_keeping_logits.default, args, kwargs)
    outputs = _outputs(a, return_entropy=a["return_entropy"], return_argmax=a["return_argmax"])
    # the kept rows' logits over this rank's classes, in the input dtype (csrc/ops/cross_entropy.h)
    rows = _kept_logit_rows(a["input"], a["linear_weight"], a["target"], a)
    return (*outputs, a["input"].new_empty((rows, a["linear_weight"].shape[0])))


def _kept_rows(rows, V, D, elem, workspace_bytes):
    """kept_rows_of (csrc/plan.cpp) on symbolic sizes: every row where all their logits fit in the workspace, else
    as many as fit with their gathered rows where that is at least the minimum; -1 where none are kept."""
    default_workspace, min_rows, partial_bytes = torch.ops.fused_ce._kept_logit_rows_constants()
    row_bytes = V * elem + (V + 1023) // 1024 * partial_bytes
    budget = default_workspace if workspace_bytes is None else workspace_bytes
    if rows * row_bytes <= budget:
        return rows
    kept = budget // (row_bytes + 2 * D * elem)
    return kept if kept >= min_rows else -1


def _check_kept_rows():
    """At import: the sizing above is the C++ one (the fake kernel needs it on symbolic sizes, which the C++
    function cannot take from here): a change to one without the other fails loudly."""
    for rows, V, D, elem, workspace in [(16384, 128256, 4096, 2, None), (2048, 128256, 4096, 2, None),
                                        (8192, 256000, 2304, 4, 6 << 30), (600, 32000, 256, 2, 1 << 20),
                                        (1, 1, 1, 2, None), (70000, 50000, 1024, 2, 2 << 30)]:  # fmt: skip
        want = torch.ops.fused_ce._kept_logit_rows_of(rows, V, D, elem, workspace)
        if _kept_rows(rows, V, D, elem, workspace) != want:
            raise ImportError(f"fused_ce/_fake.py's kept-rows sizing differs from csrc/plan.cpp's at {rows, V, D}")


_check_kept_rows()


def _kept_logit_rows(input, linear_weight, target, options):
    """kept_logit_rows (csrc/plan.h) from shapes: 0 where none are kept (a scalar loss, a device or dtype without
    the kernels)."""
    if options["reduction"] != "none" or not torch.ops.fused_ce._cuda_kernels_embedded(input.device, input.dtype):
        return 0
    V = options["max_shard_rows"] if options["process_group"] else linear_weight.shape[0]
    rows = _kept_rows(target.numel(), V, input.shape[-1], input.element_size(), options["workspace_bytes"])
    return 0 if isinstance(rows, int) and rows < 0 else rows


def _grads(input, linear_weight, linear_bias, output_mask):
    def grad(t, needed):
        return t.new_empty(t.shape) if needed and t is not None else input.new_empty((0,))

    return grad(input, output_mask[0]), grad(linear_weight, output_mask[1]), grad(linear_bias, output_mask[2])


def _low_rank_grads(a, dtype=None):
    """The low-rank term's gradients (csrc/ops/cross_entropy.h): shaped as its arguments where given, else empty."""
    input, weight = a["low_rank_input"], a["low_rank_weight"]
    if input is None:
        return a["input"].new_empty((0,)), a["input"].new_empty((0,))
    return input.new_empty(input.shape, dtype=dtype), weight.new_empty(weight.shape, dtype=dtype)


def _register_backward_fake(name):
    """The backward ops' fake kernel: the gradients asked for (the recomputing one's, and the one from kept logits)."""
    op = getattr(torch.ops.fused_ce, name).default
    tensors = [
        a.name for a in op._schema.arguments if a.name not in ("input", "output_mask") and "Tensor" in str(a.type)
    ]

    @torch.library.register_fake(f"fused_ce::{name}")
    def fake(*args, **kwargs):
        a = _arguments(op, args, kwargs)
        _check_devices(a["caller"], a["input"], **{n: a[n] for n in tensors})
        return (*_grads(a["input"], a["linear_weight"], a["linear_bias"], a["output_mask"]), *_low_rank_grads(a))


_register_backward_fake("linear_cross_entropy_backward")
_register_backward_fake("_linear_cross_entropy_backward_from_logits")


@torch.library.register_fake("fused_ce::linear_cross_entropy_with_grad")
def _linear_cross_entropy_with_grad_fake(*args, **kwargs):
    a = _arguments(torch.ops.fused_ce.linear_cross_entropy_with_grad.default, args, kwargs)
    torch._check(
        a["reduction"] in ("mean", "sum"), lambda: "linear_cross_entropy_with_grad: reduction must be 'mean' or 'sum'"
    )
    input = a["input"]
    outputs = _outputs(a, return_entropy=a["return_entropy"], return_argmax=a["return_argmax"])
    grad_input, grad_weight, grad_bias = _grads(input, a["linear_weight"], a["linear_bias"], a["output_mask"])
    if input.dtype != torch.float16:
        no_scale = input.new_empty((0,), dtype=torch.float32)
        return (*outputs, grad_input, grad_weight, grad_bias, no_scale, *_low_rank_grads(a))
    # dX and db in float32 until the backward scales them, dW in float16 times a power of two (csrc/ops/cross_entropy.h)
    mask, bias = a["output_mask"], a["linear_bias"]
    to_float32 = [
        g.new_empty(g.shape, dtype=torch.float32) if formed else g
        for g, formed in ((grad_input, mask[0]), (grad_bias, mask[2] and bias is not None))
    ]
    scale = input.new_empty((), dtype=torch.float32)
    return (*outputs, to_float32[0], grad_weight, to_float32[1], scale, *_low_rank_grads(a, torch.float32))


@torch.library.register_fake("fused_ce::_scale_grad_")
def _scale_grad_fake(grad, scale):
    torch._check(scale.numel() == 1, lambda: "fused_ce::_scale_grad_: scale must hold one value")


def _policy_outputs(a):
    input = a["input"]
    names = ("linear_weight", "target", "advantages", "token_weights", "old_log_probs", "ref_log_probs", "linear_bias",
             "low_rank_input", "low_rank_weight")  # fmt: skip
    _check_devices("linear_policy_loss", input, **{n: a[n] for n in names})
    _check_low_rank_pair("linear_policy_loss", a)
    loss = input.new_empty((), dtype=_loss_dtype(input))
    return loss, loss.new_empty((6, *a["target"].shape) if a["return_stats"] else (0,))


@torch.library.register_fake("fused_ce::linear_policy_loss")
def _linear_policy_loss_fake(*args, **kwargs):
    return _policy_outputs(_arguments(torch.ops.fused_ce.linear_policy_loss.default, args, kwargs))


@torch.library.register_fake("fused_ce::linear_policy_loss_with_grad")
def _linear_policy_loss_with_grad_fake(*args, **kwargs):
    a = _arguments(torch.ops.fused_ce.linear_policy_loss_with_grad.default, args, kwargs)
    grads = _grads(a["input"], a["linear_weight"], a["linear_bias"], a["output_mask"])
    half = a["input"].dtype == torch.float16
    if half:  # float32 until the backward scales them (csrc/ops/cross_entropy.h)
        grads = tuple(g.new_empty(g.shape, dtype=torch.float32) for g in grads)
    return (*_policy_outputs(a), *grads, *_low_rank_grads(a, torch.float32 if half else None))


def _distillation_outputs(a):
    """linear_distillation_loss's (loss, entropy) from its arguments by name: a float32 scalar, or the rows'
    ('none'); the entropy the rows' where asked for, else empty."""
    input, linear_weight, teacher_input = a["input"], a["linear_weight"], a["teacher_input"]
    caller = "linear_distillation_loss"
    torch._check(linear_weight.dim() == 2, lambda: f"{caller}: linear_weight must be 2-D [V, D]")
    torch._check(
        linear_weight.shape[1] == input.shape[-1],
        lambda: f"{caller}: linear_weight has {linear_weight.shape[1]} features but input has {input.shape[-1]}",
    )
    if teacher_input is not None:
        torch._check(a["teacher_weight"] is not None and a["teacher_weight"].shape[0] == linear_weight.shape[0],
                     lambda: f"{caller}: teacher_weight and linear_weight must share the vocabulary")  # fmt: skip
        torch._check(teacher_input.shape[:-1] == input.shape[:-1],
                     lambda: f"{caller}: teacher_input's rows differ from input's")  # fmt: skip
    tensors = ("linear_weight", "teacher_input", "teacher_weight", "target", "linear_bias", "teacher_bias",
               "teacher_top_indices", "teacher_top_log_probs")  # fmt: skip
    _check_devices(caller, input, **{n: a[n] for n in tensors})
    loss = input.new_empty(input.shape[:-1] if a["reduction"] == "none" else (), dtype=_loss_dtype(input))
    return loss, loss.new_empty(input.shape[:-1] if a["return_entropy"] else (0,))


@torch.library.register_fake("fused_ce::linear_distillation_loss")
def _linear_distillation_loss_fake(*args, **kwargs):
    return _distillation_outputs(_arguments(torch.ops.fused_ce.linear_distillation_loss.default, args, kwargs))


@torch.library.register_fake("fused_ce::_linear_distillation_with_grad")
def _linear_distillation_with_grad_fake(*args, **kwargs):
    a = _arguments(torch.ops.fused_ce._linear_distillation_with_grad.default, args, kwargs)
    return (*_distillation_outputs(a), *_grads(a["input"], a["linear_weight"], a["linear_bias"], a["output_mask"]))
