"""On-policy distillation as a policy gradient: the teacher's log-ratio on the sampled tokens as a
negative advantage (`distill_loss(kind="sampled_reverse_kl")`).

On the student's own samples y_t, k_t = log pi_old(y_t) - log pi_teacher(y_t) is the per-token
(k1) estimate of KL(pi || pi_teacher) (pi_old: the policy that sampled, whose log-probs the
trainer has from the rollouts). Its negative, times `beta`, is added to each token's advantage,
and the policy loss of `config` (any preset: PPO clip, IS corrections, aggregation) trains on

    A'_t = A_t - beta k_t

so that an RL reward and the teacher's guidance share one loss and one read of the student's
logits (the teacher's are read once, without gradient, for log pi_teacher(y_t)). With no
`advantages` it is pure on-policy distillation (Agarwal et al. 2023's on-policy setting; the
per-token reverse-KL advantage of Thinking Machines' "On-Policy Distillation", 2025).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..arguments import ModelHead, RolloutInputs, checked_inputs
from ..config import LossConfig
from ..logit_transform import LogitTransform
from ..output import LossOutput
from ..token_terms import masked_mean


def shifted_advantage_loss(
    inp,
    beta: float,
    teacher_logp: Callable[[torch.Tensor], torch.Tensor],
    student_logp: Callable[[torch.Tensor], torch.Tensor],
    old_logp: torch.Tensor | None,
    policy_loss: Callable[[torch.Tensor], LossOutput],
) -> LossOutput:
    """The policy loss on A - beta (log pi_old - log pi_teacher) of the sampled tokens.

    `inp`: the policy loss's checked inputs (LossInputs); `teacher_logp(labels)` /
    `student_logp(labels)`: log-probs of the caller's-shaped labels without gradient (from
    logits or from a head); `policy_loss(advantages)`: the loss on the shifted advantages."""

    def unflat(t: torch.Tensor) -> torch.Tensor:  # [1, N] back to the caller's [N]
        return t[0] if inp.flat_input else t

    labels = unflat(inp.labels)
    with torch.no_grad():
        sampler = old_logp
        if sampler is None:  # on-policy: the student's own log-probs, one more read
            sampler = student_logp(labels)
        shifted, gap = teacher_shifted_advantages(
            unflat(inp.advantages), sampler, teacher_logp(labels), unflat(inp.valid), beta
        )
    out = policy_loss(shifted)
    out.metrics["distill"] = masked_mean(gap.reshape(inp.mask.shape), inp)
    return out


def teacher_shifted_advantages(
    advantages: torch.Tensor,
    sampler_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A - beta k, k) per token, k = log pi_old(y) - log pi_teacher(y) on the counted tokens
    (0 elsewhere): the advantages of on-policy distillation as a policy gradient, for a
    trainer that runs its own policy loss (fusedrl-train does). `advantages`: [B] or like the
    log-probs."""
    gap = torch.where(mask != 0, sampler_logp.float() - teacher_logp.float(), 0.0)
    if advantages.dim() < gap.dim():
        advantages = advantages.unsqueeze(-1)
    return advantages - beta * gap, gap


def check_sampled_config(cfg: object, temperature) -> LossConfig:
    """The policy loss's config at the distillation's temperature (per-token temperatures:
    left at 1, the tensor goes to the loss as its `temperature=`)."""
    cfg = cfg if cfg is not None else LossConfig()
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"config must be a fusedrl.LossConfig, got {type(cfg).__name__}")
    if isinstance(temperature, torch.Tensor):
        if cfg.temperature != 1.0:
            raise ValueError(
                f"temperature (per token) and config.temperature={cfg.temperature} are both "
                "set: pass one"
            )
        return cfg
    if cfg.temperature not in (1.0, temperature):
        raise ValueError(
            f"config.temperature={cfg.temperature!r} differs from temperature={temperature!r}: "
            "the student's and the teacher's log-probs are taken at one temperature"
        )
    return cfg.replace(temperature=temperature)


def sampled_reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    temperature: float,
    cfg: LossConfig,
    normalizer,
    inplace: bool,
    backend: str,
    advantages: torch.Tensor | None,
    old_logp: torch.Tensor | None,
    transform: LogitTransform | None = None,
    grad_scale=None,
) -> LossOutput:
    """`transform`: the soft cap both models' logits are read under (None: none);
    `grad_scale`: the policy loss's (`policy_loss`)."""
    import fusedrl.single_process as single_process

    if advantages is None:  # pure distillation
        advantages = torch.zeros(student_logits.shape[:-1], device=student_logits.device)
    # The policy loss's own checks (labels, mask, advantages, old_logp), before any kernel runs:
    # [B, T] tensors, masked labels made safe, per-sequence advantages broadcast.
    rollout, head = RolloutInputs(old_logp=old_logp), model_head(temperature, transform)
    inp = checked_inputs(student_logits, labels, advantages, mask, rollout, head, cfg, normalizer)
    temperature = checked_temperature(inp, temperature)

    def logprobs(logits, filters):
        return lambda labels: single_process.token_logprobs(
            logits, labels, temperature, backend=backend, **filters, transform=transform
        )[0]

    def loss(shifted):
        return single_process.policy_loss(
            student_logits,
            labels,
            shifted,
            mask,
            rollout,
            head,
            cfg,
            normalizer,
            inplace=inplace,
            backend=backend,
            grad_scale=grad_scale,
        )

    # The sampler's log-probs over the engine's sampled sets (as its old_logp are); the
    # teacher's over the whole vocabulary.
    return shifted_advantage_loss(
        inp,
        beta,
        logprobs(teacher_logits.detach(), {}),
        logprobs(student_logits.detach(), sampling_filters(cfg)),
        old_logp,
        loss,
    )


def model_head(temperature, transform) -> ModelHead:
    """The policy loss's model head: per-token temperatures (a float is in the config
    already) and the model's transform."""
    return ModelHead(temperature if isinstance(temperature, torch.Tensor) else None, transform)


def checked_temperature(inp, temperature):
    """Per-token temperatures as the policy loss checked them ([B, T] or the caller's [N];
    1 on masked tokens, whose rows the log-prob calls read too), or the float."""
    if inp.row_temps is None:
        return temperature
    return inp.row_temps[0] if inp.flat_input else inp.row_temps


def sampling_filters(cfg: LossConfig) -> dict:
    """The config's top_k / top_p / min_p, as keywords of the log-prob functions."""
    return {"top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p}
