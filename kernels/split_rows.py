"""The fused token-level loss with each row split over co-resident programs: exactly one read and
one write of the logits, whatever L2 holds.

The two-sweep kernel (token_loss.py) streams a row for its statistics and again for its
gradient, relying on L2 to serve the second read: one row per program, so the rows in flight are
capped by L2 (one 297 KB row per SM of an H100 is 39 MB of its 50 MB), and so are the bytes in
flight (8-16 KB per SM against the ~14-23 KB Little's law asks at 3 TB/s); ~18 % of the re-reads
miss (../shared/notes/perf-2026-11.md has the counters). Here a row is split into `slices` of
BLOCK_V elements, one per program of a group: each program loads its whole slice at once (32
elements, four 16-byte loads, per thread) and keeps it in registers; the group exchanges each
slice's (sum 2^d, sum 2^d d, sum 2^(2 d)), d = y - y_label (every program loads the label's
logit: the sums then add up with no rescaling) through global memory, every program adds them
into the row's lse and entropy, evaluates the token's loss terms (`token_loss.token_step`, the
same as the two-sweep kernel's) and writes its slice's gradient from the registers it still
holds. A row whose sums overflow (its label's probability below ~1e-33, a banned label, a NaN or
inf in the row) takes a second, exact round: each slice's online softmax read again from memory
(`_store_exact_partial`), merged with rescaling (`merge_partials`). DRAM traffic: one read and
one write of the logits, plus 16 bytes per slice and row of partials that live in L2.

The exchange is a barrier per row and group: each program stores its partial into one of two
ring slots, arrives on the group's counter (an atomic with release semantics) and spins until
all `slices` programs have arrived (acquire). Two slots suffice: a program writes slot k & 1
again only after passing barrier k + 1, which no program passes before every peer has arrived at
it, i.e. has read slot k. Spinning needs every program of a group resident at once, which a
cooperative launch guarantees (the driver refuses a grid that cannot be co-resident, and the
launcher then runs the two-sweep kernel); the grid is sized from the compiled kernel's registers
and shared memory (`resident_per_sm`). Masked rows need no exchange: every program reads the
row's `valid` flag and skips it alike.

PHASE: the exchange inside one launch (PHASE_ONE_LAUNCH), or split over two launches: PHASE_STATS
writes every row's partials, PHASE_FINISH reads them back and writes the gradient (the logits
are read twice). The Triton interpreter runs programs one after another, so a spin would never
end there: the CPU tests run the one-launch kernel without an exchange (rows of one slice) and
the two launches for rows of 2-18 slices; the exchange's barrier is GPU-only (tests/test_gpu.py).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import token_loss
from .device import launches_on
from .launch import REGISTERS_PER_SM, next_power_of_2
from .loss_sums import SLOT_LABELS_OK, SUM_WIDTH, slot
from .rows import (
    FLOOR,
    LN2,
    _stats_online,
    capped,
    exp2,
    grad_coefficients,
    grad_tile,
    label_entry,
    logp_of,
    merged_stats,
    reference_stats,
    row_offset,
    row_temperature,
    scaled,
)
from .terms import (  # noqa: F401  (the codes: aot varies these)
    ENTROPY_COEF_AT,
    KL_CODES,
    KL_VALUE_CODES,
    LOSS_CODES,
)
from .token_args import LossVariant, TokenLossArgs
from .token_loss import (
    CROSSED_SWITCHES,  # noqa: F401  (aot crosses the same switches here)
    _variant_launch,
    load_token_inputs,
    loss_prologue,
    sum_programs,
    token_step,
)

KERNEL_FAMILY = "split_row"

PHASE_CODES = {"one_launch": 0, "stats": 1, "finish": 2}
PHASE_ONE_LAUNCH = tl.constexpr(PHASE_CODES["one_launch"])
PHASE_STATS = tl.constexpr(PHASE_CODES["stats"])
PHASE_FINISH = tl.constexpr(PHASE_CODES["finish"])

# A slice is 32 elements per thread of an 8-warp program (8192 16-bit or 4096 fp32 elements:
# 16 KB, four 16-byte loads per thread in flight at once). Two such programs per SM (up to 128
# registers: at 80, for three, ptxas spills 8-248 bytes in most variants) keep 32 KB of loads in
# flight per SM at their rows' start, where the two-sweep kernel keeps 8-16 KB and Little's law
# asks ~14-23 KB at 3 TB/s. 64 elements per thread would double that, but ptxas then spills at
# any cap that keeps two programs resident.
SPLIT_WARPS = 8
SLICE_BYTES = 16384
PROGRAMS_PER_SM = 2
# Slices per row at most: V <= 524288 in 16-bit logits, 262144 in fp32.
MAX_SLICES = tl.constexpr(64)
PARTIAL = tl.constexpr(4)  # floats per slice partial: max, sum, weighted sum, (squares)
# The exact round's tiles: one element per thread (its online softmax keeps three or four
# running vectors; it runs on rare rows, and its registers count on every row).
FALLBACK_BLOCK = tl.constexpr(256)
# Under the interpreter a slice is small, so that V = 1031 spans several (tests lower it more).
INTERPRETED_SLICE = 512


# When the fused loss runs here instead of in the two-sweep kernel (FUSEDRL_SPLIT_ROWS): "off"
# (the default until a GPU run has measured it: tests/test_gpu.py, bench/run_gpu.sh), "on" (on a
# GPU, for logits it fits: `split_rows_fit`), "always" (every call, the interpreter's too).
POLICIES = ("off", "on", "always")
POLICY = os.environ.get("FUSEDRL_SPLIT_ROWS", "off")
if POLICY not in POLICIES:
    raise ValueError(f"FUSEDRL_SPLIT_ROWS must be one of {POLICIES}, got {POLICY!r}")


def fused_token_loss(logits: torch.Tensor, grad: torch.Tensor, args: TokenLossArgs):
    """The fused token-level loss (`token_loss.fused_token_loss`'s arguments and outputs) by the
    split-row kernel where POLICY takes it, else (or when a GPU cannot hold its grid
    co-resident) by the two-sweep kernel."""
    wanted = POLICY == "always" or (POLICY == "on" and split_rows_fit(logits, grad))
    # (the sum of p^2, the Optimal Token Baseline's input, is the two-sweep kernel's: a fifth
    # running sum here spills registers in some of its variants; so is the read through a
    # sampled set's floors, a switch this kernel does not have)
    if wanted and args.sum_sq is None and args.floors is None:
        out = split_row_loss(logits, grad, args)
        if out is not None:
            return out
    return token_loss.fused_token_loss(logits, grad, args)


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    """The slice width (BLOCK_V): SLICE_BYTES of logits on a GPU."""
    if device.type == "cuda":
        return SLICE_BYTES // elem_bytes
    widest = next_power_of_2(-(-vocab // MAX_SLICES.value))
    return max(min(INTERPRETED_SLICE, next_power_of_2(vocab)), widest)


def max_registers(warps: int) -> int:
    """The register cap that keeps PROGRAMS_PER_SM programs resident (128 at 8 warps; ptxas
    allocates in units of 8 per thread)."""
    return REGISTERS_PER_SM // (PROGRAMS_PER_SM * 32 * warps) // 8 * 8


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    return {"num_warps": SPLIT_WARPS, "maxnreg": max_registers(SPLIT_WARPS)}


def resident_per_sm(
    registers: int,
    shared_bytes: int,
    warps: int,
    registers_per_sm: int = REGISTERS_PER_SM,
    shared_per_sm: int = 233472,
    threads_per_sm: int = 2048,
    blocks_per_sm: int = 32,
) -> int:
    """Programs of a compiled kernel resident on one SM at once, as the hardware allocates:
    registers per warp in units of 256, 1 KB of shared memory reserved per program (sm_80 and
    later), and the threads' and programs' limits. The defaults are an H100's."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = registers_per_sm // per_warp // warps
    by_threads = threads_per_sm // (32 * warps)
    by_shared = shared_per_sm // (shared_bytes + 1024)
    return max(0, min(by_registers, by_threads, by_shared, blocks_per_sm))


@triton.jit
def _slice_sums(x, reference, row_scale2, cap2, SOFTCAP: tl.constexpr, FAST_EXP2: tl.constexpr):
    """(sum 2^d, sum 2^d d) of one slice, d = y - reference clamped below at FLOOR, y the scaled
    logits: one pass over the registers, each element converted once and not kept (the slice
    stays live, 16-bit, until its gradient). The row's reference (its label's y) is known to
    every program, so the slices' sums add up without rescaling; `reference_stats` says when
    they overflowed (then `_store_exact_partial`)."""
    if SOFTCAP:
        x, _ = capped(x, cap2, FAST_EXP2)
    d = tl.maximum(
        x.to(tl.float32) * row_scale2 - reference, FLOOR, propagate_nan=tl.PropagateNan.ALL
    )
    e = exp2(d, FAST_EXP2)
    return tl.sum(e, axis=0), tl.sum(e * d, axis=0)


@triton.jit
def _store_exact_partial(
    out_ptr,
    entry,
    slice_ptr,
    length,
    row_scale2,
    cap2,
    FAST_EXP2: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The slice's exact partial, read again from memory by the online softmax (`rows`), as
    `merge_partials` takes it: (its lse2, 1, its mean y) at out_ptr."""
    lse2, mean_y, _ = _stats_online(
        slice_ptr,
        tl.minimum(length, BLOCK_V),
        row_scale2,
        cap2,
        "",
        FAST_EXP2,
        False,
        SOFTCAP,
        FALLBACK_BLOCK,
    )
    partial = tl.where(
        entry == 0, lse2, tl.where(entry == 1, 1.0, tl.where(entry == 2, mean_y, 0.0))
    )
    tl.store(out_ptr + entry, partial)


@triton.jit
def merge_partials(maxes, sums, weighted, squares, SQUARES: tl.constexpr, FAST_EXP2: tl.constexpr):
    """(lse2, mean y, sum p^2) of a row from its slices' partials ([MAX_SLICES] vectors; absent
    slices hold max -inf and zero sums and drop out): each slice's sums rescaled to the row's
    max, as the online softmax does per element."""
    row_max = tl.max(maxes, axis=0)
    rescale = tl.where(maxes == -float("inf"), 0.0, exp2(maxes - row_max, FAST_EXP2))
    weighted_sq = 0.0
    if SQUARES:
        weighted_sq = tl.sum(squares * rescale * rescale, axis=0)
    total = tl.sum(sums * rescale, axis=0)
    return merged_stats(row_max, total, tl.sum(weighted * rescale, axis=0), weighted_sq, SQUARES)


@triton.jit
def _merge_partials_kernel(partials_ptr, out_ptr, slices, SQUARES: tl.constexpr):
    """Test harness of `merge_partials`: row r's [MAX_SLICES, PARTIAL] partials (the first
    `slices` given) in, (lse2, mean y, sum p^2) out."""
    row = tl.program_id(0)
    index = tl.arange(0, MAX_SLICES)
    present = index < slices
    base = partials_ptr + row * MAX_SLICES * PARTIAL + index * PARTIAL
    lse2, mean_y, sum_sq = merge_partials(
        tl.load(base, mask=present, other=-float("inf")),
        tl.load(base + 1, mask=present, other=0.0),
        tl.load(base + 2, mask=present, other=0.0),
        tl.load(base + 3, mask=present, other=0.0),
        SQUARES,
        False,
    )
    tl.store(out_ptr + row * 3, lse2)
    tl.store(out_ptr + row * 3 + 1, mean_y)
    tl.store(out_ptr + row * 3 + 2, sum_sq)


@triton.jit
def _group_barrier(arrivals_ptr, target):
    """Arrive on the group's counter and wait until it reaches `target`: the stores before it
    (the partial) are visible to every program past it (release / acquire at GPU scope; the
    CTA barriers make one thread's atomics stand for the whole program)."""
    tl.debug_barrier()
    tl.atomic_add(arrivals_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _split_row_loss_kernel(
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
    partials_ptr,
    temperature_ptr,
    entropy_coef_ptr,
    grad_scale_ptr,
    exchange_ptr,
    arrivals_ptr,
    time,
    vocab,
    slices,
    partial_rows,
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
    FAST_EXP2: tl.constexpr,
    PHASE: tl.constexpr,
    EXCHANGE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program p is slice p % slices of group p // slices; group g walks rows g, g + groups, ...
    The arguments are the two-sweep kernel's (`token_loss._fused_token_loss_kernel`, which
    documents them) and: `exchange_ptr`, the partials' fp32 buffer (PHASE_ONE_LAUNCH: two ring
    slots of [MAX_SLICES, PARTIAL] per group; the two launches: [2 MAX_SLICES + 1, PARTIAL] per
    row: the slices' sums, their exact partials, and the label's logit, carried from the first
    launch to the second because in place the second may have overwritten it); `arrivals_ptr`:
    one int32 counter per group, zero at launch; EXCHANGE: the rows span more than one slice
    (or the two launches). Group g's slice-0 program writes the group's sums to row g of
    `partials` (`partial_rows` rows; rows past the groups get zeros)."""
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
    pid = tl.program_id(0)
    slice_id = pid % slices
    group = pid // slices
    groups = tl.num_programs(0) // slices
    lead = slice_id == 0  # the program that writes the row's scalars and the group's sums
    # Per element only the lane index: the slice's start and length are scalars (per-element
    # offsets and masks hoisted out of the row loop would take 32 registers each).
    slice_start = slice_id * BLOCK_V
    lanes = tl.arange(0, BLOCK_V)
    in_slice = lanes < vocab - slice_start
    entry = tl.arange(0, PARTIAL)
    peers = tl.arange(0, MAX_SLICES)
    slots = tl.arange(0, SUM_WIDTH)
    sums = tl.zeros([SUM_WIDTH], dtype=tl.float32)
    exchanged = 0  # rows this group has exchanged: the barrier's count and the ring's slot
    # With an exchange, each row's slice is loaded a row ahead: its loads are in flight while
    # the group exchanges and writes the row before (a masked row's slice is not read).
    valid_next = tl.load(valid_ptr + group) != 0
    if EXCHANGE:
        first_ptr = logits_ptr + row_offset(group, time, stride_b, stride_t) + slice_start
        x_next = tl.load(first_ptr + lanes, mask=in_slice, other=-float("inf"))  # (if masked)
    for row32 in range(group, rows, groups):
        row = tl.cast(row32, tl.int64)  # int64 offsets: B x T x V may exceed 2^31
        grad_row = grad_ptr + row_offset(row, time, grad_stride_b, grad_stride_t)
        valid = valid_next
        following = row + groups
        valid_next = tl.load(valid_ptr + following, mask=following < rows, other=0) != 0
        if EXCHANGE:
            x = x_next
            if valid_next:  # (else x_next keeps a stale slice that nothing reads)
                following_ptr = row_offset(following, time, stride_b, stride_t) + slice_start
                x_next = tl.load(
                    logits_ptr + following_ptr + lanes, mask=in_slice, other=-float("inf")
                )
        else:  # (no exchange to wait for, and the registers of a second slice stay free)
            x = tl.load(
                logits_ptr + row_offset(row, time, stride_b, stride_t) + slice_start + lanes,
                mask=tl.where(valid, in_slice, False),
                other=-float("inf"),
            )
        if PHASE == PHASE_ONE_LAUNCH:
            part = exchange_ptr + (group * 2 + exchanged % 2) * MAX_SLICES * PARTIAL
        else:
            part = exchange_ptr + row * (2 * MAX_SLICES + 1) * PARTIAL
        if valid:
            row_ptr = logits_ptr + row_offset(row, time, stride_b, stride_t)
            label = tl.load(labels_ptr + row)
            label_outside = (label < 0) | (label >= vocab)
            label = tl.where(label_outside, 0, label)
            if PHASE == PHASE_FINISH:
                label_logit = tl.load(part + 2 * MAX_SLICES * PARTIAL)
            else:
                label_logit = tl.load(row_ptr + label).to(tl.float32)
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
            label_value = label_logit
            if SOFTCAP:
                label_value, _ = capped(label_logit, cap2, FAST_EXP2)
            reference = scaled(label_value, row_scale2)
            if PHASE != PHASE_FINISH:
                local_sum, local_offsets = _slice_sums(
                    x, reference, row_scale2, cap2, SOFTCAP, FAST_EXP2
                )
                if EXCHANGE:
                    fast = tl.where(entry == 1, local_sum, tl.where(entry == 2, local_offsets, 0.0))
                    tl.store(part + slice_id * PARTIAL + entry, fast)
                if PHASE == PHASE_STATS:
                    # The exact partial too (the second launch cannot read the slice again in
                    # place: its peers may have written theirs), and the label's logit.
                    _store_exact_partial(
                        part + (MAX_SLICES + slice_id) * PARTIAL,
                        entry,
                        row_ptr + slice_start,
                        vocab - slice_start,
                        row_scale2,
                        cap2,
                        FAST_EXP2,
                        SOFTCAP,
                        BLOCK_V,
                    )
                    if lead:
                        tl.store(part + 2 * MAX_SLICES * PARTIAL, label_logit)
            if PHASE == PHASE_ONE_LAUNCH:
                if EXCHANGE:
                    _group_barrier(arrivals_ptr + group, slices * (exchanged + 1))
                exchanged += 1
            if PHASE != PHASE_STATS:
                if EXCHANGE:
                    present = peers < slices
                    peer = part + peers * PARTIAL
                    # .cg: from L2, never from this SM's L1, which may hold the slot's lines
                    # from two rows ago (L1 is not coherent across SMs).
                    local_sum = tl.sum(
                        tl.load(peer + 1, mask=present, other=0.0, cache_modifier=".cg")
                    )
                    local_offsets = tl.sum(
                        tl.load(peer + 2, mask=present, other=0.0, cache_modifier=".cg")
                    )
                lse2, mean_y, _, overflow = reference_stats(
                    reference, local_sum, local_offsets, 0.0, False
                )
                if overflow:
                    # The same decision in every program of the row (from the same sums): the
                    # exact statistics, a second round over the slice from memory. A label of
                    # probability ~1e-33 or below, a banned label, a NaN or inf in the row.
                    if PHASE == PHASE_ONE_LAUNCH:
                        if EXCHANGE:
                            part = exchange_ptr + (group * 2 + exchanged % 2) * MAX_SLICES * PARTIAL
                            _store_exact_partial(
                                part + slice_id * PARTIAL,
                                entry,
                                row_ptr + slice_start,
                                vocab - slice_start,
                                row_scale2,
                                cap2,
                                FAST_EXP2,
                                SOFTCAP,
                                BLOCK_V,
                            )
                            _group_barrier(arrivals_ptr + group, slices * (exchanged + 1))
                        else:
                            lse2, mean_y, _ = _stats_online(
                                row_ptr,
                                vocab,
                                row_scale2,
                                cap2,
                                "",
                                FAST_EXP2,
                                False,
                                SOFTCAP,
                                FALLBACK_BLOCK,
                            )
                        exchanged += 1
                    else:
                        part = part + MAX_SLICES * PARTIAL  # the first launch's exact partials
                    if EXCHANGE:
                        present = peers < slices
                        peer = part + peers * PARTIAL
                        lse2, mean_y, _ = merge_partials(
                            tl.load(peer, mask=present, other=-float("inf"), cache_modifier=".cg"),
                            tl.load(peer + 1, mask=present, other=0.0, cache_modifier=".cg"),
                            tl.load(peer + 2, mask=present, other=0.0, cache_modifier=".cg"),
                            0.0,
                            False,
                            FAST_EXP2,
                        )
                lse = lse2 * LN2
                entropy = lse - mean_y * LN2
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
                if lead:
                    sums += token_sums + slot(
                        slots, SLOT_LABELS_OK, tl.where(label_outside, 1.0, 0.0)
                    )
                    tl.store(logp_ptr + row, logp)
                    tl.store(entropy_ptr + row, entropy)
                k0, k1, onehot = grad_coefficients(
                    d_token * scale_grad, dentropy * scale_grad, entropy, row_inv_t, cap2, SOFTCAP
                )
                # The gradient from the registers: p (k0 + k1 log2 p), times r (1 - r) under a
                # soft cap (a -inf logit gives p = 0; only log2 p needs the clamp); the label's
                # entry, with its one-hot term, is stored after by the slice that holds it.
                grad = grad_tile(
                    x, row_scale2, lse2, k0, k1, cap2, ENTROPY_BONUS, SOFTCAP, FAST_EXP2, True
                )
                # In place, the label's logit (read above by every program of the group) must
                # be read before its owner overwrites it: the exchange's barriers order it
                # across programs, this one across the warps of a program without exchange.
                tl.debug_barrier()
                out_ty = grad_ptr.dtype.element_ty
                tl.store(grad_row + slice_start + lanes, grad.to(out_ty), mask=in_slice)
                label_grad = label_entry(
                    label_logit,
                    row_scale2,
                    lse2,
                    k0,
                    k1,
                    onehot,
                    cap2,
                    ENTROPY_BONUS,
                    SOFTCAP,
                    FAST_EXP2,
                )
                tl.debug_barrier()  # after every store that covered the label's element
                if (label >= slice_start) & (label < slice_start + BLOCK_V):
                    tl.store(grad_row + label, label_grad.to(out_ty))
        elif PHASE != PHASE_STATS:
            zeros = tl.zeros([BLOCK_V], grad_ptr.dtype.element_ty)
            tl.store(grad_row + slice_start + lanes, zeros, mask=in_slice)
            if lead:
                tl.store(logp_ptr + row, 0.0)
                tl.store(entropy_ptr + row, 0.0)
    if PHASE != PHASE_STATS:
        if lead:
            tl.store(partials_ptr + group * SUM_WIDTH + slots, sums)
        for empty in range(groups + pid, partial_rows, tl.num_programs(0)):
            tl.store(partials_ptr + empty * SUM_WIDTH + slots, tl.zeros([SUM_WIDTH], tl.float32))


@launches_on("partials")
def merge_partials_rows(partials: torch.Tensor, slices: int, squares: bool = True) -> torch.Tensor:
    """`merge_partials` on its own: [rows, MAX_SLICES, PARTIAL] fp32 partials (the first `slices`
    of each row read) -> [rows, 3] fp32 (lse2, mean y, sum p^2), in base 2 as the kernel has
    them. The exchange's arithmetic, testable where the exchange itself cannot run."""
    rows = partials.shape[0]
    if partials.shape[1:] != (MAX_SLICES.value, PARTIAL.value) or partials.dtype != torch.float32:
        raise ValueError(
            f"partials must be float32 [rows, {MAX_SLICES}, {PARTIAL}], got {partials.dtype} "
            f"{tuple(partials.shape)}"
        )
    out = torch.empty(rows, 3, dtype=torch.float32, device=partials.device)
    if rows:
        _merge_partials_kernel[(rows,)](
            partials.contiguous(), out, slices, SQUARES=squares, num_warps=4
        )
    return out


_NOT_CO_RESIDENT: dict[tuple, str] = {}


@functools.cache
def _sm_resources(device_index: int) -> tuple[int, dict[str, int]]:
    props = torch.cuda.get_device_properties(device_index)
    limits = {
        "registers_per_sm": getattr(props, "regs_per_multiprocessor", REGISTERS_PER_SM),
        "shared_per_sm": getattr(props, "shared_memory_per_multiprocessor", 233472),
        "threads_per_sm": getattr(props, "max_threads_per_multi_processor", 2048),
    }
    return props.multi_processor_count, limits


def _compiled_resources(compiled) -> tuple[int, int]:
    """(registers per thread, shared bytes) of a compiled kernel."""
    if getattr(compiled, "n_regs", None) is None and hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    return int(compiled.n_regs), int(getattr(compiled.metadata, "shared", 0))


def _groups(rows: int, slices: int, partial_rows: int, per_sm: int, sms: int) -> int:
    """Groups of a grid: as many as fit co-resident (`per_sm` programs per SM on `sms` SMs),
    no more than the rows or the partials' rows."""
    return max(1, min(rows, partial_rows, sms * per_sm // slices))


def split_rows_fit(logits: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the split-row kernel takes these logits on a GPU: 16-bit or fp32 rows that fit
    MAX_SLICES slices, and whose loads and stores are 128-bit (V, the row strides and both
    base addresses 16-byte aligned, as Triton can see: multiples of 16 elements)."""
    if logits.device.type != "cuda" or logits.dim() != 3:
        return False
    batch, time, vocab = logits.shape
    width = block_size(vocab, logits.device, logits.element_size())
    aligned = (
        all(
            s % 16 == 0
            for s in (vocab, logits.stride(0), logits.stride(1), grad.stride(0), grad.stride(1))
        )
        and logits.data_ptr() % 16 == 0
        and grad.data_ptr() % 16 == 0
    )
    return aligned and -(-vocab // width) <= MAX_SLICES.value and logits.stride(2) == 1


@launches_on("logits")
def split_row_loss(
    logits: torch.Tensor, grad: torch.Tensor, args: TokenLossArgs, two_launches: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`token_loss.fused_token_loss` (same arguments but `sum_sq`, same outputs) by the split-row
    kernel, or None when a GPU cannot hold a group co-resident (the caller runs the two-sweep
    kernel).
    `two_launches`: the exchange through a second launch instead of a barrier (default: on CPU,
    where the interpreter cannot spin, when rows span more than one slice)."""
    if args.sum_sq is not None or args.floors is not None:
        raise ValueError(
            "sum_sq, floors: the split-row kernel neither sums p^2 nor reads a sampled set's "
            "floors (the two-sweep one does)"
        )
    batch, time, vocab = logits.shape
    rows, device = batch * time, logits.device
    logp = torch.empty(batch, time, dtype=torch.float32, device=device)
    entropy = torch.empty_like(logp)
    partial_rows = sum_programs(logits)
    partials = torch.empty(partial_rows, SUM_WIDTH.value, dtype=torch.float32, device=device)
    if rows == 0:
        return logp, entropy, partials.zero_()
    width = block_size(vocab, device, logits.element_size())
    slices = -(-vocab // width)
    if slices > MAX_SLICES.value:
        raise ValueError(f"vocab {vocab} spans {slices} slices of {width}: at most {MAX_SLICES}")
    if two_launches is None:
        two_launches = device.type != "cuda" and slices > 1
    if device.type != "cuda" and slices > 1 and not two_launches and _interpreted():
        raise ValueError("the interpreter runs programs one by one: a group barrier never ends")
    scalars, constexprs, variant = _split_launch(
        slices > 1 or two_launches,
        width,
        logits.element_size(),
        device,
        args.variant,
        args.presence(),
    )

    def arguments(exchange: torch.Tensor, arrivals: torch.Tensor) -> tuple:
        return (
            rows,
            logits,
            grad,
            *args.per_token_pointers(logp),
            logp,
            entropy,
            partials,
            *args.scalar_pointers(logp),
            exchange,
            arrivals,
            time,
            vocab,
            slices,
            partial_rows,
            logits.stride(0),
            logits.stride(1),
            args.advantages.stride(0),
            args.advantages.stride(1),
            grad.stride(0),
            grad.stride(1),
            *scalars,
            float(args.grad_scale),
            float(args.agg_denominator),
        )

    if device.type != "cuda" or two_launches:
        unused = torch.empty(1, dtype=torch.int32, device=device)
        groups = max(1, min(rows, partial_rows))
        grid = (groups * slices,)
        if two_launches:
            exchange = torch.empty(rows, 2 * MAX_SLICES.value + 1, PARTIAL.value, device=device)
            launch = arguments(exchange, unused)
            _split_row_loss_kernel[grid](*launch, **constexprs, PHASE=PHASE_CODES["stats"])
            _split_row_loss_kernel[grid](*launch, **constexprs, PHASE=PHASE_CODES["finish"])
        else:  # one slice per row (or a recorded launch): no co-residency needed
            launch = arguments(logp, unused)
            _split_row_loss_kernel[grid](*launch, **constexprs, PHASE=PHASE_CODES["one_launch"])
        return logp, entropy, partials
    plan = _cooperative_grid(arguments, variant, rows, slices, partial_rows, device)
    if plan is None:
        return None
    grid, launch, options, key = plan
    try:
        _split_row_loss_kernel[grid](*launch, **options)
    except RuntimeError as error:  # the driver's "too many blocks in cooperative launch"
        _NOT_CO_RESIDENT[key] = str(error)
        return None
    return logp, entropy, partials


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1024)
def _split_launch(
    exchange: bool, block: int, elem_bytes: int, device, variant: LossVariant, presence: tuple
) -> tuple[tuple, dict, tuple]:
    """(scalars, constexprs, the variant as a hashable key) of a split-row launch: the two-sweep
    kernel's (`token_loss._variant_launch`, same arguments) less the sum of p^2, with the
    exchange switch and this kernel's launch options. Worked out once per variant: the host's
    time is the loss's at a short row."""
    scalars, constexprs = _variant_launch(block, elem_bytes, device, variant, presence)
    constexprs = {k: v for k, v in constexprs.items() if k not in ("SUM_PI_SQUARED", "FLOORED")}
    constexprs.update(EXCHANGE=exchange, **launch_options(block))
    return scalars, constexprs, tuple(sorted(constexprs.items()))


def _cooperative_grid(arguments, variant, rows, slices, partial_rows, device):
    """(grid, arguments, options, variant key) of the one-launch kernel on a GPU, with a grid
    that is co-resident: sized from the compiled kernel's registers and shared memory, to be
    launched cooperatively (the driver refuses a grid it cannot hold resident, e.g. under an MPS
    or green-context SM limit or beside other kernels' resident programs, rather than let a
    group spin forever). None when the variant cannot be resident here."""
    key = (device.index, variant, slices)
    if key in _NOT_CO_RESIDENT:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, limits = _sm_resources(index)
    options = {**dict(variant), "PHASE": PHASE_CODES["one_launch"], "launch_cooperative_grid": True}
    if key not in _RESOURCES:
        placeholder = torch.empty(1, dtype=torch.int32, device=device)
        compiled = _split_row_loss_kernel.warmup(
            *arguments(placeholder.float(), placeholder), grid=(1,), **options
        )
        _RESOURCES[key] = _compiled_resources(compiled)
    registers, shared = _RESOURCES[key]
    per_sm = min(resident_per_sm(registers, shared, SPLIT_WARPS, **limits), PROGRAMS_PER_SM + 1)
    groups = _groups(rows, slices, partial_rows, per_sm, sms)
    if per_sm == 0 or groups * slices > sms * per_sm:
        _NOT_CO_RESIDENT[key] = f"{slices} slices, {per_sm} programs per SM on {sms} SMs"
        return None
    # Two ring slots of partials per group (each written before it is read), and one arrivals
    # counter per group, zero at launch (a memset of a few hundred bytes).
    ring = torch.empty(groups * 2 * MAX_SLICES.value * PARTIAL.value, device=device)
    launch = arguments(ring, torch.zeros(groups, dtype=torch.int32, device=device))
    return (groups * slices,), launch, options, key


# Per variant: the compiled kernel's (registers, shared bytes), and why a cooperative launch
# was refused (that variant then runs the two-sweep kernel).
_RESOURCES: dict[tuple, tuple[int, int]] = {}
