"""TRL: its trainers' per-token log-probs and entropies through fused_ce, and GRPOTrainer's loss fused at 6NDV.

    from fused_ce.integrations.trl import apply
    apply()                      # before building the trainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

TRL (1.15 and later) computes every trainer's per-token log-probs with a fused LM head
(``trl.trainer.utils.add_fused_lm_head``: the model called with ``fused_lm_head=True`` returns log-probs, entropies,
top-1 flags and mean logits instead of logits). ``apply()`` makes that head fused_ce's ``linear_log_probs`` (the old
and reference policies without grad, the policy's with it: 8NDV, the logits recomputed in the backward), for every
trainer that uses it (GRPO, RLOO, DPO's policy and reference, KTO, SFT's), every field of TRL's contract included
(DPO's WPO weights, ``log_sum_sq_probs``: one more forward without grad); TRL's own head stays for the mean logits
and WPO weights of a softcapped head.
It also replaces GRPOTrainer's loss by ``fused_ce.linear_policy_loss`` (the gradients formed in the forward: 6NDV)
where the configuration maps onto it:

- ``loss_type`` "grpo", "bnpo", "dr_grpo" or "dapo" (PPO-clip with two-sided bounds ``epsilon``/``epsilon_high``;
  each normalisation is a token weight), ``beta`` for the k3 KL against the reference's log-probs (times the ratio
  with ``use_bias_correction_kl``, TRL's default), token-level importance sampling;
- not under DeepSpeed ZeRO-3 (TRL's own head and loss there: ZeRO-3 re-partitions the head between forward and
  backward), nor with: another loss type ("cispo", "sapo", "vespo", "luspo"), ``importance_sampling_level="sequence"``,
  ``delta``, ``off_policy_mask_threshold``, ``top_entropy_quantile < 1``, vLLM's importance-sampling correction,
  an entropy bonus, a MoE auxiliary loss, vision inputs. Those keep TRL's own loss,
  on fused_ce's log-probs.

The logged metrics are TRL's (kl, entropy, the clip ratios' means and per-sequence extremes ``clip_ratio/low_min``
and ``high_max``), from the fused loss's per-token stats.

GKDTrainer and OnlineDPOTrainer (``trl.experimental``) compute their losses on full logits of their own (GKD's
generalised JSD from the student's and the teacher's forward; online DPO's log-probs from its own logits), which
fused_ce does not replace: GKDTrainer's student, which SFTTrainer gives TRL's fused head that GKD's loss never calls,
is not marked as fused_ce's, and the trainer warns once; for a fused generalised JSD use DistillationTrainer.

DistillationTrainer's loss (its generalised JSD between the student's and the teacher's heads on the completion
tokens, ``beta`` and ``temperature``, each head's logit scale and softcap) becomes
``fused_ce.linear_distillation_loss``, called where TRL calls its own (inside the student's forward redirection),
with TRL's normalisation (``num_items_in_batch``) and its logged entropy. TRL is imported on ``apply()``.
"""

import contextlib
import functools
import types
import warnings

import torch

from ..functional import linear_cross_entropy, linear_distillation_loss, linear_log_probs, linear_policy_loss
from .transformers import Refused, _lora_of, _lora_terms

# TRL's FusedCausalLMOutput fields; the last two are linear in the logits' scale (not under a softcap)
_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
_UNCAPPED_OUTPUTS = ("mean_logits", "log_sum_sq_probs")
_MAPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _head_scales(config):
    """TRL's reading of a model's logit transform: (softcap, logit_scale)."""
    text = config.get_text_config()
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if text.model_type == "hyperclovax" else 1 / text.logits_scaling
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else scale


def _mean_logits(hidden, weight, bias, scale, low_rank=None):
    """Each row's mean over the vocabulary of ``scale * (hidden @ W.T + b)``, without gradient, in float32:
    ``scale * (hidden @ mean_v W + mean_v b)``, the mean of the logits without them (an N x D product; exact for a
    head without a softcap, which is not linear); a low-rank term's ``u @ mean_v B`` added."""
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        out = hidden.detach().float() @ weight.detach().mean(0, dtype=torch.float32)
        if bias is not None:
            out = out + bias.detach().float().mean()
        if low_rank is not None:
            out = out + low_rank[0].detach().float() @ low_rank[1].detach().mean(0, dtype=torch.float32)
        return out * scale


