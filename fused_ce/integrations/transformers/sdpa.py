"""SDPA's causal kernel kept where transformers would give it an explicit mask under ``torch.compile``."""

import functools
import inspect

import torch


def keep_causal_sdpa_when_compiled(enabled=True):
    """Let transformers skip the causal mask under ``torch.compile`` where nothing is padded, as it does in eager.

    Under compile, transformers gives SDPA an explicit ``[B, 1, T, T]`` causal mask where eager passes
    ``is_causal=True`` (4.x and 5.x up to 5.17 at least, on any torch; 5.24 on torch before 2.13, where dynamo
    reads ``torch.compiler.is_exporting()`` as true), and SDPA then runs its masked kernel: about 3x the causal
    one's time (docs/performance.md).
    Where there is no padding mask, the query and key lengths are equal and nothing is offset or windowed, the mask
    is exactly ``is_causal=True``'s, so this makes transformers' own check (``masking_utils._ignore_causal_mask_sdpa``,
    wrapped) say so while compiling; every other case, and every call outside compile, keeps its answer. Process-wide
    (every model of the process), idempotent; ``enabled=False`` restores transformers' function. Not for
    ``torch.export`` of a model that will later run with a key/value cache: the exported graph keeps ``is_causal``.
    """
    from transformers import masking_utils

    current = masking_utils._ignore_causal_mask_sdpa
    original = getattr(current, "_fused_ce_original", current)
    if not enabled:
        masking_utils._ignore_causal_mask_sdpa = original
        return
    if current is not original:
        return  # already kept
    # the arguments by position: (padding_mask, query length, key/value length, then offsets and the local window,
    # named and ordered differently across transformers' versions)
    names = list(inspect.signature(original).parameters)

    @functools.wraps(original)
    def ignore_causal_mask(*args, **kwargs):
        if torch.compiler.is_compiling():
            values = dict(zip(names, args), **kwargs)
            padding_mask, q_length, kv_length = (values.get(n) for n in names[:3])
            rest = {n: values.get(n) for n in names[3:]}
            offsets = [v for n, v in rest.items() if "offset" in n]
            if (
                padding_mask is None
                and q_length == kv_length
                and all(isinstance(v, int) and v == 0 for v in offsets if v is not None)
                and all(v is None for n, v in rest.items() if "local" in n)
            ):
                return True
        return original(*args, **kwargs)

    ignore_causal_mask._fused_ce_original = original
    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask
