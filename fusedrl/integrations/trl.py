"""Drop-in for TRL's `GRPOTrainer`: the same training numbers, without fp32 copies of the logits.

    from fusedrl.integrations.trl import FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

`FusedGRPOTrainer` changes two methods of `trl.GRPOTrainer` and nothing else:

- `_get_per_token_logps_and_entropies` (old / reference / current log-probs): the completion
  logits of the model are handed to `fusedrl.token_logprobs` as a strided view, so no fp32 copy
  of [B, T, V] is made;
- `_compute_loss`: the whole GRPO-family loss (ratio, clipping, KL, IS correction, aggregation)
  is `fusedrl.policy_loss` on those logits, with the config from `loss_config_from_trl(args)` and
  TRL's own normaliser (`num_items_in_batch` for dapo/cispo, the sequence count for grpo/sapo/
  dr_grpo, gradient-accumulation scaling as TRL does it).

Generation, rewards, advantages, logging and vLLM handling stay TRL's. A TRL option whose
semantics fusedrl does not reproduce raises a ValueError naming it (`UNSUPPORTED`).
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

import fusedrl
from fusedrl import LossConfig

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
# TRL options (name -> the value under which fusedrl reproduces TRL exactly).
UNSUPPORTED = {
    "top_entropy_quantile": 1.0,
    "off_policy_mask_threshold": None,
    "use_adaptive_entropy": False,
    "entropy_coef": 0.0,
}
# TRL's cispo caps the IS ratio at epsilon_high with no lower bound: fusedrl's cispo bounds are
# [1 - eps_low, 1 + eps_high], so eps_low just below 1 leaves the lower side open.
_OPEN_LOWER_BOUND = 1.0 - 1e-12


def loss_config_from_trl(args: GRPOConfig) -> LossConfig:
    """The LossConfig that reproduces `GRPOTrainer._compute_loss` for these TRL arguments."""
    for name, neutral in UNSUPPORTED.items():
        value = getattr(args, name, neutral)
        if value != neutral:
            raise ValueError(
                f"GRPOConfig.{name}={value!r} is not supported by fusedrl's TRL integration "
                f"(supported: {name}={neutral!r})"
            )
    if args.beta != 0.0 and getattr(args, "use_bias_correction_kl", False):
        raise ValueError(
            "GRPOConfig.use_bias_correction_kl=True (KL multiplied by the IS ratio) with beta > 0 "
            "is not supported by fusedrl's TRL integration; set use_bias_correction_kl=False"
        )
    loss_type = args.loss_type
    if loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"GRPOConfig.loss_type={loss_type!r} is not supported by fusedrl's TRL integration; "
            f"supported: {SUPPORTED_LOSS_TYPES}"
        )
    level = args.importance_sampling_level
    if level not in ("token", "sequence"):
        raise ValueError(f"GRPOConfig.importance_sampling_level={level!r} is not supported")
    if level == "sequence" and loss_type not in ("grpo", "sapo"):
        raise ValueError(
            f"GRPOConfig.importance_sampling_level='sequence' with loss_type={loss_type!r}: "
            "fusedrl supports sequence-level ratios with loss_type 'grpo' (GSPO)"
        )
    if level == "sequence" and loss_type == "sapo":
        raise ValueError(
            "GRPOConfig.loss_type='sapo' with importance_sampling_level='sequence' "
            "is not supported by fusedrl"
        )
    eps_low = args.epsilon
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    kl = "k3" if args.beta != 0.0 else None
    common = dict(temperature=args.temperature, beta=args.beta, kl=kl)
    if loss_type == "cispo":
        if eps_high <= 1.0:
            raise ValueError(
                f"GRPOConfig.epsilon_high={eps_high!r}: TRL's cispo uses it as the absolute cap of "
                "the IS ratio, so it must be > 1"
            )
        return LossConfig(
            loss="cispo",
            eps_low=_OPEN_LOWER_BOUND,
            eps_high=eps_high - 1.0,
            agg="token-mean",
            **common,
        )
    if loss_type == "sapo":
        return LossConfig(
            loss="sapo",
            sapo_tau_pos=args.sapo_temperature_pos,
            sapo_tau_neg=args.sapo_temperature_neg,
            agg="seq-mean-token-mean",
            **common,
        )
    agg = {
        "grpo": "seq-mean-token-mean",
        "bnpo": "token-mean",
        "dapo": "token-mean",
        "dr_grpo": "seq-mean-token-sum-norm",
    }[loss_type]
    extra: dict[str, Any] = {}
    if loss_type == "dr_grpo":
        extra["norm_constant"] = float(args.max_completion_length)
    return LossConfig(
        loss="ppo",
        ratio_level=level,
        eps_low=eps_low,
        eps_high=eps_high,
        delta=args.delta,
        agg=agg,
        **extra,
        **common,
    )


class FusedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with per-token log-probs and the loss from fusedrl's fused kernels."""

    def __init__(self, *args: Any, fused_backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_config = loss_config_from_trl(self.args)
        self.fused_backend = fused_backend

    # -------------------------------------------------------------------------- logits
    def _completion_logits(self, model, input_ids, attention_mask, logits_to_keep):
        """[B, T, V] logits predicting the completion tokens: a view, never an fp32 copy."""
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=logits_to_keep + 1,
            )
        return outputs.logits[:, :-1][:, -logits_to_keep:]

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal: Any,
    ):
        if any(v is not None for v in multimodal.values()) or compute_aux_loss:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            logits = self._completion_logits(
                model, input_ids[rows], attention_mask[rows], logits_to_keep
            )
            logp, entropy = fusedrl.token_logprobs(
                logits,
                input_ids[rows, -logits_to_keep:],
                temperature=self.temperature,
                return_entropy=compute_entropy,
                backend=self.fused_backend,
            )
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # -------------------------------------------------------------------------- loss
    def _normalizer(self, inputs, batch: int):
        """TRL's denominators: global token count (dapo/cispo) or all B sequences (grpo, sapo,
        dr_grpo; TRL averages over every sequence, empty ones included)."""
        loss_type = self.loss_type
        if loss_type in ("dapo", "cispo"):
            return inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if loss_type == "bnpo":
            return None
        return float(batch)

    def _compute_loss(self, model, inputs):
        if self.aux_loss_enabled or any(
            inputs.get(k) is not None
            for k in ("pixel_values", "image_grid_thw", "token_type_ids", "mm_token_type_ids")
        ):
            raise ValueError("FusedGRPOTrainer supports text-only models without router aux loss")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        logits = self._completion_logits(model, input_ids, attention_mask, logits_to_keep)

        is_weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_weights = inputs["importance_sampling_ratio"]
        out = fusedrl.policy_loss(
            logits,
            completion_ids,
            inputs["advantages"],
            mask,
            old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            config=self.fused_config,
            normalizer=self._normalizer(inputs, completion_ids.size(0)),
            is_weights=is_weights,
            return_entropy=True,
            backend=self.fused_backend,
        )
        mode = "train" if self.model.training else "eval"
        loss = out.loss
        if self.loss_type not in ("dapo", "cispo") and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._log_fused_metrics(mode, out, mask)
        return loss

    def _log_fused_metrics(self, mode: str, out, mask) -> None:
        """TRL's metric names, from the fused outputs (the means are local to this process)."""
        metrics = self._metrics[mode]
        gather = self.accelerator.gather

        def mean(value):
            return gather(value.detach().reshape(1)).float().mean().item()

        metrics["entropy"].append(mean(out.metrics["entropy"]))
        if self.beta != 0.0:
            metrics["kl"].append(mean(out.metrics["kl"]))
        if self.loss_type == "cispo":
            metrics["cispo_clip_ratio"].append(mean(out.metrics["clip_high"]))
        elif self.loss_type != "sapo":
            metrics["clip_ratio/low_mean"].append(mean(out.metrics["clip_low"]))
            metrics["clip_ratio/high_mean"].append(mean(out.metrics["clip_high"]))
            metrics["clip_ratio/region_mean"].append(mean(out.metrics["clipfrac"]))
