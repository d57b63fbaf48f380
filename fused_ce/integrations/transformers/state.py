"""What apply leaves on a model (or class), read by the loss, the rewritten forward and the Trainer's patches."""

# apply(token_accuracy=True) sets the first on the model (or class); a call with labels then holds a list in the
# second while it runs, into which the loss puts the call's token accuracy.
_ASKS_ACCURACY = "_fused_ce_token_accuracy"


_ACCURACY_ATTRIBUTE = "_fused_ce_token_accuracies"


# apply(logits=...) on the model (or class): "eval" or "never"
_LOGITS_POLICY = "_fused_ce_logits"


# While the Trainer's compute_loss runs a label-smoothed step through the fused loss: the loss keywords that give its
# LabelSmoother's loss (label_smoothing, and shift_labels / num_items_in_batch where the smoother's differ)
_TRAINER_LOSS = "_fused_ce_trainer_loss"


# apply(grad_filter_eps=...) on the model (or class)
_GRAD_FILTER_EPS = "_fused_ce_grad_filter_eps"


LOGITS_POLICIES = ("eval", "never")