def _log_sum_sq_probs(hidden, weight, bias, labels, log_probs, scale, low_rank=None):
    """``log sum_v p_v^2`` of each row's ``softmax(scale * z)``, without gradient: ``LSE(2 scale z) - 2 LSE(scale z)``,
    the first the lse of one more forward of the op at twice the scale (2NDV, no logits), the second the label's
    logit less its log-prob (an N x D product); with a low-rank term of the logits (u, B), its part too."""
    with torch.no_grad():
        flat, target = hidden.detach().reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        terms = {}
        if low_rank is not None:
            u, B = low_rank[0].detach().reshape(flat.shape[0], -1), low_rank[1].detach()
            terms = dict(low_rank_input=u, low_rank_weight=B)
        _, lse_doubled = linear_cross_entropy(
            flat, weight.detach(), target, linear_bias=None if bias is None else bias.detach(), reduction="none",
            logit_scale=2.0 * scale, return_lse=True, **terms,
        )  # fmt: skip
        with torch.autocast(hidden.device.type, enabled=False):
            rows = target.clamp(min=0)
            label_logit = (flat.float() * weight.detach()[rows].float()).sum(-1)
            if bias is not None:
                label_logit = label_logit + bias.detach()[rows].float()
            if terms:
                label_logit = label_logit + (u.float() * B[rows].float()).sum(-1)
            lse = scale * label_logit - log_probs.detach().reshape(-1).float()
        return (lse_doubled - 2.0 * lse).view(labels.shape)


