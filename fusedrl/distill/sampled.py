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

import torch

from ..config import LossConfig
from ..output import LossOutput


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
) -> LossOutput:
    from ..api import policy_loss, token_logprobs

    if cfg.temperature not in (1.0, temperature):
        raise ValueError(
            f"config.temperature={cfg.temperature!r} differs from temperature={temperature!r}: "
            "the student's and the teacher's log-probs are taken at one temperature"
        )
    cfg = cfg.replace(temperature=temperature)
    valid = mask.detach() != 0 if isinstance(mask, torch.Tensor) else mask
    safe_labels = torch.where(valid, labels, 0) if isinstance(labels, torch.Tensor) else labels
    fused = "auto" if backend == "auto" else backend
    with torch.no_grad():
        teacher_logp, _ = token_logprobs(
            teacher_logits.detach(), safe_labels, temperature, backend=fused
        )
        sampler = old_logp
        if sampler is None:  # on-policy: the student's own log-probs, one more read
            sampler, _ = token_logprobs(
                student_logits.detach(), safe_labels, temperature, backend=fused
            )
        gap = torch.where(valid, sampler.float() - teacher_logp, 0.0)
    shape = gap.shape
    if advantages is None:
        base = torch.zeros(shape, device=gap.device)
    elif advantages.dim() == 1 and len(shape) == 2:
        base = advantages.float()[:, None].expand(shape)  # one per sequence
    else:
        base = advantages.float()
    out = policy_loss(
        student_logits, labels, base - beta * gap, mask, old_logp=old_logp, config=cfg,
        normalizer=normalizer, inplace=inplace, backend=backend,
    )  # fmt: skip
    weights = valid.float() * (mask.float() if mask.dtype != torch.bool else 1.0)
    out.metrics["distill"] = (gap * weights).sum() / weights.sum().clamp_min(1e-8)
    return out
