"""Sampling-mask replay on vocab-sharded rows: each row's floor found by radix selects whose digit
histograms are summed over the group, never by moving logits.

The set vLLM sampled from is {v : z_v / T >= floor} for one floor per row (`fusedrl.sampling` has
the rules: min_p, then top_k, then top_p on the renormalised rest). On one process the floor comes
from a sort or a top-k of the row; here no rank holds the row. Each filter is a question about the
whole row that a few sums over the group answer:

- min_p: floor = max z / T + log(min_p): one all-reduce (MAX) of 1 float per token, the row max
  (top_p shares it: its masses are exp(z / T - max)).
- top_k: the k-th largest value is the largest order key K with count(key >= K) >= k. A radix
  select finds it most significant digit first: 8 bits of key a pass, each rank counts its
  candidates whose key matches the digits chosen so far by their next digit, and one all-reduce
  (SUM) of 256 counters per token gives the whole row's counts. fp32 keys take 4 passes (fp64: 8).
- top_p: the smallest kept value is the largest x with mass(z / T >= x) >= top_p x the candidates'
  mass (`_top_p_target` shows why); the same select with masses for counts, 4 passes of 256 sums.

Backends whose row kernels read the sets through floors (Triton: below a row's floor a logit reads
as -inf, the label excepted) get each row's floor on this rank's raw logits: the smallest of its
slice's logits in the set (`slice_floors(raw=True)`; x / T is monotone in x, so x >= it iff x is
in the set), and no masked copy is written. The others (the torch backend, a soft cap, whose sets
are the capped logits') read the slice with -inf below the floor (`mask_slice`: the label and
NaN kept, as the fused kernels do). The passes run on blocks of rows that every rank cuts alike
(sized by the widest slice), so that the collectives line up.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..logit_transform import LogitTransform, capped_rows
from ..row_blocks import block_rows, row_blocks, rows_temperature
from ..sampling import SamplingMask
from ..torch_backend import _scaled
from .comm import all_reduce
from .shard import VocabShard

DIGIT_BITS = 8
DIGITS = 1 << DIGIT_BITS  # counters (or masses) per token in each select pass's all-reduce

# (tensor, op) -> the tensor summed (or maxed) over the group, in place.
Reduce = Callable[[torch.Tensor, object], None]


def _order_keys(scaled: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 keys whose unsigned order (as bit patterns) is the values' order, and their width:
    the float's bits with the sign bit flipped, or all bits flipped when negative. -0 and +0 share
    a key; a NaN has a key like any other (the callers give NaN no weight)."""
    scaled = scaled + 0.0  # -0 -> +0
    if scaled.dtype == torch.float64:
        bits = scaled.view(torch.int64)
        signed = torch.where(bits < 0, bits ^ 0x7FFF_FFFF_FFFF_FFFF, bits)
        return signed ^ (-(1 << 63)), 64  # the sign bit flipped: unsigned order as bit patterns
    bits = scaled.view(torch.int32).to(torch.int64)
    signed = torch.where(bits < 0, bits ^ 0x7FFF_FFFF, bits)
    return signed + (1 << 31), 32