def add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",), _original=None):
    """TRL's ``add_fused_lm_head`` with fused_ce computing the head: the same ``FusedCausalLMOutput``. TRL's original
    does it for what fused_ce has not (``mean_logits`` and ``log_sum_sq_probs`` of a softcapped head) and under
    DeepSpeed ZeRO-3. Whether fused_ce's head was added."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    softcap, logit_scale = _head_scales(model.config)
    if (
        any(name not in _FUSED_OUTPUTS for name in outputs)
        or (softcap is not None and any(name in _UNCAPPED_OUTPUTS for name in outputs))
        or is_deepspeed_zero3_enabled()
    ):
        # ZeRO-3 re-partitions the head between forward and backward, where linear_log_probs recomputes it
        _original(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
        return False
    from torch.distributed.tensor import DTensor
    from trl.trainer.utils import FusedCausalLMOutput

    original_forward = model.forward
    text_config = model.config.get_text_config()
    # before transformers 5, vision-language models expose their language backbone as `model` (as TRL reads it)
    old_vlm = text_config is not model.config and int(__import__("transformers").__version__.split(".")[0]) < 5
    backbone_name = "model" if old_vlm else "base_model"

    @functools.wraps(type(model).forward)
    def forward(
        self,
        *args,
        fused_lm_head=False,
        labels=None,
        shift_labels=None,
        num_items_in_batch=None,
        fused_policy=None,
        **kwargs,
    ):
        if not fused_lm_head:
            for name, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    kwargs[name] = value
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone = getattr(self, backbone_name)(*args, **kwargs)  # looked up per call: FSDP and PEFT replace it
        if shift_labels is None:
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        head = self.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        weight, bias, low_rank = head.weight, head.bias, None
        if _lora_of(head) is not None:  # LoRA on the head: its adapters the losses' low-rank term
            if isinstance(weight, DTensor):
                raise Refused("fused_ce: LoRA on an FSDP2-sharded lm_head is not fused in TRL's head; use TRL's own")
            weight, bias, low_rank = _lora_terms(head, hidden)
        if isinstance(weight, DTensor):  # FSDP2's sharded head: gathered (its gradient reduce-scattered back)
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        head_precision = contextlib.nullcontext()
        if cast_lm_head_to_fp32:  # in float32 outside autocast, as TRL's (whose autocast would cast it back)
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            low_rank = None if low_rank is None else (low_rank[0].float(), low_rank[1].float())
            head_precision = torch.autocast(hidden.device.type, enabled=False)
        mask = labels != -100
        keywords = dict(linear_bias=bias, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
        if low_rank is not None:
            keywords.update(low_rank_input=low_rank[0], low_rank_weight=low_rank[1])
        if fused_policy is not None:  # GRPOTrainer's loss (_compute_loss below): the policy loss over these tokens
            with head_precision:
                loss, stats = linear_policy_loss(
                    hidden, weight, labels, **fused_policy, **keywords, return_stats="per_token"
                )
            return FusedCausalLMOutput(loss=loss, label_mask=mask), stats
        with head_precision:
            out = linear_log_probs(
                hidden, weight, labels, return_entropy="entropy" in outputs, return_argmax="is_top1" in outputs,
                **keywords,
            )  # fmt: skip
        log_probs = out if torch.is_tensor(out) else out.log_probs
        entropy = None if torch.is_tensor(out) else out.entropy
        is_top1 = None if torch.is_tensor(out) or out.argmax is None else (out.argmax == labels) & mask
        mean_logits = None
        if "mean_logits" in outputs:  # (TRL's is of the tempered logits, 0 at ignored rows)
            mean_logits = _mean_logits(hidden, weight, bias, logit_scale / temperature, low_rank)
            mean_logits = mean_logits.masked_fill(~mask, 0.0)
        log_sum_sq_probs = None
        if "log_sum_sq_probs" in outputs:  # (DPO's WPO weights)
            with head_precision:
                log_sum_sq_probs = _log_sum_sq_probs(
                    hidden, weight, bias, labels, log_probs, logit_scale / temperature, low_rank
                )
            log_sum_sq_probs = log_sum_sq_probs.masked_fill(~mask, 0.0)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None)
            aux_loss = load_balancing_loss_func(
                backbone.router_logits, experts, text_config.num_experts_per_tok, kwargs.get("attention_mask")
            )
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits,
            is_top1=is_top1, label_mask=mask, aux_loss=aux_loss,
        )  # fmt: skip

    model.forward = types.MethodType(forward, model)
    return True


def maps_onto_policy_loss(trainer, inputs):
    """Whether this GRPOTrainer step's loss is fused_ce.linear_policy_loss's (see the module's docstring)."""
    args = trainer.args
    return (
        trainer.loss_type in _MAPPED_LOSSES
        and trainer.importance_sampling_level == "token"
        and args.delta is None
        and trainer.off_policy_mask_threshold is None
        and trainer.top_entropy_quantile >= 1.0
        and not (trainer.use_vllm and trainer.vllm_importance_sampling_correction)
        and not getattr(trainer, "_entropy_bonus_enabled", False)
        and not trainer.aux_loss_enabled
        and all(
            inputs.get(k) is None for k in ("pixel_values", "image_grid_thw", "token_type_ids", "mm_token_type_ids")
        )
        and getattr(trainer, "_fused_ce_head", False)
    )


def _token_weights(trainer, mask, inputs):
    """The weight of each completion token in the loss: TRL's normalisation of each loss type."""
    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    mask = mask.float()
    if trainer.loss_type == "grpo":  # the mean over sequences of each sequence's token mean
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / mask.size(0) / accumulation
    if trainer.loss_type == "bnpo":  # the token mean over the batch
        return mask / mask.sum().clamp(min=1.0) / accumulation
    if trainer.loss_type == "dr_grpo":  # a constant normaliser
        return mask / (mask.size(0) * trainer.max_completion_length) / accumulation
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes  # "dapo"
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return mask / normalizer


def _compute_loss(self, model, inputs, _original=None):
    """GRPOTrainer._compute_loss through fused_ce.linear_policy_loss where it maps, else TRL's own."""
    if not maps_onto_policy_loss(self, inputs):
        return _original(self, model, inputs)
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    keep = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    # the per-token inputs on the shifted labels' positions: the completion is the last `keep` of them
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-keep] = -100
    labels = labels.masked_fill(torch.nn.functional.pad(mask, (prompt_ids.size(1), 0)) == 0, -100)
    shifted = labels[:, 1:].size(1)

    def on_labels(per_completion_token):
        full = per_completion_token.new_zeros(input_ids.size(0), shifted)
        full[:, -keep:] = per_completion_token
        return full

    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    policy = dict(
        advantages=on_labels(advantages.expand(-1, keep).float()),
        token_weights=on_labels(_token_weights(self, mask, inputs)),
        old_log_probs=None if inputs.get("old_per_token_logps") is None else on_labels(inputs["old_per_token_logps"]),
        ref_log_probs=on_labels(inputs["ref_per_token_logps"]) if self.beta != 0.0 else None,
        clip_low=self.epsilon_low,
        clip_high=self.epsilon_high,
        kl_coef=self.beta,
        kl_times_ratio=bool(getattr(self.args, "use_bias_correction_kl", False)),
    )
    with self.accelerator.autocast():
        out, stats = model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, fused_policy=policy
        )
    mode = "train" if self.model.training else "eval"
    # TRL's global_masked_mean of each metric from this rank's per-token values (0 at tokens not counted): one
    # reduction, one read
    logged = {"kl": stats.kl} if self.beta != 0.0 else {}  # (in TRL's order)
    logged["entropy"] = stats.entropy
    logged["clip_ratio/low_mean"], logged["clip_ratio/high_mean"] = stats.clip_low, stats.clip_high
    logged["clip_ratio/region_mean"] = stats.clip_low + stats.clip_high
    counted = labels[:, 1:] != -100
    totals = self.accelerator.reduce(
        torch.stack([*(v.detach().sum() for v in logged.values()), counted.sum().float()]), reduction="sum"
    )
    for name, total in zip(logged, (totals[:-1] / totals[-1].clamp(min=1.0)).tolist()):
        self._metrics[mode][name].append(total)
    # the per-sequence clip fractions' extremes over every rank's sequences (TRL's masked_seq_mean, nanmin/nanmax)
    tokens = counted.sum(-1)
    for name, flags, extreme in (("low_min", stats.clip_low, torch.min), ("high_max", stats.clip_high, torch.max)):
        per_sequence = self.accelerator.gather(flags.detach().sum(-1) / tokens)  # (NaN: a sequence without tokens)
        present = per_sequence[~per_sequence.isnan()]
        self._metrics[mode][f"clip_ratio/{name}"].append(extreme(present).item() if present.numel() else float("nan"))
    return out.loss


