"""The fused token-level policy loss: one read of each row, the gradient written in the same kernel.

Per row (token): sweep 1 reads the logits once for lse, the label logit and the entropy; the
token's scalars (ratio, clip, KL, IS weight, aggregation weight) then give d(loss)/d(logp) and
d(loss)/d(H) in registers; sweep 2 writes d(loss)/d(logits) (into the logits when in place). The
second sweep re-reads a row the first one has just streamed, so on a GPU it is served mostly by L2:
HBM traffic is ~1 read + 1 write of the logits.

The per-token formulas are those of `fusedrl.token_terms` (the same clamps and tie rules), with
the variant chosen by constexpr switches so that each configuration compiles to straight-line code.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import block_size, fast_exp2, launch_options, persistent_programs
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
from .rows import (
    LOG2E,
    cap_arg,
    check_floors,
    logp_of,
    row_offset,
    row_stats,
    row_temperature,
    rows_buffer,
    write_row_grad,
    write_row_zeros,
)
from .terms import (  # noqa: F401  (the codes: aot varies a kernel's constexprs by its module's)
    BETA_AT,
    ENTROPY_COEF_AT,
    HIGH_BOUND_AT,
    KL_CODES,
    KL_NONE,
    KL_VALUE_CODES,
    LOSS_CODES,
    LOW_BOUND_AT,
    kl_dlogp,
    kl_value,
    policy_term,
    token_ratio,
    variant_constexprs,
    variant_scalars,
)
from .token_args import LossVariant, TokenLossArgs

# Switches compiled together on top of the base configuration (aot.variants), beside each alone:
# the soft cap with what else the fused kernel's sweeps may carry.
CROSSED_SWITCHES = (
    ("SOFTCAP", "ENTROPY_BONUS"),
    ("SOFTCAP", "SUM_PI_SQUARED"),
    ("SOFTCAP", "ROW_TEMPERATURE"),
)


BLOCK_COUNT = tl.constexpr(1024)  # mask weights per load of AGG_FROM_MASK's count


@triton.jit
def loss_prologue(
    rows,
    mask_ptr,
    entropy_coef_ptr,
    grad_scale_ptr,
    entropy_coef,
    grad_scale,
    agg_denominator,
    ENTROPY_COEF_FROM_PTR: tl.constexpr,
    GRAD_SCALE_FROM_PTR: tl.constexpr,
    AGG_FROM_MASK: tl.constexpr,
):
    """(entropy coefficient, gradient scale, aggregation denominator) of a loss kernel's
    program, read once: each a number or a device scalar; with AGG_FROM_MASK and no
    denominator given, the counted tokens' mask weight (token-mean), which every program sums
    (a read of the [B, T] mask, against the rows' [B, T, V])."""
    bonus_coef = entropy_coef
    if ENTROPY_COEF_FROM_PTR:
        bonus_coef = tl.load(entropy_coef_ptr)
    scale_grad = grad_scale
    if GRAD_SCALE_FROM_PTR:
        scale_grad = tl.load(grad_scale_ptr)
    denominator = agg_denominator
    if AGG_FROM_MASK:
        if agg_denominator == 0.0:  # token-mean: the counted tokens' mask weight
            total = tl.zeros([BLOCK_COUNT], dtype=tl.float32)
            for start in range(0, rows, BLOCK_COUNT):
                index = start + tl.arange(0, BLOCK_COUNT)
                total += tl.load(mask_ptr + index, mask=index < rows, other=0).to(tl.float32)
            denominator = tl.maximum(tl.sum(total), 1e-8)
    return bonus_coef, scale_grad, denominator


@triton.jit
def load_token_inputs(
    row,
    time,
    adv_ptr,
    adv_stride_b,
    adv_stride_t,
    mask_ptr,
    agg_weight_ptr,
    denominator,
    old_ptr,
    low_ptr,
    high_ptr,
    is_weight_ptr,
    ref_ptr,
    loss_scalars,
    AGG_FROM_MASK: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    HAS_IS: tl.constexpr,
    KL_VALUE: tl.constexpr,
):
    """(adv, agg_weight, old, low, high, is_weight, ref) of one token: every per-token scalar
    the loss reads, loaded before the row's logits so that their latency hides behind them.
    AGG_FROM_MASK: the aggregation weight is the mask weight over `denominator`."""
    adv = tl.load(adv_ptr + (row // time) * adv_stride_b + (row % time) * adv_stride_t)
    if AGG_FROM_MASK:
        agg_weight = tl.load(mask_ptr + row).to(tl.float32) / denominator
    else:
        agg_weight = tl.load(agg_weight_ptr + row)
    old = 0.0
    if HAS_OLD:
        old = tl.load(old_ptr + row)
    low = loss_scalars[LOW_BOUND_AT]
    high = loss_scalars[HIGH_BOUND_AT]
    if HAS_BOUNDS:
        low = tl.load(low_ptr + row)
        high = tl.load(high_ptr + row)
    is_weight = 1.0
    if HAS_IS:
        is_weight = tl.load(is_weight_ptr + row)
    ref = 0.0
    if KL_VALUE != KL_NONE:
        ref = tl.load(ref_ptr + row)
    return adv, agg_weight, old, low, high, is_weight, ref


@triton.jit
def token_step(
    logp,
    entropy,
    adv,
    agg_weight,
    old,
    low,
    high,
    is_weight,
    ref,
    weight_ptr,
    slots,
    loss_scalars,
    bonus_coef,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_OLD: tl.constexpr,
    KL: tl.constexpr,
    KL_VALUE: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
):
    """(d(loss)/d(logp), d(loss)/d(H), the token's SUM_SLOTS vector) of one counted token from
    its log-prob and entropy: the policy term, the IS weight, the KL, the entropy bonus, the
    aggregation weight folded into both derivatives. Every loss kernel's per-token step."""
    if not HAS_OLD:
        old = logp
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
    value = value * is_weight
    d_token = d_token * is_weight
    # A NaN input the token's loss reads makes its row's gradient NaN, as its loss term
    # is (the clamps and selects above would drop it; docs/losses.md, "NaN inputs")
    unread = old != old
    kl = 0.0
    if KL_VALUE != KL_NONE:
        kl = kl_value(logp, ref, KL_VALUE)
    if KL != KL_NONE:
        beta = loss_scalars[BETA_AT]
        d_token += beta * kl_dlogp(logp, ref, KL)
        value += beta * kl
        unread = unread | (ref != ref)
    d_token = tl.where(unread, float("nan"), d_token)
    dentropy = -bonus_coef * agg_weight
    if ENTROPY_BONUS:
        value -= bonus_coef * entropy
    # The sums before the gradient's sweep, so that none of their inputs is live across it
    # (registers: the gradient loop runs at the 64-register cap); the mask weight loaded here.
    weight = tl.load(weight_ptr).to(tl.float32)  # bool or fp32 weights
    sums = (
        slot(slots, SLOT_LOSS, tl.where(unread, float("nan"), value) * agg_weight)
        + slot(slots, SLOT_WEIGHT, weight)
        + slot(slots, SLOT_CLIPFRAC, tl.where(clipped, weight, 0.0))
        + slot(slots, SLOT_CLIP_LOW, tl.where(below, weight, 0.0))
        + slot(slots, SLOT_CLIP_HIGH, tl.where(above, weight, 0.0))
        + slot(slots, SLOT_DUAL_CLIPFRAC, tl.where(dual_clipped, weight, 0.0))
        + slot(slots, SLOT_KL, kl * weight)
        + slot(slots, SLOT_PPO_KL, (old - logp) * weight)
        + slot(slots, SLOT_LOGP, logp * weight)
        + slot(slots, SLOT_ENTROPY, entropy * weight)
    )
    return d_token * agg_weight, dentropy, sums


@triton.jit
def _fused_token_loss_kernel(
    rows,
    logits_ptr,
    grad_ptr,
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
    logp_ptr,
    entropy_ptr,
    sum_sq_ptr,
    partials_ptr,
    temperature_ptr,
    entropy_coef_ptr,
    grad_scale_ptr,
    floor_ptr,
    time,
    vocab,
    stride_b,
    stride_t,
    adv_stride_b,
    adv_stride_t,
    grad_stride_b,
    grad_stride_t,
    inv_temperature,
    scale2,
    cap2,
    loss_scalars,
    grad_scale,
    agg_denominator,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_OLD: tl.constexpr,
    KL: tl.constexpr,
    KL_VALUE: tl.constexpr,
    HAS_IS: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    ENTROPY_COEF_FROM_PTR: tl.constexpr,
    GRAD_SCALE_FROM_PTR: tl.constexpr,
    AGG_FROM_MASK: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SUM_PI_SQUARED: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FLOORED: tl.constexpr,
):
    """Persistent: each program walks rows pid, pid + programs, ... so that only as many rows
    are in flight as the launcher chose (`sum_programs`). ENTROPY_COEF_FROM_PTR:
    the entropy coefficient is a device scalar (adaptive entropy control changes it between
    steps without a recompile or a host sync), read once per program. SOFTCAP: the rows are read
    as tanh(a x) (`rows.capped`, cap2 = 2 a log2(e)). SUM_PI_SQUARED: sweep 1 also sums
    sum_v pi_v^2 per row into sum_sq_ptr (the Optimal Token Baseline's input), one FFMA per
    element more. HAS_BOUNDS: per-token ratio bounds (DCPO), else the variant's constant ones;
    `loss_scalars`: the variant's runtime numbers (token_args.KERNEL_SCALARS).
    grad_scale (or, GRAD_SCALE_FROM_PTR, a device scalar): the factor the caller multiplies the
    loss by before backward; the gradient is written times it, the loss and its sums are not.
    AGG_FROM_MASK: each token's aggregation weight is its mask weight over agg_denominator
    (token-mean's normalizer, B x norm_constant), or, where that is 0, over the counted tokens'
    total, which every program sums first (a read of the [B, T] mask, against the rows'
    [B, T, V]): no weights kernel before this one.

    Each program also sums, over its counted rows, the token's loss term (times its
    aggregation weight) and the metrics' mask-weighted values (SUM_SLOTS) into its row of
    `partials`: the loss and the metrics then need no [B, T] arithmetic on the host, only
    `token_loss_sums` (a few registers per row against a row of V logits).

    FLOORED: each row over its replayed sampled set (vLLM's top_k / top_p / min_p): the logits
    below floor_ptr[row], the label excepted, read as -inf (`rows.floored`), so the set costs
    one compare and select per element and no masked copy of the logits."""
    bonus_coef, scale_grad, denominator = loss_prologue(
        rows=rows,
        mask_ptr=mask_ptr,
        entropy_coef_ptr=entropy_coef_ptr,
        grad_scale_ptr=grad_scale_ptr,
        entropy_coef=loss_scalars[ENTROPY_COEF_AT],
        grad_scale=grad_scale,
        agg_denominator=agg_denominator,
        ENTROPY_COEF_FROM_PTR=ENTROPY_COEF_FROM_PTR,
        GRAD_SCALE_FROM_PTR=GRAD_SCALE_FROM_PTR,
        AGG_FROM_MASK=AGG_FROM_MASK,
    )
    slots = tl.arange(0, SUM_WIDTH)
    sums = tl.zeros([SUM_WIDTH], dtype=tl.float32)
    for row32 in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)  # int64 offsets: B x T x V may exceed 2^31
        grad_row = grad_ptr + row_offset(row, time, grad_stride_b, grad_stride_t)
        if tl.load(valid_ptr + row) != 0:
            row_ptr = logits_ptr + row_offset(row, time, stride_b, stride_t)
            # Every per-token scalar is loaded before sweep 1, so their latency hides behind it.
            # The labels arrive unchecked: one outside [0, V) is counted (the host raises on
            # the count, `labels_ok`) and read as 0, never out of the row.
            label = tl.load(labels_ptr + row)
            label_outside = (label < 0) | (label >= vocab)
            label = tl.where(label_outside, 0, label)
            label_logit = tl.load(row_ptr + label)
            # Counted at once, so that the flag is not live across sweep 1 (registers: the
            # stats loop's unrolling needs them).
            sums += slot(slots, SLOT_LABELS_OK, tl.where(label_outside, 1.0, 0.0))
            adv, agg_weight, old, low, high, is_weight, ref = load_token_inputs(
                row=row,
                time=time,
                adv_ptr=adv_ptr,
                adv_stride_b=adv_stride_b,
                adv_stride_t=adv_stride_t,
                mask_ptr=mask_ptr,
                agg_weight_ptr=agg_weight_ptr,
                denominator=denominator,
                old_ptr=old_ptr,
                low_ptr=low_ptr,
                high_ptr=high_ptr,
                is_weight_ptr=is_weight_ptr,
                ref_ptr=ref_ptr,
                loss_scalars=loss_scalars,
                AGG_FROM_MASK=AGG_FROM_MASK,
                HAS_OLD=HAS_OLD,
                HAS_BOUNDS=HAS_BOUNDS,
                HAS_IS=HAS_IS,
                KL_VALUE=KL_VALUE,
            )
            row_inv_t, row_scale2 = row_temperature(
                temperature_ptr, row, inv_temperature, scale2, ROW_TEMPERATURE
            )
            floor = 0.0
            if FLOORED:
                floor = tl.load(floor_ptr + row)
            # Sweep 1 keeps its lines in L2 (evict_last): sweep 2 re-reads the row right after.
            label_value, lse, mean_z, sum_pi_sq = row_stats(
                row_ptr,
                vocab,
                row_scale2,
                label_logit,
                cap2,
                "evict_last",
                FAST_EXP2,
                SUM_PI_SQUARED,
                SOFTCAP,
                BLOCK_V,
                floor,
                FLOORED,
            )
            entropy = lse - mean_z
            logp = logp_of(label_value, row_inv_t, lse)
            d_token, dentropy, token_sums = token_step(
                logp=logp,
                entropy=entropy,
                adv=adv,
                agg_weight=agg_weight,
                old=old,
                low=low,
                high=high,
                is_weight=is_weight,
                ref=ref,
                weight_ptr=mask_ptr + row,
                slots=slots,
                loss_scalars=loss_scalars,
                bonus_coef=bonus_coef,
                LOSS=LOSS,
                DUAL_CLIP=DUAL_CLIP,
                HAS_DELTA=HAS_DELTA,
                HAS_OLD=HAS_OLD,
                KL=KL,
                KL_VALUE=KL_VALUE,
                ENTROPY_BONUS=ENTROPY_BONUS,
            )
            sums += token_sums
            write_row_grad(
                row_ptr,
                grad_row,
                label,
                label_logit,
                vocab,
                row_inv_t,
                row_scale2,
                lse,
                entropy,
                d_token * scale_grad,
                dentropy * scale_grad,
                cap2,
                "evict_first",
                ENTROPY_BONUS,
                SOFTCAP,
                FAST_EXP2,
                BLOCK_V,
                floor,
                FLOORED,
            )
            tl.store(logp_ptr + row, logp)
            tl.store(entropy_ptr + row, entropy)
            if SUM_PI_SQUARED:
                tl.store(sum_sq_ptr + row, sum_pi_sq)
        else:
            write_row_zeros(grad_row, vocab, BLOCK_V)
            tl.store(logp_ptr + row, 0.0)
            tl.store(entropy_ptr + row, 0.0)
            if SUM_PI_SQUARED:
                tl.store(sum_sq_ptr + row, 0.0)
    tl.store(partials_ptr + tl.program_id(0) * SUM_WIDTH + slots, sums)


@functools.lru_cache(maxsize=1024)
def _variant_launch(
    block: int, elem_bytes: int, device: torch.device, variant: LossVariant, presence: tuple
) -> tuple[tuple, dict]:
    """(the kernel's scalars from 1 / T to the entropy coefficient, its constexprs and launch
    options): functions of the variant, which optional inputs are given (`presence`), the vocab
    tile and the device alone, worked out once per variant. At a 4k-token micro-batch the host's
    time is the loss's, and these are a third of the launcher's."""
    has_old, has_ref, has_is, has_bounds, row_temps, coef_tensor, sum_sq, scale_tensor, floors = (
        presence
    )
    scalars = (
        1.0 / variant.temperature,
        LOG2E.value / variant.temperature,  # log2(e) / T: sweep 1 works in base 2
        cap_arg(variant.cap),
        variant_scalars(variant),  # one tuple: the kernels' `loss_scalars`
    )
    constexprs = dict(
        **variant_constexprs(variant, has_ref, has_is, has_bounds, coef_tensor),
        HAS_OLD=has_old,
        GRAD_SCALE_FROM_PTR=scale_tensor,
        AGG_FROM_MASK=variant.agg_from_mask,
        ROW_TEMPERATURE=row_temps,
        SOFTCAP=variant.cap is not None,
        SUM_PI_SQUARED=sum_sq,
        FAST_EXP2=fast_exp2(device),
        BLOCK_V=block,
        FLOORED=floors,
        **launch_options(block, elem_bytes),
    )
    return scalars, constexprs


def sum_programs(logits: torch.Tensor) -> int:
    """How many programs the fused kernel runs on these logits: the rows of its `partials`."""
    batch, time, vocab = logits.shape
    rows, row_bytes = batch * time, vocab * logits.element_size()
    return persistent_programs(rows, row_bytes, logits.device, fit_l2=False)


@launches_on("logits")
def fused_token_loss(
    logits: torch.Tensor, grad: torch.Tensor, args: TokenLossArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the fused kernel on [B, T, V] logits; writes `grad` (may be `logits`) and returns
    (logp, entropy, partials): logp and entropy [B, T] fp32, partials [programs, SUM_WIDTH] fp32,
    each program's sums over its rows (`token_loss_sums` adds them up). `args`: the loss's
    inputs and variant (kernels/token_args.py says what each field is)."""
    check_floors(args.floors, args.labels, args.variant.cap)
    batch, time, vocab = logits.shape
    logp = torch.empty(batch, time, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp)
    programs = sum_programs(logits)
    partials = torch.empty(programs, SUM_WIDTH.value, dtype=torch.float32, device=logits.device)
    if batch * time == 0:
        return logp, entropy, partials.zero_()
    block = block_size(vocab, logits.device, logits.element_size())  # (tests lower its cap)
    scalars, constexprs = _variant_launch(
        block, logits.element_size(), logits.device, args.variant, args.presence()
    )
    _fused_token_loss_kernel[(programs,)](
        batch * time,
        logits,
        grad,
        *args.per_token_pointers(logp),
        logp,
        entropy,
        logp if args.sum_sq is None else rows_buffer(args.sum_sq, args.labels, "sum_sq"),
        partials,
        *args.scalar_pointers(logp),
        logp if args.floors is None else args.floors,
        time,
        vocab,
        *logits.stride()[:2],  # (one call for both: a microsecond a launch at a host-bound size)
        *args.advantages.stride(),
        *grad.stride()[:2],
        *scalars,
        float(args.grad_scale),  # (per call: not a variant's)
        float(args.agg_denominator),
        **constexprs,
    )
    return logp, entropy, partials