def _key_values(keys: torch.Tensor, key_bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The float value of each key (`_order_keys` inverted)."""
    if key_bits == 64:
        signed = keys ^ (-(1 << 63))
        bits = torch.where(signed < 0, signed ^ 0x7FFF_FFFF_FFFF_FFFF, signed)
        return bits.view(torch.float64).to(dtype)
    signed = keys - (1 << 31)
    bits = torch.where(signed < 0, signed ^ 0x7FFF_FFFF, signed).to(torch.int32)
    return bits.view(torch.float32).to(dtype)


def _radix_select(
    keys: torch.Tensor,
    key_bits: int,
    weights: torch.Tensor,
    target: torch.Tensor,
    reduce: Reduce,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] the largest key K with sum(weights where key >= K) >= target over the whole row (every
    rank's slice), [n] whether there is one: not where the whole row weighs less). `weights` >= 0
    (0: not a candidate); the answer is the key of a candidate. One all-reduce of [n, DIGITS] a
    pass."""
    rows = keys.shape[0]
    device = keys.device
    prefix = torch.zeros(rows, dtype=torch.int64, device=device)  # the digits chosen so far
    above = torch.zeros(rows, dtype=weights.dtype, device=device)  # weight of keys > prefix's
    found = torch.ones(rows, dtype=torch.bool, device=device)
    for shift in range(key_bits - DIGIT_BITS, -1, -DIGIT_BITS):
        high_bits = key_bits - shift - DIGIT_BITS
        weight = weights
        if high_bits:  # only the keys that share the prefix (a logical shift of the bits)
            high = (keys >> (shift + DIGIT_BITS)) & ((1 << high_bits) - 1)
            weight = torch.where(high == prefix[:, None], weights, 0.0)
        digit = (keys >> shift) & (DIGITS - 1)
        hist = torch.zeros(rows, DIGITS, dtype=weights.dtype, device=device)
        hist.scatter_add_(1, digit, weight)
        reduce(hist, dist.ReduceOp.SUM)
        # at_or_above[d]: the weight of keys whose digit here is >= d (and prefix above): a sum of
        # non-negative terms from the top, so it never increases with d, in fp too.
        at_or_above = hist.flip(-1).cumsum(-1).flip(-1) + above[:, None]
        reaches = at_or_above >= target[:, None]
        chosen = reaches.sum(-1) - 1  # the largest digit that still reaches the target
        # In exact arithmetic a later pass always reaches it (the bucket chosen before did);
        # summed in another order it may fall an ulp short: its smallest candidate is the answer.
        lowest = torch.where(hist > 0, torch.arange(DIGITS, device=device), DIGITS).amin(-1)
        if shift != key_bits - DIGIT_BITS:
            chosen = torch.where(chosen < 0, lowest, chosen)
        found &= (chosen >= 0) & (chosen < DIGITS)
        chosen = chosen.clamp(0, DIGITS - 1)
        beyond = torch.cat([at_or_above, above[:, None]], dim=-1)  # d + 1 = DIGITS: keys > prefix
        above = beyond.gather(1, (chosen + 1)[:, None]).squeeze(1)
        prefix = (prefix << DIGIT_BITS) | chosen
    return prefix, found


def _top_p_target(mass: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM drops, in ascending order, each value x whose cumulative mass (its own included, over
    the candidates' total M) is <= 1 - p, the largest always kept; ties keep all (as
    `fusedrl.sampling`). So x is kept iff mass(> x) < p M, and the smallest kept value is the
    largest x with mass(>= x) >= p M: a select whose target is p M."""
    return mass * top_p


@torch.no_grad()
def row_floors(
    scaled: torch.Tensor, sampling: SamplingMask, vocab: int, reduce: Reduce
) -> torch.Tensor:
    """[n] floors of the sampled sets of [n, V_r] temperature-scaled slices of rows whose whole
    width is `vocab`; `reduce` sums (or maxes) a tensor over the group in place. A token is in
    its row's set iff scaled >= floor (`mask_slice` keeps the label and NaN too)."""
    rows = scaled.shape[0]
    floor = torch.full((rows,), -math.inf, dtype=scaled.dtype, device=scaled.device)
    if rows == 0 or not sampling.active:
        return floor
    nan = scaled.isnan()
    top_p = sampling.top_p is not None and sampling.top_p < 1
    top = None
    if top_p or (sampling.min_p is not None and sampling.min_p > 0):
        top = torch.full_like(floor, -math.inf)  # a rank of only padding still takes part
        if scaled.shape[-1]:
            top = torch.where(nan, -math.inf, scaled).amax(-1)
        reduce(top, dist.ReduceOp.MAX)
        if sampling.min_p is not None and sampling.min_p > 0:
            floor = torch.maximum(floor, top + math.log(sampling.min_p))
    keys, key_bits = _order_keys(scaled)
    if sampling.top_k is not None and sampling.top_k < vocab:
        counted = (~nan).to(scaled.dtype)
        target = torch.full((rows,), float(sampling.top_k), dtype=scaled.dtype, device=floor.device)
        kth, found = _radix_select(keys, key_bits, counted, target, reduce)
        kth_value = _key_values(kth, key_bits, scaled.dtype)
        floor = torch.maximum(floor, torch.where(found, kth_value, -math.inf))
    if top_p:
        shift = torch.where(torch.isfinite(top), top, 0.0)
        candidate = (scaled >= floor[:, None]) & ~nan
        weights = torch.where(candidate, torch.exp(scaled - shift[:, None]), 0.0)
        mass = weights.sum(-1)
        reduce(mass, dist.ReduceOp.SUM)
        target = _top_p_target(mass, sampling.top_p)
        smallest, found = _radix_select(keys, key_bits, weights, target, reduce)
        value = _key_values(smallest, key_bits, scaled.dtype)
        floor = torch.maximum(floor, torch.where(found, value, -math.inf))
    return floor


def group_reduce(group) -> Reduce:
    def reduce(tensor: torch.Tensor, op) -> None:
        all_reduce(tensor, group, op)

    return reduce


def rows_per_block(shard: VocabShard) -> int:
    """Rows of a select block: the same on every rank (the collectives must line up), sized by
    the widest slice as the torch backend sizes its blocks."""
    return block_rows(shard.widest)


def _flat_rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a [B, T, W] tensor as [n, W]: a view when it flattens, else a copy
    of those rows alone."""
    batch, time, width = x.shape
    try:
        return x.view(batch * time, width)[start:stop]
    except RuntimeError:
        flat = torch.arange(start, stop, device=x.device)
        return x[flat // time, flat % time]


@torch.no_grad()
def slice_floors(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    sampling: SamplingMask,
    shard: VocabShard,
    group,
    transform: LogitTransform | None = None,
    raw: bool = False,
) -> torch.Tensor:
    """[B * T] floors of the rows whose token columns on this rank are `logits` [B, T, width];
    `temperature` a float or the rows' own ([B, T]: each row's set is its temperature's).
    `transform`: a soft cap: the sets (and floors) are the capped logits'.

    `raw`: instead, each row's floor on this rank's raw logits (fp32, no soft cap), for the row
    kernels' `floors=`: the smallest logit of the slice in the set (+inf where none is), so that
    a logit x of the slice is in the set iff x >= it. It differs from rank to rank; the sets
    are the same."""
    if raw and transform is not None and transform.softcap is not None:
        raise ValueError("raw floors are thresholds on the raw logits: not under a soft cap")
    batch, time, _ = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 and not raw else torch.float32
    floors = torch.empty(batch * time, dtype=dtype, device=logits.device)
    step = rows_per_block(shard)
    for start in range(0, batch * time, step):
        stop = min(start + step, batch * time)
        rows_t = rows_temperature(temperature, start, stop)
        rows = _flat_rows(logits, start, stop)
        scaled = _scaled(capped_rows(rows, transform), rows_t)
        floor = row_floors(scaled, sampling, shard.vocab_size, group_reduce(group))
        if raw and rows.shape[-1] == 0:  # a rank of only padding: none of the set here
            floor = torch.full_like(floor, math.inf, dtype=torch.float32)
        elif raw:  # (a NaN is in no set here: the kernels keep it whatever the floor)
            in_set = scaled >= floor[:, None]
            floor = torch.where(in_set, rows.float(), math.inf).amin(-1)
        floors[start:stop] = floor
    return floors


@torch.no_grad()
def mask_slice(
    logits: torch.Tensor,
    labels: torch.Tensor,
    floors: torch.Tensor,
    temperature: float | torch.Tensor,
    out: torch.Tensor,
    transform: LogitTransform | None = None,
) -> None:
    """out = `logits` [B, T, W] with -inf below each row's floor, except the row's label (local
    column; < 0: on another rank) and NaN; `out` may be `logits`. No communication.
    `temperature`: a float or the rows' own ([B, T]); `transform`: a soft cap (the floors are
    the capped logits'; `out` keeps the raw ones, which the kernels cap as they read)."""
    flat_labels = labels.reshape(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    for start, (block, out_block) in row_blocks(logits, out):
        stop = start + block.shape[0]
        scaled = _scaled(capped_rows(block, transform), rows_temperature(temperature, start, stop))
        keep = (scaled >= floors[start:stop, None]) | scaled.isnan()
        keep |= columns == flat_labels[start:stop, None]
        out_block.copy_(torch.where(keep, block, -math.inf))
