"""`policy_loss` and `token_logprobs` on vocab-sharded logits (what `fusedrl.policy_loss(...,
tp_group=...)` and `fusedrl.token_logprobs(..., tp_group=...)` run).

Per call: the header (a few ints per rank, `header.py`), then one all-gather of PARTIALS fp32 per
token per rank in the forward (`rows.whole_row_stats`); the [B, T] loss terms run unchanged on the
replicated values, and the backward writes each rank's gradient slice with no communication.
Sampling-mask replay (top_k / top_p / min_p) adds the radix selects of `sampling.py` before the
sweeps (all-reduces of at most 256 values per token a pass), then reads the slice through each
row's floor on it (the Triton kernels' `floors=`: no masked copy), or, where the ops cannot (the
torch backend, a soft cap), masked to the sampled set: written into the gradient buffer when there
is one (as on one process), else a block of rows at a time.
"""

from __future__ import annotations

import torch

import fusedrl.single_process as single_process

from .._autograd import attach_grad, check_writable
from .._inputs import (
    check_labels,
    check_logits,
    check_temperature_arg,
    temperature_of,
)
from ..arguments import ModelHead, RolloutInputs, checked_inputs
from ..config import LossConfig
from ..double_backward import refuse_double_backward
from ..logit_transform import LogitTransform
from ..output import LossOutput
from ..row_blocks import row_blocks
from ..sampling import SamplingMask, check_sampling
from ..token_terms import token_terms
from .comm import group_size
from .dtensor import local_value, unwrap_logits
from .header import (
    NO_LIMIT,
    agree,
    check_vocab_arguments,
    logprob_inputs_replicated,
    loss_inputs_replicated,
    range_unchecked,
    seeded,
    shown_temperature,
    unseeded_pick,
    with_compared,
)
from .ops import refuse_unsupported, slice_ops
from .rows import whole_row_stats, write_slice_grad
from .sampling import mask_slice, slice_floors


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


