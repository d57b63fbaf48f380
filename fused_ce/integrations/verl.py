"""verl: the actor's and reference policy's log-probs and entropy from fused_ce's ``linear_log_probs``.

In a verl job's configuration (the FSDP engine, dense and vision-language models alike)::

    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=fused_ce

verl 0.9 imports its plugins (the ``verl.plugins`` entry points) in every process it starts, and fused_ce's is this
module, so nothing else is needed where fused_ce is installed; with ``VERL_USE_EXTERNAL_PLUGINS=none`` name it in
``actor_rollout_ref.model.external_lib=fused_ce.integrations.verl`` instead (or import it before verl builds a model).

verl's fused forward (``verl/models/transformers/dense_common.py``, and ``qwen2_vl.py``, ``qwen3_vl.py``,
``glm4v.py``, ``qwen3_5.py`` for its vision-language models) computes ``(log_probs, entropy)`` from the last hidden
states, the lm_head weight, the rolled input ids and the sampling temperature through
``verl.utils.experimental.torch_functional.FusedLinearForPPO(impl_backend=...)``. With ``impl_backend=fused_ce``
that call is ``fused_ce.linear_log_probs(..., temperature=..., return_entropy=True)``: the same outputs (float32
log-probs, the entropy in the hidden states' dtype, as verl's torch backend returns them) and gradients, without the
``[tokens, V]`` logits. Importing this module only registers the backend (verl's modules are patched as verl
imports them); the backend is used only where a job asks for it.

The reference and old policies' forwards run without grad. Where memory counts there more than time, the
environment variable ``FUSED_CE_VERL_NO_GRAD_WORKSPACE_BYTES`` (set in the job's runtime environment, so that
verl's workers see it) is their ``workspace_bytes``: one too small for row blocks of cuBLAS logits (134217728 at
Qwen2.5-7B's head) takes fused_ce's lean path, tiles of logits reduced in registers in a few MiB, at 1.7x the
default's time there, still ahead of verl's Triton kernel (docs/integrations.md). The actor's step keeps the
default.
"""

import functools
import importlib.abc
import os
import sys

BACKEND = "fused_ce"
NO_GRAD_WORKSPACE = "FUSED_CE_VERL_NO_GRAD_WORKSPACE_BYTES"


def _no_grad_workspace():
    """The no-grad forwards' workspace_bytes from NO_GRAD_WORKSPACE (None where unset: the default)."""
    value = os.environ.get(NO_GRAD_WORKSPACE, "").strip()
    if not value:
        return None
    try:
        workspace = int(value)
    except ValueError:
        workspace = 0
    if workspace <= 0:
        raise ValueError(f"fused_ce.integrations.verl: {NO_GRAD_WORKSPACE} must be a positive number of bytes, "
                         f"got {value!r}")  # fmt: skip
    return workspace


def log_probs_and_entropy(hidden_states, vocab_weights, input_ids, temperature=1.0):
    """verl's ``FusedLinearForPPO.forward`` contract through fused_ce: ``hidden_states [..., D]``, ``vocab_weights
    [V, D]``, ``input_ids [...]`` (every token counted: verl has no ignored label here) -> (log-probs float32,
    entropy in the hidden states' dtype), both shaped like ``input_ids`` and differentiable. Without grad (the
    reference and old policies), in the workspace NO_GRAD_WORKSPACE names where it is set."""
    import torch

    from ..functional import linear_log_probs

    differentiable = torch.is_grad_enabled() and (hidden_states.requires_grad or vocab_weights.requires_grad)
    workspace = None if differentiable else _no_grad_workspace()
    out = linear_log_probs(
        hidden_states,
        vocab_weights,
        input_ids.to(hidden_states.device),
        temperature=float(temperature),
        ignore_index=None,
        return_entropy=True,
        **({} if workspace is None else dict(workspace_bytes=workspace)),
    )
    return out.log_probs, out.entropy.to(hidden_states.dtype)


def _patch_fused_linear(module):
    """FusedLinearForPPO accepts impl_backend="fused_ce" (verl's own check allows "torch" and "liger")."""
    cls = module.FusedLinearForPPO
    if getattr(cls, "_fused_ce_patched", False):
        return
    init, forward = cls.__init__, cls.forward

    @functools.wraps(init)
    def __init__(self, chunk_size=512, impl_backend="torch"):
        if impl_backend != BACKEND:
            init(self, chunk_size=chunk_size, impl_backend=impl_backend)
            return
        init(self, chunk_size=chunk_size, impl_backend="torch")  # (verl's checks and attributes)
        self.impl_backend = BACKEND

    @functools.wraps(forward)
    def fused_forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        if self.impl_backend != BACKEND:
            return forward(self, hidden_states, vocab_weights, input_ids, temperature)
        return log_probs_and_entropy(hidden_states, vocab_weights, input_ids, temperature)

    cls.__init__, cls.forward, cls._fused_ce_patched = __init__, fused_forward, True


def _patch_forward_with_backends(module):
    """patch_forward_with_backends takes fused_kernels_backend="fused_ce" (its list is "triton", "torch", "liger";
    another value would skip the fused forward, printing so): the model gets verl's torch-backend forward, whose
    FusedLinearForPPO reads the backend from the model."""
    original = module.patch_forward_with_backends
    if getattr(original, "_fused_ce_original", None) is not None:
        return

    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not (use_fused_kernels and fused_kernels_backend == BACKEND):
            return original(model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)
        original(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model._verl_fused_kernels_backend = BACKEND

    patch_forward_with_backends._fused_ce_original = original
    module.patch_forward_with_backends = patch_forward_with_backends


# verl's modules this backend changes, and how: each as it is imported (or now, where it already is).
_PATCHES = {
    "verl.utils.experimental.torch_functional": _patch_fused_linear,
    "verl.models.transformers.monkey_patch": _patch_forward_with_backends,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches verl's modules once they are executed, so that registering the backend (at ``import verl``, through
    its plugin entry point) imports none of them, nor transformers."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader, _PATCHES[name])
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # (get_source and the rest: tracebacks and inspect read the module's source)
        return getattr(self.loader, name)


def install():
    """Register the backend (idempotent): verl's modules imported already are patched now, the others on import."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


install()
