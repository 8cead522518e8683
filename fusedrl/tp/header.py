"""The header: a few ints per rank, exchanged once per call before any per-token data.

A rank that raised alone would leave the others waiting in the next collective forever. So the
ranks first share what must agree (shapes, the vocab layout, the dtype, the settings) and the
facts about their inputs that need the whole group to judge (the label range against the global
vocab size, a checksum of the replicated labels, whether their own checks passed); then every
rank runs the same checks on the same gathered numbers and raises the same error, or none does.
It costs one all-gather of len(FIELDS) int64 per rank and one device-to-host read.
"""

from __future__ import annotations

import contextlib
import numbers
import zlib
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch

from ..config import LossConfig
from .comm import all_gather, group_rank_and_size, header_device
from .shard import VocabShard

NONE = -1  # an optional field left out (vocab_start / vocab_size not given)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_NO_LABEL = 1 << 62

# Host-side fields first, then the label statistics computed on the labels' device.
HOST_FIELDS = ("failed", "batch", "time", "flat", "size", "start", "vocab_size", "dtype", "call",
               "seed")  # fmt: skip
LABEL_FIELDS = ("label_min", "label_max", "label_sum", "label_count", "mask_sum")
FIELDS = HOST_FIELDS + LABEL_FIELDS


class TensorParallelInputError(ValueError):
    """Bad input to a tensor-parallel call, found by the header's checks on every rank."""


# The local checks take the labels with no upper bound (`range_unchecked`): their range needs
# the global vocab size, which the header settles (and then checks on every rank alike).
NO_LIMIT = 1 << 62


def range_unchecked(labels: object) -> object:
    """labels with negative ids raised to 0, for the local checks only (see NO_LIMIT); the
    header carries their true minimum. Anything but an integer tensor is passed on as is, for
    the local checks to name."""
    if isinstance(labels, torch.Tensor) and not (
        labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex()
    ):
        return labels.clamp_min(0)
    return labels


def unseeded_pick(cfg: object) -> bool:
    """clip_cov without clip_cov_seed picks tokens at random: every rank must pick the same
    ones, so `agree` draws a seed on every rank and all use rank 0's (`seeded`)."""
    return isinstance(cfg, LossConfig) and cfg.loss == "clip_cov" and cfg.clip_cov_seed is None


def seeded(cfg: LossConfig, seed: int) -> LossConfig:
    return cfg.replace(clip_cov_seed=seed) if unseeded_pick(cfg) else cfg


def check_vocab_arguments(vocab_start: object, vocab_size: object) -> None:
    for name, value, low in (("vocab_start", vocab_start, 0), ("vocab_size", vocab_size, 1)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value}")


def _label_stats(labels: object, valid: object, tokens: object, device) -> torch.Tensor:
    """[label_min, label_max, label_sum, label_count, mask_sum] over the counted tokens, on the
    device (no host sync); placeholders when the inputs are malformed (their own checks say
    why). The sums weigh each token by its position (int64, wrapping alike on every rank), so
    that labels or mask weights moved between tokens change them; mask_sum sums the bits of the
    fp32 mask weights, so that a weight changed anywhere does."""
    well_formed = (
        isinstance(labels, torch.Tensor)
        and isinstance(tokens, torch.Tensor)
        and not (labels.dtype.is_floating_point or labels.dtype == torch.bool)
        and not labels.is_complex()
        and tuple(labels.shape) == tuple(tokens.shape[:-1])
        and labels.device == device
        and (
            valid is None
            or (
                isinstance(valid, torch.Tensor)
                and valid.shape == labels.shape
                and valid.device == device
            )
        )
    )
    if not well_formed or labels.numel() == 0:
        return torch.tensor([_NO_LABEL, -_NO_LABEL, 0, 0, 0], dtype=torch.int64, device=device)
    labels = labels.long()
    position = torch.arange(1, labels.numel() + 1, device=device).view(labels.shape)
    if valid is None:
        counted, bits = torch.ones_like(labels, dtype=torch.bool), torch.zeros_like(labels)
    else:
        counted = valid != 0
        bits = valid.float().contiguous().view(torch.int32).long()
    return torch.stack([
        torch.where(counted, labels, _NO_LABEL).amin(),
        torch.where(counted, labels, -_NO_LABEL).amax(),
        (torch.where(counted, labels, 0) * position).sum(),
        counted.sum(),
        (bits * position).sum(),
    ])  # fmt: skip


