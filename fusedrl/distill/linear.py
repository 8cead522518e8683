"""`linear_distill_loss`: `distill_loss` from two LM heads, whose logits never exist whole
(the two heads are swept together by `heads.py`)."""

from __future__ import annotations

from dataclasses import replace

import torch

import fusedrl.linear_single_process as linear_single_process

from .._autograd import attach_linear_grads, wanted_grads
from .._inputs import (
    check_lm_head,
    check_logits,
    check_skip_masked_rows,
    prepare_loss_inputs,
)
from ..arguments import RolloutInputs, checked_inputs
from ..backends import LINEAR_BACKENDS
from ..config import LossConfig
from ..linear_torch import LinearInputs, live_row_indices
from ..logit_transform import check_logit_transform
from ..output import LossOutput
from ..token_terms import aggregation_weights, masked_mean, scaled_by
from .args import check_distill_args, checked_call, distill_config, resolved_kind
from .heads import check_teacher_head, pair_sweep
from .rows import KERNEL_KIND, two_row_ops


def linear_distill_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float | torch.Tensor = 1.0,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    backend: str = "auto",
    advantages: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    student_transform: dict | None = None,
    teacher_transform: dict | None = None,
    skip_masked_rows: bool = False,
    live_rows: int | None = None,
    grad_scale: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> LossOutput:
    """`fusedrl.distill_loss` of the logits `student_hidden @ student_weight.T + student_bias`
    and `teacher_hidden @ teacher_weight.T + teacher_bias`, which are never stored whole.

    Args:
        student_hidden: [B, T, H] (a strided view is fine) or [N, H]; bf16 / fp16 / fp32 / fp64.
        student_weight: [V, H], the student's LM head; its dtype and device.
        teacher_hidden: the teacher's hidden states for the same tokens, [B, T, H'] / [N, H'];
            no gradient.
        teacher_weight: [V, H'], the teacher's LM head (the same vocabulary); no gradient.
        labels, mask, kind, beta, temperature, config, normalizer, advantages, old_logp: as in
            `fusedrl.distill_loss`.
        student_bias, teacher_bias: [V] or None.
        backend: "auto" (Triton on CUDA, torch elsewhere) | "triton" | "torch".
        student_transform, teacher_transform: each model's soft cap / logit scale after its
            head, as {"softcap": c, "logit_scale": s} (`model_logit_transform(model)`; None:
            none), applied to each chunk of its logits as in `linear_policy_loss`.
        skip_masked_rows, live_rows: neither head makes logits for the rows whose mask is 0,
            as in `linear_policy_loss` (sampled_reverse_kl: its policy loss; the two heads'
            log-probs, which have no mask, are taken on every row).
        grad_scale: the factor the caller will multiply the loss by before backward, as in
            `policy_loss`: the student's gradients are written times it.
        cu_seqlens, max_seqlen: packed sequences ([N, H] hidden states), as in
            `distill_loss`; not with kind="sampled_reverse_kl".

    Returns:
        LossOutput as `distill_loss`'s, its loss differentiable w.r.t. student_hidden,
        student_weight and student_bias (each that requires grad).
    """
    beta, skip, temperature = _checked_scalars(
        kind, beta, skip_masked_rows, live_rows, temperature, backend, advantages, old_logp
    )
    per_token_t = isinstance(temperature, torch.Tensor)
    student_hidden, weight, bias, head, student_kwargs = _checked_heads(
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        student_transform,
        teacher_transform,
    )
    if kind == "sampled_reverse_kl":
        if cu_seqlens is not None or max_seqlen is not None:
            raise NotImplementedError(
                "cu_seqlens with kind='sampled_reverse_kl' is not supported yet: pass the "
                "teacher-shifted advantages to fusedrl.linear_policy_loss(..., cu_seqlens=)"
            )
        return _sampled_reverse_kl(
            student_hidden,
            weight,
            bias,
            head,
            student_kwargs,
            labels,
            mask,
            beta,
            temperature,
            config,
            normalizer,
            backend,
            advantages,
            old_logp,
            skip,
            live_rows,
            grad_scale,
        )
    cfg, agg_weights = distill_config(config), None
    if cu_seqlens is not None or max_seqlen is not None:
        # the divergence is each token's own: the boundaries enter through the weights alone
        from ..segments import packed_aggregation

        cfg, agg_weights = packed_aggregation(
            cu_seqlens, max_seqlen, student_hidden, weight.shape[0], mask, cfg, normalizer
        )
    advantages = torch.zeros(student_hidden.shape[:-1], device=student_hidden.device)
    inp = prepare_loss_inputs(
        student_hidden,
        labels,
        advantages,
        mask,
        None,
        None,
        None,
        cfg,
        normalizer,
        vocab=weight.shape[0],
        source="student_hidden",
        temperature=temperature if per_token_t else None,
        grad_scale=grad_scale,
        agg_weights=agg_weights,
    )
    temperature = inp.row_temps if per_token_t else temperature
    lin = LinearInputs(
        hidden=inp.logits,
        weight=weight,
        bias=bias,
        rows=replace(inp, logits=None),
        transform=check_logit_transform(**student_kwargs),
    )
    if skip:
        lin.live = live_row_indices(inp.valid, live_rows)
    ops = two_row_ops(backend, student_hidden.device)
    return _head_divergence(
        lin,
        head,
        ops,
        resolved_kind(kind, beta),
        beta,
        temperature,
        cfg,
        student_hidden,
        weight,
        bias,
    )


