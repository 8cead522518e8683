"""The fused token-level loss's own sums: what each program adds up over its rows, and the one
program that turns them into the loss and the metrics.

The fused kernel (token_loss.py) knows each token's loss term and clip flags in registers; summing
them there, one [SUM_WIDTH] vector per program, leaves the host no [B, T] arithmetic: a loss call
is the fused kernel and `token_loss_sums`, two launches, where the loss and its metrics in torch
took some thirty small kernels (the host's time at a 4k-token micro-batch). The sums are added up
in a fixed order, so the loss is the same bit for bit on every call of a shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import launches_on

# Not a row sweep: it reads [programs, SUM_WIDTH] floats (aot compiles its launch as recorded).
KERNEL_FAMILY = "reduce"

# What each program sums over its rows, one row of `partials` per program; `token_loss_sums`
# adds the rows up into the loss and the metrics' weighted means (fusedrl.fused_backend names
# them). "weight" is the counted tokens' mask weight, the means' denominator.
SUM_SLOTS = (
    "loss", "weight", "clipfrac", "clip_low", "clip_high", "dual_clipfrac", "kl", "ppo_kl",
    "logp_mean", "entropy",
)  # fmt: skip
SUM_WIDTH = tl.constexpr(16)  # a power of two >= len(SUM_SLOTS): one vector per program
SLOT_LOSS = tl.constexpr(SUM_SLOTS.index("loss"))
SLOT_WEIGHT = tl.constexpr(SUM_SLOTS.index("weight"))
SLOT_CLIPFRAC = tl.constexpr(SUM_SLOTS.index("clipfrac"))
SLOT_CLIP_LOW = tl.constexpr(SUM_SLOTS.index("clip_low"))
SLOT_CLIP_HIGH = tl.constexpr(SUM_SLOTS.index("clip_high"))
SLOT_DUAL_CLIPFRAC = tl.constexpr(SUM_SLOTS.index("dual_clipfrac"))
SLOT_KL = tl.constexpr(SUM_SLOTS.index("kl"))
SLOT_PPO_KL = tl.constexpr(SUM_SLOTS.index("ppo_kl"))
SLOT_LOGP = tl.constexpr(SUM_SLOTS.index("logp_mean"))
SLOT_ENTROPY = tl.constexpr(SUM_SLOTS.index("entropy"))


@triton.jit
def slot(slots, k: tl.constexpr, value):
    """`value` at slot k of a program's sums vector, 0 elsewhere."""
    return tl.where(slots == k, value, 0.0)


@triton.jit
def _token_loss_sums_kernel(
    partials_ptr, programs, loss_ptr, metrics_ptr, BLOCK_PROGRAMS: tl.constexpr
):
    """One program: the programs' sums added up in a fixed order (the same loss bit for bit on
    every call of a shape), the loss stored, every slot divided by the mask weight (clamped at
    1e-8, so an all-masked batch gives zeros): the metrics' means."""
    slots = tl.arange(0, SUM_WIDTH)
    sums = tl.zeros([SUM_WIDTH], dtype=tl.float32)
    for start in range(0, programs, BLOCK_PROGRAMS):
        index = start + tl.arange(0, BLOCK_PROGRAMS)
        tile = tl.load(
            partials_ptr + index[:, None] * SUM_WIDTH + slots[None, :],
            mask=(index < programs)[:, None],
            other=0.0,
        )
        sums += tl.sum(tile, axis=0)
    weight = tl.sum(tl.where(slots == SLOT_WEIGHT, sums, 0.0))
    tl.store(loss_ptr, tl.sum(tl.where(slots == SLOT_LOSS, sums, 0.0)))
    tl.store(metrics_ptr + slots, sums / tl.maximum(weight, 1e-8))


BLOCK_PROGRAMS = 64  # programs' rows per load: a persistent grid has a few hundred at most


@launches_on("partials")
def token_loss_sums(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, means): the 0-dim loss and the [SUM_WIDTH] slots of `fused_token_loss`'s partials
    divided by the mask weight (`SUM_SLOTS` names them; the loss and weight slots are not
    metrics)."""
    loss = torch.empty((), dtype=torch.float32, device=partials.device)
    means = torch.empty(SUM_WIDTH.value, dtype=torch.float32, device=partials.device)
    _token_loss_sums_kernel[(1,)](
        partials, partials.shape[0], loss, means, BLOCK_PROGRAMS=BLOCK_PROGRAMS, num_warps=2
    )
    return loss, means
