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
from ..token_terms import masked_mean


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
    from .._inputs import prepare_loss_inputs
    from ..api import policy_loss, token_logprobs

    if cfg.temperature not in (1.0, temperature):
        raise ValueError(
            f"config.temperature={cfg.temperature!r} differs from temperature={temperature!r}: "
            "the student's and the teacher's log-probs are taken at one temperature"
        )
    cfg = cfg.replace(temperature=temperature)
    if advantages is None:  # pure distillation
        advantages = torch.zeros(student_logits.shape[:-1], device=student_logits.device)
    # The policy loss's own checks (labels, mask, advantages, old_logp), before any kernel runs:
    # [B, T] tensors, masked labels made safe, per-sequence advantages broadcast.
    inp = prepare_loss_inputs(
        student_logits, labels, advantages, mask, old_logp, None, None, cfg, normalizer
    )

    def unflat(t: torch.Tensor) -> torch.Tensor:  # [1, N] back to the caller's [N]
        return t[0] if inp.flat_input else t

    with torch.no_grad():
        teacher_logp, _ = token_logprobs(
            teacher_logits.detach(), unflat(inp.labels), temperature, backend=backend
        )
        sampler = old_logp
        if sampler is None:  # on-policy: the student's own log-probs, one more read
            sampler, _ = token_logprobs(
                student_logits.detach(), unflat(inp.labels), temperature, backend=backend
            )
        gap = torch.where(unflat(inp.valid), sampler.float() - teacher_logp, 0.0)
    out = policy_loss(
        student_logits, labels, unflat(inp.advantages) - beta * gap, mask, old_logp=old_logp,
        config=cfg, normalizer=normalizer, inplace=inplace, backend=backend,
    )  # fmt: skip
    out.metrics["distill"] = masked_mean(gap.reshape(inp.mask.shape), inp)
    return out
