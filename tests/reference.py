"""The plain PyTorch reference the op is tested against, and error measures."""

import torch
import torch.nn.functional as F


def reference_loss(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    logit_scale=1.0,
    upcast=True,
    return_lse=False,
):
    """F.linear + F.cross_entropy, plus the formulas of the extra keywords.

    With ``upcast`` the logits are taken to float32 after the linear layer (what
    torch eager does for a bf16 model), else kept in the input dtype's result.
    """
    logits = F.linear(input, linear_weight, linear_bias)
    logits = logits.float() if upcast and logits.dtype != torch.float64 else logits
    logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = logits.reshape(-1, logits.shape[-1])
    tflat = target.reshape(-1)
    loss = F.cross_entropy(
        flat,
        tflat,
        weight=None if weight is None else weight.to(flat.dtype),
        ignore_index=ignore_index,
        reduction="none" if reduction == "none" else reduction,
        label_smoothing=label_smoothing,
    )
    lse = flat.logsumexp(-1)
    if z_loss:
        valid = (tflat != ignore_index).to(lse.dtype)
        z = z_loss * lse.square() * valid
        if reduction == "none":
            loss = loss + z
        elif reduction == "sum":
            loss = loss + z.sum()
        else:
            loss = loss + z.sum() / valid.sum()
    if reduction == "none":
        loss = loss.reshape(target.shape)
    if return_lse:
        return loss, lse.reshape(target.shape)
    return loss


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_problem(N, D, V, dtype=torch.float32, device="cpu", ignore_frac=0.1, bias=False, seed=None):
    """Fresh random inputs: x ~ N(0, 1), w ~ N(0, 1/D), 10% ignored targets."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    x = torch.randn(N, D, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(V, D, generator=g) / D**0.5).to(device=device, dtype=dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < ignore_frac] = -100
    b = (torch.randn(V, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    return x, w, t.to(device), b
