"""`linear_policy_loss` and `linear_token_logprobs` with a vocab-sharded LM head: `weight` is this
rank's rows [V_r, H] (and `bias` its [V_r]), `hidden` is replicated.

The rows' statistics come from the LM-head backend's sweep over this rank's weight rows (the
logits exist a block of rows at a time, as without tensor parallelism: torch blocks, or with
backend="triton" cuBLAS chunks read by the Triton row kernels), then the same single all-gather
and merge as for logits (`rows.whole_row_stats`). The gradient sweep runs with the whole rows'
lse and entropy and gives this rank's dW, db and its part of dX; the [N, H] input gradient is
summed over the group in backward (one all-reduce), unless reduce_input_grad=False (Megatron's
column-parallel convention: the caller reduces it).
"""

from __future__ import annotations

import dataclasses

import torch

import fusedrl.backends as backends
import fusedrl.linear_single_process as linear_single_process
import fusedrl.linear_torch as linear_torch
import fusedrl.linear_triton as linear_triton
import fusedrl.tp.sampling as tp_sampling

from .._autograd import attach_linear_grads, wanted_grads
from .._inputs import (
    check_labels,
    check_lm_head,
    check_logits,
    check_skip_masked_rows,
    check_temperature_arg,
    temperature_of,
)
from ..arguments import ModelHead, RolloutInputs, checked_inputs
from ..backends import LINEAR_BACKENDS
from ..config import LossConfig
from ..double_backward import refuse_double_backward
from ..logit_transform import check_logit_transform
from ..output import LossOutput
from ..sampling import check_sampling
from ..token_terms import token_terms
from ..torch_backend import _scaled
from .comm import group_size, sum_grad_over_group
from .dtensor import local_value
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
from .ops import refuse_unsupported
from .rows import whole_row_stats
from .shard import VocabShard


def _refuse(backend: str) -> None:
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {LINEAR_BACKENDS}")
    refuse_unsupported(backend)


def _backend(backend: str, hidden: torch.Tensor):
    """The LM-head backend module (linear_torch or linear_triton), resolved as on one process;
    its dtype refusal here, before the header: a rank whose slice is all padding would not reach
    the kernels that check it, and the others would wait for it."""
    impl = backends.resolve_linear(backend, hidden.device)
    if impl is not linear_torch and linear_triton.design() == "on-chip":
        raise NotImplementedError(
            f"{linear_triton.DESIGN_ENV}=on-chip has no tensor-parallel path: its kernels make "
            "the logits tiles of the whole head; unset it (the 'gemm' design runs with tp_group)"
        )
    if impl is linear_triton:
        linear_triton.check_hidden_dtype(hidden)
    return impl


def _head_settings(hidden: object, want: tuple, reduce_input_grad: bool) -> str:
    """What the ranks of an LM-head call must share beside the config: the hidden size (the
    backward all-reduce of d(hidden) is [N, H]) and whether that all-reduce runs at all."""
    size = hidden.shape[-1] if isinstance(hidden, torch.Tensor) and hidden.dim() else None
    return (
        f"hidden_size={size} grads_of_hidden_weight_bias={tuple(want)} "
        f"reduce_input_grad={reduce_input_grad}"
    )


def _head_rows(weight, bias, vocab_start, vocab_size):
    """A group of one: the head's token rows, for the single-process call."""
    check_vocab_arguments(vocab_start, vocab_size)
    if vocab_start not in (None, 0):
        raise ValueError(f"vocab_start={vocab_start} with a single rank: its slice starts at 0")
    rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    if vocab_size is None or rows is None or vocab_size == rows:
        return weight, bias
    if vocab_size > rows:
        raise ValueError(f"vocab_size={vocab_size} exceeds the {rows} rows of the LM head")
    return weight[:vocab_size], None if bias is None else bias[:vocab_size]


def _sharded(lin: linear_torch.LinearInputs, shard: VocabShard, group, sampling):
    """`lin` for this rank's rows of the head: every rank's row blocks alike (the widest
    slice's), and with `sampling` the sets' floors found over the group as the first sweep goes
    (then kept in `lin` for the second)."""
    # Flat rows (a strided hidden, e.g. the completion positions of a sequence, would be walked
    # sequence by sequence, a layout that could differ between ranks): a copy of [N, H] at most,
    # none when the live rows are gathered anyway (skip_masked_rows).
    hidden = lin.hidden if lin.live is not None else lin.hidden.contiguous()
    lin = dataclasses.replace(lin, hidden=hidden, block_vocab=max(shard.widest, 1))
    if sampling is None or not sampling.active:
        return lin
    reduce = tp_sampling.group_reduce(group)

    def find_floors(logits, temperature, mask):
        scaled = _scaled(logits, temperature)
        return tp_sampling.row_floors(scaled, mask, shard.vocab_size, reduce)

    chunk_sets = _ChunkSets(linear_torch.flat_rows(lin, lin.rows.labels), shard, group, sampling)
    return dataclasses.replace(
        lin, sampling=sampling, find_floors=find_floors, chunk_floors=chunk_sets
    )


