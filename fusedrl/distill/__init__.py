"""Distillation from a teacher's logits, in one pass over both: `distill_loss`.

On-policy distillation (GKD, Agarwal et al. 2023; the student's own samples scored by a teacher)
trains the student toward the teacher's whole next-token distribution at every position. Per
token, with s = softmax(student / T) and q = softmax(teacher / T):

    reverse_kl   KL(s || q)  (mode-seeking; TRL's beta = 1)
    forward_kl   KL(q || s)  (mass-covering; TRL's beta = 0)
    jsd          beta KL(q || m) + (1 - beta) KL(s || m),  m = beta q + (1 - beta) s
                 (the generalized JSD of GKD as TRL's `generalized_jsd_loss` and Liger's
                 `LigerFusedLinearJSDLoss` define it, their beta = 0 / 1 endpoints included)

aggregated over the masked tokens like the policy loss (`config.agg`, `normalizer`). The gradient
to the student's logits is written while the loss is computed (the teacher's get none), so the
backward pass reads nothing. `kind="sampled_reverse_kl"` is the policy-gradient form instead
(sampled.py). docs/losses.md has the formulas and the peers' names.
"""

from __future__ import annotations

import torch

from .._autograd import with_known_grad
from .._inputs import capping_transform, check_logits, prepare_loss_inputs, scaled_temperature
from ..config import LossConfig
from ..output import LossOutput
from ..token_terms import masked_mean
from .args import (
    DISTILL_BACKENDS,
    DISTILL_KINDS,  # noqa: F401 (the package's public names)
    FULL_DISTILL_KINDS,  # noqa: F401
    check_distill_args,
    check_teacher,
    checked_call,
    distill_config,
    resolved_kind,
)
from .rows import distill as distill_rows
from .rows import two_row_ops


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float | torch.Tensor = 1.0,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    inplace: bool = False,
    backend: str = "auto",
    advantages: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    grad_scale: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> LossOutput:
    """The student-teacher divergence over the whole vocabulary, per token, aggregated; or the
    teacher's log-ratio on the sampled tokens as a negative advantage of a policy loss.

    Args:
        student_logits: [B, T, V] or [N, V] (vocab contiguous; bf16 / fp16 / fp32 / fp64).
        teacher_logits: the teacher's logits for the same tokens, the same shape; no gradient.
        labels: [B, T] the sampled token ids (the student's log-prob of each is returned).
        mask: [B, T] bool or float weights: the tokens that count.
        kind: "reverse_kl", "forward_kl" or "jsd" (module docstring), or
            "sampled_reverse_kl": the policy loss of `config` with advantages
            A_t - beta (old_logp_t - log pi_teacher(y_t)) (fusedrl/distill/sampled.py).
        beta: jsd's teacher share of the mixture, in [0, 1] (0: forward_kl, 1: reverse_kl);
            for sampled_reverse_kl the teacher term's coefficient (>= 0).
        temperature: both distributions are softmax(logits / temperature); a tensor holds
            one per token ([B, T], or [B] one per sequence), as in `policy_loss`.
        config: a LossConfig whose `agg` (and `norm_constant`) aggregate the per-token
            divergence (default token-mean, TRL's and Liger's normalisation); for
            sampled_reverse_kl the whole policy loss (preset, clip, IS, aggregation).
        normalizer: the aggregation's denominator, as in `policy_loss` (global token count).
        inplace: write d(loss)/d(student_logits) into student_logits.
        backend: "auto" (Triton on CUDA, else torch), "triton" (the two-row kernels of
            fusedrl.kernels.two_rows: one read of both rows forward, one backward) or "torch".
        advantages: sampled_reverse_kl only: the RL advantages ([B] or [B, T]; None: 0, pure
            distillation) to which the teacher term is added.
        old_logp: sampled_reverse_kl only: the sampler's log-probs of `labels` (the rollouts'),
            both the policy loss's old_logp and the k_t estimate's; None: on-policy, the
            student's own (one more read of its logits).
        softcap, logit_scale: both models' logits are c tanh(s x / c) (or s x) of these, as in
            `policy_loss`: the kernels cap both rows as they read them (a student and a teacher
            of one family, e.g. Gemma 2 sizes; heads that differ: pass their final logits, or
            `linear_distill_loss(student_transform=, teacher_transform=)`).
        grad_scale: the factor the caller will multiply the loss by before backward, as in
            `policy_loss`: the student's gradient is written times it.
        cu_seqlens, max_seqlen: packed sequences ([N, V] logits), as in `policy_loss`; not
            with sampled_reverse_kl.

    Returns:
        LossOutput(loss, logp: the student's [B, T] log-probs of `labels` at the temperature,
        entropy: None, metrics: {"distill": masked mean of the per-token divergence}).
    """
    beta, transform, temperature = _settled_arguments(
        kind, beta, softcap, logit_scale, temperature, backend, advantages, old_logp
    )
    per_token = isinstance(temperature, torch.Tensor)
    student_logits = check_logits(student_logits, name="student_logits")
    teacher = check_teacher(teacher_logits, student_logits)
    if kind == "sampled_reverse_kl":
        from .sampled import check_sampled_config, sampled_reverse_kl

        if cu_seqlens is not None or max_seqlen is not None:
            raise NotImplementedError(
                "cu_seqlens with kind='sampled_reverse_kl' is not supported yet: pass the "
                "teacher-shifted advantages to fusedrl.policy_loss(..., cu_seqlens=) instead"
            )

        cfg = check_sampled_config(config, temperature)
        return sampled_reverse_kl(
            student_logits,
            teacher,
            labels,
            mask,
            beta,
            temperature,
            cfg,
            normalizer,
            inplace,
            backend,
            advantages,
            old_logp,
            transform,
            grad_scale,
        )
    packing = (cu_seqlens, max_seqlen, student_logits, mask, normalizer)
    cfg, agg_weights = _aggregation(distill_config(config), *packing)
    # The shared checks of the policy loss (labels, mask, normalizer, the [N, V] form); a
    # distillation has no advantages.
    advantages = torch.zeros(student_logits.shape[:-1], device=student_logits.device)
    inp = prepare_loss_inputs(
        student_logits,
        labels,
        advantages,
        mask,
        None,
        None,
        None,
        cfg,
        normalizer,
        temperature=temperature if per_token else None,
        grad_scale=grad_scale,
        agg_weights=agg_weights,
    )
    temperature = inp.row_temps if per_token else temperature
    teacher3 = teacher.unsqueeze(0) if inp.flat_input else teacher
    ops = two_row_ops(backend, inp.logits.device)
    kind = resolved_kind(kind, beta)

    def compute(grad):
        loss, logp, divergence = distill_rows(
            ops, inp, teacher3, kind, beta, temperature, cfg, grad, transform
        )
        return loss, (logp, divergence)

    loss, (logp, divergence) = with_known_grad(
        student_logits, inp.logits, inplace, inp.flat_input, compute, inp.grad_scale
    )
    if inp.flat_input:
        logp = logp[0]
    return LossOutput(
        loss=loss, logp=logp, entropy=None, metrics={"distill": masked_mean(divergence, inp)}
    )


