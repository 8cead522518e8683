"""The header: a few ints per rank, exchanged once per call before any per-token data.

A rank that raised alone would leave the others waiting in the next collective forever. So the
ranks first share what must agree (shapes, the vocab layout, the dtype, the settings) and the
facts about their inputs that need the whole group to judge (the label range against the global
vocab size, a hash of each replicated input, whether their own checks passed); then every rank
runs the same checks on the same gathered numbers and raises the same error, or none does.
It costs one all-gather of len(FIELDS) int64 per rank and one device-to-host read.
"""

from __future__ import annotations

import contextlib
import numbers
import re
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
HOST_FIELDS = (
    "failed",
    "batch",
    "time",
    "flat",
    "size",
    "start",
    "vocab_size",
    "dtype",
    "call",
    "seed",
)
LABEL_FIELDS = ("label_min", "label_max", "label_count")
# The per-token (and scalar) inputs every rank must hold alike, each compared by a hash of its
# bits in the header (`replicated_hash`); the LM-head forms' hidden states are not (hashing
# [N, H] would cost more than the call's header is worth; docs/tensor_parallel.md says so).
REPLICATED = (
    "cu_seqlens",  # packed sequences' boundaries (not per token: hashed whole, as the mask);
    # first, so that boundaries that differ are named before the padded inputs they move
    "labels",
    "mask",
    "advantages",
    "old_logp",
    "ref_logp",
    "rollout_logp",
    "is_weights",
    "temperature",
    "normalizer",
    "grad_scale",
)
FIELDS = HOST_FIELDS + LABEL_FIELDS + tuple(f"hash_{name}" for name in REPLICATED)
_ABSENT = 0  # the hash of an input not given (None, or a number folded into `call`)


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
    """[label_min, label_max, label_count] over the counted tokens, on the device (no host
    sync); placeholders when the inputs are malformed (their own checks say why)."""
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
        return torch.tensor([_NO_LABEL, -_NO_LABEL, 0], dtype=torch.int64, device=device)
    labels = labels.long()
    counted = torch.ones_like(labels, dtype=torch.bool) if valid is None else valid != 0
    return torch.stack(
        [
            torch.where(counted, labels, _NO_LABEL).amin(),
            torch.where(counted, labels, -_NO_LABEL).amax(),
            counted.sum(),
        ]
    )


# splitmix64's finaliser (as signed int64): every input bit flips about half of the output bits,
# so a sum of mixed (value, position) words has no linear collisions: changes that cancel in a
# weighted sum of the values ((+1, -2, +1) at neighbouring positions) do not cancel here.
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)  # logical: torch's >> on int64 keeps the sign


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _MIX1  # int64 products wrap alike on every rank
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _bits(value: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as int64, one word per element: bit-exact, so that -0.0 and 0.0 or two
    NaN payloads differ as they would in the computation."""
    value = value.detach().contiguous()
    if value.dtype.is_floating_point:
        value = value.view(_INT_OF_WIDTH[value.element_size()])
    return value.long()


def replicated_hash(
    value: object, counted: torch.Tensor | None, device, position_keys=None
) -> torch.Tensor:
    """A 0-dim int64 hash of `value`'s bits and their positions, over the tokens `counted`
    (broadcast over its trailing dims: what a masked token holds never counts); a number is
    hashed as its float64 bits, None as _ABSENT. On the device, no host sync.
    `position_keys(numel, device)`: the mixed positions 1..numel (`_position_keys`), shared by
    the call's inputs of one size."""
    if value is None:
        return torch.full((), _ABSENT, dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), float(value), dtype=torch.float64, device=device)
    elif value.dim() == 0:
        value = value.double()  # a scalar tensor and the same number hash alike
    bits = _bits(value)
    keys = (position_keys or _position_keys)(bits.numel(), bits.device)
    mixed = _mix(bits ^ keys.view(bits.shape))
    if counted is not None and counted.shape == bits.shape[: counted.dim()]:
        keep = counted.reshape(*counted.shape, *([1] * (bits.dim() - counted.dim())))
        mixed = torch.where(keep, mixed, 0)
    return mixed.sum().to(device)