def _divergence_loss(
    student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight, completion_mask, beta,
    num_items_in_batch=None, student_lm_head_bias=None, teacher_lm_head_bias=None, student_logit_scale=1.0,
    teacher_logit_scale=1.0, student_final_logit_softcapping=None, teacher_final_logit_softcapping=None,
    temperature=1.0,
):  # fmt: skip
    """DistillationTrainer's loss (trl.trainer.distillation_trainer._chunked_divergence_loss: its arguments and
    returns, the loss, the student's entropy summed over the counted tokens, their count) through
    fused_ce.linear_distillation_loss."""
    from ..distributed import uses_dtensors

    def whole(weight, bias, hidden):  # FSDP2's DTensor head gathered once, as TRL's own loss does
        if uses_dtensors(weight):
            weight = weight.full_tensor().to(hidden.dtype)
            bias = bias.full_tensor() if bias is not None else None
        return weight, bias

    student_lm_head_weight, student_lm_head_bias = whole(
        student_lm_head_weight, student_lm_head_bias, student_hidden_states
    )
    teacher_lm_head_weight, teacher_lm_head_bias = whole(
        teacher_lm_head_weight, teacher_lm_head_bias, teacher_hidden_states
    )
    teacher_dtype = teacher_hidden_states.dtype
    counted = completion_mask != 0
    loss, entropy = linear_distillation_loss(
        student_hidden_states, student_lm_head_weight, teacher_hidden_states.detach(),
        teacher_lm_head_weight.detach().to(teacher_dtype), torch.where(counted, 0, -100), beta=beta,
        temperature=temperature, reduction="sum", linear_bias=student_lm_head_bias,
        teacher_bias=None if teacher_lm_head_bias is None else teacher_lm_head_bias.detach().to(teacher_dtype),
        softcap=student_final_logit_softcapping, logit_scale=student_logit_scale,
        teacher_softcap=teacher_final_logit_softcapping, teacher_logit_scale=teacher_logit_scale,
        return_entropy=True,
    )  # fmt: skip
    n_valid = counted.sum()
    if num_items_in_batch is None:
        loss = loss / n_valid.clamp(min=1)  # (a rank with no counted token: 0, as TRL's)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss, entropy.sum(), n_valid


def _distillation_module():
    try:
        from trl.trainer import distillation_trainer
    except ImportError:  # (a TRL without it)
        return None
    return distillation_trainer if hasattr(distillation_trainer, "_chunked_divergence_loss") else None


def _trl_modules(function):
    import sys

    return [
        m
        for n, m in list(sys.modules.items())
        if n.startswith("trl.") and getattr(m, "add_fused_lm_head", None) is function
    ]


