"""Context parallelism: packed sequences split over the ranks of a group (verl's Ulysses
sequence parallelism, torch's context parallel), `policy_loss(..., cu_seqlens=, cp_group=)`.

Each rank holds a contiguous chunk of the packed token stream, in rank order: rank r's logits
[N_r, V] are tokens offset_r .. offset_r + N_r of the N tokens that `cu_seqlens` (the whole
batch's boundaries, the same on every rank) cuts into S sequences; a sequence may cross ranks.
Every per-token input is the rank's chunk [N_r]; `advantages` and `is_weights` may be one per
sequence as [S, 1] (the same on every rank; a one-dimensional [S] could read as per token on a
rank whose chunk holds S tokens, so it is refused by name); temperatures per token or one.
The LM-head form (`linear_policy_loss(..., cp_group=)`) takes each rank's chunk of the hidden
states [N_r, H] and the whole head.

How: each rank reads its chunk's logits once for the log-probs and entropy (the log-prob pass,
differentiable). One all-gather then brings every rank's per-token scalars (the mask, the
log-probs and entropy, the rollout's log-probs, per-token advantages, weights, temperatures: a
few floats a token, never the logits) to every rank, which computes the loss's terms over the
whole batch alike (the packed two-pass route's: fusedrl/packed.py) and hands its own chunk's
d(loss)/d(logp) and d(loss)/d(entropy) to its log-prob pass's backward, which reads its logits
once more and writes their gradient (2R + 1W; no collective in the backward).

Outputs: the loss and the metrics, the same on every rank (the whole batch's); logp and
entropy of this rank's chunk [N_r]. The gradient is d(loss)/d(this rank's logits): summed over
the group, the model's parameter gradients are the single-process ones (pass `grad_scale=`
the group's size where the data-parallel reduction averages over it instead).

Before the data, a header (one all-gather of 4 int64 a rank): each rank's N_r, whether its own
checks and log-prob pass went through (and the entry point's before them: `argument_checks`),
a hash of the settings every rank must share (`cu_seqlens`, `max_seqlen`, the config,
normalizer, grad_scale, per-sequence [S, 1] values, a 0-dim temperature, the entropy_coef
tensor) and which columns it sends, so that a bad argument on one rank, or settings that
differ, raise on every rank instead of leaving the others in the all-gather; what is checked
after it, every rank checks alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

import fusedrl.packed as packed

from ._inputs import check_config, check_logits
from .arguments import ModelHead, RolloutInputs
from .config import LossConfig
from .output import LossOutput
from .segments import Segments, check_cu_seqlens, layout_length, sum_norm_normalizer
from .tp.comm import all_gather, group_rank_and_size
from .tp.header import argument_checks as tp_argument_checks
from .tp.header import replicated_hash


class ContextParallelInputError(ValueError):
    """Bad input to a context-parallel call, found by the header on every rank."""


def policy_loss(
    rows: packed.LogitsRows | packed.HeadRows,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig | None,
    normalizer,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    cp_group,
    return_entropy: bool,
    entropy_coef: torch.Tensor | None,
    grad_scale,
) -> LossOutput:
    """`fusedrl.policy_loss` / `linear_policy_loss` of this rank's chunk of packed sequences
    (the module docstring says how) on the call's `rows` (its logits [N_r, V], or its hidden
    states [N_r, H] and the LM head), its rollout inputs and model head as objects."""
    cfg = config if config is not None else LossConfig()
    rank, world = group_rank_and_size(cp_group)
    own = logp = entropy = failure = None
    try:  # everything a rank reads alone, before any collective (a failure joins the header)
        check_config(cfg)
        want_entropy = return_entropy or cfg.needs_entropy or entropy_coef is not None
        _local_checks(rows, labels, mask, advantages, rollout, head, cu_seqlens)
        valid = mask != 0
        temperature = cfg.temperature
        if isinstance(head.temperature, torch.Tensor):  # per token, or one for all
            temperature = torch.where(valid, head.temperature.float(), 1.0)
        sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p}
        logp, entropy = rows.logprobs(
            torch.where(valid, labels, 0), temperature, want_entropy, head.transform, **sampling
        )
        own = _own_columns(mask, valid, logp, entropy, advantages, rollout, head)
    except (TypeError, ValueError, NotImplementedError) as err:
        failure = err
    # (the values every rank gives whole: per-sequence [S, 1] ones, a 0-dim temperature, the
    # entropy coefficient's tensor)
    shared = [v for v in (advantages, rollout.is_weights) if _is_tensor(v, dims=(2,))]
    shared += [v for v in (head.temperature,) if _is_tensor(v, dims=(0,))]
    shared += [] if entropy_coef is None else [entropy_coef]  # (any shape: hashed whole)
    settings = (cu_seqlens, max_seqlen, cfg, normalizer, grad_scale, shared)
    sizes = _header(rows.source, settings, own, failure, cp_group, world, rank)
    # From here every rank holds the same boundaries, settings and layout: what raises, raises
    # on every rank alike.
    tokens, offset = sum(sizes), sum(sizes[:rank])
    mine = slice(offset, offset + sizes[rank])
    whole = torch.empty((tokens, 1), device=rows.source.device)  # (what cu_seqlens counts)
    checked = check_cu_seqlens(cu_seqlens, whole, max_seqlen)
    segments = Segments(checked, tokens, layout_length(cfg, max_seqlen))
    normalizer = sum_norm_normalizer(segments, cfg, normalizer)
    full = _gather(own, sizes, cp_group, world)
    whole_rollout = RolloutInputs(
        **{f.name: full.get(f.name, getattr(rollout, f.name)) for f in dataclasses.fields(rollout)}
    )
    whole_head = dataclasses.replace(head, temperature=full.get("temperature", head.temperature))
    options = {"return_entropy": return_entropy, "grad_scale": grad_scale}
    if entropy_coef is not None:
        options["entropy_coef"] = entropy_coef
    inp = packed.padded_inputs(
        rows,
        segments,
        torch.zeros(tokens, dtype=torch.long, device=whole.device),
        # (gathered per token, or [S, 1] per sequence: never the ambiguous 1-D [S])
        full["advantages"]
        if "advantages" in full
        else segments.per_token(advantages, "advantages"),
        full["mask"],
        whole_rollout,
        whole_head,
        cfg,
        normalizer,
        options,
    )
    counted = segments.unpad(inp.valid.float()) != 0
    values = (
        torch.where(counted, full["logp"], 0.0),
        None if entropy is None else torch.where(counted, full["entropy"], 0.0),
    )
    terms, loss = packed.terms_with_grads(rows, segments, values, (logp, entropy), inp, cfg, mine)
    return LossOutput(
        loss=loss,
        logp=own["logp"],
        entropy=own["entropy"] if return_entropy else None,
        metrics=terms.metrics,
    )


def _local_checks(rows, labels, mask, advantages, rollout, head, cu_seqlens) -> None:
    """This rank's arguments alone: [N_r, V] logits (or [N_r, H] hidden states), every
    per-token input [N_r]; `advantages` and `is_weights` [N_r] per token or [S, 1] per sequence
    (a one-dimensional [S] could read as either where a chunk holds S tokens); per-token or one
    temperature (their values, and the labels', the log-prob pass checks)."""
    source = "logits" if isinstance(rows, packed.LogitsRows) else "hidden"
    logits = check_logits(rows.source, name=source)
    if logits.dim() != 2:
        raise ValueError(
            f"cp_group takes packed [N, {'V' if source == 'logits' else 'H'}] {source} (this "
            f"rank's chunk), got {tuple(logits.shape)}"
        )
    if getattr(rows, "skip_masked_rows", False) or getattr(rows, "live_rows", None) is not None:
        raise NotImplementedError("skip_masked_rows / live_rows with cp_group is not supported")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cp_group needs cu_seqlens: the whole batch's [S + 1] boundaries")
    if cu_seqlens.device != logits.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, the {source} on {logits.device}")
    chunk, sequences = (logits.shape[0],), cu_seqlens.numel() - 1
    per_token = {"labels": labels, "mask": mask, **rollout.per_token()}
    temperature = head.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        per_token["temperature"] = temperature  # (per sequence: not under cp_group)
    for name, value in per_token.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if isinstance(value, torch.Tensor) and tuple(value.shape) != chunk:
            raise ValueError(
                f"{name} shape {tuple(value.shape)} must be [{chunk[0]}]: one per token of this "
                "rank's chunk (cp_group)"
            )
    floats = {"advantages": advantages, "is_weights": rollout.is_weights, **per_token}
    for name, value in floats.items():  # (gathered as fp32: the padded call's dtype checks
        # would see fp32 columns, so an integer tensor is named here)
        if name not in ("labels", "mask") and isinstance(value, torch.Tensor):
            if not value.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    for name, value in (("advantages", advantages), ("is_weights", rollout.is_weights)):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if value is not None and shape not in (chunk, (sequences, 1)):
            raise ValueError(
                f"{name} shape {shape} must be [{chunk[0]}] (one per token of this rank's chunk) "
                f"or [{sequences}, 1] (one per sequence of cu_seqlens) under cp_group"
            )


# The columns a rank may send beside the mask and log-probs; the header compares which it sends.
OPTIONAL_COLUMNS = (
    "entropy",
    "old_logp",
    "ref_logp",
    "rollout_logp",
    "prox_logp",
    "advantages",
    "is_weights",
    "temperature",
)


def _own_columns(mask, valid, logp, entropy, advantages, rollout, head) -> dict:
    """This rank's per-token scalars for the gather (0 where a token does not count)."""
    own = {"mask": mask, "logp": torch.where(valid, logp.detach(), 0.0)}
    if entropy is not None:
        own["entropy"] = torch.where(valid, entropy.detach(), 0.0)
    own.update({k: v for k, v in rollout.per_token().items() if v is not None})
    for name, value in (("advantages", advantages), ("is_weights", rollout.is_weights)):
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            own[name] = value  # per token ([S, 1]: per sequence, the same on every rank)
    if isinstance(head.temperature, torch.Tensor) and head.temperature.dim() == 1:
        own["temperature"] = head.temperature
    return own


def _header(source, settings: tuple, own, failure, group, world: int, rank: int) -> list[int]:
    """Every rank's chunk size, once every rank's own checks and log-prob pass passed, and the
    ranks agree on the settings (boundaries, max_seqlen, config, normalizer, grad_scale) and
    on which columns they send; else the same error on every rank (the failing rank its
    own)."""
    size = source.shape[0] if isinstance(source, torch.Tensor) and source.dim() >= 1 else -1
    device = source.device if isinstance(source, torch.Tensor) else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.zeros(4, dtype=torch.int64, device=device)
    local[0], local[1] = size, int(failure is not None)
    if failure is None:
        local[2] = _settings_digest(settings, device)
        local[3] = sum(1 << i for i, name in enumerate(OPTIONAL_COLUMNS) if name in own)
    rows = all_gather(local, group, world).tolist()
    failed = [r for r, row in enumerate(rows) if row[1]]
    if failed:
        if failure is not None:
            raise failure
        raise ContextParallelInputError(
            f"fusedrl context parallel: rank(s) {failed} rejected their inputs (their error "
            "names the argument)"
        )
    # (which columns first: a per-sequence value on some ranks alone is a layout that differs)
    if len({row[3] for row in rows}) > 1:
        raise ContextParallelInputError(
            "fusedrl context parallel: ranks disagree on which inputs they give, or on which "
            "are per token: every rank gives the same ones, advantages / is_weights [N_r] per "
            "token or [S, 1] per sequence on every rank"
        )
    if len({row[2] for row in rows}) > 1:
        raise ContextParallelInputError(
            "fusedrl context parallel: ranks disagree on cu_seqlens, max_seqlen, the config, "
            "normalizer, grad_scale, the per-sequence [S, 1] advantages / is_weights, a 0-dim "
            "temperature or the entropy_coef tensor (each must be the same on every rank)"
        )
    return [row[0] for row in rows]


def _is_tensor(value: object, dims: tuple[int, ...]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() in dims


def _settings_digest(settings: tuple, device) -> torch.Tensor:
    """A 0-dim int64 hash of what every rank must share (no host sync)."""
    cu_seqlens, max_seqlen, cfg, normalizer, grad_scale, shared = settings
    digest = replicated_hash(cu_seqlens.long(), None, device)
    digest = digest ^ (zlib.crc32(f"{max_seqlen!r} {cfg!r}".encode()) << 1)
    for factor, value in enumerate((normalizer, grad_scale, *shared), start=3):
        if value is not None:
            digest = digest ^ (replicated_hash(value, None, device) * factor)
    return digest


@contextlib.contextmanager
def argument_checks(cp_group, source: object) -> Iterator[None]:
    """Around the checks an entry point runs before a context-parallel call reaches its header
    (`source`: the call's logits or hidden states): a bad argument on one rank joins the
    group's header, where every other rank raises a ContextParallelInputError naming it,
    instead of raising there alone while they wait for it."""
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as err:
        if cp_group is None or isinstance(err, ContextParallelInputError):
            raise
        try:
            rank, world = group_rank_and_size(cp_group)
        except Exception:  # (not a group: nothing to join)
            raise err from None
        if world == 1:
            raise
        _header(source, None, None, err, cp_group, world, rank)
        raise  # (_header raised it already)


def _gather(own: dict, sizes: list[int], group, world: int) -> dict:
    """Every rank's per-token columns, whole: one all-gather of [max N_r, K] fp32 (a bool mask
    comes back bool; fp32 holds every value these columns take as they are)."""
    names = list(own)
    width = max(sizes)
    device = own["mask"].device
    stacked = torch.zeros((width, len(names)), dtype=torch.float32, device=device)
    stacked[: sizes[group_rank_and_size(group)[0]]] = torch.stack(
        [own[name].float() for name in names], dim=1
    )
    parts = all_gather(stacked, group, world)
    columns = torch.cat([parts[r, : sizes[r]] for r in range(world)])
    full = {name: columns[:, i] for i, name in enumerate(names)}
    if own["mask"].dtype == torch.bool:
        full["mask"] = full["mask"] != 0
    return full


@contextlib.contextmanager
def group_argument_checks(sharded: bool, source: object, tp_group, cp_group) -> Iterator[None]:
    """The entry points' checks before a parallel call's header: a bad argument on one rank
    raises on every rank of its tensor-parallel (`tp.header.argument_checks`) and its
    context-parallel group (`argument_checks`)."""
    with tp_argument_checks(sharded, source, tp_group), argument_checks(cp_group, source):
        yield
