"""The HF Trainer's patches: evaluation's logits and metrics (``prediction_step``) and a label-smoothed
``compute_loss`` through the fused loss, installed once by ``apply``."""

import functools
import inspect

from .forward import _builds_logits, _unwrapped
from .state import _LOGITS_POLICY, _TRAINER_LOSS


def _is_switched(model):
    model = _unwrapped(model)
    return getattr(getattr(model, "forward", None), "_fused_ce_original", None) is not None


def _install_trainer_hook():
    """transformers' Trainer, for a model switched to fused_ce (once; other models' calls unchanged):

    - a loss-only evaluation (``prediction_loss_only``: no ``compute_metrics``) asks a fused head for no logits with
      ``skip_logits=True``, but only Liger's; its ``prediction_step`` passes it to a switched model too; and one
      with ``compute_metrics`` on a model applied with ``logits="never"`` is an error naming the option;
    - ``label_smoothing_factor`` (the Trainer's LabelSmoother, which would take the labels from the model and smooth
      its full logits) becomes the fused loss's ``label_smoothing`` where the step builds no logits (training, or
      ``logits="never"``): the smoother's loss, its normalisation and shift included.
    """
    try:
        from transformers import Trainer
    except ImportError:
        return
    if hasattr(Trainer.prediction_step, "_fused_ce_original"):
        return
    original = Trainer.prediction_step

    @functools.wraps(original)
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if _is_switched(self.model) and not self.args.use_liger_kernel:
            if prediction_loss_only:
                inputs = {**inputs, "skip_logits": True}
            elif getattr(_unwrapped(self.model), _LOGITS_POLICY, "eval") == "never" and "labels" in inputs:
                raise ValueError(
                    "fused_ce: this Trainer evaluates with compute_metrics (or predict), which needs the model's "
                    "logits, but the model was switched with fused_ce.integrations.transformers.apply(model, "
                    'logits="never"), which builds none: apply it with logits="eval" (the default; evaluation then '
                    "returns the model's own logits and loss), or evaluate without compute_metrics"
                )
        return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    prediction_step._fused_ce_original = original
    Trainer.prediction_step = prediction_step
    original_compute_loss = Trainer.compute_loss

    @functools.wraps(original_compute_loss)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        smoother, lm = self.label_smoother, _unwrapped(self.model)
        if (
            smoother is None
            or self.compute_loss_func is not None
            or "labels" not in inputs
            or not _is_switched(lm)
            or _builds_logits(lm, inputs.get("skip_logits"))
        ):
            return original_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        loss = {"label_smoothing": smoother.epsilon}
        if lm._get_name() not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            loss["shift_labels"] = inputs["labels"]  # (the smoother shifts causal LMs' labels only)
        if "num_items_in_batch" not in inspect.signature(type(smoother).__call__).parameters:
            loss["num_items_in_batch"] = None  # (4.x's smoother: the mean over the micro-batch's counted tokens)
        elif not self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss["num_items_in_batch"] = num_items_in_batch  # (the smoother divides by it either way)
        setattr(lm, _TRAINER_LOSS, loss)
        self.label_smoother = None  # (the model's loss, from the labels it now keeps, is the smoother's)
        try:
            return original_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.label_smoother = smoother
            delattr(lm, _TRAINER_LOSS)

    compute_loss._fused_ce_original = original_compute_loss
    Trainer.compute_loss = compute_loss