def _position_keys(numel: int, device) -> torch.Tensor:
    return _mix(torch.arange(1, numel + 1, device=device))


def _replicated_hashes(values: dict, counted: object, device) -> torch.Tensor:
    unknown = set(values) - set(REPLICATED)
    if unknown:  # a programming error of the caller's, never the user's
        raise KeyError(f"no header field for {sorted(unknown)}; known: {REPLICATED}")
    counted = counted if isinstance(counted, torch.Tensor) else None
    keys: dict = {}  # the [B, T] inputs share their mixed positions: made once a call

    def position_keys(numel: int, on) -> torch.Tensor:
        if (numel, on) not in keys:
            keys[numel, on] = _position_keys(numel, on)
        return keys[numel, on]

    return torch.stack(
        [
            replicated_hash(
                values.get(name),
                None if name in ("mask", "cu_seqlens") else counted,
                device,
                position_keys,
            )
            for name in REPLICATED
        ]
    )


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
    replicated: Callable[[object], tuple[dict, object]] | None = None,
    draw_seed: bool = False,
) -> tuple[object, VocabShard, int]:
    """This rank's own checks, then the header: (what `local_checks()` returned, the group's
    layout, rank 0's random seed), or the same error on every rank.

    `tokens`: the per-token tensor the call reads ([B, T, V_r] / [N, V_r] logits, or the hidden
    states of the LM-head forms), giving B, T and the dtype; `vocab_rows()`: this rank's V_r
    (asked once the local checks passed). `call` describes the settings every rank must share
    (the config, the temperature). `replicated(checked)`: ({name in REPLICATED: the checked
    input, or None}, the counted tokens [B, T] bool or None), hashed for the header once the
    local checks passed. `draw_seed`: draw a seed from this rank's generator; every rank uses
    rank 0's, so that random token selections (clip_cov without a seed) are the same everywhere.
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
    values, counted = ({}, None)
    if failure is None and replicated is not None:
        values, counted = replicated(checked)
    local = torch.cat(
        [
            torch.tensor(host, dtype=torch.int64, device=device),
            _label_stats(labels, valid, tokens, device),
            _replicated_hashes(values, counted, device),
        ]
    )
    rows = [dict(zip(FIELDS, row)) for row in all_gather(local, group, world).tolist()]
    shard = check(rows, rank, failure, lambda: _gather_text(call, group, world, device))
    return checked, shard, rows[0]["seed"]


def loss_inputs_replicated(inp, cu_seqlens=None) -> tuple[dict, torch.Tensor]:
    """`agree`'s `replicated` for the policy losses: their checked `LossInputs` (and packed
    sequences' boundaries, which their aggregation weights come from)."""
    values = {
        "cu_seqlens": _boundaries(cu_seqlens),
        "labels": inp.labels,
        "mask": inp.mask,
        "advantages": inp.advantages,
        "old_logp": inp.old_logp,
        "ref_logp": inp.ref_logp,
        "rollout_logp": inp.rollout_logp,
        "is_weights": inp.is_weights,
        "normalizer": inp.normalizer,
        "temperature": inp.row_temps,  # (a number is in the call's settings)
        "grad_scale": inp.grad_scale,
    }
    return values, inp.valid


def logprob_inputs_replicated(labels, temperature, cu_seqlens=None) -> tuple[dict, None]:
    """`agree`'s `replicated` for the log-prob functions: the checked labels and temperature
    (and packed sequences' boundaries, where a loss's per-sequence terms follow the pass)."""
    per_token = temperature if isinstance(temperature, torch.Tensor) else None
    return {"labels": labels, "temperature": per_token, "cu_seqlens": _boundaries(cu_seqlens)}, None


def with_compared(replicated: tuple[dict, object], compared) -> tuple[dict, object]:
    """`replicated` and, where a packed loss hands them (`compared`: (values, counted) of its
    padded inputs, `loss_inputs_replicated`'s), the loss's own inputs beside the log-prob
    pass's labels and temperature (those stay the pass's own)."""
    if compared is None:
        return replicated
    extra, counted = compared
    own = {k: v for k, v in extra.items() if k not in ("labels", "temperature")}
    return {**replicated[0], **own}, counted


