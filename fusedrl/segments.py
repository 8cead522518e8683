"""The boundaries of packed sequences: `cu_seqlens` checked, the padded layout of per-token
scalars, each token's aggregation weight per sequence.

What every packed call shares (fusedrl/packed.py, the policy loss; distillation's packed
aggregation): it reads `cu_seqlens` and the per-token scalars (mask, log-probs, a few floats a
token), never the logits. A loss whose terms need whole sequences takes them on the [S, T_max]
padded layout of those scalars (`Segments.pad` / `unpad`); T_max is `max_seqlen` when given,
else read from `cu_seqlens` (one host sync on a GPU).
"""

from __future__ import annotations

import functools

import torch

from ._inputs import _fail_if, prepare_loss_inputs
from .config import LossConfig
from .token_terms import Metrics, add_mismatch_metrics, aggregation_weights

_INDEX_DTYPES = (torch.int32, torch.int64)


class Segments:
    """The sequences of a packed batch: their boundaries and lengths, and, made when first used
    (a loss that sees no boundary never needs them, nor T_max's host read), the padded layout:
    each padded position's flat row (`rows`, N where the position is padding) and whether it
    holds a token (`inside`)."""

    def __init__(self, cu_seqlens: torch.Tensor, tokens: int, max_seqlen: int | None):
        self.tokens = tokens
        self.count = cu_seqlens.numel() - 1
        self.starts = cu_seqlens[:-1].long()
        self.lengths = cu_seqlens[1:].long() - self.starts
        self.bound = max_seqlen  # the caller's bound on the longest, or None

    @functools.cached_property
    def longest(self) -> int:
        """T_max: `max_seqlen`, or the longest sequence (a host read)."""
        if self.bound is not None:
            return self.bound
        return int(self.lengths.max()) if self.count else 0

    @functools.cached_property
    def inside(self) -> torch.Tensor:
        positions = torch.arange(self.longest, device=self.lengths.device)
        return positions < self.lengths[:, None]  # [S, T_max]

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        positions = torch.arange(self.longest, device=self.lengths.device)
        return torch.where(self.inside, self.starts[:, None] + positions, self.tokens)

    def stand_in(self, source: torch.Tensor, vocab: int) -> torch.Tensor:
        """[S, T_max, V] logits in name only (one V-wide row, expanded: nothing copied): what
        carries the vocabulary, dtype and device of the padded layout to the input checks."""
        return source.new_zeros(1, 1, vocab).expand(self.count, self.longest, -1)

    def check_per_token(self, tensors: dict) -> None:
        """Each per-token argument given is [N], one value per packed token."""
        for name, value in tensors.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) != (self.tokens,):
                raise ValueError(
                    f"{name} shape {tuple(value.shape)} must be [{self.tokens}]: one per packed "
                    "token (cu_seqlens)"
                )

    def pad(self, flat: torch.Tensor | None, fill: float | bool = 0) -> torch.Tensor | None:
        """A per-token [N] tensor on the [S, T_max] padded layout, `fill` on the padding."""
        if flat is None:
            return None
        padded = flat.new_full((self.tokens + 1,), fill)
        padded[: self.tokens] = flat
        return padded[self.rows]

    def unpad(self, padded: torch.Tensor | None) -> torch.Tensor | None:
        """The tokens of an [S, T_max] tensor, [N] (a scatter: no host sync)."""
        if padded is None:
            return None
        flat = padded.new_zeros(self.tokens + 1)
        flat.scatter_(0, self.rows.reshape(-1), torch.where(self.inside, padded, 0).reshape(-1))
        return flat[: self.tokens]

    def per_token(self, values: torch.Tensor | None, name: str) -> torch.Tensor | None:
        """One value per sequence [S] (or [S, 1]) repeated over its tokens, [N]; a per-token [N]
        tensor as it is. With N == S a 1-D tensor reads both ways; the readings agree where every
        sequence is one token long, and a pack with empty sequences is refused."""
        if values is None or (values.dim() == 1 and values.shape[0] == self.tokens):
            self.check_unambiguous(values, name)
            return values
        if tuple(values.shape) not in ((self.count,), (self.count, 1)):
            raise ValueError(
                f"{name} shape {tuple(values.shape)} must be [{self.tokens}] (one per token) or "
                f"[{self.count}] (one per sequence of cu_seqlens)"
            )
        return torch.repeat_interleave(values.reshape(-1), self.lengths, output_size=self.tokens)

    def padded_per_sequence_or_token(self, values: torch.Tensor | None, fill: float = 0.0):
        """A per-token [N] tensor padded to [S, T_max]; a per-sequence one ([S], [S, 1]) as it is
        (the padded call's own per-sequence layout)."""
        if values is None or not (values.dim() == 1 and values.shape[0] == self.tokens):
            return values
        return self.pad(values, fill)

    def check_unambiguous(self, values: torch.Tensor | None, name: str) -> None:
        """A caller's 1-D tensor of N == S values: one a token and one a sequence are the same
        reading only if every sequence is one token long; else (some empty, some longer) it is
        refused (without a host sync off the CPU). (Not for per-token columns made here, such
        as context parallelism's gathered ones.)"""
        one_dimensional = isinstance(values, torch.Tensor) and values.dim() == 1
        if one_dimensional and values.shape[0] == self.tokens == self.count and self.count:
            _fail_if(
                (self.lengths != 1).any(),
                f"{name} of shape {tuple(values.shape)} reads as one per token and one per "
                f"sequence alike ({self.tokens} tokens in {self.count} sequences, not one token "
                "each): pass [S, 1] for one per sequence, or per-token values on boundaries "
                "without empty sequences",
                values,
            )


