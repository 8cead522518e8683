"""The LM-head loss on one process: what `fusedrl.linear_policy_loss` and
`fusedrl.linear_token_logprobs` run once their arguments are settled (the model's transform
checked, tensor parallelism dispatched), and what a tensor-parallel group of one and
`linear_distill_loss`'s sampled form run. The logits exist a chunk or a tile at a time
(`linear_torch`, `linear_triton`); the exact KL to a reference head sweeps both heads
(`distill.heads`).
"""

from __future__ import annotations

import dataclasses

import torch

import fusedrl.backends as backends
import fusedrl.linear_torch as linear_torch
import fusedrl.output as output

from ._autograd import attach_linear_grads, wanted_grads
from ._inputs import (
    check_labels,
    check_lm_head,
    check_logits,
    check_sum_pi_squared,
    check_temperature_arg,
    temperature_of,
)
from .arguments import ModelHead, RolloutInputs, checked_inputs
from .config import LossConfig
from .distill.heads import check_teacher_head, policy_loss_with_reference
from .distill.rows import two_row_ops
from .double_backward import refuse_double_backward
from .linear_torch import LinearInputs, live_row_indices
from .logit_transform import LogitTransform
from .output import LossOutput
from .sampling import check_sampling


def sums_squares_in_sweep(backend: str, device: torch.device) -> bool:
    """Whether the backend sums pi^2 in the log-prob sweep itself (Triton's "gemm" design)."""
    return backends.resolve_linear(backend, device).squares_in_sweep()


def linear_policy_loss(
    hidden,
    weight,
    labels,
    advantages,
    mask,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig | None = None,
    normalizer=None,
    *,
    bias=None,
    backend: str = "auto",
    return_entropy: bool = False,
    ref_weight=None,
    ref_hidden=None,
    ref_bias=None,
    entropy_coef=None,
    skip_masked_rows: bool = False,
    live_rows: int | None = None,
    return_sum_pi_squared: bool = False,
    grad_scale=None,
    agg_weights=None,
) -> LossOutput:
    """`fusedrl.linear_policy_loss` on one process, its rollout inputs and model head as
    objects (fusedrl/arguments.py): `skip_masked_rows` a bool (True when `live_rows` is
    given); `agg_weights` as in `single_process`."""
    full_kl = config is not None and config.full_kl
    cfg = config if config is not None else LossConfig()
    transform = head.transform
    if isinstance(hidden, torch.Tensor):  # the head's shape before the labels are checked
        check_lm_head(weight, bias, hidden)  # against its rows (a [H, V] head is named as such)
    inp = checked_inputs(
        hidden,
        labels,
        advantages,
        mask,
        rollout,
        head,
        cfg,
        normalizer,
        vocab=weight.shape[0] if isinstance(weight, torch.Tensor) else None,
        source="hidden",
        ref_head=full_kl,
        entropy_coef=entropy_coef,
        grad_scale=grad_scale,
        agg_weights=agg_weights,
    )
    weight, bias = check_lm_head(weight, bias, hidden)
    ref_head = None
    if full_kl:
        ref_head = check_teacher_head(
            hidden if ref_hidden is None else ref_hidden,
            ref_weight,
            ref_bias,
            hidden,
            weight.shape[0],
            ("ref_hidden", "ref_weight", "ref_bias"),
        )
        ref_head.transform = transform
    lin = LinearInputs(
        hidden=inp.logits,
        weight=weight,
        bias=bias,
        rows=dataclasses.replace(inp, logits=None),
        sampling=cfg.sampling,
        transform=transform,
    )
    if skip_masked_rows:
        lin.live = live_row_indices(inp.valid, live_rows)
    impl = backends.resolve_linear(backend, hidden.device)
    want = wanted_grads(hidden, weight, bias)
    if ref_head is not None:
        ops = two_row_ops(backend, hidden.device)
        result = policy_loss_with_reference(lin, ref_head, ops, cfg, return_entropy, want)
    else:
        result = impl.policy_loss(lin, cfg, return_entropy, want)
    logp, entropy, terms, grads = result
    loss = terms.loss
    if any(want):
        loss = attach_linear_grads(
            loss, hidden, weight, bias, inp.flat_input, want, grads, inp.grad_scale
        )
    sum_pi_squared = None
    if return_sum_pi_squared:
        with torch.no_grad():  # the head once more at T / 2, over the whole vocabulary
            sharp, _ = impl.token_logprobs(lin, temperature_of(inp, cfg) / 2, False)
        sum_pi_squared = torch.where(inp.valid, output.sum_pi_squared_of(logp, sharp), 0.0)
    if inp.flat_input:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
        sum_pi_squared = None if sum_pi_squared is None else sum_pi_squared[0]
    return LossOutput(
        loss=loss,
        logp=logp,
        entropy=entropy,
        metrics=terms.metrics,
        sum_pi_squared=sum_pi_squared,
    )