def _gkd_trainer():
    """trl.experimental's GKDTrainer, where this TRL has it (imported quietly: its experimental warning is TRL's
    to give when a user imports it)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("trl.experimental.gkd") is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer
    return GKDTrainer


def _unflag_gkd(trainer_class):
    """GKDTrainer builds on SFTTrainer, which gives the student TRL's fused head, but computes its generalised JSD
    on both models' full logits (its own compute_loss): the student is not marked fused_ce's, and the trainer says
    so once, naming DistillationTrainer (whose loss is fused)."""
    init = trainer_class.__init__
    if hasattr(init, "_fused_ce_original"):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        student = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        student._fused_ce_head = False
        warnings.warn(
            "fused_ce.integrations.trl: GKDTrainer computes its generalised JSD on the student's and the teacher's "
            "full logits (TRL's own loss, which fused_ce does not replace); DistillationTrainer's loss is fused "
            "(fused_ce.linear_distillation_loss)",
            stacklevel=2,
        )

    __init__._fused_ce_original = init
    trainer_class.__init__ = __init__


def apply():
    """Switch TRL's fused LM head to fused_ce, GRPOTrainer's loss to fused_ce.linear_policy_loss where its
    configuration maps onto it, and DistillationTrainer's loss to fused_ce.linear_distillation_loss. Call before
    building the trainer; returns the patched GRPO trainer class. GKDTrainer and OnlineDPOTrainer keep TRL's own
    losses on full logits (GKDTrainer's student is not marked fused, and says so)."""
    import trl
    import trl.trainer.utils as utils
    from trl.trainer import grpo_trainer

    if not hasattr(utils, "add_fused_lm_head"):
        raise ImportError(
            f"fused_ce.integrations.trl needs trl >= 1.15 (its fused LM head, trl.trainer.utils.add_fused_lm_head); "
            f"found trl {trl.__version__}: pip install -U trl"
        )
    if hasattr(utils.add_fused_lm_head, "_fused_ce_original"):
        return grpo_trainer.GRPOTrainer  # already switched
    original_head = utils.add_fused_lm_head
    head = functools.partial(add_fused_lm_head, _original=original_head)

    def marked_head(model, *args, **kwargs):
        model._fused_ce_head = head(model, *args, **kwargs)

    marked_head._fused_ce_original = original_head
    for module in _trl_modules(original_head):  # trl.trainer.utils and every trainer that imported it by name
        module.add_fused_lm_head = marked_head
    trainer = grpo_trainer.GRPOTrainer
    if not hasattr(trainer._compute_loss, "_fused_ce_original"):
        original = trainer._compute_loss

        def compute_loss(self, model, inputs):
            self._fused_ce_head = getattr(
                self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model,
                "_fused_ce_head",
                False,
            )
            return _compute_loss(self, model, inputs, _original=original)

        compute_loss._fused_ce_original = original
        trainer._compute_loss = compute_loss
    distillation = _distillation_module()
    if distillation is not None and not hasattr(distillation._chunked_divergence_loss, "_fused_ce_original"):

        def divergence(*args, **kwargs):
            return _divergence_loss(*args, **kwargs)

        divergence._fused_ce_original = distillation._chunked_divergence_loss
        distillation._chunked_divergence_loss = divergence
    gkd = _gkd_trainer()
    if gkd is not None:
        _unflag_gkd(gkd)
    return trainer


def restore():
    """Undo apply(): TRL's own fused LM head and GRPO loss (models patched meanwhile keep fused_ce's head)."""
    import trl.trainer.utils as utils
    from trl.trainer import grpo_trainer

    patched = getattr(utils, "add_fused_lm_head", None)
    original = getattr(patched, "_fused_ce_original", None)
    if original is not None:
        for module in _trl_modules(patched):
            module.add_fused_lm_head = original
    trainer = grpo_trainer.GRPOTrainer
    if hasattr(trainer._compute_loss, "_fused_ce_original"):
        trainer._compute_loss = trainer._compute_loss._fused_ce_original
    distillation = _distillation_module()
    if distillation is not None and hasattr(distillation._chunked_divergence_loss, "_fused_ce_original"):
        distillation._chunked_divergence_loss = distillation._chunked_divergence_loss._fused_ce_original
    gkd = _gkd_trainer()
    if gkd is not None and hasattr(gkd.__init__, "_fused_ce_original"):
        gkd.__init__ = gkd.__init__._fused_ce_original
