"""Vocabulary-parallel fused_ce over torch.distributed: the output layer split by classes across a group.

Each rank holds a contiguous shard of the classes (rows of ``linear_weight`` and ``linear_bias``) and
the same tokens. The op computes its shard's logits block by block; between a block's row statistics
and its gradient it combines the row statistics over the group (two all-reduces of a few floats per
row, inside the op: csrc/vocab_parallel.h), so every rank gets the same loss and lse, the gradients of
its own shards, and its shard's part of the input gradient, which this module sums over the group:
an all-reduce for a replicated input, a reduce-scatter for a sequence-parallel one (DTensor), or a
``Partial`` placement that DTensor reduces where it needs to.

Two ways in:

- ``process_group=`` with plain tensors: ``linear_weight`` is this rank's shard, ``input`` is the
  full (replicated) input, targets and class weights are global. Shards may differ in size; they
  follow rank order unless ``vocab_start`` says where this rank's starts. The shard sizes are
  gathered once per (group, shard size) and remembered.
- DTensors: a weight placed ``Shard(0)`` on a 1-D mesh, with the input a DTensor on the same mesh,
  ``Replicate()`` or sharded along a sequence dimension (as torchtitan's ``ColwiseParallel`` lm_head
  receives it). The layout comes from the DTensor's metadata: no communication.

A DTensor weight with a plain-tensor input is refused: that is what a weight managed by FSDP2's
``fully_shard`` looks like outside the sharded module's forward (sharded over the *data*-parallel
ranks, which hold different tokens), and treating it as a vocabulary shard would be silently wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# (group name, this rank's rows, vocab_start given) -> (this rank's first class, every rank's rows)
_SHARDS: dict[tuple[str, int, int | None], tuple[int, list[int]]] = {}


def _is_dtensor(t) -> bool:
    return t is not None and type(t).__name__ == "DTensor" and hasattr(t, "placements")


def uses_dtensors(*tensors) -> bool:
    return any(_is_dtensor(t) for t in tensors)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group (the shards' parts of dX)."""

    @staticmethod
    def forward(ctx, input, group_name):
        ctx.group_name = group_name
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad):
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_reduce(grad.contiguous(), "sum", ctx.group_name)), None


