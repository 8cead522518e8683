"""`TrainConfig`: every knob of a `fusedrl-train` run, loadable from YAML with CLI overrides.

The defaults are the embedded job (`fusedrl-train` with no arguments): a tiny random Qwen2 and the
built-in `sum` task on CPU, sized to raise the reward within minutes on 2 cores. A real run names
a model and a dataset and usually a YAML file (docs/trainer.md has one).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from fusedrl.config import PRESETS, LossConfig

ADVANTAGES = ("grpo", "dr_grpo", "lite_ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo",
              "dcpo_sas")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# LossConfig fields a run may override on top of its preset (None = the preset's value).
LOSS_OVERRIDES = ("eps_low", "eps_high", "dual_clip_c", "delta", "agg", "kl", "beta",
                  "entropy_coef", "is_correction", "is_cap", "is_cap_low")


@dataclass
class TrainConfig:
    # --- model and data -------------------------------------------------------------------
    model: str | None = None  # local path or hub id; None = build the tiny Qwen2 in OUT/base_model
    dataset: str | None = None  # .jsonl / .json / .parquet; None = the built-in `sum` task
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    system_prompt: str | None = None
    reward: str = "arith"  # comma list of name[=weight]: math, format, arith, or module:function
    max_prompt_tokens: int = 512  # longer prompts are rejected with the offending row named
    # --- rollouts -------------------------------------------------------------------------
    group_size: int = 8  # G completions per prompt
    prompts_per_step: int = 16  # summed over data-parallel ranks
    max_tokens: int = 6  # completion budget per sample (L_max)
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.3
    vllm_kv_cache_gb: float = 0.25  # KV cache size on a CPU engine
    vllm_sleep: bool = True  # free vLLM's GPU memory while training (GPU only)
    # --- algorithm ------------------------------------------------------------------------
    preset: str = "dapo"
    advantage: str = "grpo"
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
    lr: float | None = None  # None = 1e-6 for --model, 3e-3 for the built-in tiny model
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    skip_nonfinite_steps: int = 0  # updates with a NaN/inf loss or grad norm skipped before failing
    max_steps: int = 60
    seed: int = 0
    dtype: str = "auto"  # forward (autocast) and vLLM dtype; auto = bf16 on GPU, fp32 on CPU
    backend: str = "auto"  # fusedrl backend
    # --- output ---------------------------------------------------------------------------
    out: str = "runs/fusedrl"
    save_every: int = 20
    keep_last: int = 2
    resume: str | None = None  # a run directory (its latest checkpoint) or a checkpoint directory
    tensorboard: bool = True
    progress: bool = True

    def loss_config(self) -> LossConfig:
        overrides = {k: getattr(self, k) for k in LOSS_OVERRIDES if getattr(self, k) is not None}
        cfg = LossConfig.preset(self.preset, temperature=self.temperature, **overrides)
        if cfg.agg == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
            # Dr.GRPO divides by a constant: the generation budget.
            cfg = cfg.replace(norm_constant=float(self.max_tokens))
        return cfg

    def validate(self) -> TrainConfig:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {msg}")

        need(self.preset in PRESETS, "preset",
             f"unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        need(self.advantage in ADVANTAGES, "advantage",
             f"unknown advantage {self.advantage!r}; choose one of {list(ADVANTAGES)}")
        need(self.group_size >= 2, "group_size",
             f"must be >= 2 (group-relative advantages need two samples), got {self.group_size}")
        for name in ("prompts_per_step", "max_tokens", "max_steps", "ppo_epochs", "minibatches",
                     "max_num_gen_batches", "keep_last", "save_every", "max_prompt_tokens"):
            need(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_size", "warmup_steps", "overlong_buffer", "weight_decay",
                     "skip_nonfinite_steps"):
            need(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        need(self.overlong_buffer <= self.max_tokens, "overlong_buffer",
             f"must be <= max_tokens={self.max_tokens}, got {self.overlong_buffer}")
        need(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        need(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.lr is None or self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip}")
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        need(self.prompts_per_step * self.group_size >= self.minibatches, "minibatches",
             f"{self.minibatches} minibatches need at least as many sequences per step "
             f"(prompts_per_step x group_size = {self.prompts_per_step * self.group_size})")
        need(not (self.dupo and self.dynamic_sampling), "dupo",
             "DUPO refills the batch by duplication, dynamic sampling by oversampling: pick one")
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
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config {path}: expected a mapping of options, got {type(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--config {path}: unknown option(s) {unknown}")
        return cls(**data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)


def _field_type(f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(TrainConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else kind(text)

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusedrl-train",
        description="GRPO-family RL with vLLM rollouts and fusedrl's fused loss. With no "
        "arguments: a tiny random Qwen2 learns the built-in `sum` task on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of options; CLI flags override it")
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(f)
        parse = _parse_bool if kind is bool else kind
        if f.default is None:
            parse = _optional(kind)
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", dest=f.name, type=parse, default=argparse.SUPPRESS,
            help=f"(default: {f.default})", metavar=kind.__name__.upper(),
        )
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The run's config: defaults <- --config YAML <- CLI flags, validated."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config", None)
    cfg = TrainConfig.from_yaml(path) if path else TrainConfig()
    cfg = dataclasses.replace(cfg, **args)
    return cfg.validate()

