"""The loss computed inside a head module's own call, shared by the integrations.

An engine that manages the head's weight (FSDP2 however it wraps, DeepSpeed ZeRO-3, DDP, tensor parallel's
``parallelize_module``) gathers, reshards and reduces it in the module's call hooks: calling the head as a module,
with the loss to compute as a keyword, gives the loss the weight as the engine has it for the head's forward.
"""

# The head is called through its module (hooks and all) with this keyword: FSDP2 (root, per layer, or the head
# apart), DeepSpeed ZeRO-3 and DDP gather, reshard and reduce its weight as for its own forward.
_LOSS_KEYWORD = "_fused_ce_loss"


class _HeadForward:
    """The forward of a head switched to fused_ce (its instance attribute ``forward``): the head's own without the
    keyword, else the loss the keyword holds (called with the head, whose weight its engine has gathered now, and
    the head's input). An object rather than a bound method: it pickles and deep-copies with its head, and
    torch.compile traces its creation where a head is first met inside a compiled forward."""

    def __init__(self, head, own):
        self.head = head
        self.own = own  # an instance forward the head had (an engine's wrapper), else None: its class's

    def __call__(self, input, **kwargs):
        loss = kwargs.pop(_LOSS_KEYWORD, None)
        if loss is not None:
            return loss(self.head, input)
        if self.own is not None:
            return self.own(input, **kwargs)
        return type(self.head).forward(self.head, input, **kwargs)


def _route_through(head):
    """Give the head the forward above (once; its class untouched)."""
    if not isinstance(head.__dict__.get("forward"), _HeadForward):
        head.forward = _HeadForward(head, head.__dict__.get("forward"))
    return head
