"""distill_loss's arguments: the kinds, their checks, the aggregation's config."""

from __future__ import annotations

import math
import numbers

import torch

from .._inputs import check_logits, check_temperature
from ..config import LossConfig

# The divergence over the whole vocabulary (one pass over both logits), or the teacher's log-ratio
# on the sampled tokens as a negative advantage of the policy loss (sampled.py).
FULL_DISTILL_KINDS = ("reverse_kl", "forward_kl", "jsd")
DISTILL_KINDS = (*FULL_DISTILL_KINDS, "sampled_reverse_kl")
DISTILL_BACKENDS = ("auto", "torch", "triton")


def resolved_kind(kind: str, beta: float) -> str:
    """jsd at beta = 0 / 1 is forward_kl / reverse_kl (TRL's endpoints; the mixture's logs would
    take log 0 there)."""
    if kind == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    return kind


def check_distill_args(kind: object, beta: object) -> float:
    if kind not in DISTILL_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {DISTILL_KINDS}")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta):
        raise ValueError(f"beta must be a finite number, got {beta!r}")
    if kind == "sampled_reverse_kl":
        if beta < 0:
            raise ValueError(f"beta (the teacher term's coefficient) must be >= 0, got {beta}")
    elif not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (the teacher's share of the mixture), got {beta}")
    return float(beta)


def check_sampled_args(kind: str, advantages: object, old_logp: object) -> None:
    """advantages / old_logp belong to kind="sampled_reverse_kl" (whose policy loss checks them)."""
    if kind == "sampled_reverse_kl":
        return
    for name, value in (("advantages", advantages), ("old_logp", old_logp)):
        if value is not None:
            raise ValueError(
                f"{name} is read only by kind='sampled_reverse_kl' (the policy loss with the "
                f"teacher's log-ratio in its advantages), got kind={kind!r}"
            )


def check_teacher(teacher_logits: object, student_logits: torch.Tensor) -> torch.Tensor:
    teacher_logits = check_logits(teacher_logits, name="teacher_logits")
    if tuple(teacher_logits.shape) != tuple(student_logits.shape):
        raise ValueError(
            f"teacher_logits shape {tuple(teacher_logits.shape)} must equal student_logits shape "
            f"{tuple(student_logits.shape)} (the same tokens over the same vocabulary)"
        )
    if teacher_logits.device != student_logits.device:
        raise ValueError(
            f"teacher_logits is on {teacher_logits.device} but student_logits are on "
            f"{student_logits.device}"
        )
    return teacher_logits.detach()


def distill_config(config: object) -> LossConfig:
    """The aggregation of the per-token divergence: config.agg / norm_constant (token-mean by
    default). The temperature is distill_loss's own argument."""
    cfg = config if config is not None else LossConfig()
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"config must be a fusedrl.LossConfig, got {type(cfg).__name__}")
    if cfg.temperature != 1.0:
        raise ValueError(
            f"config.temperature={cfg.temperature!r}: distill_loss takes its temperature as an "
            "argument (temperature=), not from the config"
        )
    return cfg


def checked_call(kind, temperature, backend, backends, advantages, old_logp, backend_note=""):
    """The checks distill_loss and linear_distill_loss share after beta's and their own: the
    temperature (a float checked; per-token ones are checked with the inputs), the backend among
    `backends`, advantages / old_logp only where read. Returns the temperature."""
    if not isinstance(temperature, torch.Tensor):
        temperature = check_temperature(temperature)
    if backend not in backends:
        raise ValueError(f"backend={backend!r} is not one of {backends}{backend_note}")
    check_sampled_args(kind, advantages, old_logp)
    return temperature