def _shard_layout(group, rows: int, vocab_start: int | None, device) -> tuple[int, list[int]]:
    """(this rank's first class, every rank's shard size), gathered once per (group, rows, vocab_start)."""
    key = (group.group_name, rows, vocab_start)
    if key not in _SHARDS:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "fused_ce: the vocabulary shard sizes of this process group are gathered on the first eager call; "
                "call the loss once outside torch.compile (or pass DTensors, whose layout needs no communication)"
            )
        device = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        mine = torch.tensor([rows, -1 if vocab_start is None else vocab_start], device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        sizes = [int(t[0]) for t in every]
        starts = [int(t[1]) for t in every]
        rank = dist.get_rank(group)
        if vocab_start is None:
            if any(s != -1 for s in starts):
                raise ValueError("fused_ce: vocab_start must be given on every rank of the group or on none")
            vocab_start = sum(sizes[:rank])
        else:
            order = sorted(range(len(sizes)), key=lambda r: starts[r])
            covered = 0
            for r in order:
                if starts[r] != covered:
                    raise ValueError(
                        f"fused_ce: the vocabulary shards (vocab_start, rows) = {list(zip(starts, sizes))} per rank "
                        "do not tile [0, V) without gaps or overlaps"
                    )
                covered += sizes[r]
        _SHARDS[key] = (vocab_start, sizes)
    return _SHARDS[key]


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _full(t):
    """A DTensor's whole value (targets, class weights), or t."""
    return t.full_tensor() if _is_dtensor(t) else t


# What a weight sharded by FSDP2 (or partitioned by DeepSpeed ZeRO-3) needs: the loss computed where the engine
# has gathered it, inside its module's call.
FSDP2_FIX = (
    "A weight sharded by FSDP2 (fully_shard) is whole only inside its module's forward: for a Hugging Face model, "
    "fused_ce.integrations.transformers.apply(model) routes the loss through the head's own call; for a module "
    "of yours, compute the loss in its forward or in a method registered with "
    "torch.distributed.fsdp.register_fsdp_forward_method(module, name)."
)


def resolve(input, linear_weight, target, linear_bias, weight, process_group, vocab_start):
    """The op's arguments for a vocabulary-parallel call: local tensors and (group name, vocab_start, shards).

    The input returned carries the reduction of its gradient over the group.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    if _is_dtensor(linear_weight):
        mesh, placements = linear_weight.device_mesh, tuple(linear_weight.placements)
        if placements == (Replicate(),):  # the whole weight on every rank: no vocabulary split
            return _full(input), linear_weight.to_local(), _full(target), _full(linear_bias), _full(weight), None
        if mesh.ndim != 1 or placements != (Shard(0),):
            raise ValueError(
                f"fused_ce: linear_weight is a DTensor placed {placements} on a {mesh.ndim}-D mesh; a vocabulary-"
                "parallel weight is placed Shard(0) on a 1-D tensor-parallel mesh. " + FSDP2_FIX
            )
        if not _is_dtensor(input) or input.device_mesh != mesh:
            raise ValueError(
                "fused_ce: linear_weight is a DTensor placed Shard(0) but input is not a DTensor on the same mesh. "
                + FSDP2_FIX
                + " If it is a tensor-parallel vocabulary shard, pass input as a DTensor on its mesh (Replicate() or "
                "sequence-sharded) or pass linear_weight.to_local() with process_group="
            )
        (input_placement,) = input.placements
        if isinstance(input_placement, Partial):
            raise ValueError("fused_ce: input is a Partial DTensor; reduce it first (redistribute to Replicate())")
        if not isinstance(input_placement, Replicate):
            input = input.redistribute(mesh, [Replicate()])  # sequence parallel: all-gather, reduce-scatter back
        group = mesh.get_group()
        if process_group is not None and process_group.group_name != group.group_name:
            raise ValueError("fused_ce: process_group differs from the mesh of the DTensor linear_weight")
        V, P, rank = linear_weight.shape[0], mesh.size(), mesh.get_local_rank()
        chunk = -(-V // P)  # Shard(0) splits as torch.chunk does
        sizes = [max(0, min(chunk, V - r * chunk)) for r in range(P)]
        if linear_bias is not None and _is_dtensor(linear_bias) and tuple(linear_bias.placements) != (Shard(0),):
            raise ValueError("fused_ce: linear_bias must be placed Shard(0) like linear_weight")
        local = linear_weight.to_local()
        if local.shape[0] != sizes[rank] or (vocab_start is not None and vocab_start != rank * chunk):
            raise ValueError(
                f"fused_ce: rank {rank}'s shard of the DTensor linear_weight has {local.shape[0]} rows at "
                f"{vocab_start}; Shard(0) of {V} rows over {P} ranks gives {sizes[rank]} at {rank * chunk}"
            )
        x = input.to_local(grad_placements=[Partial()])
        shard = (group.group_name, rank * chunk, sizes)
        return x, local, _full(target), _local(linear_bias), _full(weight), shard

    if uses_dtensors(input, linear_bias):
        raise ValueError("fused_ce: with a process_group, pass plain tensors (this rank's shard of linear_weight)")
    rows = linear_weight.shape[0]
    start, sizes = _shard_layout(process_group, rows, vocab_start, input.device)
    x = _SumGradOverGroup.apply(input, process_group.group_name) if input.requires_grad else input
    return x, linear_weight, target, linear_bias, weight, (process_group.group_name, start, sizes)


def teacher_shard(teacher_input, teacher_weight, teacher_bias):
    """linear_distillation_loss's teacher for a vocabulary-parallel call: local tensors, the head's shard the
    student's (a DTensor teacher_weight placed Shard(0) as the student's; the op checks the shards' sizes)."""
    from torch.distributed.tensor import Shard

    if _is_dtensor(teacher_weight) and tuple(teacher_weight.placements) != (Shard(0),):
        raise ValueError(
            f"fused_ce: teacher_weight is a DTensor placed {tuple(teacher_weight.placements)}; in a vocabulary-"
            "parallel distillation both heads are placed Shard(0) on the same mesh"
        )
    return _full(teacher_input), _local(teacher_weight), _local(teacher_bias)
