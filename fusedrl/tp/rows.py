"""The two sweeps over a rank's vocab slice: whole-row statistics (the one all-gather per call)
and the gradient slice (no communication)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .comm import all_gather
from .merge import merge, pack
from .ops import SliceOps
from .shard import VocabShard


@torch.no_grad()
def whole_row_stats(
    slice_stats: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    shard: VocabShard,
    group,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp, lse and entropy [B, T] of the whole rows, the same bits on every rank, from the
    global [B, T] labels and `slice_stats(local_labels) -> (logp_r, lse_r, entropy_r)`, the
    [B, T] statistics of this rank's token columns (called only when it has some; local labels
    are column indices, any column where another rank holds the label). Masked rows give 0."""
    if shard.width > 0:
        logp_r, lse_r, entropy_r = slice_stats(shard.local_labels(labels, missing=0))
    else:  # only padding columns here: no probability mass
        lse_r = torch.full(labels.shape, float("-inf"), device=labels.device)
        logp_r, entropy_r = lse_r, torch.zeros_like(lse_r)
    gathered = all_gather(pack(logp_r, lse_r, entropy_r), group, shard.world)
    out = merge(gathered, shard.owners(labels.reshape(-1)))
    out = tuple(t.view(labels.shape) for t in out)
    if valid is None:
        return out
    return tuple(torch.where(valid, t, 0.0) for t in out)


@torch.no_grad()
def write_slice_grad(
    ops: SliceOps,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    shard: VocabShard,
    out: torch.Tensor,
    floors: torch.Tensor | None = None,
) -> None:
    """out = this rank's slice of d(loss)/d(logits), from the replicated whole-row statistics
    and per-token derivatives; `out` may be `logits` (in place). Padding columns get 0.
    `floors`: the sampled sets' raw floors on this slice (`SliceOps.reads_floors`)."""
    out[..., shard.width :].zero_()
    if shard.width == 0:
        return
    local = shard.local_labels(labels, missing=-1)
    ops.grad(
        shard.narrow(logits),
        local,
        lse,
        entropy,
        dlogp,
        dentropy,
        temperature,
        shard.narrow(out),
        floors=floors,
    )
