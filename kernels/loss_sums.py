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
from .launch import next_power_of_2

# Not a row sweep: it reads [programs, SUM_WIDTH] floats (aot compiles its launch as recorded).
KERNEL_FAMILY = "reduce"

# What each program sums over its rows, one row of `partials` per program; `token_loss_sums`
# adds the rows up into the loss and the metrics' weighted means (fusedrl.fused_backend names
# them). "weight" is the counted tokens' mask weight, the means' denominator.
# "labels_ok": the programs count the counted tokens whose label lies outside [0, V) (the
# kernels read the labels raw: this is the labels' range check, with no launch of its own);
# `token_loss_sums` turns the count into 1.0 when it is 0, else 0.0 (a flag, not a mean).
# The metrics every call reports come first, then the KL's and the entropy's, which some calls
# report: the driver takes a call's metrics as one slice's views (`fused_backend._metric_slots`).
SUM_SLOTS = (
    "clipfrac",
    "clip_low",
    "clip_high",
    "dual_clipfrac",
    "ppo_kl",
    "logp_mean",
    "kl",
    "entropy",
    "labels_ok",
    "loss",
    "weight",
)
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
SLOT_LABELS_OK = tl.constexpr(SUM_SLOTS.index("labels_ok"))


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
    1e-8, so an all-masked batch gives zeros): the metrics' means; the labels' slot becomes
    1.0 when no counted label lay outside the vocabulary, else 0.0."""
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
    outside = tl.sum(tl.where(slots == SLOT_LABELS_OK, sums, 0.0))
    means = sums / tl.maximum(weight, 1e-8)
    means = tl.where(slots == SLOT_LABELS_OK, tl.where(outside == 0, 1.0, 0.0), means)
    tl.store(metrics_ptr + slots, means)


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


# The aggregation modes (fusedrl.config's `agg`), as the weights kernel knows them.
AGG_CODES = {
    "token-mean": 0,
    "seq-mean-token-mean": 1,
    "seq-mean-token-sum": 2,
    "seq-mean-token-sum-norm": 3,
}
AGG_TOKEN_MEAN = tl.constexpr(AGG_CODES["token-mean"])
AGG_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(AGG_CODES["seq-mean-token-mean"])
AGG_SEQ_MEAN_TOKEN_SUM = tl.constexpr(AGG_CODES["seq-mean-token-sum"])
AGG_SUM_NORM = tl.constexpr(AGG_CODES["seq-mean-token-sum-norm"])
# How the call's normalizer arrives: none (the mask's own count), a number, a device scalar.
NORMALIZER_CODES = {None: 0, "number": 1, "tensor": 2}
NORMALIZER_TENSOR = tl.constexpr(NORMALIZER_CODES["tensor"])
NORMALIZER_NONE = tl.constexpr(NORMALIZER_CODES[None])


@triton.jit
def _sequence_weight(mask_ptr, b, time, BLOCK_T: tl.constexpr):
    """The mask weight of sequence b (its counted tokens' weights summed)."""
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(0, time, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        weights = tl.load(mask_ptr + tl.cast(b, tl.int64) * time + t, mask=t < time, other=0)
        total += weights.to(tl.float32)
    return tl.sum(total)


@triton.jit
def _aggregation_weights_kernel(
    mask_ptr,
    normalizer_ptr,
    out_ptr,
    batch,
    time,
    normalizer,
    norm_constant,
    AGG: tl.constexpr,
    NORMALIZER: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: agg_w[b, t] = d(aggregated loss) / d(token loss) for a [B, T] mask that is
    0 on every token that does not count (fusedrl.token_terms.aggregation_weights's formulas):
    the mask over its total (token-mean), over each sequence's and the non-empty sequences'
    counts (seq-mean-*), or over B x norm_constant. The batch's totals take one read of the mask,
    the weights another: [B, T] floats, against the fused kernel's [B, T, V] logits."""
    total = tl.zeros([], dtype=tl.float32)
    nonempty = tl.zeros([], dtype=tl.float32)
    if AGG != AGG_SUM_NORM:  # (B x the norm constant needs no count)
        for b in range(0, batch):
            seq = _sequence_weight(mask_ptr, b, time, BLOCK_T)
            total += seq
            nonempty += tl.where(seq > 0, 1.0, 0.0)
    if NORMALIZER == NORMALIZER_TENSOR:
        normalizer = tl.load(normalizer_ptr)
    if AGG == AGG_TOKEN_MEAN:
        denominator = tl.maximum(total, 1e-8)
    elif AGG == AGG_SEQ_MEAN_TOKEN_MEAN or AGG == AGG_SEQ_MEAN_TOKEN_SUM:
        denominator = tl.maximum(nonempty, 1.0)
    else:  # seq-mean-token-sum-norm: B x the norm constant (T unless given)
        denominator = batch * 1.0
    if NORMALIZER != NORMALIZER_NONE:
        denominator = normalizer
    for b in range(0, batch):
        scale = 1.0 / denominator
        if AGG == AGG_SEQ_MEAN_TOKEN_MEAN or AGG == AGG_SEQ_MEAN_TOKEN_SUM:
            seq = _sequence_weight(mask_ptr, b, time, BLOCK_T)
            scale = tl.where(seq > 0, 1.0, 0.0)
            if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
                scale = scale / tl.maximum(seq, 1e-8)
        for start in range(0, time, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            offset = tl.cast(b, tl.int64) * time + t
            mask = tl.load(mask_ptr + offset, mask=t < time, other=0).to(tl.float32)
            if AGG == AGG_TOKEN_MEAN:
                weight = mask / denominator
            elif AGG == AGG_SEQ_MEAN_TOKEN_MEAN or AGG == AGG_SEQ_MEAN_TOKEN_SUM:
                weight = mask * scale / denominator
            else:
                weight = mask / denominator / norm_constant
            tl.store(out_ptr + offset, weight, mask=t < time)


BLOCK_T = 1024  # tokens per load of the weights kernel (a sequence is read in such tiles)


@launches_on("mask")
def aggregation_weights(
    mask: torch.Tensor,
    agg: str,
    normalizer: float | torch.Tensor | None,
    norm_constant: float | None,
) -> torch.Tensor:
    """The [B, T] fp32 aggregation weights of `mask` ([B, T] fp32, 0 wherever a token does not
    count, or bool: read as 0 / 1 without a conversion) in one launch; `normalizer`: the
    call's (a number, a 0-dim fp32 device tensor, or None); `norm_constant`:
    seq-mean-token-sum-norm's (None: T)."""
    batch, time = mask.shape
    mask = mask.contiguous()
    out = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    if mask.numel() == 0:
        return out
    tensor = isinstance(normalizer, torch.Tensor)
    code = NORMALIZER_CODES["tensor" if tensor else None if normalizer is None else "number"]
    _aggregation_weights_kernel[(1,)](
        mask,
        normalizer.reshape(1) if tensor else mask,  # (placeholder, never read)
        out,
        batch,
        time,
        0.0 if tensor or normalizer is None else float(normalizer),
        float(time if norm_constant is None else norm_constant),
        AGG=AGG_CODES[agg],
        NORMALIZER=code,
        BLOCK_T=min(BLOCK_T, next_power_of_2(time)),
        num_warps=4,
    )
    return out
