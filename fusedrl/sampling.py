"""Sampling-mask replay: the set of tokens vLLM sampled from, as one threshold per row.

vLLM's V1 sampler (the `processed_logprobs` mode) divides the logits by the temperature, then
masks (sets to -inf) in this order: min_p (tokens whose probability is below min_p x the largest
probability), top_k (logits below the k-th largest, ties kept), top_p (on the distribution
renormalised over what is left: in ascending order, tokens whose cumulative probability, their own
included, is <= 1 - p; the largest is always kept). Each filter keeps a prefix of the tokens in
descending logit order, so the kept set is {v : z_v / T >= floor} for one `floor` per row, and the
log-probs and entropy over that set are the row's log-softmax with everything below the floor at
-inf. The sampled token is kept as well, floor or not: the trainer's logits differ from the
engine's in the last bits, and a token sampled at the boundary must not get log-prob -inf.

Cost per row, on top of the plain log-softmax: one max (min_p); one top-k read (top_k); top_p
sorts the candidates: only the k kept by top_k when top_k is set, else the whole row (a full sort,
the expensive case). Ties at the top-p boundary are all kept here, while vLLM keeps a fixed
number of them (its cumulative sum drops them one at a time): with bf16 logits such ties are
common, and those rows' log-probs differ from vLLM's (docs/losses.md, "Sampling-mask replay").
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingMask:
    """vLLM's sampling filters, None (or top_p = 1, min_p = 0) where off."""

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @property
    def active(self) -> bool:
        return (
            self.top_k is not None
            or (self.top_p is not None and self.top_p < 1)
            or (self.min_p is not None and self.min_p > 0)
        )


# vLLM's (and TRL's) "consider all tokens": SamplingParams(top_k=0) is the default, -1 the old
# one.
TOP_K_OFF = (0, -1)


def check_sampling(top_k, top_p, min_p, where: str = "") -> SamplingMask:
    """The filters as given to token_logprobs / LossConfig, with errors naming the argument: what
    vLLM's SamplingParams takes (top_k 0 or -1 and top_p 1 and min_p 0 are off; min_p 1 keeps
    the largest), numpy numbers too."""
    prefix = f"{where}." if where else ""
    if top_k is not None:
        value = _number(top_k, numbers.Integral)
        if value is None or not (value >= 1 or value in TOP_K_OFF):
            raise ValueError(
                f"{prefix}top_k must be an int >= 1, or 0 / -1 / None (off), got {top_k!r}"
            )
        top_k = value
    if top_p is not None:
        value = _number(top_p, numbers.Real)
        if value is None or not 0 < value <= 1:
            raise ValueError(f"{prefix}top_p must be in (0, 1] or None (off), got {top_p!r}")
        top_p = value
    if min_p is not None:
        value = _number(min_p, numbers.Real)
        if value is None or not 0 <= value <= 1:
            raise ValueError(f"{prefix}min_p must be in [0, 1] or None (off), got {min_p!r}")
        min_p = value
    return SamplingMask(
        top_k=None if top_k in TOP_K_OFF else top_k,
        top_p=None if top_p is None else float(top_p),
        min_p=None if min_p is None else float(min_p),
    )


def _number(value, kind) -> int | float | None:
    """`value` as a plain int (kind Integral) or float (Real); None where it is not one (bools,
    strings, tensors: a tensor's value would be a host read)."""
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    return int(value) if kind is numbers.Integral else float(value)


@torch.no_grad()
def sampling_floor(scaled: torch.Tensor, sampling: SamplingMask) -> torch.Tensor:
    """[n, V] temperature-scaled logits (fp32) -> [n] floor: a token is in the set vLLM sampled
    from iff scaled >= floor (`apply_floor` keeps the sampled label too). No host sync."""
    rows, vocab = scaled.shape
    floor = torch.full((rows,), -math.inf, dtype=scaled.dtype, device=scaled.device)
    if rows == 0 or not sampling.active:
        return floor
    if sampling.min_p is not None and sampling.min_p > 0:
        # p_v >= min_p max p  <=>  z_v - max z >= log(min_p)
        floor = torch.maximum(floor, scaled.amax(-1) + math.log(sampling.min_p))
    values = None  # the candidates in descending order: the top k (or, for top_p, every token)
    if sampling.top_k is not None and sampling.top_k < vocab:
        values = scaled.topk(sampling.top_k, -1).values
        floor = torch.maximum(floor, values[:, -1])
    if sampling.top_p is not None and sampling.top_p < 1:
        whole_row = values is None
        values = scaled.sort(-1, True).values if whole_row else values
        values = torch.where(values >= floor[:, None], values, -math.inf)
        ascending = values.flip(-1)
        weights = torch.exp(ascending - values[:, :1])
        mass = weights.cumsum(-1)
        total = mass[:, -1:]
        if not whole_row:
            # vLLM renormalises over every token left, ties with the k-th largest beyond the k
            # that topk took included: they come first in ascending order (they equal the least).
            candidates = torch.where(scaled >= floor[:, None], scaled, -math.inf)
            total = torch.exp(candidates - values[:, :1]).sum(-1, keepdim=True)
            mass = mass + (total - mass[:, -1:]).clamp_min(0)
        mass = mass / total
        drop = mass <= 1.0 - sampling.top_p
        drop[:, -1] = False  # the largest is always kept
        kept_min = torch.where(drop, math.inf, ascending).amin(-1)
        floor = torch.maximum(floor, kept_min)
    return floor


def kept(scaled: torch.Tensor, floor: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[n, V] bool: the sampled set of each row (at or above its floor) and the row's label (an
    ignored position's negative label keeps token 0, as the kernels do; a label >= V keeps
    nothing: under tensor parallelism it is on another rank)."""
    columns = torch.arange(scaled.shape[-1], device=scaled.device)
    return (scaled >= floor[:, None]) | (columns == labels.clamp_min(0)[:, None])


def apply_floor(scaled: torch.Tensor, floor: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The scaled logits with every token below its row's floor at -inf, except the label."""
    return torch.where(kept(scaled, floor, labels), scaled, -math.inf)


@torch.no_grad()
def mask_to_sampled_set(
    block: torch.Tensor, labels: torch.Tensor, temperature: float, sampling: SamplingMask
) -> torch.Tensor:
    """[n, V] logits (any float dtype) -> the same with -inf outside the sampled set: what the
    fused kernels read to replay the mask (their -inf entries get p = 0 and no gradient)."""
    scaled = block.float() / temperature
    keep = kept(scaled, sampling_floor(scaled, sampling), labels)
    return torch.where(keep, block, -math.inf)
