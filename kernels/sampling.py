"""Sampling-mask replay on chip: each row's sampled set found without a sort, as a floor.

vLLM's sampler keeps, per row, the tokens that survive min_p, then top_k, then top_p on the
renormalised rest (`fusedrl.sampling` has the exact rules). Each filter keeps a prefix of the row
in descending logit order, so the set is {v : key(x_v) >= K} for one key K per row. This kernel
finds K without sorting and stores its value, the row's floor: the Triton row kernels read the
logits through it (`rows.floored`: below the floor, the label excepted, a logit reads as -inf),
so no masked copy of the logits is written (`sampled_floors`). Kernels that cannot read floors
(the CUDA extension's) get the row written with -inf outside the set, the label and NaN kept
(`write_sampled_set`, WRITE_ROWS), which they then read in place.

The key is the logit's fp32 bit pattern mapped to a uint32 whose order is the values' order; x/T
is monotone in x, so the keys of the raw logits serve every temperature. K is the largest key
whose candidates at or above it weigh at least a target: a count (top_k: the k-th largest) or a
share of the candidates' probability mass (top_p: the smallest kept token is the first whose
larger ones weigh less than p). min_p is one more floor on the keys. Two ways find K:

- Gathered (COMPACT: top_k up to COMPACT_TOP_K, with or without the others; top_p without
  top_k). The row max's read also keeps a running max per tile position; the k-th largest of
  GROUPS group maxima of those is a threshold with at least k logits above it and, unless several
  of the k largest share a group, few more. One more read gathers the logits at or above the
  threshold (and min_p's floor) into the program's CANDIDATES floats of scratch (1 KB, in L2),
  and the k-th largest and top_p's floor are found among them in registers, by pairs. Without
  top_k, top_p's k is a guess (TOP_P_GUESS: a trained model's nucleus is mostly a few tokens);
  the gather's read also sums the mass of top_p's candidates over the whole row, and the
  gathered logits decide when they hold at least top_p of it. Two reads of each row in all,
  whatever the dtype.
- Radix passes, where the candidates are not few (a larger top_k, a row where more than
  CANDIDATES crowd above the threshold, e.g. ties, a nucleus wider than the gathered logits, a
  NaN): most significant digit first, top_k
  counts 8 bits of key a pass in shared memory (`tl.histogram`); top_p compares each logit with
  4 thresholds a pass (2 bits), as values. Passes over each row of B-bit logits (B = 16 for
  bf16, 20 for fp16, 32 for fp32): the row max (min_p, top_p) 1; top_k B / 8 rounded up (bf16:
  2), counting; top_p B / 2 (bf16: 8), summing exp(y - max) of the candidates. A select skips
  the passes whose digits the floor so far and the row max already share (top_p after top_k or
  min_p: usually 3 or 4 of its 8).

The masked write (WRITE_ROWS only) is 1 read and 1 write more. Only the first read and the write
are HBM traffic when the rows in flight fit in L2 (the launcher sizes the persistent grid as the
fused kernel does); the radix top_p passes issue a compare, a select and an add per threshold and
element, so there the kernel is bound by its instruction issue, not by memory: docs/losses.md has
the cost against the plain kernel. No global atomics; the only scratch is the gathered path's.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import max_registers, persistent_programs
from .rows import LOG2E, row_offset, row_temperature_arg

# top_p: 2 bits of key a pass, each logit compared with 4 thresholds as values (a compare, select
# and add each). top_k: 8 bits a pass, counted in shared memory by tl.histogram.
RADIX_BITS = tl.constexpr(2)
RADIX = tl.constexpr(4)
COUNT_BITS = tl.constexpr(8)
COUNT_RADIX = tl.constexpr(256)
# A tile of the select passes: each thread keeps RADIX running sums per element it holds
# (4 at 8 warps: 16 registers), summed over the tiles in registers and reduced once per pass.
# Interpreted: small tiles, so that the tests' odd vocabularies take several and a partial one.
GPU_BLOCK_V = 1024
SELECT_WARPS = 8
INTERPRETED_BLOCK_V = 512
# Its loops are compute-bound selects, not the row sweeps whose SASS budgets aot checks.
KERNEL_FAMILY = "select"
# The key of -inf: every key at or below it stands for "no threshold" (they are -inf and NaNs).
NEG_INF_KEY = tl.constexpr(0x007FFFFF)
# How far (in ulps) min_y x T may be from the min_p floor: 2 roundings, ~1 ulp each.
MIN_P_STEPS = tl.constexpr(4)
# The candidates' select (COMPACT): the row's logits at or above a threshold, gathered into a
# program's CANDIDATES floats of scratch (L2-resident: 1 KB a program) when no more than that;
# the threshold under top_k is the k-th largest of GROUPS group maxima of the row, so top_k up
# to COMPACT_TOP_K (half the groups: a few maxima share a group) gathers k + a few logits.
CANDIDATES = tl.constexpr(256)
GROUPS = tl.constexpr(256)
CHUNK = tl.constexpr(16)
COMPACT_TOP_K = 128
# top_p without top_k gathers as top_k = TOP_P_GUESS would: ~180 logits of a row whose largest
# are spread out, the nucleus of most of a trained model's rows (else the radix passes run).
TOP_P_GUESS = tl.constexpr(COMPACT_TOP_K)


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    return GPU_BLOCK_V if device.type == "cuda" else INTERPRETED_BLOCK_V


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    """Two programs per SM (as `persistent_programs` assumes): 128 registers a thread."""
    return {"num_warps": SELECT_WARPS, "maxnreg": max_registers(SELECT_WARPS)}


@triton.jit
def _order_key(x):
    """The uint32 key of fp32 x: its bits with the sign bit set, or all inverted when negative,
    so that keys compare as the values do (-0 and +0 share a key; NaN sorts above +inf)."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _key_value(key):
    """The fp32 value of an order key (the inverse of key = bits | sign, or ~bits when the sign
    is set), -inf for the keys at or below -inf's: `x >= _key_value(K)` is then `key(x) >= K`
    for every x but NaN (kept apart by the callers)."""
    bits = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key)
    return tl.where(key <= NEG_INF_KEY, -float("inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _min_p_floor_key(x_max, temperature, log_min_p):
    """The key of the smallest x with x / T >= max x / T + log(min_p) (p >= min_p max p, as vLLM
    computes it), so that min_p is one more floor on the keys. min_y x T lands within a few
    ulps of it: step to it by keys (adjacent keys are adjacent floats)."""
    min_y = tl.math.div_rn(x_max, temperature) + log_min_p
    key = _order_key(min_y * temperature)
    for _ in tl.static_range(MIN_P_STEPS):
        key = tl.where(tl.math.div_rn(_key_value(key), temperature) < min_y, key + 1, key)
    for _ in tl.static_range(MIN_P_STEPS):
        key = tl.where(tl.math.div_rn(_key_value(key - 1), temperature) >= min_y, key - 1, key)
    return key


@triton.jit
def _count_select(
    row_ptr,
    vocab,
    k,
    floor_key,
    top_key,
    KEY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The largest key K with at least k logits at or above it (the k-th largest), or one at or
    below floor_key when fewer than k lie at or above that floor. COUNT_BITS of key per pass,
    most significant first: the logits whose key matches the digits chosen so far are counted
    by their next digit (`tl.histogram`: shared-memory counters), and the largest digit with at
    least k at or above it, those above the prefix included, is taken.

    K lies in [floor_key, top_key] or matters only there (the caller takes the larger of K and
    floor_key), so the leading digits the two share are K's: those passes are skipped, and no
    logit lies above their prefix."""
    offs = tl.arange(0, BLOCK_V)
    digits = tl.arange(0, COUNT_RADIX)
    prefix = floor_key & 0  # uint32 0
    above = 0  # logits whose key is above the prefix's range
    for p in tl.static_range(KEY_BITS // COUNT_BITS):
        shift = 32 - (p + 1) * COUNT_BITS  # constexpr: p is
        if (floor_key >> shift) == (top_key >> shift):
            prefix = (floor_key >> shift) << shift
        else:
            counts = tl.zeros([COUNT_RADIX], tl.int32)
            for start in range(0, vocab, BLOCK_V):
                in_row = start + offs < vocab
                x = tl.load(row_ptr + start + offs, mask=in_row, other=0.0)
                keys = _order_key(x.to(tl.float32))
                if p > 0:
                    high = shift + COUNT_BITS
                    in_row = in_row & ((keys >> high) == (prefix >> high))
                digit = ((keys >> shift) & (COUNT_RADIX - 1)).to(tl.int32)
                counts += tl.histogram(digit, COUNT_RADIX, mask=in_row)
            # at_or_above[d]: the matching logits with digit >= d, plus those above the prefix
            at_or_above = above + tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts
            chosen = tl.max(tl.where(at_or_above >= k, digits, 0), axis=0)
            above += tl.sum(tl.where(digits > chosen, counts, 0), axis=0)
            prefix = prefix | (chosen.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _mass_select(
    row_ptr,
    vocab,
    top_p,
    floor_key,
    top_key,
    y_max2,
    scale2,
    KEY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The largest key K whose candidates (the logits >= the value of floor_key) at or above it
    hold at least top_p of the candidates' probability mass. RADIX_BITS of key per pass, most
    significant first: each logit is compared, as a value, with the RADIX keys prefix + d 2^shift
    (no key is built per element) and adds its exp(y - max y) to the sums of those it reaches;
    the largest d whose sum reaches the target is kept. Passes whose digits floor_key and
    top_key (the row max's) share are skipped, as in `_count_select`.

    Tiles are [1, BLOCK_V], so that the [RADIX, BLOCK_V] running sums are the tile broadcast in
    each thread's registers (a 1-D tile would be re-laid out through shared memory, with
    barriers, on every trip); they are reduced across threads once per pass."""
    offs = tl.arange(0, BLOCK_V)[None, :]
    digits = tl.arange(0, RADIX)
    floor_value = _key_value(floor_key)
    prefix = floor_key & 0  # uint32 0
    target = top_p * 0.0  # top_p x the candidates' total, once a pass has summed it
    for p in tl.static_range(KEY_BITS // RADIX_BITS):
        shift = 32 - (p + 1) * RADIX_BITS  # constexpr: p is
        if (floor_key >> shift) == (top_key >> shift):
            prefix = (floor_key >> shift) << shift
        else:
            # Digit 0 always qualifies (its candidates are those of the prefix): its threshold
            # is -inf, so its sum is the candidates' total (the target's denominator).
            bounds = tl.where(digits == 0, -float("inf"), _key_value(prefix | (digits << shift)))
            sums = tl.zeros([RADIX, BLOCK_V], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                in_row = start + offs < vocab
                x = tl.load(row_ptr + start + offs, mask=in_row, other=-float("inf"))
                x = x.to(tl.float32)
                # 0 off the candidates and at -inf (outside the row)
                weights = tl.where(x >= floor_value, tl.exp2(x * scale2 - y_max2), 0.0)
                sums += tl.where(x >= bounds[:, None], weights, 0.0)
            at_or_above = tl.sum(sums, axis=1)
            total = tl.sum(tl.where(digits == 0, at_or_above, 0.0), axis=0)
            target = tl.where(target == 0.0, top_p * total, target)
            chosen = tl.max(tl.where(at_or_above >= target, digits, 0), axis=0)
            prefix = prefix | (chosen.to(tl.uint32) << shift)
    return prefix


@triton.jit
def _held_at_or_above(x, scratch_ptr, size, floor_value, y_max2, scale2, WEIGH: tl.constexpr):
    """For each x_i (a [CANDIDATES] tile): how many of the `size` values at scratch_ptr lie at
    or above it, or WEIGH: their mass exp(y - max y), of those at or above floor_value. Chunks
    of [CANDIDATES, CHUNK] pairs, up to `size` (tl.sort's bitonic network took ~1.5 s a row in
    the interpreter, where the tests run), summed in slot order: the same sums every run."""
    held = tl.zeros([CANDIDATES], tl.float32)
    for chunk in range(0, tl.cdiv(size, CHUNK)):  # the filled chunks only
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        other = tl.load(scratch_ptr + cols, mask=cols < size, other=-float("inf"))
        if WEIGH:
            weight = tl.where(other >= floor_value, tl.exp2(other * scale2 - y_max2), 0.0)
        else:
            weight = tl.where(other > -float("inf"), 1.0, 0.0)
        held += tl.sum(tl.where(other[None, :] >= x[:, None], weight[None, :], 0.0), axis=1)
    return held


@triton.jit
def _kth_group_max(lanes, k, scratch_ptr, BLOCK_V: tl.constexpr):
    """The k-th largest of the row's GROUPS group maxima (lanes: the row's running maxima, one
    per tile position), a lower bound of the k-th largest logit: k groups hold a logit at or
    above it. Few logits lie at or above it beside the k largest (only where two of those share
    a group), so they are what `_gather_candidates` gathers. -inf where fewer than k groups
    hold a finite logit. Uses the program's scratch (GROUPS <= CANDIDATES floats)."""
    groups = tl.max(tl.reshape(lanes, [GROUPS, BLOCK_V // GROUPS]), axis=1)
    tl.debug_barrier()  # every thread has read the program's last row from the scratch
    tl.store(scratch_ptr + tl.arange(0, GROUPS), groups)
    tl.debug_barrier()
    ranks = _held_at_or_above(groups, scratch_ptr, GROUPS, 0.0, 0.0, 1.0, False)
    return tl.max(tl.where(ranks >= k, groups, -float("inf")), axis=0)


@triton.jit
def _gather_candidates(
    row_ptr,
    vocab,
    threshold,
    scratch_ptr,
    floor_value,
    y_max2,
    scale2,
    BLOCK_V: tl.constexpr,
    WEIGH_ROW: tl.constexpr,
):
    """(How many finite logits of the row lie at or above threshold, the first CANDIDATES of
    them stored at scratch_ptr in row order; with WEIGH_ROW the mass exp(y - max y) of the
    row's logits at or above floor_value, else 0). A tile with none above the threshold skips
    its scan and stores: most tiles of a row."""
    offs = tl.arange(0, BLOCK_V)
    found = tl.zeros([], tl.int32)
    mass = tl.zeros([BLOCK_V], tl.float32)
    # Every thread has read this row's group maxima from the scratch (`_kth_group_max`) before
    # any store over them: a race the interpreter, one thread, cannot show.
    tl.debug_barrier()
    for start in range(0, vocab, BLOCK_V):
        in_row = start + offs < vocab
        x = tl.load(row_ptr + start + offs, mask=in_row, other=-float("inf")).to(tl.float32)
        if WEIGH_ROW:  # 0 off the candidates and at -inf (outside the row)
            mass += tl.where(x >= floor_value, tl.exp2(x * scale2 - y_max2), 0.0)
        taken = ((x >= threshold) & (x > -float("inf"))).to(tl.int32)
        count = tl.sum(taken, axis=0)
        if count > 0:
            slot = found + tl.cumsum(taken, axis=0) - 1
            tl.store(scratch_ptr + slot, x, mask=(taken != 0) & (slot < CANDIDATES))
        found += count
    tl.debug_barrier()  # the stores are visible to every thread of the program
    return found, tl.sum(mass, axis=0)


@triton.jit
def _candidates_floor(
    scratch_ptr,
    found,
    floor_key,
    top_k,
    top_p,
    row_mass,
    y_max2,
    scale2,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
):
    """(The floor key from the gathered candidates, whether they decided it), in registers:
    top_k's k-th largest (the largest with k at or above it, ties included), then top_p's
    smallest kept logit (the largest whose candidates at or above it hold at least top_p of
    their mass). The same keys as the radix selects'. With top_k every logit at or above the
    final floor is gathered; without it, top_p's candidates weigh row_mass, and the gathered
    ones decide only if they hold top_p of that (else the floor is below them: not decided)."""
    slots = tl.arange(0, CANDIDATES)
    x = tl.load(scratch_ptr + slots, mask=slots < found, other=-float("inf"))
    decided = found > 0  # (the caller gathered some); without top_k, top_p's mass may say no
    if HAS_TOP_K:
        # -inf (no floor) where fewer than k lie at or above the threshold: min_p's floor holds
        ranks = _held_at_or_above(x, scratch_ptr, found, 0.0, 0.0, 1.0, False)
        kth = tl.max(tl.where(ranks >= top_k, x, -float("inf")), axis=0)
        floor_key = tl.maximum(floor_key, _order_key(kth))
    if HAS_TOP_P:
        floor_value = _key_value(floor_key)
        held = _held_at_or_above(x, scratch_ptr, found, floor_value, y_max2, scale2, True)
        if HAS_TOP_K:
            # The mass at or above the least candidate is the total, summed as `held` sums it:
            # the least is kept (and top_p rounding to 1 keeps every candidate) whatever the
            # rounding.
            target = top_p * tl.max(held, axis=0)
        else:
            target = top_p * row_mass
            decided = decided & (tl.max(held, axis=0) >= target)
        smallest_kept = tl.max(tl.where(held >= target, x, -float("inf")), axis=0)
        floor_key = tl.where(decided, tl.maximum(floor_key, _order_key(smallest_kept)), floor_key)
    return floor_key, decided


@triton.jit
def _sampled_set_kernel(
    logits_ptr,
    labels_ptr,
    out_ptr,
    floor_ptr,
    scratch_ptr,
    rows,
    time,
    vocab,
    stride_b,
    stride_t,
    out_stride_b,
    out_stride_t,
    temperature_ptr,
    temperature,
    scale2,
    top_k,
    top_p,
    log_min_p,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WRITE_ROWS: tl.constexpr,
    COMPACT: tl.constexpr,
):
    """floor_ptr[row] = the row's floor (raw logits; -inf: every logit is in the set), and with
    WRITE_ROWS the row itself into out_ptr, -inf below the floor but for the label and NaN."""
    # Significant bits of the fp32 key: sign, exponent and the input's mantissa, in whole digits.
    MANTISSA: tl.constexpr = logits_ptr.dtype.element_ty.fp_mantissa_width
    KEY_BITS: tl.constexpr = (9 + MANTISSA + RADIX_BITS - 1) // RADIX_BITS * RADIX_BITS
    COUNT_KEY_BITS: tl.constexpr = (9 + MANTISSA + COUNT_BITS - 1) // COUNT_BITS * COUNT_BITS
    offs = tl.arange(0, BLOCK_V)
    scratch = scratch_ptr + tl.program_id(0) * CANDIDATES  # (unread without COMPACT)
    for row32 in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.cast(row32, tl.int64)  # int64 offsets: B x T x V may exceed 2^31
        row_ptr = logits_ptr + row_offset(row, time, stride_b, stride_t)
        out_row = out_ptr + row_offset(row, time, out_stride_b, out_stride_t)
        # Only min_p's floor and top_p's masses depend on the temperature (top_k and the keys
        # do not): per-token temperatures (vLLM's per-request ones) are one load per row.
        row_t, row_scale2 = _row_temperature(
            temperature_ptr, row, temperature, scale2, ROW_TEMPERATURE
        )
        y_max2 = 0.0
        floor_key = tl.zeros([], tl.uint32)
        top_key = floor_key | 0xFFFFFFFF  # the largest key, until the row max is known
        if HAS_MIN_P or HAS_TOP_P or COMPACT:
            lanes = tl.full([BLOCK_V], -float("inf"), tl.float32)
            unordered = offs < 0  # NaNs seen, per tile position
            for start in range(0, vocab, BLOCK_V):
                in_row = start + offs < vocab
                x = tl.load(row_ptr + start + offs, mask=in_row, other=-float("inf"))
                x32 = x.to(tl.float32)
                lanes = tl.maximum(lanes, x32)
                if COMPACT:
                    unordered = unordered | (x32 != x32)
            x_max_row = tl.max(lanes, axis=0)
            y_max2 = x_max_row * row_scale2
            top_key = _order_key(x_max_row)
            if HAS_MIN_P:
                floor_key = _min_p_floor_key(x_max_row, row_t, log_min_p)
        radix = True
        if COMPACT:
            # One more read (from L2) gathers the few logits that can be in the set; the radix
            # passes run only where they do not decide. A NaN is not gathered, but top_k's keys
            # rank it above +inf (as torch.topk does): a row with one takes the radix passes,
            # which count it, and gathers nothing.
            has_nan = tl.max(unordered.to(tl.int32), axis=0)
            decided = has_nan < 0  # False: the radix passes, unless the gathered logits decide
            if has_nan == 0:
                floor_value = _key_value(floor_key)
                group_rank = top_k if HAS_TOP_K else TOP_P_GUESS
                threshold = tl.maximum(
                    floor_value, _kth_group_max(lanes, group_rank, scratch, BLOCK_V)
                )
                found, row_mass = _gather_candidates(
                    row_ptr,
                    vocab,
                    threshold,
                    scratch,
                    floor_value,
                    y_max2,
                    row_scale2,
                    BLOCK_V,
                    HAS_TOP_P and not HAS_TOP_K,
                )
                if (found > 0) & (found <= CANDIDATES):  # else all -inf, or crowded
                    floor_key, decided = _candidates_floor(
                        scratch,
                        found,
                        floor_key,
                        top_k,
                        top_p,
                        row_mass,
                        y_max2,
                        row_scale2,
                        HAS_TOP_K,
                        HAS_TOP_P,
                    )
            radix = ~decided
        if radix:
            if HAS_TOP_K:
                # The k-th largest of the whole row: where min_p left fewer than k, its floor is
                # the higher one (vLLM's top_k runs on the min_p-masked logits). So only a K
                # above min_p's floor matters, and the search may start from its leading digits.
                top_k_key = _count_select(
                    row_ptr, vocab, top_k, floor_key, top_key, COUNT_KEY_BITS, BLOCK_V
                )
                floor_key = tl.maximum(floor_key, top_k_key)
            if HAS_TOP_P:
                floor_key = _mass_select(
                    row_ptr, vocab, top_p, floor_key, top_key, y_max2, row_scale2, KEY_BITS, BLOCK_V
                )
        floor_value = _key_value(floor_key)
        tl.store(floor_ptr + row, floor_value)
        if WRITE_ROWS:
            label = tl.maximum(tl.load(labels_ptr + row), 0)
            for start in range(0, vocab, BLOCK_V):
                idx = start + offs
                in_row = idx < vocab
                x = tl.load(row_ptr + idx, mask=in_row, other=0.0, eviction_policy="evict_first")
                x32 = x.to(tl.float32)
                keep = x32 >= floor_value
                # The label stays (the engine's logits differ from ours in the last bits); NaN
                # stays so that a corrupt row still reads as NaN downstream.
                keep = keep | (idx == label) | (x32 != x32)
                out = tl.where(keep, x, -float("inf")).to(out_ptr.dtype.element_ty)
                tl.store(out_row + idx, out, mask=in_row, eviction_policy="evict_first")


@triton.jit
def _row_temperature(temperature_ptr, row, temperature, scale2, ROW_TEMPERATURE: tl.constexpr):
    """(T, log2(e) / T) of a row: the kernel's scalars, or the row's own temperature."""
    if ROW_TEMPERATURE:
        row_t = tl.load(temperature_ptr + row)
        return row_t, LOG2E / row_t
    else:
        return temperature, scale2


def _filters(vocab: int, top_k, top_p, min_p) -> tuple[bool, bool, bool]:
    """Which filters act (top_k >= V, top_p = 1 and min_p = 0 are off, as None)."""
    return (
        top_k is not None and top_k < vocab,
        top_p is not None and top_p < 1,
        min_p is not None and min_p > 0,
    )


def _gathers_candidates(has_top_k: bool, has_top_p: bool, has_min_p: bool, top_k) -> bool:
    """Whether the select gathers the row's candidates (COMPACT): top_k (+ the others) up to
    COMPACT_TOP_K, or top_p without top_k (min_p alone needs no select)."""
    if has_top_k:
        return top_k <= COMPACT_TOP_K
    return has_top_p


def _launch_select(logits, labels, out, floors, temperature, top_k, top_p, min_p, row_temps):
    """One launch of the select over every row: floors (flat [B x T] fp32) and, when `out` is
    not None, the masked rows into it."""
    batch, time, vocab = logits.shape
    has_top_k, has_top_p, has_min_p = _filters(vocab, top_k, top_p, min_p)
    block = block_size(vocab, logits.device, logits.element_size())
    # (the group maxima need GROUPS tile positions: every launch's tiles but a test's narrow ones)
    compact = block >= GROUPS.value and _gathers_candidates(has_top_k, has_top_p, has_min_p, top_k)
    programs = persistent_programs(batch * time, vocab * logits.element_size(), logits.device)
    out_arg = logits if out is None else out
    scratch = floors  # (unread without COMPACT)
    if compact:
        scratch = torch.empty(
            programs * CANDIDATES.value, dtype=torch.float32, device=floors.device
        )
    _sampled_set_kernel[(programs,)](
        logits,
        labels.contiguous(),
        out_arg,
        floors,
        scratch,
        batch * time,
        time,
        vocab,
        logits.stride(0),
        logits.stride(1),
        out_arg.stride(0),
        out_arg.stride(1),
        row_temperature_arg(row_temps, labels),
        float(temperature),
        LOG2E.value / temperature,
        int(top_k) if has_top_k else 0,
        float(top_p) if has_top_p else 1.0,
        math.log(min_p) if has_min_p else 0.0,
        HAS_TOP_K=has_top_k,
        HAS_TOP_P=has_top_p,
        HAS_MIN_P=has_min_p,
        ROW_TEMPERATURE=row_temps is not None,
        BLOCK_V=block,
        WRITE_ROWS=out is not None,
        COMPACT=compact,
        **launch_options(block, logits.element_size()),
    )


@launches_on("logits")
def sampled_floors(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    row_temps: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] fp32: each row's sampled-set floor on the raw [B, T, V] logits (vocab contiguous,
    any batch/time strides), what `logprobs` and `token_loss` read with `floors=`: the set is the
    logits at or above it, and the label. -inf where no filter acts. Filters and `row_temps` as
    `write_sampled_set`'s."""
    batch, time, vocab = logits.shape
    floors = torch.full((batch, time), -math.inf, dtype=torch.float32, device=logits.device)
    if batch * time == 0 or not any(_filters(vocab, top_k, top_p, min_p)):
        return floors
    _launch_select(logits, labels, None, floors, temperature, top_k, top_p, min_p, row_temps)
    return floors


@launches_on("logits")
def write_sampled_set(
    logits: torch.Tensor,
    labels: torch.Tensor,
    out: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    row_temps: torch.Tensor | None = None,
) -> None:
    """out = [B, T, V] logits with -inf outside each row's sampled set (out may be logits; vocab
    contiguous, any batch/time strides): for kernels that cannot read floors. The filters are
    off when None (top_k >= V, top_p = 1, min_p = 0 are off too). `row_temps`: per-token
    temperatures ([B, T]), in place of `temperature`."""
    batch, time, vocab = logits.shape
    if batch * time == 0:
        return
    if not any(_filters(vocab, top_k, top_p, min_p)):
        if out.data_ptr() != logits.data_ptr():
            out.copy_(logits)
        return
    floors = torch.empty(batch * time, dtype=torch.float32, device=logits.device)
    _launch_select(logits, labels, out, floors, temperature, top_k, top_p, min_p, row_temps)