class _ChunkSets:
    """backend="triton": the floors through which the row kernels read a chunk of cuBLAS logits
    (`floors=`: no masked write), each row's on this rank's slice (`slice_floors(raw=True)`),
    found over the group the first time the chunk is made (the statistics sweep) and kept for
    the gradient sweep, which makes the same chunk again (the same bits: the same GEMM on the
    same rows). A soft cap is already applied to the chunk in place: the floors are on the
    capped logits, which are what the kernels read."""

    def __init__(self, labels: torch.Tensor, shard: VocabShard, group, sampling) -> None:
        self.floors = torch.empty(labels.numel(), dtype=torch.float32, device=labels.device)
        self.found = 0  # rows [0, found) have their floors
        self.shard, self.group, self.sampling = shard, group, sampling

    def __call__(self, start: int, stop: int, logits: torch.Tensor, temperature) -> torch.Tensor:
        """[1, n] fp32 floors of the chunk `logits` [1, n, V_r]; `temperature`: a float or the
        chunk's rows' own ([1, n])."""
        if stop > self.found:
            self.floors[start:stop] = tp_sampling.slice_floors(
                logits, temperature, self.sampling, self.shard, self.group, raw=True
            )
            self.found = stop
        return self.floors[start:stop][None]


def _slice_inputs(lin: linear_torch.LinearInputs, shard: VocabShard):
    """The LM-head inputs restricted to this rank's token rows (views)."""
    bias = None if lin.bias is None else lin.bias[: shard.width]
    return dataclasses.replace(lin, weight=lin.weight[: shard.width], bias=bias)


def _take_part_without_rows(lin, shard: VocabShard, group, temperature) -> None:
    """A rank of only padding rows has no sweep, but the sets' floors are found over the group:
    it runs their collectives with an empty slice, on the same row blocks as the others."""
    if shard.width == 0 and lin.sampling is not None:
        batch, time, _ = lin.hidden.shape
        if lin.live is not None:  # the sweeps' rows: the live ones
            batch, time = 1, lin.live.numel()
        empty = lin.hidden.new_empty(batch, time, 0)
        rows_t = linear_torch.flat_rows(lin, temperature)
        tp_sampling.slice_floors(empty, rows_t, lin.sampling, shard, group)


def _with_labels(part: linear_torch.LinearInputs, labels: torch.Tensor):
    return dataclasses.replace(part, rows=dataclasses.replace(part.rows, labels=labels))


def _slice_stats(lin, part, labels, shard, temperature, impl):
    """(logp_r, lse_r, entropy_r) [B, T] of this rank's token rows of the head (`part`), the
    labels as columns of the slice (`_columns`). The sets' floors, found by this sweep, are kept
    in `lin` for the gradient sweep."""
    if impl is linear_triton:  # < 0: another rank's label (no column kept in a sampled set)
        local = shard.local_labels(labels, missing=-1)
        return linear_triton.stats(_with_labels(part, local), temperature)
    local = _columns(labels, shard)
    lse = torch.empty(local.numel(), dtype=torch.float32, device=local.device)
    logp, entropy, _ = linear_torch.sweep(part, local, temperature, True, lse_out=lse)
    lin.saved_floors = part.saved_floors
    return logp, lse.view(local.shape), entropy


