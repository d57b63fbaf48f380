"""axolotl: a plugin that switches the model axolotl loads to fused_ce's loss.

In an axolotl config (axolotl 0.21; ``examples/axolotl.yml``)::

    plugins:
      - fused_ce.integrations.axolotl.FusedCEPlugin
    fused_ce_logits: eval          # optional: "never" builds no logits in evaluation either

Once axolotl has loaded the model (adapters included), the plugin calls ``fused_ce.integrations.transformers.apply``
on it: the loss of every causal LM and vision-language model that ``apply`` reproduces comes from the last hidden
states and the lm_head weight, the ``[batch, seq, V]`` logits never built, through axolotl's own Trainer (sample
packing, gradient accumulation, FSDP, DeepSpeed and LoRA as axolotl sets them up; the Trainer's label smoothing
too). A model ``apply`` cannot reproduce is refused by name when it loads. Liger's fused linear cross-entropy and
Cut Cross-Entropy replace the same head: a config that also enables either is an error naming both.
"""

from typing import Literal

from pydantic import BaseModel, Field

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as exc:  # (the plugin is loaded by axolotl, which is then installed)
    raise ImportError("fused_ce.integrations.axolotl needs axolotl (pip install axolotl)") from exc


class FusedCEArgs(BaseModel):
    """The plugin's config keys."""

    fused_ce_logits: Literal["eval", "never"] = Field(
        default="eval",
        json_schema_extra={
            "description": (
                "What a call with labels returns as logits outside training: 'eval' (the model's own logits and "
                "loss, for eval metrics) or 'never' (the fused loss, no logits: less memory, no logit metrics)"
            )
        },
    )
    fused_ce_token_accuracy: bool = Field(
        default=False,
        json_schema_extra={"description": "Also return outputs.token_accuracy from the loss's own pass"},
    )


# axolotl config keys that put another fused loss on the same head
_OTHER_HEADS = {
    "liger_fused_linear_cross_entropy": "Liger's fused linear cross-entropy (its LigerPlugin)",
    "cut_cross_entropy": "Cut Cross-Entropy (its CutCrossEntropyPlugin)",
}


def _plugins_enabled(cfg):
    """The other fused heads this config enables, as (key, what)."""
    plugins = " ".join(str(p) for p in (cfg.get("plugins") or []))
    enabled = []
    for key, what in _OTHER_HEADS.items():
        plugin = "LigerPlugin" if key.startswith("liger") else "CutCrossEntropyPlugin"
        # CutCrossEntropyArgs defaults cut_cross_entropy to True: the plugin listed enables it
        value = cfg.get(key)
        if plugin in plugins and (value or (value is None and plugin == "CutCrossEntropyPlugin")):
            enabled.append((key, what))
    return enabled


class FusedCEPlugin(BasePlugin):
    """fused_ce's loss for the model axolotl loads (see the module's docstring)."""

    def get_input_args(self):
        return "fused_ce.integrations.axolotl.FusedCEArgs"

    def pre_model_load(self, cfg):
        others = _plugins_enabled(cfg)
        if others:
            names = ", ".join(f"{what} ({key})" for key, what in others)
            raise ValueError(
                f"fused_ce.integrations.axolotl.FusedCEPlugin: this config also enables {names}, which replaces the "
                "same lm_head loss; keep one: remove the other plugin (or set its key to false), or remove "
                "FusedCEPlugin"
            )

    def post_model_load(self, cfg, model):
        from .transformers import apply

        apply(
            model,
            logits=cfg.get("fused_ce_logits") or "eval",
            token_accuracy=bool(cfg.get("fused_ce_token_accuracy")),
        )