def check_cu_seqlens(cu_seqlens: object, logits: object, max_seqlen: object) -> torch.Tensor:
    """`cu_seqlens`: a 1-D int32 / int64 tensor on the logits' device, 0 first, N last,
    never decreasing (the values checked without a host sync off the CPU), for [N, V] logits."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D [S + 1] (0 first, the token count last), got shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"cu_seqlens needs packed [N, V] logits (or [N, H] hidden states), got {shape}"
        )
    if cu_seqlens.device != logits.device:
        raise ValueError(
            f"cu_seqlens is on {cu_seqlens.device} but the logits are on {logits.device}"
        )
    if max_seqlen is not None and (
        isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0
    ):
        raise TypeError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    tokens = logits.shape[0]
    bad = (cu_seqlens[0] != 0) | (cu_seqlens[-1] != tokens)
    if cu_seqlens.numel() > 1:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        bad = bad | (lengths < 0).any()
        if max_seqlen is not None:
            _fail_if(
                (lengths > max_seqlen).any(),
                f"max_seqlen={max_seqlen} is shorter than the longest sequence in cu_seqlens",
                cu_seqlens,
            )
    _fail_if(
        bad,
        f"cu_seqlens must start at 0, never decrease and end at the token count {tokens}",
        cu_seqlens,
    )
    return cu_seqlens


def layout_length(cfg: LossConfig, max_seqlen: int | None) -> int | None:
    """The padded layout's T_max as `Segments` takes it: `max_seqlen`, the caller's bound on the
    longest sequence (it never changes a number: `sum_norm_normalizer`), except for GMPO under
    seq-mean-token-sum-norm without norm_constant, whose normalizer also counts its policy
    term's sequences: there the longest is read (one host sync on an accelerator)."""
    if cfg.agg == "seq-mean-token-sum-norm" and cfg.norm_constant is None and cfg.loss == "gmpo":
        return None
    return max_seqlen


def sum_norm_normalizer(segments: Segments, cfg: LossConfig, normalizer):
    """The normalizer that makes seq-mean-token-sum-norm without norm_constant divide by T, the
    longest sequence's length (the padded call on the sequences cut out; the oracle's), on a
    layout of T_max = max_seqlen, a bound that may exceed it (a pack's capacity): the sequence
    count (or the normalizer given) times longest / T_max, a device scalar (no host read).
    Anything else: `normalizer` as it is."""
    bounded = segments.bound is not None and segments.bound > 0 and segments.count > 0
    if cfg.agg != "seq-mean-token-sum-norm" or cfg.norm_constant is not None or not bounded:
        return normalizer
    base = float(segments.count) if normalizer is None else normalizer
    longest = segments.lengths.max().clamp_min(1).float()
    return base * longest / float(segments.bound)