class SampledSets:
    """The rows' sampled sets on this rank's slice, found over the group, and the labels as
    columns of the slice (< 0: on another rank), which are in the sets whatever their value.
    Read through each row's raw floor on the slice where the ops can (`SliceOps.reads_floors`:
    no masked copy of the slice, `floors`), else through the slice masked to the sets."""

    def __init__(
        self, logits, labels, temperature, sampling: SamplingMask, shard, group, ops, transform=None
    ):
        self.temperature, self.transform = temperature, transform
        self.labels = shard.local_labels(labels, missing=-1)
        # (raw floors are fp32: an fp64 slice is masked, to keep its sets exact)
        raw = ops.reads_floors and logits.dtype != torch.float64
        floors = slice_floors(
            shard.narrow(logits), temperature, sampling, shard, group, transform, raw
        )
        # `floors`: the raw ones the kernels read ([B, T]), or None: the slice is masked instead,
        # by the scaled ones
        self.floors = floors.view(labels.shape) if raw else None
        self._scaled_floors = None if raw else floors

    @property
    def reads_floors(self) -> bool:
        return self.floors is not None

    def write(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out = the token columns `logits` with -inf outside the sets (out may be logits); only
        where the ops do not read floors."""
        mask_slice(logits, self.labels, self._scaled_floors, self.temperature, out, self.transform)

    @torch.no_grad()
    def stats(self, ops, logits, local, valid):
        """ops.stats over the sets of [B, T, W] token columns: through the floors, or one masked
        block of rows at a time (no buffer of the slice's size when there is no gradient to
        write). `local`: the labels as columns, any column where another rank holds one."""
        if self.reads_floors:
            return ops.stats(logits, self.labels, valid, self.temperature, floors=self.floors)
        batch, time, _ = logits.shape
        out = [
            torch.empty(batch * time, dtype=torch.float32, device=logits.device)
            for _stat in ("logp", "lse", "entropy")
        ]
        flat_local = local.reshape(-1)
        flat_valid = None if valid is None else valid.reshape(-1)
        flat_keep = self.labels.reshape(-1)
        buffer = None  # one masked block, reused
        for start, (block,) in row_blocks(logits):
            stop = start + block.shape[0]
            if buffer is None or buffer.shape[1] < block.shape[0]:
                buffer = torch.empty((1, *block.shape), dtype=block.dtype, device=block.device)
            masked = buffer[:, : block.shape[0]]
            rows_t = self.temperature
            if isinstance(rows_t, torch.Tensor):  # the block's rows' own, as [1, n]
                rows_t = rows_t.reshape(1, -1)[:, start:stop]
            mask_slice(
                block[None],
                flat_keep[start:stop][None],
                self._scaled_floors[start:stop],
                rows_t,
                masked,
                self.transform,
            )
            rows_valid = None if flat_valid is None else flat_valid[start:stop][None]
            part = ops.stats(masked, flat_local[start:stop][None], rows_valid, rows_t)
            for whole, rows in zip(out, part):
                whole[start:stop] = rows[0]
        return tuple(t.view(batch, time) for t in out)


def policy_loss(
    logits,
    labels,
    advantages,
    mask,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig | None = None,
    normalizer=None,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    inplace: bool = False,
    backend: str = "auto",
    return_entropy: bool = False,
    grad_scale=None,
    agg_weights=None,
    cu_seqlens=None,
) -> LossOutput:
    """`fusedrl.policy_loss` of vocab-sharded logits (its rollout inputs and model head as
    objects, fusedrl/arguments.py); `agg_weights` as in `single_process`, from packed
    sequences' `cu_seqlens` (which the header compares across ranks). Per-token temperatures
    are replicated, as every per-token input: each rank divides its slice's rows by them; a
    soft cap is elementwise: each rank caps its slice as its kernels read it; `grad_scale`:
    each rank's slice of the gradient written times it (the ranks must agree on all three: the
    header compares them)."""
    cfg = config if config is not None else LossConfig()
    logits, tp_group = unwrap_logits(logits, tp_group)
    labels, advantages, mask = map(local_value, (labels, advantages, mask))
    rollout = rollout.map(lambda _, value: local_value(value))
    head = head.map_temperature(local_value)
    normalizer = local_value(normalizer)
    if group_size(tp_group) == 1:
        refuse_unsupported(backend)
        return single_process.policy_loss(
            token_columns(logits, vocab_start, vocab_size),
            labels,
            advantages,
            mask,
            rollout,
            head,
            config,
            normalizer,
            inplace=inplace,
            backend=backend,
            return_entropy=return_entropy,
            grad_scale=grad_scale,
            agg_weights=agg_weights,
        )

    wants_grad = isinstance(logits, torch.Tensor) and logits.requires_grad
    wants_grad = wants_grad and torch.is_grad_enabled()
    transform = head.transform

    def local_checks():
        refuse_unsupported(backend)
        inp = checked_inputs(
            logits,
            range_unchecked(labels),
            advantages,
            mask,
            rollout,
            head,
            cfg,
            normalizer,
            vocab=NO_LIMIT,
            grad_scale=local_value(grad_scale),
            agg_weights=agg_weights,
        )
        if wants_grad and inplace:
            check_writable(logits)
        return inp, slice_ops(backend, inp.logits.device, transform)

    (inp, ops), shard, seed = agree(
        tp_group,
        local_checks,
        tokens=logits,
        vocab_rows=lambda: logits.shape[-1],
        labels=labels,
        valid=mask,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        call=f"{cfg!r} temperature={shown_temperature(head.temperature)} {transform!r}",
        replicated=lambda checked: loss_inputs_replicated(checked[0], cu_seqlens),
        draw_seed=unseeded_pick(cfg),
    )
    cfg = seeded(cfg, seed)
    temperature = temperature_of(inp, cfg)  # the config's, or the per-token ones as checked

    need_entropy = return_entropy or cfg.needs_entropy
    with torch.no_grad():
        source, grad = inp.logits, None
        if wants_grad:
            grad = inp.logits
            if not inplace:
                grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        sets = floors = None
        if cfg.sampling is not None:
            sets = SampledSets(
                inp.logits, inp.labels, temperature, cfg.sampling, shard, tp_group, ops, transform
            )
            floors = sets.floors
            if grad is not None and floors is None:
                # the masked slice goes where the gradient will be written, and is read there
                sets.write(shard.narrow(inp.logits), shard.narrow(grad))
                source, sets = grad, None

        def slice_stats(local):
            if sets is not None:
                return sets.stats(ops, shard.narrow(source), local, inp.valid)
            return ops.stats(shard.narrow(source), local, inp.valid, temperature)

        logp, lse, entropy = whole_row_stats(slice_stats, inp.labels, inp.valid, shard, tp_group)
        terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
        loss = terms.loss
        if grad is not None:
            write_slice_grad(
                ops,
                source,
                inp.labels,
                lse,
                entropy,
                terms.dlogp,
                terms.dentropy,
                temperature,
                shard,
                grad,
                floors,
            )
    if wants_grad:
        if inplace:
            torch.autograd.graph.increment_version(logits)
        loss = attach_grad(logits, loss, grad[0] if inp.flat_input else grad, inp.grad_scale)
    entropy = entropy if need_entropy else None
    if inp.flat_input:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return LossOutput(loss=loss, logp=logp, entropy=entropy, metrics=terms.metrics)


def _row_stats(logits, labels, ops, shard, group, temperature, sets=None):
    def slice_stats(local):
        if sets is not None:
            return sets.stats(ops, shard.narrow(logits), local, None)
        return ops.stats(shard.narrow(logits), local, None, temperature)

    return whole_row_stats(slice_stats, labels, None, shard, group)


class _Logprobs(torch.autograd.Function):
    """logp (and the entropy) of vocab-sharded rows; backward writes this rank's slice alone.
    Replay: `source`, the slice masked to the sampled sets, read in place of `logits`, or
    `sets` read through their floors (`SampledSets.reads_floors`)."""

    @staticmethod
    def forward(ctx, logits, labels, ops, shard, group, temperature, return_entropy, source, sets):
        source = logits if source is None else source
        logp, lse, entropy = _row_stats(source, labels, ops, shard, group, temperature, sets)
        floors = None if sets is None else sets.floors
        ctx.save_for_backward(source, labels, lse, entropy, floors)
        ctx.ops, ctx.shard, ctx.temperature = ops, shard, temperature
        return (logp, entropy) if return_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        refuse_double_backward("fusedrl.token_logprobs (tp_group)")
        logits, labels, lse, entropy, floors = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        dentropy = None if grad_entropy is None else grad_entropy.float()
        write_slice_grad(
            ctx.ops,
            logits,
            labels,
            lse,
            entropy,
            grad_logp.float(),
            dentropy,
            ctx.temperature,
            ctx.shard,
            grad,
            floors,
        )
        return grad, None, None, None, None, None, None, None, None


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
    transform: LogitTransform | None = None,
    cu_seqlens=None,
    compared=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fusedrl.token_logprobs` over vocab-sharded logits; `transform`: a soft cap, as in
    `policy_loss`; `cu_seqlens`: packed sequences' boundaries, compared across ranks (each
    row's log-prob is its own; a packed loss's per-sequence terms follow this pass)."""
    logits, tp_group = unwrap_logits(logits, tp_group)
    labels, temperature = local_value(labels), local_value(temperature)
    if group_size(tp_group) == 1:
        refuse_unsupported(backend)
        columns = token_columns(logits, vocab_start, vocab_size)
        return single_process.token_logprobs(
            columns,
            labels,
            temperature,
            return_entropy,
            backend,
            top_k,
            top_p,
            min_p,
            transform=transform,
        )

    def local_checks():
        refuse_unsupported(backend)
        sampling = check_sampling(top_k, top_p, min_p)
        checked = check_logits(logits)
        ids = check_labels(range_unchecked(labels), checked, None, vocab=NO_LIMIT)
        temps = check_temperature_arg(
            temperature, tuple(ids.shape), checked.device, checked.dim() == 2
        )
        return ids, temps, slice_ops(backend, checked.device, transform), sampling

    (ids, temperature, ops, sampling), shard, _ = agree(
        tp_group,
        local_checks,
        tokens=logits,
        vocab_rows=lambda: logits.shape[-1],
        labels=labels,
        valid=None,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        call=f"token_logprobs temperature={shown_temperature(temperature)} "
        f"top_k={top_k!r} top_p={top_p!r} min_p={min_p!r} {transform!r}",
        replicated=lambda checked: with_compared(
            logprob_inputs_replicated(*checked[:2], cu_seqlens), compared
        ),
    )
    flat = logits.dim() == 2
    logits3 = logits.unsqueeze(0) if flat else logits
    labels2 = ids.unsqueeze(0) if flat else ids
    sets = None
    if sampling.active:
        sets = SampledSets(
            logits3.detach(), labels2, temperature, sampling, shard, tp_group, ops, transform
        )
    if logits.requires_grad and torch.is_grad_enabled():
        source = None
        if sets is not None and not sets.reads_floors:  # one masked copy, kept for backward
            source = torch.empty_like(logits3, requires_grad=False)
            sets.write(shard.narrow(logits3.detach()), shard.narrow(source))
            sets = None
        out = _Logprobs.apply(
            logits3, labels2, ops, shard, tp_group, temperature, return_entropy, source, sets
        )
        logp, entropy = (out[0], out[1]) if return_entropy else (out[0], None)
    else:
        logp, _, entropy = _row_stats(logits3, labels2, ops, shard, tp_group, temperature, sets)
        entropy = entropy if return_entropy else None
    if flat:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return logp, entropy
