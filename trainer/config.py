"""`TrainConfig`: every knob of a `fusedrl-train` run, loadable from YAML with CLI overrides.

The defaults are the embedded job (`fusedrl-train` with no arguments): a tiny Llama, warm-started
on the built-in `sum` task, then trained by RL on it; sized to run within minutes on 2 CPU cores.
A real run names a model and a dataset and usually a YAML file (docs/trainer.md has one).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from fusedrl.backends import BACKENDS
from fusedrl.config import (
    AGGS,
    FULL_KLS,
    IS_CORRECTIONS,
    KL_ESTIMATORS,
    KLS,
    LOSSES,
    PRESETS,
    LossConfig,
)
from fusedrl.distill import DISTILL_KINDS
from fusedrl.packed import reads_logits_once

ADVANTAGES = (
    "grpo",
    "dr_grpo",
    "lite_ppo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "dcpo_sas",
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
ROLLOUTS = ("auto", "vllm", "hf")
# Adaptive entropy control's step and bounds when unset: TRL 1.16's GRPOConfig defaults.
ENTROPY_CONTROL_DEFAULTS = {
    "entropy_coef_delta": 0.005,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
}
# LossConfig fields a run may override on top of its preset (None = the preset's value).
LOSS_OVERRIDES = (
    "loss",
    "eps_low",
    "eps_high",
    "dual_clip_c",
    "delta",
    "agg",
    "kl",
    "beta",
    "entropy_coef",
    "is_correction",
    "is_cap",
    "is_cap_low",
    "kl_bias_correction",
    "off_policy_mask",
    "top_entropy_quantile",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "kl_cov_coef",
    "dppo_ratio_cap",
    "kl_tau",
    "decoupled_is_cap",
    "dro_beta",
    "rejection",
    "rejection_threshold",
    "trust_region_delta",
    "trust_region_mode",
    "m2po_tau",
)


def _reads_packed_rows_once(loss_config: LossConfig) -> bool:
    """Whether the packed loss of the trainer's calls (which hand the engine's log-probs: given,
    whatever they are) reads the logits once: then it takes the exact KL's reference logits."""
    return reads_logits_once(loss_config, rollout_logp=True, is_weights=None)


def _triton_installed() -> bool:
    from fusedrl import backends

    return backends.TRITON_INSTALLED  # looked up once, at fusedrl's import


# What a command does with its --out, or how it talks, not the job it trains: never saved in
# config.yaml (a config read back by --config or --resume overwrites, resumes or shows the
# libraries' logs only where its own command line asks for it).
PER_INVOCATION = ("overwrite", "resume", "verbose")