def require_cu_seqlens(cu_seqlens: object, max_seqlen: object) -> None:
    if cu_seqlens is None and max_seqlen is not None:
        raise ValueError("max_seqlen is the longest packed sequence's: it needs cu_seqlens")


def check_packed_rows(cu_seqlens: object, rows: object, max_seqlen: object, temperature=None):
    """The log-prob functions' `cu_seqlens` / `max_seqlen`: checked as the loss's, and nothing
    more (each token's log-prob and entropy are its own row's, whatever the boundaries).
    Returns `temperature`, one per sequence ([S] or [S, 1], as the loss takes them) repeated
    over its tokens ([N])."""
    require_cu_seqlens(cu_seqlens, max_seqlen)
    if cu_seqlens is None:
        return temperature
    check_cu_seqlens(cu_seqlens, rows, max_seqlen)
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        segments = Segments(cu_seqlens, rows.shape[0], max_seqlen)
        shape = tuple(temperature.shape)
        if shape in ((segments.tokens,), (segments.count,), (segments.count, 1)):
            return segments.per_token(temperature, "temperature")
    return temperature


def replace_agg(cfg: LossConfig) -> LossConfig:
    """The config with a token-mean aggregation (the weights given stand in for its own)."""
    return cfg if cfg.agg == "token-mean" else cfg.replace(agg="token-mean", norm_constant=None)


def segment_weights(
    segments: Segments, source: torch.Tensor, vocab: int, mask, cfg: LossConfig, normalizer
) -> torch.Tensor | None:
    """Each token's aggregation weight [N] under `cfg.agg` over the packed sequences
    (`token_terms.aggregation_weights` on their padded layout, unpadded); None for token-mean,
    whose weights are the mask's own."""
    if cfg.agg == "token-mean":
        return None
    # (the aggregation alone: its weights read the mask, the normalizer and agg's fields)
    aggregation = LossConfig(agg=cfg.agg, norm_constant=cfg.norm_constant)
    padded = padded_mask_inputs(segments, source, vocab, mask, aggregation, normalizer)
    return segments.unpad(aggregation_weights(padded, aggregation))


def padded_mask_inputs(
    segments: Segments, source, vocab: int, mask, cfg: LossConfig, normalizer, rollout_logp=None
):
    """The checked, masked inputs (`prepare_loss_inputs`) on the padded layout of a call that
    reads the mask (and the engine's log-probs) alone: labels and advantages 0, the logits a
    stand-in. What the per-sequence weights and metrics are taken from."""
    zeros = torch.zeros(segments.tokens, device=source.device)
    return prepare_loss_inputs(
        segments.stand_in(source, vocab),
        segments.pad(zeros.long()),
        segments.pad(zeros),
        segments.pad(mask, False if mask.dtype == torch.bool else 0),
        None,
        None,
        segments.pad(rollout_logp),
        cfg,
        normalizer,
    )


def packed_aggregation(
    cu_seqlens, max_seqlen, source: torch.Tensor, vocab: int, mask, cfg: LossConfig, normalizer
) -> tuple[LossConfig, torch.Tensor | None]:
    """(the config with a token-mean aggregation, each token's weight under its own
    aggregation over the packed sequences, None for token-mean): for a loss whose terms are
    each a token's own (distillation's divergences), the boundaries' whole part."""
    check_packed_rows(cu_seqlens, source, max_seqlen)
    segments = Segments(cu_seqlens, source.shape[0], layout_length(cfg, max_seqlen))
    segments.check_per_token({"mask": mask})
    normalizer = sum_norm_normalizer(segments, cfg, normalizer)
    return replace_agg(cfg), segment_weights(segments, source, vocab, mask, cfg, normalizer)


def rollout_mismatch(segments, source, vocab: int, mask, rollout_logp, logp) -> dict:
    """`token_terms.add_mismatch_metrics` of packed log-probs against the engine's: on the
    padded layout of the [N] per-token values (small [S, T] tensors, no logits)."""
    padded = padded_mask_inputs(segments, source, vocab, mask, LossConfig(), None, rollout_logp)
    metrics = Metrics()
    add_mismatch_metrics(metrics, segments.pad(logp.detach()), None, padded)
    return metrics