def _boundaries(cu_seqlens):
    """int32 and int64 boundaries hash alike."""
    return cu_seqlens.long() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens


def _disagree(what: str, values: list) -> TensorParallelInputError:
    per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    return TensorParallelInputError(
        f"fusedrl tensor parallel: ranks disagree on {what} ({per_rank})"
    )


def _gather_text(text: str, group, world: int, device: torch.device) -> list[str]:
    """Every rank's `text` (two all-gathers: the lengths, then the padded bytes). Only on the
    error path, which every rank takes alike (their header said so)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = all_gather(torch.tensor([data.numel()], device=device), group, world)
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = all_gather(padded.to(device), group, world).cpu()
    return [bytes(row[:n].tolist()).decode() for row, n in zip(rows, lengths.view(-1).tolist())]


_SETTING = re.compile(r"(\w+)=('[^']*'|\([^()]*\)|[^\s,()]+)")


def settings_disagree(calls: list[str]) -> TensorParallelInputError:
    """The error for ranks whose settings differ, naming the settings that do (`key=value`
    pairs of the calls, compared in order), or the whole settings where their lists differ."""
    pairs = [_SETTING.findall(call) for call in calls]
    if len({tuple(key for key, _ in p) for p in pairs}) == 1:
        differing = [
            f"{key} ({', '.join(f'rank {r}: {p[i][1]}' for r, p in enumerate(pairs))})"
            for i, (key, _) in enumerate(pairs[0])
            if len({p[i][1] for p in pairs}) > 1
        ]
        if differing:
            return TensorParallelInputError(
                "fusedrl tensor parallel: ranks disagree on the settings: " + "; ".join(differing)
            )
    return _disagree("the settings", calls)


def check(
    rows: list[dict], rank: int, failure: BaseException | None, calls: Callable[[], list[str]]
) -> VocabShard:
    """The checks every rank runs on the same gathered header (so they raise alike); `calls()`
    gathers every rank's settings, to name those that differ."""
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
    dtypes = [
        str(_DTYPES[h["dtype"]]).replace("torch.", "") if h["dtype"] != NONE else "?" for h in rows
    ]
    if len(set(dtypes)) > 1:
        raise _disagree("the dtype of the logits (or hidden)", dtypes)
    if len({h["call"] for h in rows}) > 1:
        raise settings_disagree(calls())
    shard = _layout(rows, rank)
    _check_replicated(rows, shard.vocab_size)
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
                    )
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


def _check_replicated(rows: list[dict], vocab_size: int) -> None:
    counted = [h for h in rows if h["label_count"] > 0]
    if counted:
        low = min(h["label_min"] for h in counted)
        high = max(h["label_max"] for h in counted)
        if low < 0 or high >= vocab_size:
            raise TensorParallelInputError(
                f"labels must be global token ids in [0, {vocab_size}) where mask is set "
                f"(vocab_size = {vocab_size}), found {low if low < 0 else high}"
            )
    counts = [h["label_count"] for h in rows]
    if len(set(counts)) > 1:
        raise _disagree("the number of counted tokens (mask != 0)", counts)
    for name in REPLICATED:
        hashes = [h[f"hash_{name}"] for h in rows]
        if len(set(hashes)) > 1:
            shown = ["not given" if v == _ABSENT else f"{v & ((1 << 64) - 1):016x}" for v in hashes]
            raise _disagree(
                f"{name}, which must be the same on every rank (a hash of its bits where the mask "
                "is set)",
                shown,
            )


def join_refusing(group, error: BaseException, tokens: object) -> NoReturn:
    """A rank whose arguments failed before its header still takes part in it, carrying the
    failure: it raises `error`, every other rank a TensorParallelInputError naming it, where
    they would otherwise wait for it forever in their header."""

    def local_checks() -> None:
        raise error

    agree(
        group,
        local_checks,
        tokens=tokens,
        vocab_rows=lambda: NONE,
        labels=None,
        valid=None,
        vocab_start=None,
        vocab_size=None,
        call="",
    )
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