def _padded(grad: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """A gradient of the token rows, with zero rows for the padding (they are no tokens)."""
    if grad is None or grad.shape[0] == rows:
        return grad
    return torch.cat([grad, grad.new_zeros(rows - grad.shape[0], *grad.shape[1:])])


def _columns(labels: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The labels as columns of this rank's slice; past its last column where another rank holds
    the label: no one-hot term, and a sampled set keeps no column for it (a negative label would
    keep column 0, an ignored position's convention)."""
    return shard.local_labels(labels, missing=shard.width)


def _slice_grads(lin, labels, lse, entropy, dlogp, dentropy, temperature, shard, want, rows, impl):
    local = _columns(labels, shard)
    if shard.width == 0:  # only padding rows here: no part of dX, zero dW and db
        hidden = lin.hidden
        dx = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grads = linear_torch.LinearGrads(dx if want[0] else None, None, None)
        weight_grad = lin.weight.new_zeros(rows, lin.weight.shape[1]) if want[1] else None
        bias_grad = lin.bias.new_zeros(rows) if want[2] and lin.bias is not None else None
        return dataclasses.replace(grads, weight=weight_grad, bias=bias_grad)
    part = _slice_inputs(lin, shard)  # a rank of only padding rows gets no sweep (no collective)
    if impl is linear_triton:  # a label < 0: in another slice (no one-hot term)
        part = _with_labels(part, shard.local_labels(labels, missing=-1))
        grads = linear_triton.gradients(part, temperature, lse, entropy, dlogp, dentropy, want)
    else:
        grads = linear_torch.backward(
            part, local, temperature, dlogp, dentropy, want, whole_rows=(lse, entropy)
        )
    return dataclasses.replace(
        grads, weight=_padded(grads.weight, rows), bias=_padded(grads.bias, rows)
    )


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
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_input_grad: bool = True,
    skip_masked_rows: bool = False,
    live_rows: int | None = None,
    grad_scale=None,
    agg_weights=None,
    cu_seqlens=None,
) -> LossOutput:
    """`fusedrl.linear_policy_loss` of a vocab-sharded head (its rollout inputs and model head
    as objects, fusedrl/arguments.py). Per-token temperatures are replicated; the model's
    transform after the head is elementwise: each rank applies it to its slice of the logits
    (and its derivative to their gradient); `grad_scale`: each rank's gradients written times
    it (the header compares all three across ranks). `skip_masked_rows`, `live_rows`: as on
    one process; the mask is replicated, so every rank walks the same live rows (the ranks
    must agree on the skip: their per-chunk collectives follow the rows). `agg_weights`,
    `cu_seqlens`: packed sequences, as in `tp.loss.policy_loss`."""
    cfg = config if config is not None else LossConfig()
    labels, advantages, mask = map(local_value, (labels, advantages, mask))
    rollout = rollout.map(lambda _, value: local_value(value))
    head = head.map_temperature(local_value)
    normalizer = local_value(normalizer)
    if group_size(tp_group) == 1:
        _refuse(backend)
        weight, bias = _head_rows(weight, bias, vocab_start, vocab_size)
        return linear_single_process.linear_policy_loss(
            hidden,
            weight,
            labels,
            advantages,
            mask,
            rollout,
            head,
            config,
            normalizer,
            bias=bias,
            backend=backend,
            return_entropy=return_entropy,
            skip_masked_rows=check_skip_masked_rows(skip_masked_rows, live_rows),
            live_rows=live_rows,
            grad_scale=grad_scale,
            agg_weights=agg_weights,
        )
    skip = live_rows if live_rows is not None else skip_masked_rows
    want = wanted_grads(hidden, weight, bias)

    def local_checks():
        _refuse(backend)
        check_skip_masked_rows(skip_masked_rows, live_rows)
        check_lm_head(weight, bias, check_logits(hidden, name="hidden"))
        inp = checked_inputs(
            hidden,
            range_unchecked(labels),
            advantages,
            mask,
            rollout,
            head,
            cfg,
            normalizer,
            vocab=NO_LIMIT,
            source="hidden",
            grad_scale=local_value(grad_scale),
            agg_weights=agg_weights,
        )
        return inp, _backend(backend, inp.logits), head.transform

    (inp, impl, transform), shard, seed = agree(
        tp_group,
        local_checks,
        tokens=hidden,
        vocab_rows=lambda: weight.shape[0],
        labels=labels,
        valid=mask,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        call=(
            f"{cfg!r} temperature={shown_temperature(head.temperature)} {head.transform!r} "
            f"skip_masked_rows={skip} "
            f"{_head_settings(hidden, want, reduce_input_grad)}"
        ),
        replicated=lambda checked: loss_inputs_replicated(checked[0], cu_seqlens),
        draw_seed=unseeded_pick(cfg),
    )
    cfg = seeded(cfg, seed)
    lin = linear_torch.LinearInputs(
        hidden=inp.logits,
        weight=weight,
        bias=bias,
        rows=dataclasses.replace(inp, logits=None),
        transform=transform,
    )
    if skip is not False:
        lin.live = linear_torch.live_row_indices(inp.valid, live_rows)
    lin = _sharded(lin, shard, tp_group, cfg.sampling)
    need_entropy = return_entropy or cfg.needs_entropy
    with torch.no_grad():
        part = _slice_inputs(lin, shard)
        temperature = temperature_of(inp, cfg)
        _take_part_without_rows(lin, shard, tp_group, temperature)
        logp, lse, entropy = whole_row_stats(
            lambda local: _slice_stats(lin, part, inp.labels, shard, temperature, impl),
            inp.labels,
            inp.valid,
            shard,
            tp_group,
        )
        terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
        loss = terms.loss
        if any(want):
            grads = _slice_grads(
                lin,
                inp.labels,
                lse,
                entropy,
                terms.dlogp,
                terms.dentropy,
                temperature,
                shard,
                want,
                weight.shape[0],
                impl,
            )
    if any(want):
        if want[0] and reduce_input_grad:
            hidden = sum_grad_over_group(hidden, tp_group)
        loss = attach_linear_grads(
            loss, hidden, weight, bias, inp.flat_input, want, grads, inp.grad_scale
        )
    entropy = entropy if need_entropy else None
    if inp.flat_input:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return LossOutput(loss=loss, logp=logp, entropy=entropy, metrics=terms.metrics)


class _LinearLogprobs(torch.autograd.Function):
    """logp (and the entropy) through a vocab-sharded LM head; backward sweeps this rank's rows
    again and sums dX over the group (unless told not to)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, lin, shard, group, temperature, want, reduce, impl):
        part = _slice_inputs(lin, shard)
        labels = lin.rows.labels
        _take_part_without_rows(lin, shard, group, temperature)
        logp, lse, entropy = whole_row_stats(
            lambda local: _slice_stats(lin, part, labels, shard, temperature, impl),
            labels,
            None,
            shard,
            group,
        )
        ctx.stats = (lin, shard, group, temperature, want, reduce, lse, entropy, hidden.shape)
        ctx.impl = impl
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        refuse_double_backward("fusedrl.linear_token_logprobs (tp_group)")
        lin, shard, group, temperature, want, reduce, lse, entropy, shape = ctx.stats
        grads = _slice_grads(
            lin,
            lin.rows.labels,
            lse,
            entropy,
            grad_logp.float(),
            grad_entropy.float(),
            temperature,
            shard,
            want,
            lin.weight.shape[0],
            ctx.impl,
        )
        dx = grads.hidden
        if dx is not None:
            dx = dx.view(shape)
            if reduce:
                torch.distributed.all_reduce(dx, group=group)
        return dx, grads.weight, grads.bias, None, None, None, None, None, None, None


def linear_token_logprobs(
    hidden,
    weight,
    labels,
    temperature: float = 1.0,
    return_entropy: bool = False,
    bias=None,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    *,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_input_grad: bool = True,
    softcap: float | None = None,
    logit_scale: float | None = None,
    cu_seqlens=None,
    compared=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fusedrl.linear_token_logprobs` of a vocab-sharded head; `cu_seqlens`: as in
    `tp.loss.token_logprobs`."""
    labels, temperature = local_value(labels), local_value(temperature)
    if group_size(tp_group) == 1:
        _refuse(backend)
        weight, bias = _head_rows(weight, bias, vocab_start, vocab_size)
        return linear_single_process.linear_token_logprobs(
            hidden,
            weight,
            labels,
            temperature,
            return_entropy,
            bias,
            backend,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            transform=check_logit_transform(softcap, logit_scale),
        )
    want = wanted_grads(hidden, weight, bias)

    def local_checks():
        _refuse(backend)
        sampling = check_sampling(top_k, top_p, min_p)
        transform = check_logit_transform(softcap, logit_scale)
        checked = check_logits(hidden, name="hidden")
        check_lm_head(weight, bias, checked)
        ids = check_labels(range_unchecked(labels), checked, None, vocab=NO_LIMIT, source="hidden")
        temps = check_temperature_arg(
            temperature, tuple(ids.shape), checked.device, checked.dim() == 2
        )
        return ids, temps, _backend(backend, checked), sampling, transform

    (ids, temperature, impl, sampling, transform), shard, _ = agree(
        tp_group,
        local_checks,
        tokens=hidden,
        vocab_rows=lambda: weight.shape[0],
        labels=labels,
        valid=None,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        call=(
            f"linear_token_logprobs temperature={shown_temperature(temperature)} "
            f"top_k={top_k!r} top_p={top_p!r} min_p={min_p!r} softcap={softcap!r} "
            f"logit_scale={logit_scale!r} {_head_settings(hidden, want, reduce_input_grad)}"
        ),
        replicated=lambda checked: with_compared(
            logprob_inputs_replicated(*checked[:2], cu_seqlens), compared
        ),
    )
    flat = hidden.dim() == 2
    hidden3 = hidden.unsqueeze(0) if flat else hidden
    labels2 = ids.unsqueeze(0) if flat else ids
    lin = linear_torch.logprob_inputs(hidden3, weight, bias, labels2)
    lin = _sharded(dataclasses.replace(lin, transform=transform), shard, tp_group, sampling)
    if any(want):
        logp, entropy = _LinearLogprobs.apply(
            hidden3,
            weight,
            bias,
            lin,
            shard,
            tp_group,
            temperature,
            want,
            reduce_input_grad,
            impl,
        )
    else:
        part = _slice_inputs(lin, shard)
        _take_part_without_rows(lin, shard, tp_group, temperature)
        logp, _, entropy = whole_row_stats(
            lambda local: _slice_stats(lin, part, labels2, shard, temperature, impl),
            labels2,
            None,
            shard,
            tp_group,
        )
    entropy = entropy if return_entropy else None
    if flat:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return logp, entropy