def _host_fields(tokens, vocab_rows, vocab_start, vocab_size, call, failed, seed) -> list:
    shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else ()
    ok = len(shape) in (2, 3)
    lead = (1, *shape[:-1]) if len(shape) == 2 else shape[:-1]
    dtype = tokens.dtype if isinstance(tokens, torch.Tensor) else None
    return [
        int(failed),
        lead[0] if ok else NONE,
        lead[1] if ok else NONE,
        int(len(shape) == 2),
        NONE if vocab_rows is None else vocab_rows,
        NONE if vocab_start is None or failed else int(vocab_start),
        NONE if vocab_size is None or failed else int(vocab_size),
        _DTYPES.index(dtype) if dtype in _DTYPES else NONE,
        zlib.crc32(call.encode()),
        seed,
    ]


def shown_temperature(temperature) -> str:
    """How `agree`'s `call` names a temperature: per-token ones by that fact (their values are
    replicated like every per-token input, not compared), a number by its repr."""
    return "per-token" if isinstance(temperature, torch.Tensor) else repr(temperature)


def agree(
    group,
    local_checks: Callable[[], object],
    *,
    tokens: object,
    vocab_rows: Callable[[], int],
    labels: object,
    valid: object,
    vocab_start: object,
    vocab_size: object,
    call: str,
    draw_seed: bool = False,
) -> tuple[object, VocabShard, int]:
    """This rank's own checks, then the header: (what `local_checks()` returned, the group's
    layout, rank 0's random seed), or the same error on every rank.

    `tokens`: the per-token tensor the call reads ([B, T, V_r] / [N, V_r] logits, or the hidden
    states of the LM-head forms), giving B, T and the dtype; `vocab_rows()`: this rank's V_r
    (asked once the local checks passed). `call` describes the settings every rank must share
    (the config, the temperature). `draw_seed`: draw a seed from this rank's generator; every
    rank uses rank 0's, so that random token selections (clip_cov without a seed) are the same
    everywhere.
    """
    rank, world = group_rank_and_size(group)
    failure = checked = None
    size = None
    try:
        check_vocab_arguments(vocab_start, vocab_size)
        checked = local_checks()
        size = vocab_rows()
    except Exception as err:  # raised below once every rank knows (else the others would hang)
        failure = err
    device = header_device(group, tokens)
    seed = int(torch.randint(0, 1 << 62, ())) if draw_seed else 0
    host = _host_fields(tokens, size, vocab_start, vocab_size, call, failure is not None, seed)
    local = torch.cat(
        [
            torch.tensor(host, dtype=torch.int64, device=device),
            _label_stats(labels, valid, tokens, device),
        ]
    )
    rows = [dict(zip(FIELDS, row)) for row in all_gather(local, group, world).tolist()]
    return checked, check(rows, rank, failure), rows[0]["seed"]


def _disagree(what: str, values: list) -> TensorParallelInputError:
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return TensorParallelInputError(
        f"fusedrl tensor parallel: ranks disagree on {what} ({per_rank})"
    )


def check(rows: list[dict], rank: int, failure: BaseException | None) -> VocabShard:
    """The checks every rank runs on the same gathered header (so they raise alike)."""
    failed = [r for r, h in enumerate(rows) if h["failed"]]
    if failed:
        if failure is not None:
            raise failure
        raise TensorParallelInputError(
            f"fusedrl tensor parallel: rank(s) {failed} rejected their inputs (each raised its "
            "own error there); no rank computed anything"
        )
    lead = [(h["time"],) if h["flat"] else (h["batch"], h["time"]) for h in rows]
    if len(set(lead)) > 1:
        raise _disagree("the token shape of logits / labels ([B, T] or [N])", lead)
    dtypes = [str(_DTYPES[h["dtype"]]).replace("torch.", "") if h["dtype"] != NONE else "?"
              for h in rows]  # fmt: skip
    if len(set(dtypes)) > 1:
        raise _disagree("the dtype of the logits (or hidden)", dtypes)
    if len({h["call"] for h in rows}) > 1:
        raise _disagree(
            "the settings (config / temperature; crc32 of each)", [h["call"] for h in rows]
        )
    shard = _layout(rows, rank)
    _check_labels(rows, shard.vocab_size)
    return shard