def _aggregation(cfg, cu_seqlens, max_seqlen, student_logits, mask, normalizer):
    """(config, per-token aggregation weights or None): `cfg` as it is, or for packed
    sequences its token-mean form and each token's weight (fusedrl/segments.py: the divergence is
    each token's own, so the boundaries enter through the weights alone)."""
    if cu_seqlens is None and max_seqlen is None:
        return cfg, None
    from ..segments import packed_aggregation

    vocab = student_logits.shape[-1]
    return packed_aggregation(cu_seqlens, max_seqlen, student_logits, vocab, mask, cfg, normalizer)


def _settled_arguments(
    kind, beta, softcap, logit_scale, temperature, backend, advantages, old_logp
):
    """distill_loss's arguments checked: (beta, the soft cap's transform or None, the
    temperature with a bare logit scale folded in)."""
    beta = check_distill_args(kind, beta)
    transform = capping_transform(softcap, logit_scale)
    if transform is None:  # a bare scale of both rows is one of the temperature
        temperature = scaled_temperature(temperature, logit_scale)
    temperature = checked_call(
        kind,
        temperature,
        backend,
        DISTILL_BACKENDS,
        advantages,
        old_logp,
        " (distill_loss has no CUDA C++ kernel yet)",
    )
    return beta, transform, temperature