class _LinearLogprobsFn(torch.autograd.Function):
    """logp (and entropy) with nothing of [N, V] saved: backward sweeps the vocab again.
    `squares`: a last output, sum_v pi_v^2 (no gradient), from the same sweep."""

    @staticmethod
    def forward(
        ctx, impl, lin, temperature, want, hidden, weight, bias, return_entropy, squares=False
    ):
        if squares:
            logp, entropy, sum_sq = impl.token_logprobs_squares(lin, temperature, True)
            ctx.mark_non_differentiable(sum_sq)
            extra = (sum_sq,)
        else:
            logp, entropy = impl.token_logprobs(lin, temperature, return_entropy)
            extra = ()
        ctx.impl, ctx.lin, ctx.temperature, ctx.want = impl, lin, temperature, want
        ctx.hidden_shape, ctx.return_entropy = hidden.shape, return_entropy
        return (logp, entropy, *extra) if return_entropy else (logp, *extra)

    @staticmethod
    def backward(ctx, grad_logp, *grads):
        refuse_double_backward("fusedrl.linear_token_logprobs")
        grad_entropy = grads[0] if ctx.return_entropy else None  # (then the squares' None)
        lin = ctx.lin
        if lin is None:
            raise RuntimeError(
                "fusedrl.linear_token_logprobs: backward ran twice through the same graph "
                "(retain_graph is not supported)"
            )
        ctx.lin = None
        grads = ctx.impl.backward(
            lin, lin.rows.labels, ctx.temperature, grad_logp, grad_entropy, ctx.want
        )
        grad_hidden = None if grads.hidden is None else grads.hidden.view(ctx.hidden_shape)
        return None, None, None, None, grad_hidden, grads.weight, grads.bias, None, None


def linear_token_logprobs(
    hidden,
    weight,
    labels,
    temperature=1.0,
    return_entropy: bool = False,
    bias=None,
    backend: str = "auto",
    top_k=None,
    top_p=None,
    min_p=None,
    *,
    transform: LogitTransform | None = None,
    return_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`fusedrl.linear_token_logprobs` on one process; `return_sum_pi_squared` only where the
    sweep sums the squares itself (`sums_squares_in_sweep`)."""
    hidden = check_logits(hidden, name="hidden")
    weight, bias = check_lm_head(weight, bias, hidden)
    labels = check_labels(labels, hidden, None, vocab=weight.shape[0], source="hidden")
    sampling = check_sampling(top_k, top_p, min_p)
    impl = backends.resolve_linear(backend, hidden.device)
    flat = hidden.dim() == 2
    temperature = check_temperature_arg(temperature, tuple(labels.shape), hidden.device, flat)
    hidden3 = hidden.unsqueeze(0) if flat else hidden
    labels2 = labels.unsqueeze(0) if flat else labels
    lin = linear_torch.logprob_inputs(
        hidden3, weight, bias, labels2, sampling if sampling.active else None
    )
    lin.transform = transform
    want = wanted_grads(hidden, weight, bias)
    squares = ()
    if return_sum_pi_squared:
        check_sum_pi_squared(sampling.active)
    if any(want):
        out = _LinearLogprobsFn.apply(
            impl,
            lin,
            temperature,
            want,
            hidden,
            weight,
            bias,
            return_entropy,
            return_sum_pi_squared,
        )
        logp, entropy = (out[0], out[1]) if return_entropy else (out[0], None)
        squares = out[-1:] if return_sum_pi_squared else ()
    elif return_sum_pi_squared:
        logp, entropy, sum_sq = impl.token_logprobs_squares(lin, temperature, return_entropy)
        squares = (sum_sq,)
    else:
        logp, entropy = impl.token_logprobs(lin, temperature, return_entropy)
    if flat:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
        squares = tuple(t[0] for t in squares)
    return (logp, entropy, *squares)
