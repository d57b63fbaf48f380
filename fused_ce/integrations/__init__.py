"""Integrations with training frameworks, one module each, imported on demand (``import fused_ce`` imports none).

- ``fused_ce.integrations.transformers``: Hugging Face causal LMs in one line (``apply(model)``).
- ``fused_ce.integrations.trl``: TRL's fused LM head and GRPO's loss (``apply()``).
- ``fused_ce.integrations.axolotl``: a plugin for axolotl's config (``plugins: [...FusedCEPlugin]``).
- ``fused_ce.integrations.verl``: verl's fused forward, ``fused_kernel_options.impl_backend=fused_ce`` (loaded by
  verl's plugin entry point).
- ``fused_ce.integrations.torchtitan``: a loss for torchtitan's config (``FusedCrossEntropyLoss.Config()``).
- ``fused_ce.integrations.megatron``: a Megatron-Core GPTModel's LM loss (``apply(model)``).
"""
