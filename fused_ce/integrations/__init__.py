"""Integrations with training frameworks, one module each, imported on demand (``import fused_ce`` imports none).

- ``fused_ce.integrations.transformers``: Hugging Face causal LMs in one line (``apply(model)``).
"""