def _head_divergence(lin, head, ops, kind, beta, temperature, cfg, student_hidden, weight, bias):
    """The divergence's loss from one sweep of both heads, its gradients attached."""
    inp = lin.rows
    want = wanted_grads(student_hidden, weight, bias)
    agg_w = aggregation_weights(inp, cfg)  # the mask and counts alone: 0 off the counted tokens
    stats, grads = pair_sweep(  # (the gradients written times the caller's loss factor)
        lin,
        head,
        ops,
        KERNEL_KIND[kind],
        beta,
        temperature,
        want,
        scaled_by(agg_w, inp.grad_scale),
    )
    logp, divergence = stats[0], torch.where(inp.valid, stats[3], 0.0)
    loss = (agg_w * divergence).sum()
    if any(want):
        loss = attach_linear_grads(
            loss, student_hidden, weight, bias, inp.flat_input, want, grads, inp.grad_scale
        )
    logp = logp[0] if inp.flat_input else logp
    return LossOutput(
        loss=loss, logp=logp, entropy=None, metrics={"distill": masked_mean(divergence, inp)}
    )


def _checked_scalars(
    kind, beta, skip_masked_rows, live_rows, temperature, backend, advantages, old_logp
):
    """(beta, whether the heads skip the masked rows, the temperature) checked."""
    beta = check_distill_args(kind, beta)
    skip = check_skip_masked_rows(skip_masked_rows, live_rows)
    temperature = checked_call(kind, temperature, backend, LINEAR_BACKENDS, advantages, old_logp)
    return beta, skip, temperature


def _checked_heads(
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    student_transform,
    teacher_transform,
):
    """Both heads checked: (student_hidden, its weight, its bias, the teacher's TeacherHead with
    its transform, the student's transform keywords)."""
    student_hidden = check_logits(student_hidden, name="student_hidden")
    student_names = ("student_weight", "student_bias", "student_hidden")
    weight, bias = check_lm_head(student_weight, student_bias, student_hidden, student_names)
    head = check_teacher_head(
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        student_hidden,
        weight.shape[0],
        ("teacher_hidden", "teacher_weight", "teacher_bias"),
    )
    student_kwargs = _transform_kwargs(student_transform, "student_transform")
    head.transform = check_logit_transform(
        **_transform_kwargs(teacher_transform, "teacher_transform")
    )
    return student_hidden, weight, bias, head, student_kwargs


def _transform_kwargs(transform: object, name: str) -> dict:
    """{"softcap", "logit_scale"} of a model's head transform (None: neither)."""
    if transform is None:
        return {}
    if not isinstance(transform, dict) or not set(transform) <= {"softcap", "logit_scale"}:
        raise ValueError(
            f"{name} must be None or a dict with keys softcap / logit_scale (as "
            f"model_logit_transform returns), got {transform!r}"
        )
    return dict(transform)


def _sampled_reverse_kl(
    student_hidden,
    weight,
    bias,
    head,
    student_kwargs,
    labels,
    mask,
    beta,
    temperature,
    config,
    normalizer,
    backend,
    advantages,
    old_logp,
    skip,
    live_rows,
    grad_scale=None,
) -> LossOutput:
    """kind="sampled_reverse_kl" from the heads: the policy loss of `linear_policy_loss` with
    the teacher's log-ratio on the sampled tokens in its advantages (`sampled.py`)."""
    from .sampled import (
        check_sampled_config,
        checked_temperature,
        model_head,
        sampling_filters,
        shifted_advantage_loss,
    )

    cfg = check_sampled_config(config, temperature)
    if advantages is None:  # pure distillation
        advantages = torch.zeros(student_hidden.shape[:-1], device=student_hidden.device)
    student_head = check_logit_transform(**student_kwargs)
    rollout, model = RolloutInputs(old_logp=old_logp), model_head(temperature, student_head)
    inp = checked_inputs(
        student_hidden,
        labels,
        advantages,
        mask,
        rollout,
        model,
        cfg,
        normalizer,
        vocab=weight.shape[0],
        source="student_hidden",
    )
    temperature = checked_temperature(inp, temperature)
    flat = inp.flat_input
    teacher_rows = head.hidden[0] if flat else head.hidden

    def logprobs(hidden, head_weight, head_bias, transform, filters):
        def run(labels):
            return linear_single_process.linear_token_logprobs(
                hidden,
                head_weight,
                labels,
                temperature,
                bias=head_bias,
                backend=backend,
                **filters,
                transform=transform,
            )[0]

        return run

    def loss(shifted):
        return linear_single_process.linear_policy_loss(
            student_hidden,
            weight,
            labels,
            shifted,
            mask,
            rollout,
            model,
            cfg,
            normalizer,
            bias=bias,
            backend=backend,
            skip_masked_rows=skip,
            live_rows=live_rows,
            grad_scale=grad_scale,
        )

    return shifted_advantage_loss(
        inp,
        beta,
        logprobs(teacher_rows, head.weight, head.bias, head.transform, {}),
        logprobs(
            student_hidden.detach(),
            weight.detach(),
            None if bias is None else bias.detach(),
            student_head,
            sampling_filters(cfg),
        ),
        old_logp,
        loss,
    )