def _layout(rows: list[dict], rank: int) -> VocabShard:
    sizes = [h["size"] for h in rows]
    given = [h["start"] for h in rows]
    if NONE in given and any(s != NONE for s in given):
        raise _disagree("vocab_start (give it on every rank or on none)", given)
    if NONE in given:
        starts = [sum(sizes[:r]) for r in range(len(rows))]
    else:
        starts = given
        end = 0
        for r in sorted(range(len(rows)), key=lambda r: (starts[r], sizes[r])):
            if starts[r] != end:
                kind = "overlap" if starts[r] < end else "leave a gap"
                raise TensorParallelInputError(
                    f"fusedrl tensor parallel: the vocab slices {kind} at token id "
                    f"{min(end, starts[r])}: [vocab_start, vocab_start + V_r) per rank are "
                    + ", ".join(
                        f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})" for q in range(len(rows))
                    )  # fmt: skip
                    + "; they must tile [0, total) with no gap or overlap"
                )
            end += sizes[r]
    total = sum(sizes)
    declared = [h["vocab_size"] for h in rows]
    if len(set(declared)) > 1:
        raise _disagree("vocab_size", ["None" if v == NONE else v for v in declared])
    vocab_size = total if declared[0] == NONE else declared[0]
    if vocab_size > total:
        raise TensorParallelInputError(
            f"fusedrl tensor parallel: the vocab slices add up to {total} columns (V_r per rank: "
            f"{sizes}) but vocab_size is {vocab_size}: every token id must be in some rank's slice"
        )
    return VocabShard(rank=rank, starts=tuple(starts), sizes=tuple(sizes), vocab_size=vocab_size)


def _check_labels(rows: list[dict], vocab_size: int) -> None:
    counted = [h for h in rows if h["label_count"] > 0]
    if counted:
        low = min(h["label_min"] for h in counted)
        high = max(h["label_max"] for h in counted)
        if low < 0 or high >= vocab_size:
            raise TensorParallelInputError(
                f"labels must be global token ids in [0, {vocab_size}) where mask is set "
                f"(vocab_size = {vocab_size}), found {low if low < 0 else high}"
            )
    sums = [(h["label_sum"], h["label_count"], h["mask_sum"]) for h in rows]
    if len(set(sums)) > 1:
        raise _disagree(
            "the labels / mask, which must be the same on every rank (position-weighted sums of "
            "the counted labels, their count, and of the mask weights' bits)",
            sums,
        )


def join_refusing(group, error: BaseException, tokens: object) -> NoReturn:
    """A rank whose arguments failed before its header still takes part in it, carrying the
    failure: it raises `error`, every other rank a TensorParallelInputError naming it, where
    they would otherwise wait for it forever in their header."""

    def local_checks() -> None:
        raise error

    agree(group, local_checks, tokens=tokens, vocab_rows=lambda: NONE, labels=None, valid=None,
          vocab_start=None, vocab_size=None, call="")  # fmt: skip
    raise error  # (agree raised it already)


@contextlib.contextmanager
def argument_checks(sharded: bool, logits: object, tp_group) -> Iterator[None]:
    """Around the checks an entry point runs before a tensor-parallel call reaches its header:
    a bad argument on one rank joins the group's header (`join_refusing`) instead of raising
    there alone. `logits`: the call's logits (or hidden states), DTensor or local."""
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as err:
        if not sharded or isinstance(err, TensorParallelInputError):
            raise
        from .comm import group_size
        from .dtensor import unwrap_logits

        try:
            tokens, group = unwrap_logits(logits, tp_group)
        except (TypeError, ValueError):
            raise err from None
        if group_size(group) == 1:
            raise
        join_refusing(group, err, tokens)
