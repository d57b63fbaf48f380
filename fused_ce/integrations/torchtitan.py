"""torchtitan: a language model's loss through fused_ce, inside its lm_head's call, the logits never built.

    from fused_ce.integrations.torchtitan import FusedCrossEntropyLoss

    def llama3_8b_fused_ce() -> Trainer.Config:   # a config_registry function of one's own
        config = llama3_8b()
        config.loss = FusedCrossEntropyLoss.Config()
        return config

torchtitan (0.3.0) takes its loss from ``Trainer.Config.loss``; for a ``ChunkedLossWrapper`` it hands the loss the
model's ``lm_head`` (``set_lm_head``) and the decoder returns its hidden states instead of logits. This loss is one:
called as torchtitan's, ``loss_fn(pred, labels, global_valid_tokens)``, it sums the cross-entropy of the counted
tokens (labels other than torchtitan's ``IGNORE_INDEX``) and divides by ``global_valid_tokens``, as torchtitan's
``CrossEntropyLoss`` does. The sum is computed inside the lm_head's own call, so FSDP2 gathers the head's weight
and reduce-scatters its gradient as for the head's forward; under tensor parallelism the head's DTensor weight
(``ColwiseParallel``: ``Shard(0)``, the vocabulary) makes it vocabulary parallel, the log-sum-exp combined across
the shards. Its forward runs once (no chunks, no second backward): the gradients of a scalar loss are formed in
the forward. Validation (hidden states without grad) computes the loss alone.
"""

import dataclasses

from torchtitan.components.loss import IGNORE_INDEX, BaseLoss, ChunkedLossWrapper

from ..functional import linear_cross_entropy
from ._head import _LOSS_KEYWORD, _route_through


class FusedCrossEntropyLoss(ChunkedLossWrapper):
    """torchtitan's cross-entropy (sum over the counted tokens / ``global_valid_tokens``) through fused_ce."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        z_loss: float = 0.0
        """The z-loss coefficient (``z_loss * lse**2`` per counted token), 0 for none."""

        workspace_bytes: int | None = None
        """fused_ce's workspace (None: its default)."""

    def __init__(self, config: Config, *, compile_config=None):
        # (ChunkedLossWrapper's own __init__ builds a per-chunk loss this one does not use; the lm_head comes from
        # set_lm_head, as for it. The call is not compiled apart: fused_ce's op is one graph node wherever it runs.)
        self.config = config
        self.lm_head = None

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor, Replicate

        head = self.lm_head
        assert head is not None, "FusedCrossEntropyLoss: torchtitan's trainer calls set_lm_head first"
        if isinstance(head, FSDPModule):
            if isinstance(head.weight, DTensor) and head.weight.device_mesh.ndim > 1:
                raise NotImplementedError(
                    "fused_ce.integrations.torchtitan: FSDP2 with tensor parallel on the lm_head (a 2-D mesh) is not "
                    "supported yet; use FSDP2 alone or tensor parallel alone"
                )
            # FSDP2 gathers the weight in the head's call and reduce-scatters its gradient after the backward
            loss = _route_through(head)(pred, **{_LOSS_KEYWORD: lambda module, x: self._sum(module, x, labels)})
        else:
            # the weight in place (tensor parallel: its vocabulary shard, a DTensor parameter); not through the
            # head's call, whose ColwiseParallel hooks turn logits into DTensors and would take the loss for them
            if isinstance(head.weight, DTensor) and not isinstance(pred, DTensor):  # (as ColwiseParallel's input)
                pred = DTensor.from_local(pred, head.weight.device_mesh, [Replicate()], run_check=False)
            loss = self._sum(head, pred, labels)
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}

    def _sum(self, head, hidden, labels):
        """The summed loss, with the head's weight as its engine has it now (gathered by FSDP2; a DTensor under
        tensor parallelism)."""
        hidden = hidden.flatten(0, -2)
        return linear_cross_entropy(
            hidden, head.weight, labels.flatten().to(hidden.device), linear_bias=head.bias, reduction="sum",
            ignore_index=IGNORE_INDEX, z_loss=self.config.z_loss, workspace_bytes=self.config.workspace_bytes,
        )  # fmt: skip
