"""Batch statistics over a process group: the top-entropy selection's quantile taken over every
process's tokens, as TRL takes it under several processes (`get_high_entropy_mask` gathers).

    with fusedrl.batch_statistics_over(group):
        out = fusedrl.policy_loss(..., config=LossConfig(top_entropy_quantile=0.2))

Inside the block, a loss whose config selects tokens by an entropy quantile
(`top_entropy_quantile < 1`) takes the quantile of the counted tokens' entropies gathered over
`group` (two all-gathers: the counts, then the values padded to the largest count), so every
rank of the group keeps the tokens above one threshold. Every rank of the group must make the
same calls inside the block (they are collectives). Outside it, the call's own tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.distributed as dist

_GROUP: contextvars.ContextVar = contextvars.ContextVar("fusedrl_batch_stats", default=None)


@contextlib.contextmanager
def batch_statistics_over(group) -> Iterator[None]:
    """Within the block, batch statistics are taken over `group`'s ranks (None: this
    process's tokens alone)."""
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "batch_statistics_over(group): torch.distributed is not initialized (call "
            "init_process_group first, or pass None)"
        )
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def statistics_group():
    """The group batch statistics are taken over here, or None."""
    return _GROUP.get()


def gathered(values: torch.Tensor, selected: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `values[selected]`, concatenated in rank order (fp32): the counts first,
    then the values padded to the largest count (the host reads the counts, as TRL's padding
    across processes does)."""
    mine = values[selected].float()
    world = dist.get_world_size(group)
    count = torch.tensor([mine.numel()], dtype=torch.int64, device=values.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    padded = torch.zeros(max(sizes + [1]), dtype=torch.float32, device=values.device)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])
