"""The loss terms of a two-pass call on [B, T] scalars: one program per sequence, no torch glue.

A sequence-level ratio (GSPO, GSPO-token) needs every token's log-prob before any token's loss is
known, so its call reads the logits twice: a pass that writes logp and entropy, then a pass that
writes the gradient from d(loss)/d(logp). Between the two, this kernel does what some seventy
small torch kernels did (the host's time at a 4k-token micro-batch): each program reads its
sequence's log-probs and inputs once for the sequence log-ratio and once more for each token's
loss term, writes d(loss)/d(logp) (and d(loss)/d(H) for an entropy bonus), and sums the loss
and the metrics' weighted values into its row of `partials`, which `loss_sums.token_loss_sums`
adds up. With SEQUENCE_RATIO off it serves the token-level configurations that take two passes
(on-policy DCPO bounds or IS weights, which need logp first), with the fused kernel's formulas.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import next_power_of_2
from .loss_sums import (
    SLOT_CLIP_HIGH,
    SLOT_CLIP_LOW,
    SLOT_CLIPFRAC,
    SLOT_DUAL_CLIPFRAC,
    SLOT_ENTROPY,
    SLOT_KL,
    SLOT_LABELS_OK,
    SLOT_LOGP,
    SLOT_LOSS,
    SLOT_PPO_KL,
    SLOT_WEIGHT,
    SUM_WIDTH,
    slot,
)
from .terms import (  # noqa: F401  (the codes: aot varies a kernel's constexprs by its module's)
    BETA_AT,
    ENTROPY_COEF_AT,
    HIGH_BOUND_AT,
    KL_CODES,
    KL_NONE,
    KL_VALUE_CODES,
    LOG_RATIO_CLAMP,
    LOSS_CODES,
    LOW_BOUND_AT,
    SEQ_LOG_RATIO_MAX,
    kl_dlogp,
    kl_value,
    policy_term,
    token_ratio,
    variant_constexprs,
    variant_scalars,
)
from .token_args import TokenLossArgs

# Not a row sweep: it reads [B, T] floats (aot compiles its launch as recorded, and each code).
KERNEL_FAMILY = "reduce"


@triton.jit
def _sequence_log_ratio(logp_ptr, old_ptr, valid_ptr, mask_ptr, start, time, BLOCK_T: tl.constexpr):
    """The sequence's mask-weighted mean of the clamped token log-ratios (GSPO's log s); NaN if
    any counted token's is (a GPU's clamp would drop it, torch's keeps it)."""
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    weight = tl.zeros([BLOCK_T], dtype=tl.float32)
    for first in range(0, time, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)
        inside = t < time
        valid = tl.load(valid_ptr + start + t, mask=inside, other=0) != 0
        mask = tl.load(mask_ptr + start + t, mask=inside, other=0).to(tl.float32)
        mask = tl.where(valid, mask, 0.0)
        raw = tl.load(logp_ptr + start + t, mask=inside, other=0.0) - tl.load(
            old_ptr + start + t, mask=inside, other=0.0
        )
        clamped = tl.minimum(tl.maximum(raw, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
        clamped = tl.where(raw != raw, raw, clamped)
        total += tl.where(valid, clamped * mask, 0.0)
        weight += mask
    return tl.sum(total) / tl.maximum(tl.sum(weight), 1.0)


@triton.jit
def _sequence_terms_kernel(
    logp_ptr,
    entropy_ptr,
    labels_ptr,
    valid_ptr,
    mask_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    is_weight_ptr,
    agg_weight_ptr,
    low_ptr,
    high_ptr,
    dlogp_ptr,
    dentropy_ptr,
    partials_ptr,
    entropy_coef_ptr,
    time,
    vocab,
    adv_stride_b,
    adv_stride_t,
    loss_scalars,
    SEQUENCE_RATIO: tl.constexpr,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    KL: tl.constexpr,
    KL_VALUE: tl.constexpr,
    HAS_IS: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    ENTROPY_COEF_FROM_PTR: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program b: sequence b's d(loss)/d(logp) [T] (0 on tokens that do not count), its
    d(loss)/d(H) under ENTROPY_BONUS, and its sums (SUM_SLOTS) into partials[b]. Every [B, T]
    input is contiguous except the advantages (strides: a [B] advantage broadcast over T is
    read in place); the mask is bool or fp32 weights. Values on tokens that do not count
    (valid 0) may be anything: each store and sum selects on `valid`. `old` is logp itself
    on-policy (the launcher passes it). SEQUENCE_RATIO: GSPO's ratio s = exp(min(mean log r,
    10)) on every token, d s / d logp_t = s unless the clamp is active; else each token's own
    ratio."""
    b = tl.cast(tl.program_id(0), tl.int64)
    start = b * time
    bonus_coef = loss_scalars[ENTROPY_COEF_AT]
    if ENTROPY_COEF_FROM_PTR:
        bonus_coef = tl.load(entropy_coef_ptr)
    seq_log_ratio = 0.0
    seq_ratio = 1.0
    seq_dratio = 1.0
    if SEQUENCE_RATIO:
        seq_log_ratio = _sequence_log_ratio(
            logp_ptr, old_ptr, valid_ptr, mask_ptr, start, time, BLOCK_T
        )
        seq_ratio = tl.exp(tl.minimum(seq_log_ratio, SEQ_LOG_RATIO_MAX))
        seq_dratio = tl.where(seq_log_ratio <= SEQ_LOG_RATIO_MAX, seq_ratio, 0.0)
    slots = tl.arange(0, SUM_WIDTH)
    sums = tl.zeros([SUM_WIDTH], dtype=tl.float32)
    for first in range(0, time, BLOCK_T):
        t = first + tl.arange(0, BLOCK_T)
        inside = t < time
        at = start + t
        valid = tl.load(valid_ptr + at, mask=inside, other=0) != 0
        weight = tl.load(mask_ptr + at, mask=inside, other=0).to(tl.float32)
        weight = tl.where(valid, weight, 0.0)
        logp = tl.load(logp_ptr + at, mask=inside, other=0.0)
        old = tl.load(old_ptr + at, mask=inside, other=0.0)
        adv = tl.load(adv_ptr + b * adv_stride_b + t * adv_stride_t, mask=inside, other=0.0)
        agg_weight = tl.load(agg_weight_ptr + at, mask=inside, other=0.0)
        low = loss_scalars[LOW_BOUND_AT]
        high = loss_scalars[HIGH_BOUND_AT]
        if HAS_BOUNDS:
            low = tl.load(low_ptr + at, mask=inside, other=0.0)
            high = tl.load(high_ptr + at, mask=inside, other=0.0)
        if SEQUENCE_RATIO:
            ratio = tl.zeros([BLOCK_T], dtype=tl.float32) + seq_ratio
            dratio = tl.zeros([BLOCK_T], dtype=tl.float32) + seq_dratio
            log_ratio = tl.zeros([BLOCK_T], dtype=tl.float32) + seq_log_ratio
            nan_ratio = log_ratio != log_ratio
        else:
            ratio, dratio, nan_ratio = token_ratio(logp, old)
        value, d_token, clipped, below, above, dual_clipped = policy_term(
            logp=logp,
            ratio=ratio,
            dratio=dratio,
            nan_ratio=nan_ratio,
            adv=adv,
            low=low,
            high=high,
            loss_scalars=loss_scalars,
            LOSS=LOSS,
            DUAL_CLIP=DUAL_CLIP,
            HAS_DELTA=HAS_DELTA,
        )
        if HAS_IS:
            is_weight = tl.load(is_weight_ptr + at, mask=inside, other=0.0)
            value = value * is_weight
            d_token = d_token * is_weight
        # A NaN input the token's loss reads makes its gradient NaN, as torch's terms do (the
        # clamps and selects would drop it); a NaN sequence ratio, every token's of the sequence.
        unread = (old != old) | nan_ratio
        kl = tl.zeros([BLOCK_T], dtype=tl.float32)
        if KL_VALUE != KL_NONE:
            ref = tl.load(ref_ptr + at, mask=inside, other=0.0)
            kl = kl_value(logp, ref, KL_VALUE)
            if KL != KL_NONE:
                beta = loss_scalars[BETA_AT]
                d_token += beta * kl_dlogp(logp, ref, KL)
                value += beta * kl
                unread = unread | (ref != ref)
        d_token = tl.where(unread, float("nan"), d_token)
        entropy = tl.zeros([BLOCK_T], dtype=tl.float32)
        if HAS_ENTROPY:
            entropy = tl.load(entropy_ptr + at, mask=inside, other=0.0)
        if ENTROPY_BONUS:
            value -= bonus_coef * entropy
            dentropy = tl.where(valid, -bonus_coef * agg_weight, 0.0)
            tl.store(dentropy_ptr + at, dentropy, mask=inside)
        tl.store(dlogp_ptr + at, tl.where(valid, d_token * agg_weight, 0.0), mask=inside)
        label = tl.load(labels_ptr + at, mask=inside, other=0)
        label_outside = valid & ((label < 0) | (label >= vocab))
        sums += (
            slot(slots, SLOT_LOSS, tl.sum(tl.where(valid, value * agg_weight, 0.0)))
            + slot(slots, SLOT_WEIGHT, tl.sum(weight))
            + slot(slots, SLOT_CLIPFRAC, tl.sum(tl.where(clipped, weight, 0.0)))
            + slot(slots, SLOT_CLIP_LOW, tl.sum(tl.where(below, weight, 0.0)))
            + slot(slots, SLOT_CLIP_HIGH, tl.sum(tl.where(above, weight, 0.0)))
            + slot(slots, SLOT_DUAL_CLIPFRAC, tl.sum(tl.where(dual_clipped, weight, 0.0)))
            + slot(slots, SLOT_KL, tl.sum(tl.where(valid, kl * weight, 0.0)))
            + slot(slots, SLOT_PPO_KL, tl.sum(tl.where(valid, (old - logp) * weight, 0.0)))
            + slot(slots, SLOT_LOGP, tl.sum(tl.where(valid, logp * weight, 0.0)))
            + slot(slots, SLOT_ENTROPY, tl.sum(tl.where(valid, entropy * weight, 0.0)))
            + slot(slots, SLOT_LABELS_OK, tl.sum(tl.where(label_outside, 1.0, 0.0)))
        )
    tl.store(partials_ptr + b * SUM_WIDTH + slots, sums)


BLOCK_T = 1024  # tokens per tile: a sequence is read in such tiles, twice with a sequence ratio


@launches_on("logp")
def sequence_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    args: TokenLossArgs,
    *,
    sequence_ratio: bool,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dlogp [B, T], dentropy [B, T] or [0] without an entropy bonus, partials [B, SUM_WIDTH])
    of [B, T] fp32 log-probs: the loss terms of `fusedrl.token_terms` for the variants the fused
    kernel knows (`args` as `token_loss.fused_token_loss` takes them, `mask` and `old_logp`
    given: logp itself on-policy; no per-token temperatures, sum of p^2 or grad_scale: the
    caller scales the derivatives), with the sequence ratio when `sequence_ratio`. `entropy`:
    read for the bonus and the entropy metric (None: neither). The counted labels outside
    [0, V) of the logits, `vocab` wide, are counted (`labels_ok`)."""
    if args.mask is None or args.old_logp is None or args.variant.agg_from_mask:
        raise ValueError("sequence_terms: needs `mask`, `old_logp` and `agg_weight`")
    batch, time = logp.shape
    dlogp = torch.empty_like(logp)
    coef_tensor = args.entropy_coef_tensor
    bonus = args.variant.entropy_coef != 0.0 or coef_tensor is not None
    if bonus and entropy is None:
        raise ValueError("sequence_terms: an entropy bonus needs the entropy")
    dentropy = torch.empty_like(logp) if bonus else logp.new_empty(0)
    partials = logp.new_empty(batch, SUM_WIDTH.value)  # each program writes its row
    if batch * time == 0:
        return dlogp, dentropy, partials.zero_()
    _sequence_terms_kernel[(batch,)](
        logp.contiguous(),
        logp if entropy is None else entropy.float().contiguous(),
        *args.per_token_pointers(logp),
        dlogp,
        dentropy if bonus else logp,
        partials,
        logp if coef_tensor is None else coef_tensor.float().reshape(1),
        time,
        vocab,
        args.advantages.stride(0),
        args.advantages.stride(1),
        variant_scalars(args.variant),  # one tuple: `loss_scalars`
        **variant_constexprs(
            args.variant,
            args.ref_logp is not None,
            args.is_weight is not None,
            args.low is not None,
            coef_tensor is not None,
        ),
        SEQUENCE_RATIO=sequence_ratio,
        HAS_ENTROPY=entropy is not None,
        BLOCK_T=min(BLOCK_T, next_power_of_2(time)),
        num_warps=4,
    )
    return dlogp, dentropy, partials
