"""`policy_loss` and `token_logprobs` on vocab-sharded logits (what `fusedrl.policy_loss(...,
tp_group=...)` and `fusedrl.token_logprobs(..., tp_group=...)` run).

Per call: the header (a few ints per rank, `header.py`), then one all-gather of PARTIALS fp32 per
token per rank in the forward (`rows.whole_row_stats`); the [B, T] loss terms run unchanged on the
replicated values, and the backward writes each rank's gradient slice with no communication.
"""

from __future__ import annotations

import torch

from .. import api
from .._autograd import attach_grad
from .._inputs import check_labels, check_logits, check_temperature, prepare_loss_inputs
from ..config import LossConfig
from ..output import LossOutput
from ..sampling import check_sampling
from ..token_terms import token_terms
from .comm import group_rank_and_size
from .dtensor import local_value, unwrap_logits
from .header import (
    NO_LIMIT,
    agree,
    check_vocab_arguments,
    range_unchecked,
    seeded,
    unseeded_pick,
)
from .ops import refuse_unsupported, slice_ops
from .rows import whole_row_stats, write_slice_grad


def group_size(tp_group) -> int:
    return 1 if tp_group is None else group_rank_and_size(tp_group)[1]


def token_columns(logits: object, vocab_start: object, vocab_size: object) -> torch.Tensor:
    """A group of one holds the whole vocabulary: its token columns, for the single-process call
    (the same tensor, so the same bits, when there is no padding)."""
    check_vocab_arguments(vocab_start, vocab_size)
    logits = check_logits(logits)
    if vocab_start not in (None, 0):
        raise ValueError(f"vocab_start={vocab_start} with a single rank: its slice starts at 0")
    if vocab_size is None or vocab_size == logits.shape[-1]:
        return logits
    if vocab_size > logits.shape[-1]:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the {logits.shape[-1]} columns of the logits"
        )
    return logits[..., :vocab_size]


def policy_loss(
    logits,
    labels,
    advantages,
    mask,
    old_logp=None,
    ref_logp=None,
    rollout_logp=None,
    config: LossConfig | None = None,
    normalizer=None,
    inplace: bool = False,
    backend: str = "auto",
    return_entropy: bool = False,
    is_weights=None,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> LossOutput:
    cfg = config if config is not None else LossConfig()
    refuse_unsupported(backend, cfg.sampling if isinstance(cfg, LossConfig) else None)
    logits, tp_group = unwrap_logits(logits, tp_group)
    per_token = (labels, advantages, mask, old_logp, ref_logp, rollout_logp, is_weights)
    labels, advantages, mask, old_logp, ref_logp, rollout_logp, is_weights = map(
        local_value, per_token
    )
    if group_size(tp_group) == 1:
        return api.policy_loss(
            token_columns(logits, vocab_start, vocab_size), labels, advantages, mask,
            old_logp=old_logp, ref_logp=ref_logp, rollout_logp=rollout_logp, config=config,
            normalizer=normalizer, inplace=inplace, backend=backend,
            return_entropy=return_entropy, is_weights=is_weights,
        )  # fmt: skip

    wants_grad = isinstance(logits, torch.Tensor) and logits.requires_grad
    wants_grad = wants_grad and torch.is_grad_enabled()

    def local_checks():
        inp = prepare_loss_inputs(
            logits, range_unchecked(labels), advantages, mask, old_logp, ref_logp,
            rollout_logp, cfg, normalizer, is_weights, vocab=NO_LIMIT,
        )  # fmt: skip
        if wants_grad and inplace:
            api._check_writable(logits)
        return inp, slice_ops(backend, inp.logits.device)

    (inp, ops), shard, seed = agree(
        tp_group, local_checks, tokens=logits, vocab_rows=lambda: logits.shape[-1],
        labels=labels, valid=mask, vocab_start=vocab_start, vocab_size=vocab_size,
        call=repr(cfg), draw_seed=unseeded_pick(cfg),
    )  # fmt: skip
    cfg = seeded(cfg, seed)

    need_entropy = return_entropy or cfg.needs_entropy
    with torch.no_grad():
        logp, lse, entropy = whole_row_stats(
            lambda local: ops.stats(shard.narrow(inp.logits), local, inp.valid, cfg.temperature),
            inp.labels, inp.valid, shard, tp_group,
        )  # fmt: skip
        terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
        loss = terms.loss
        if wants_grad:
            grad = inp.logits
            if not inplace:
                grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            write_slice_grad(
                ops, inp.logits, inp.labels, lse, entropy, terms.dlogp, terms.dentropy,
                cfg.temperature, shard, grad,
            )  # fmt: skip
    if wants_grad:
        if inplace:
            torch.autograd.graph.increment_version(logits)
        loss = attach_grad(logits, loss, grad[0] if inp.flat_input else grad)
    entropy = entropy if need_entropy else None
    if inp.flat_input:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return LossOutput(loss=loss, logp=logp, entropy=entropy, metrics=terms.metrics)


def _row_stats(logits, labels, ops, shard, group, temperature):
    return whole_row_stats(
        lambda local: ops.stats(shard.narrow(logits), local, None, temperature),
        labels, None, shard, group,
    )  # fmt: skip


class _Logprobs(torch.autograd.Function):
    """logp (and the entropy) of vocab-sharded rows; backward writes this rank's slice alone."""

    @staticmethod
    def forward(ctx, logits, labels, ops, shard, group, temperature, return_entropy):
        logp, lse, entropy = _row_stats(logits, labels, ops, shard, group, temperature)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.ops, ctx.shard, ctx.temperature = ops, shard, temperature
        return (logp, entropy) if return_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, labels, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        dentropy = None if grad_entropy is None else grad_entropy.float()
        write_slice_grad(
            ctx.ops, logits, labels, lse, entropy, grad_logp.float(), dentropy, ctx.temperature,
            ctx.shard, grad,
        )  # fmt: skip
        return grad, None, None, None, None, None, None


def token_logprobs(
    logits,
    labels,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    refuse_unsupported(backend, check_sampling(top_k, top_p, min_p))
    logits, tp_group = unwrap_logits(logits, tp_group)
    labels = local_value(labels)
    if group_size(tp_group) == 1:
        columns = token_columns(logits, vocab_start, vocab_size)
        return api.token_logprobs(columns, labels, temperature, return_entropy, backend)

    def local_checks():
        checked = check_logits(logits)
        ids = check_labels(range_unchecked(labels), checked, None, vocab=NO_LIMIT)
        return ids, check_temperature(temperature), slice_ops(backend, checked.device)

    (ids, temperature, ops), shard, _ = agree(
        tp_group, local_checks, tokens=logits, vocab_rows=lambda: logits.shape[-1],
        labels=labels, valid=None, vocab_start=vocab_start, vocab_size=vocab_size,
        call=f"token_logprobs temperature={temperature!r}",
    )  # fmt: skip
    flat = logits.dim() == 2
    logits3 = logits.unsqueeze(0) if flat else logits
    labels2 = ids.unsqueeze(0) if flat else ids
    if logits.requires_grad and torch.is_grad_enabled():
        out = _Logprobs.apply(logits3, labels2, ops, shard, tp_group, temperature, return_entropy)
        logp, entropy = (out[0], out[1]) if return_entropy else (out[0], None)
    else:
        logp, _, entropy = _row_stats(logits3, labels2, ops, shard, tp_group, temperature)
        entropy = entropy if return_entropy else None
    if flat:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return logp, entropy