@dataclass
class TrainConfig:
    # --- model and data -------------------------------------------------------------------
    model: str | None = None  # local path or hub id; None = the tiny Llama in OUT/base_model
    dataset: str | None = None  # .jsonl / .json / .parquet; None = the built-in `sum` task
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    system_prompt: str | None = None
    reward: str = "arith"  # comma list of name[=weight]: math, format, arith, or module:function
    max_prompt_tokens: int = 512  # longer prompts are rejected with the offending row named
    warmstart_steps: int = 300  # supervised steps for the built-in tiny model (0 = random init)
    warmstart_noise: float = 0.6  # share of warm-start answers that run on past the sum
    # --- rollouts -------------------------------------------------------------------------
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # summed over data-parallel ranks
    max_tokens: int = 6  # completion budget per sample (L_max)
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gb: float = 0.25  # KV cache size on a CPU engine
    vllm_sleep: bool = True  # free vLLM's GPU memory while training (GPU only)
    rollout: str = "auto"  # vllm | hf (transformers generate) | auto: vllm when installed
    # --- algorithm ------------------------------------------------------------------------
    preset: str = "dapo"
    advantage: str = "grpo"
    loss: str | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip_c: float | None = None
    delta: float | None = None
    agg: str | None = None
    kl: str | None = None
    beta: float | None = None
    entropy_coef: float | None = None
    is_correction: str | None = None
    is_cap: float | None = None
    is_cap_low: float | None = None
    kl_bias_correction: bool | None = None
    off_policy_mask: float | None = None
    top_entropy_quantile: float | None = None
    vespo_k_pos: float | None = None
    vespo_lambda_pos: float | None = None
    vespo_k_neg: float | None = None
    vespo_lambda_neg: float | None = None
    clip_cov_ratio: float | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    kl_cov_ratio: float | None = None
    kl_cov_coef: float | None = None
    dppo_ratio_cap: float | None = None
    kl_tau: float | None = None
    decoupled: bool = False  # decoupled PPO: the recomputed log-probs are the proximal policy
    decoupled_is_cap: float | None = None
    dro_beta: float | None = None
    rejection: str | None = None
    rejection_threshold: str | None = None
    trust_region_delta: float | None = None
    trust_region_mode: str | None = None
    m2po_tau: float | None = None
    # adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy): None = off; the
    # other three unset: TRL's defaults (ENTROPY_CONTROL_DEFAULTS)
    entropy_target: float | None = None
    entropy_coef_delta: float | None = None
    entropy_coef_min: float | None = None
    entropy_coef_max: float | None = None
    # --- distillation ---------------------------------------------------------------------
    distill_teacher: str | None = None  # a local model directory (same vocabulary); None = off
    distill_kind: str = "reverse_kl"  # one of fusedrl.DISTILL_KINDS
    distill_coef: float = 1.0  # weight of the divergence (sampled_reverse_kl: of its advantage)
    distill_beta: float = 0.5  # jsd's teacher share of the mixture
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, oversample to refill
    max_num_gen_batches: int = 4  # oversampling rounds before training on what was kept
    dupo: bool = False  # DUPO: refill dropped groups by duplicating kept ones
    overlong_filter: bool = False  # mask truncated completions out of the loss
    overlong_buffer: int = 0  # L_cache of DAPO's soft overlong punishment (0 = off)
    overlong_penalty_factor: float = 1.0
    # --- optimisation ---------------------------------------------------------------------
    ppo_epochs: int = 1  # mu
    minibatches: int = 1  # optimizer steps per epoch
    micro_batch_size: int = 0  # sequences per forward/backward; 0 = the whole minibatch
    lr: float | None = None  # None = 1e-6 for --model, 2e-4 for the built-in tiny model
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    skip_nonfinite_steps: int = 0  # updates with a NaN/inf loss or grad norm skipped before failing
    max_steps: int = 60
    seed: int = 0
    dtype: str = "auto"  # forward (autocast) and vLLM dtype; auto = bf16 on GPU, fp32 on CPU
    backend: str = "auto"  # fusedrl backend
    fused_lm_head: bool = True  # loss from hidden states + LM head, no logits (plain heads)
    tp: int = 1  # tensor parallel ranks: the LM head split over the vocabulary (torchrun)
    pack: bool = False  # each micro-batch as one padding-free row (trainer/packing.py)
    max_tokens_per_microbatch: int | None = None  # with --pack: micro-batches by token budget
    # --- output ---------------------------------------------------------------------------
    out: str = "runs/fusedrl"
    save_every: int = 20
    keep_last: int = 2
    resume: str | None = None  # a run directory (its latest checkpoint) or a checkpoint directory
    overwrite: bool = False  # replace the run in --out (refused without it or --resume)
    tensorboard: bool = True
    progress: bool = True
    log_every: int = 10  # without a terminal: one progress line every N steps
    verbose: bool = False  # show vLLM's / transformers' own logs and warnings

    def loss_config(self) -> LossConfig:
        overrides = {k: getattr(self, k) for k in LOSS_OVERRIDES if getattr(self, k) is not None}
        if self.entropy_target is not None:
            # Adaptive entropy: the coefficient is the controller's device scalar, handed to the
            # loss each step (initial_entropy_coef), never a number in the config.
            overrides["entropy_coef"] = 0.0
        # The loss replays the rollouts' sampling mask: logp over the set vLLM sampled from.
        top_p = self.top_p if self.top_p < 1 else None
        cfg = LossConfig.preset(self.preset, temperature=self.temperature, top_p=top_p, **overrides)
        if cfg.agg == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
            # Dr.GRPO divides by a constant: the generation budget.
            cfg = cfg.replace(norm_constant=float(self.max_tokens))
        return cfg

    def entropy_control(self) -> tuple[float, float, float]:
        """(delta, min, max) of adaptive entropy control, TRL's defaults where unset."""
        return tuple(
            ENTROPY_CONTROL_DEFAULTS[name] if getattr(self, name) is None else getattr(self, name)
            for name in ENTROPY_CONTROL_DEFAULTS
        )

    def initial_entropy_coef(self) -> float:
        """The adaptive controller's starting coefficient: --entropy-coef, else the preset's."""
        if self.entropy_coef is not None:
            return self.entropy_coef
        return LossConfig.preset(self.preset).entropy_coef

    def validate(self) -> TrainConfig:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {msg}")

        need(
            self.preset in PRESETS,
            "preset",
            f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}",
        )
        need(self.kl is None or self.kl in KLS, "kl", f"one of {list(KLS)}, got {self.kl!r}")
        need(
            self.kl not in FULL_KLS or self.tp == 1,
            "kl",
            f"{self.kl!r} (the exact KL over the vocabulary) has no tensor-parallel path yet: use "
            f"--tp 1 or an estimator, one of {list(KL_ESTIMATORS)}",
        )
        need(
            self.kl not in FULL_KLS or self.backend != "cuda" or _triton_installed(),
            "kl",
            f"{self.kl!r} with --backend cuda runs Triton's two-row kernels, and triton is not "
            "installed: use --backend torch, or install triton",
        )
        need(
            self.distill_kind in DISTILL_KINDS,
            "distill_kind",
            f"one of {list(DISTILL_KINDS)}, got {self.distill_kind!r}",
        )
        need(self.distill_coef >= 0, "distill_coef", f"must be >= 0, got {self.distill_coef}")
        need(
            0 <= self.distill_beta <= 1,
            "distill_beta",
            f"must be in [0, 1], got {self.distill_beta}",
        )
        need(
            self.distill_teacher is None or self.tp == 1,
            "distill_teacher",
            "distillation has no tensor-parallel path yet: use --tp 1",
        )
        for ok, what in (
            (
                self.kl not in FULL_KLS or _reads_packed_rows_once(self.loss_config()),
                f"--kl {self.kl} and this loss (packed rows take the exact KL where the loss "
                "reads them once: token-level ratios, no sequence-level IS correction or "
                "rejection)",
            ),
        ):
            need(not self.pack or ok, "pack", f"not with {what}: drop --pack")
        budget = self.max_tokens_per_microbatch
        need(
            budget is None or (self.pack and budget >= 1),
            "max_tokens_per_microbatch",
            "is a packed micro-batch's token budget: needs --pack"
            if not self.pack
            else f"is a packed micro-batch's token budget: must be >= 1, got {budget}",
        )
        need(
            self.distill_teacher is None or self.backend != "cuda" or _triton_installed(),
            "distill_teacher",
            "with --backend cuda the divergence runs Triton's two-row "
            "kernels, and triton is not installed: use --backend torch, or install triton",
        )
        need(
            not self.decoupled or self.is_correction is None,
            "decoupled",
            "decoupled PPO's behaviour weight is the train/inference IS correction: drop "
            "--is-correction",
        )
        need(
            self.decoupled_is_cap is None or self.decoupled,
            "decoupled_is_cap",
            "is read by --decoupled only",
        )
        need(
            not self.decoupled or self.loss_config().loss != "gmpo",
            "decoupled",
            "gmpo weighs whole sequences, where decoupled PPO's proximal policy weighs tokens: "
            "use another loss, or drop --decoupled",
        )
        need(
            self.rollout != "vllm" or importlib.util.find_spec("vllm") is not None,
            "rollout",
            "vllm is not installed: use --rollout hf (transformers' generate) or auto",
        )
        need(
            not self.decoupled or self.tp == 1,
            "decoupled",
            "the proximal log-probs (prox_logp) have no tensor-parallel path yet: use --tp 1",
        )
        for name in ENTROPY_CONTROL_DEFAULTS:
            need(
                getattr(self, name) is None or self.entropy_target is not None,
                name,
                "is read by --entropy-target only (adaptive entropy control)",
            )
        if self.entropy_target is not None:
            delta, low, high = self.entropy_control()
            need(
                self.entropy_target >= 0,
                "entropy_target",
                f"must be >= 0 (nats per token), got {self.entropy_target}",
            )
            need(delta > 0, "entropy_coef_delta", f"must be > 0, got {delta}")
            need(high >= 0, "entropy_coef_max", f"must be >= 0, got {high}")
            need(
                0 <= low <= high,
                "entropy_coef_min",
                f"must be in [0, --entropy-coef-max={high}], got {low}",
            )
            start = self.initial_entropy_coef()
            need(
                low <= start <= high,
                "entropy_coef",
                f"the adaptive coefficient starts at {start}, outside [--entropy-coef-min, "
                f"--entropy-coef-max] = [{low}, {high}]",
            )
            need(
                self.tp == 1,
                "entropy_target",
                "the coefficient as a device scalar has no tensor-parallel path yet: use --tp 1",
            )
        need(
            self.advantage in ADVANTAGES,
            "advantage",
            f"unknown advantage {self.advantage!r}; choose one of {list(ADVANTAGES)}",
        )
        need(
            self.group_size >= 2,
            "group_size",
            f"must be >= 2 (group-relative advantages need two samples), got {self.group_size}",
        )
        for name in (
            "prompts_per_step",
            "max_tokens",
            "max_steps",
            "ppo_epochs",
            "minibatches",
            "max_num_gen_batches",
            "keep_last",
            "save_every",
            "max_prompt_tokens",
            "log_every",
        ):
            need(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "micro_batch_size",
            "warmup_steps",
            "overlong_buffer",
            "weight_decay",
            "skip_nonfinite_steps",
            "warmstart_steps",
        ):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(
            self.overlong_buffer <= self.max_tokens,
            "overlong_buffer",
            f"must be <= max_tokens={self.max_tokens}, got {self.overlong_buffer}",
        )
        need(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        need(
            0 <= self.warmstart_noise < 1,
            "warmstart_noise",
            f"must be in [0, 1), got {self.warmstart_noise}",
        )
        need(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.lr is None or self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        need(
            self.rollout in ROLLOUTS, "rollout", f"must be one of {ROLLOUTS}, got {self.rollout!r}"
        )
        need(
            self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {self.backend!r}"
        )
        need(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        need(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        need(
            self.vllm_kv_cache_gb > 0,
            "vllm_kv_cache_gb",
            f"must be > 0 (GB), got {self.vllm_kv_cache_gb}",
        )
        # What fusedrl's tensor-parallel loss has no path for yet (docs/tensor_parallel.md).
        need(
            self.tp == 1 or self.backend != "cuda",
            "tp",
            "--backend cuda has no tensor-parallel path: use auto, triton or torch",
        )
        need(
            self.prompts_per_step * self.group_size >= self.minibatches,
            "minibatches",
            f"{self.minibatches} minibatches need at least as many sequences per step "
            f"(prompts_per_step x group_size = {self.prompts_per_step * self.group_size})",
        )
        need(
            not (self.dupo and self.dynamic_sampling),
            "dupo",
            "DUPO refills the batch by duplication, dynamic sampling by oversampling: pick one",
        )
        need(bool(self.reward.strip()), "reward", "at least one reward function is required")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                need(math.isfinite(value), f.name, f"must be a finite number, got {value}")
        for item in filter(None, (part.strip() for part in self.reward.split(","))):
            weight = item.partition("=")[2]
            try:
                finite = not weight or math.isfinite(float(weight))
            except ValueError:
                finite = False
            need(finite, "reward", f"{item!r}: the weight must be a finite number")
        try:
            self.loss_config()
        except ValueError as exc:
            raise ValueError(f"loss options (--preset {self.preset} + overrides): {exc}") from None
        return self

    # --- YAML / CLI -----------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        if not Path(path).exists() or Path(path).is_dir():  # (a pipe is fine: <(...))
            raise FileNotFoundError(f"--config {path}: no such file")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"--config {path}: not valid YAML{at}: {problem}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config {path}: expected a mapping of options, got {type(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        # A run's saved config.yaml from before these were left out of it: they are actions of
        # the command that wrote it, not options of the job.
        data = {k: v for k, v in data.items() if k not in PER_INVOCATION}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--config {path}: unknown option(s) {unknown}")
        try:
            return cls(**{name: coerce(name, value) for name, value in data.items()})
        except ValueError as exc:
            raise ValueError(f"--config {path}: {exc}") from None

    def to_yaml(self) -> str:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in PER_INVOCATION}
        return yaml.safe_dump(data, sort_keys=False)


# One sentence per option for --help (tests/test_trainer_units.py checks every field has one).
HELP = {
    "model": "Local path or hub id of the policy; unset: a tiny warm-started Llama in "
    "OUT/base_model.",
    "dataset": "A .jsonl, .json or .parquet file of prompts; unset: the built-in `sum` task.",
    "prompt_column": "Dataset column of the prompt (text, or a list of role/content messages).",
    "answer_column": "Dataset column handed to reward functions as the reference answer "
    "(empty: the data has none; no accuracy is logged).",
    "system_prompt": "A system message prepended to every chat prompt.",
    "reward": "Comma list of name[=weight]: math, format, arith, or module:function.",
    "max_prompt_tokens": "Longest prompt accepted; a longer one is an error naming its row.",
    "warmstart_steps": "Supervised warm-start steps of the built-in tiny model on the built-in "
    "task (0: RL from random weights); ignored with --model or --dataset.",
    "warmstart_noise": "Share of warm-start answers that run on after the sum, in [0, 1).",
    "group_size": "Completions sampled per prompt (G, at least 2).",
    "prompts_per_step": "Prompts per optimizer step, summed over data-parallel ranks.",
    "max_tokens": "Completion budget per sample, in tokens.",
    "temperature": "Sampling temperature; the loss divides the logits by the same value.",
    "top_p": "Nucleus sampling threshold in (0, 1].",
    "gpu_memory_utilization": "Share of GPU memory vLLM may take.",
    "vllm_kv_cache_gb": "KV-cache size of a CPU vLLM engine, in GB.",
    "vllm_sleep": "Free vLLM's GPU memory while training (GPU only).",
    "rollout": f"Rollout engine, one of {list(ROLLOUTS)} (auto: vllm when it is installed, "
    "else hf, transformers' generate).",
    "preset": f"Loss preset, one of {sorted(PRESETS)}.",
    "advantage": f"Advantage estimator, one of {list(ADVANTAGES)}.",
    "eps_low": "Lower clip range; unset: the preset's.",
    "eps_high": "Upper clip range (clip-higher); unset: the preset's.",
    "dual_clip_c": "Dual-clip cap for negative advantages (> 1); unset: the preset's.",
    "delta": "Upper cap of the unclipped ratio (> 1 + eps_high); unset: the preset's.",
    "agg": f"Loss aggregation, one of {list(AGGS)}; unset: the preset's.",
    "kl": f"KL to the reference: an estimator from the sampled token, one of "
    f"{list(KL_ESTIMATORS)}, or the exact KL over the vocabulary, {list(FULL_KLS)} (the "
    "reference's logits made a micro-batch at a time); unset: the preset's.",
    "beta": "KL coefficient (a reference model is kept when > 0); unset: the preset's.",
    "entropy_coef": "Entropy bonus coefficient; unset: the preset's.",
    "is_correction": f"Train/inference IS correction, one of {list(IS_CORRECTIONS)}; unset: off.",
    "is_cap": "Upper bound of the IS weights; unset: the preset's (2).",
    "is_cap_low": "Lower bound of the IS weights; unset: 1 / is_cap for the mask modes.",
    "kl_bias_correction": "Multiply the KL term by the ratio pi / pi_old (DeepSeek-V3.2); "
    "unset: off.",
    "off_policy_mask": "DeepSeek-V3.2's off-policy sequence mask: negative-advantage sequences "
    "whose mean log-prob gap to vLLM's exceeds this do not train; unset: off.",
    "top_entropy_quantile": "Only the top share of tokens by entropy (within each micro-batch) "
    "train, in [0, 1]; unset: 1, all.",
    "vespo_k_pos": "VESPO's gamma shape k for A >= 0 (--preset vespo); unset: 2.",
    "vespo_lambda_pos": "VESPO's gamma rate lambda for A >= 0; unset: 3.",
    "vespo_k_neg": "VESPO's gamma shape k for A < 0; unset: 3.",
    "vespo_lambda_neg": "VESPO's gamma rate lambda for A < 0; unset: 2.",
    "loss": f"The objective, one of {list(LOSSES)}, in place of the preset's (its clip range, "
    "aggregation and KL stay); unset: the preset's.",
    "clip_cov_ratio": "Clip-Cov (--loss clip_cov): share of tokens drawn among the covariance "
    "outliers to get no gradient; unset: 0.0002.",
    "clip_cov_lb": "Clip-Cov: lower covariance bound of the candidates; unset: 1.",
    "clip_cov_ub": "Clip-Cov: upper covariance bound of the candidates; unset: 5.",
    "kl_cov_ratio": "KL-Cov (--loss kl_cov): share of tokens of largest covariance that get the "
    "|log ratio| penalty; unset: 0.0002.",
    "kl_cov_coef": "KL-Cov: coefficient of the |log ratio| penalty; unset: 0.1.",
    "dppo_ratio_cap": "DPPO (--loss dppo_tv / dppo_kl): cap of the detached ratio; unset: 3 "
    "(--eps-low / --eps-high are then the trust region's thresholds).",
    "kl_tau": "DPPO (--loss dppo_tv / dppo_kl): coefficient of prime-rl's kl_tau (log ratio)^2 on "
    "every counted token; unset: 0 (off).",
    "decoupled": "Decoupled PPO (AReaL): the ratio and its clip against the policy before the "
    "update (recomputed), each token weighted by its ratio to the engine's (behaviour) policy "
    "(fusedrl's prox_logp=); exclusive with --is-correction.",
    "decoupled_is_cap": "Decoupled PPO: tokens whose behaviour weight exceeds this (> 1) get "
    "weight 0 (AReaL's behav_imp_weight_cap); unset: no cap.",
    "dro_beta": "DRO (--loss dro): coefficient of the (log ratio)^2 / 2 penalty, required.",
    "rejection": "verl's rollout rejection sampling against vLLM's log-probs: comma-chained "
    "options token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3; unset: off.",
    "rejection_threshold": "Thresholds of --rejection in verl's format: one, or one per option "
    "(k1: a ratio range 'lower_upper' or t for [1/t, t]; k2 / k3: an upper bound).",
    "distill_teacher": "On-policy distillation: a local model directory (the same vocabulary) "
    "whose next-token distribution the policy is trained toward on its own samples, beside the "
    "RL loss; unset: off.",
    "distill_kind": f"The teacher term, one of {list(DISTILL_KINDS)}: a divergence over the "
    "whole vocabulary added to the loss, or sampled_reverse_kl, the teacher's log-ratio on the "
    "sampled tokens subtracted from the advantages (fusedrl.distill_loss).",
    "distill_coef": "Weight of the teacher term (sampled_reverse_kl: of its advantage shift).",
    "distill_beta": "jsd's teacher share of the mixture, in [0, 1] (0: forward_kl, 1: reverse_kl).",
    "trust_region_delta": "Trust-region sequence masking (arXiv 2512.23075): a sequence whose "
    "log-ratio to vLLM's log-probs leaves [-delta, delta] is dropped; unset: off.",
    "trust_region_mode": "Where --trust-region-delta looks: max (any token) or mean (the "
    "sequence's mean); unset: max.",
    "m2po_tau": "M2PO (AReaL): the tokens of largest (log ratio)^2 leave the loss until the "
    "rest's mean is below this; unset: off.",
    "entropy_target": "Adaptive entropy control (Skywork-OR1, TRL's use_adaptive_entropy): the "
    "entropy coefficient (starting at --entropy-coef) grows by --entropy-coef-delta after each "
    "optimizer step whose mean token entropy is at or below this (nats), shrinks otherwise, and "
    "applies only while the entropy is at or below it; unset: off.",
    "entropy_coef_delta": "Adaptive entropy control: the coefficient's change per optimizer step; "
    "unset: 0.005 (TRL's).",
    "entropy_coef_min": "Adaptive entropy control: the coefficient's lower bound; unset: 0.",
    "entropy_coef_max": "Adaptive entropy control: the coefficient's upper bound; unset: 1.",
    "dynamic_sampling": "DAPO: drop zero-variance groups and oversample to refill the batch.",
    "max_num_gen_batches": "Oversampling rounds of dynamic sampling before training anyway.",
    "dupo": "DUPO: refill dropped groups by duplicating kept ones.",
    "overlong_filter": "Mask truncated completions out of the loss.",
    "overlong_buffer": "DAPO's soft overlong punishment window in tokens (0: off).",
    "overlong_penalty_factor": "Largest soft overlong punishment.",
    "ppo_epochs": "Passes over each batch (mu).",
    "minibatches": "Optimizer steps per pass.",
    "micro_batch_size": "Sequences per forward/backward (0: the whole minibatch).",
    "lr": "AdamW learning rate; unset: 1e-6 with --model, 2e-4 for the built-in tiny model.",
    "weight_decay": "AdamW weight decay.",
    "warmup_steps": "Linear learning-rate warm-up steps.",
    "grad_clip": "Gradient-norm clip (0: off).",
    "skip_nonfinite_steps": "Updates with a NaN/inf loss or gradient norm skipped before failing.",
    "max_steps": "Optimizer steps of the run.",
    "seed": "Seed of the prompt stream, sampling and model initialisation.",
    "dtype": f"Compute dtype, one of {list(DTYPES)} (auto: bf16 on GPU, fp32 on CPU).",
    "backend": f"fusedrl loss backend, one of {list(BACKENDS)}.",
    "fused_lm_head": "Compute the loss from the hidden states and the LM head, never the "
    "[tokens x vocab] logits (fusedrl.linear_policy_loss), when the head is a plain linear "
    "layer and FSDP does not shard it (one data-parallel rank); --no-fused-lm-head "
    "materialises the logits.",
    "pack": "Run each micro-batch as one padding-free row: the sequences laid end to end, "
    "attention kept within each (flash attention from the position ids; sdpa / eager through a "
    "block-diagonal mask of N^2 elements), logits only where the loss reads them, the loss on "
    "packed rows (cu_seqlens); the old / reference log-prob passes too.",
    "max_tokens_per_microbatch": "With --pack: build each micro-batch from consecutive "
    "sequences while their prompt and completion tokens fit this budget (a longer sequence "
    "alone), in place of --micro-batch-size sequences. Under sdpa / eager a packed row's "
    "attention mask costs N^2: a budget keeps N small.",
    "tp": "Tensor-parallel ranks (under torchrun; must divide the world size): the LM head is "
    "split over the vocabulary on each group of tp ranks, the rest replicated on them, FSDP2 "
    "over the world / tp data-parallel ranks.",
    "out": "Run directory (metrics, checkpoints, plots, final_model).",
    "save_every": "Checkpoint every N steps (and at the last step).",
    "keep_last": "Checkpoints kept.",
    "resume": "A run directory (its latest checkpoint) or a checkpoint directory to resume from.",
    "overwrite": "Replace the run already in --out (without it, or --resume, that is refused).",
    "tensorboard": "Write TensorBoard logs under OUT/tensorboard.",
    "progress": "Show a progress bar (on a terminal) or progress lines (in a log).",
    "log_every": "Steps between progress lines when the output is not a terminal.",
    "verbose": "Show vLLM's, transformers' and torch's own logs and warnings.",
}


def _field_type(f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(TrainConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def _optional(f: dataclasses.Field) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(TrainConfig)[f.name])


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def coerce(name: str, value: object):
    """`value` (from YAML or the command line) as the type of TrainConfig field `name`: "1e-6" and
    1 become floats, "8" and 8.0 ints, "false" and "no" False; anything else is a ValueError naming
    the option. YAML reads 1e-6 as text and "false" as a truthy string: both mean what they say."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if name not in fields:
        raise ValueError(f"unknown option {name!r}")
    f, flag = fields[name], "--" + name.replace("_", "-")
    kind = _field_type(f)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if _optional(f):
            return None
        raise ValueError(f"{flag}: a value is required (it has no unset state)")
    text = value.strip() if isinstance(value, str) else None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{flag}: expected true or false, got {value!r}")
    if kind is int:
        number = value
        if text is not None:
            try:
                number = float(text) if any(c in text.lower() for c in ".e") else int(text)
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"{flag}: expected an integer, got {value!r}")
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(f"{flag}: expected an integer, got {value!r}")
        return int(number)
    if kind is float:
        number = value
        if text is not None:
            try:
                number = float(text)
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError(f"{flag}: expected a number, got {value!r}")
        return float(number)
    if not isinstance(value, str):
        raise ValueError(f"{flag}: expected text, got {type(value).__name__} {value!r}")
    return value


class _SuggestingParser(argparse.ArgumentParser):
    """argparse that names the closest flag to a mistyped one ("did you mean --max-steps?")."""

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}{self._suggestions(unknown)}")
        return parsed

    def _suggestions(self, unknown: list[str]) -> str:
        flags = [option for option in self._option_string_actions if option.startswith("--")]
        hints = []
        for token in unknown:
            if token.startswith("--"):
                close = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1, cutoff=0.6)
                hints += [f"{token.split('=', 1)[0]} -> did you mean {close[0]}?"] if close else []
        return f" ({'; '.join(hints)})" if hints else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _SuggestingParser(
        prog="fusedrl-train",
        # A prefix is not a flag: "--max-step" is a typo to name, not --max-steps to guess (and
        # a flag added later would change what an old command line meant).
        allow_abbrev=False,
        description="GRPO-family RL with vLLM rollouts and fusedrl's fused loss. With no "
        "arguments: a tiny Llama, warm-started, learns the built-in `sum` task on CPU.",
    )
    parser.add_argument("--config", help="YAML file of options; flags given here override it.")
    parser.add_argument(
        "--allow-job-change",
        action="store_true",
        default=argparse.SUPPRESS,
        help="With --resume: accept flags that change the job (model, dataset, "
        "reward, preset, advantage, group size, seed).",
    )
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(f)
        flag = "--" + f.name.replace("_", "-")
        default = "unset" if f.default is None else f.default
        help_text = f"{HELP[f.name]} (default: {default})"

        def parse(text: str, name: str = f.name):
            try:
                return coerce(name, text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

        if kind is bool:  # --flag, --flag false, --no-flag
            parser.add_argument(
                flag,
                dest=f.name,
                nargs="?",
                const=True,
                type=parse,
                default=argparse.SUPPRESS,
                metavar="BOOL",
                help=help_text,
            )
            parser.add_argument(
                f"--no-{f.name.replace('_', '-')}",
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,
                help=f"Same as {flag} false.",
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=parse,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=kind.__name__.upper(),
            )
    return parser


# Options that define the job: resuming a run with another value trains a different job on its
# weights, optimizer state and data cursor, so it takes --allow-job-change.
JOB_OPTIONS = (
    "model",
    "dataset",
    "prompt_column",
    "answer_column",
    "reward",
    "preset",
    "advantage",
    "group_size",
    "seed",
    "distill_teacher",
    "distill_kind",
    # the base model's (a run dir's base_model was warm-started with them: config.yaml says
    # what it holds) and the prompts' own text
    "warmstart_steps",
    "warmstart_noise",
    "system_prompt",
)


# Options that name a local file or folder: kept absolute in the run's config.yaml, so that
# --resume works from any working directory (the model's only where it is a local folder: else
# it is a hub id).
LOCAL_PATH_OPTIONS = ("model", "dataset", "distill_teacher")


def _absolute_paths(options: dict) -> dict:
    """`options` (by name) with each existing local path of LOCAL_PATH_OPTIONS made absolute
    from the working directory; a path that does not exist stays as typed (its error names it
    so, or it is a hub id)."""
    fixed = dict(options)
    for name in LOCAL_PATH_OPTIONS:
        value = fixed.get(name)
        if not isinstance(value, str) or not value:
            continue
        path = os.path.expanduser(value)
        # a model is a folder (a file named like a hub id is not taken for it); data a file
        if os.path.isfile(path) if name == "dataset" else os.path.isdir(path):
            fixed[name] = os.path.abspath(path)
    return fixed


def resumed_run_dir(resume: str) -> Path:
    """The run directory of --resume (a run directory, or one of its checkpoints)."""
    path = Path(resume)
    if (path / "trainer_state.json").exists() and path.parent.name == "checkpoints":
        return path.parent.parent
    return path


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The run's config: defaults <- --config YAML <- CLI flags, typed and validated before any
    model or engine starts. With --resume RUN (and no --config), RUN's own config.yaml is the
    base: a resumed run continues the same job, in its own directory unless --out says otherwise,
    and a flag that would change the job is refused without --allow-job-change."""
    args = _absolute_paths(vars(build_parser().parse_args(argv)))
    path = args.pop("config", None)
    allow_change = args.pop("allow_job_change", False)
    if path:
        cfg = TrainConfig.from_yaml(path)
        paths = {name: getattr(cfg, name) for name in LOCAL_PATH_OPTIONS}
        cfg = dataclasses.replace(cfg, **_absolute_paths(paths))
    elif args.get("resume"):
        run = resumed_run_dir(args["resume"])
        saved = run / "config.yaml"
        if not saved.exists():
            raise ValueError(
                f"--resume {args['resume']}: {saved} is missing, so the job to "
                "continue is unknown; pass its options with --config run.yaml"
            )
        cfg = dataclasses.replace(TrainConfig.from_yaml(saved), out=str(run))
        if not allow_change:
            _refuse_job_change(cfg, args, args["resume"])
    else:
        cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, **args)
    if path and cfg.resume and "out" not in args and cfg.out == TrainConfig.out:
        # a --config that names no --out continues the resumed run in its own directory, as
        # --resume alone does (not in a copy under the default --out)
        cfg = dataclasses.replace(cfg, out=str(resumed_run_dir(cfg.resume)))
    if path and cfg.resume and not allow_change:  # the --config file must continue that job too
        saved = resumed_run_dir(cfg.resume) / "config.yaml"
        if saved.exists():
            _refuse_job_change(TrainConfig.from_yaml(saved), dataclasses.asdict(cfg), cfg.resume)
    return cfg.validate()


def _refuse_job_change(saved: TrainConfig, new: dict, resume: str) -> None:
    """ValueError when `new` (options by name) changes the job `saved` (a run's config) trains.
    Local paths compare absolute (a run saved before they were kept so holds them as typed)."""
    old = _absolute_paths({name: getattr(saved, name) for name in JOB_OPTIONS})
    # (the warm start builds the tiny model of the built-in task alone: with --model or
    # --dataset its options change nothing)
    warm = saved.model is None and saved.dataset is None
    changed = {
        name: (getattr(saved, name), new[name])
        for name in JOB_OPTIONS
        if name in new and new[name] != old[name] and (warm or not name.startswith("warmstart_"))
    }
    if changed:
        listed = ", ".join(
            f"--{k.replace('_', '-')} {old!r} -> {value!r}" for k, (old, value) in changed.items()
        )
        raise ValueError(
            f"--resume {resume}: {listed} would change the job this run trains; "
            "pass --allow-job-change if that is intended"
        )
