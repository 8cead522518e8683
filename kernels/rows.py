"""Per-row building blocks shared by every fused kernel: one sweep of statistics, one of gradient.

A "row" is the vocab vector of one token. Rows are addressed as [B, T, V] with arbitrary batch and
time strides (a [B, P+T, V] slice is read in place) and int64 offsets, so no tensor is copied and
no row index can overflow.

How a sweep spends its instructions (the kernels are bound by memory traffic; a sweep should
issue few enough instructions per element that it never becomes issue-bound):
- The row is walked in BLOCK_V tiles of whole 16-byte vectors: the elements before the row's
  first 16-byte boundary (odd V, an unaligned [B, P+T, V] slice) and after its last full tile
  form one masked remainder tile, so the main loop is unmasked, its pointer provably 16-byte
  aligned (`tl.multiple_of`), and its loads and stores 128-bit whatever V is.
- Sweep 1 keeps a running (max, sum 2^(y-max), sum 2^(y-max) y) per lane slot: no block
  reduction and so no barrier inside the loop; the slots are merged once per row. Each element
  costs one exp2 (the one of the smaller of y and the running max), and the loads of tile i+1
  are issued before tile i is accumulated.
- Everything is in base 2: y = logits * log2(e) / T, one multiply per element, and exp2 is one
  MUFU.EX2 on a GPU (`FAST_EXP2`: ex2.approx.ftz; tl.exp2 also handles denormal results, which
  costs four more instructions and changes nothing a softmax can see).
- Logits below FLOOR (-inf for a banned token, -finfo.max) count as probability 0 without a
  select per element: y is clamped to FLOOR with a NaN-propagating max, so 0 * y stays 0 and a
  NaN logit still poisons the statistics.
- A replayed sampled set (vLLM's top_k / top_p / min_p, kernels/sampling.py) is read through
  each row's floor (FLOORED): a logit below it is read as -inf, one compare and select per
  element on the loaded tile, so no masked copy of the logits is ever written. The label stays
  in the set: its term is added apart where the floor dropped it (`row_stats`), and its
  gradient entry is stored apart anyway (`label_entry`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# exp2(FLOOR - max) is 0 in fp32 for any max a real row has, and FLOOR x (dentropy ln2 / T) stays
# finite for any |dentropy / T| < 1e18, so a clamped logit contributes exact zeros.
FLOOR = tl.constexpr(-1e20)


@triton.jit
def row_offset(row, time, stride_b, stride_t):
    """int64 element offset of flat row `row` of a [B, T, V] tensor with the given strides."""
    row = row.to(tl.int64)
    return (row // time) * stride_b + (row % time) * stride_t


@triton.jit
def row_temperature(temperature_ptr, row, inv_temperature, scale2, ROW_TEMPERATURE: tl.constexpr):
    """(1 / T, log2(e) / T) of a row: the kernel's scalars, or with ROW_TEMPERATURE the row's own
    temperature (a per-token [B, T] tensor), loaded once before the row's sweeps."""
    if ROW_TEMPERATURE:
        inv_t = 1.0 / tl.load(temperature_ptr + row)
        return inv_t, inv_t * LOG2E
    else:
        return inv_temperature, scale2


def cap_arg(cap: float | None) -> float:
    """The kernels' cap2 = 2 a log2(e) of a soft cap's a (`capped`); 0.0 (never read) without."""
    return 0.0 if cap is None else 2.0 * cap * LOG2E.value


def rows_buffer(buffer: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """A caller's per-row output buffer, written by flat row index: it must be a contiguous fp32
    tensor shaped and placed like `like` (the labels)."""
    if (
        buffer.dtype != torch.float32
        or buffer.shape != like.shape
        or buffer.device != like.device
        or not buffer.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous float32 tensor of shape {tuple(like.shape)} on "
            f"{like.device}, got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device} "
            f"(contiguous: {buffer.is_contiguous()})"
        )
    return buffer


def check_floors(floors: torch.Tensor | None, labels: torch.Tensor, cap: float | None) -> None:
    """Sampled-set floors ([B, T] fp32, as the labels) are thresholds on the raw logits: under a
    soft cap the sets are found over the capped logits, by the torch route."""
    if floors is None:
        return
    rows_buffer(floors, labels, "floors")
    if cap is not None:
        raise ValueError("floors (a sampled set on the raw logits) cannot be read under a soft cap")


def row_temperature_arg(row_temps, placeholder):
    """The per-token temperatures as the kernels read them (flat fp32), or a placeholder tensor
    (never read) when there are none."""
    return placeholder if row_temps is None else row_temps.float().contiguous()


@triton.jit
def exp2(x, FAST_EXP2: tl.constexpr):
    if FAST_EXP2:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp2(x)


@triton.jit
def reciprocal(x, FAST: tl.constexpr):
    """1 / x; FAST (compiled kernels): rcp.approx.ftz, one MUFU.RCP (`/` is div.full.f32, a
    reciprocal and a Newton step)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def to_fp32(x):
    """x in fp32. bf16 is the upper half of an fp32, so one shift per element converts it: the
    generic conversion of a 16-bit load packs pairs into registers and unpacks them again (three
    instructions per element), which the issue budget of the gradient loops cannot afford."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def scaled(x, scale2):
    """y = x * scale2 in fp32, clamped below at FLOOR (NaN stays NaN)."""
    return tl.maximum(x.to(tl.float32) * scale2, FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def capped(x, cap2, FAST_EXP2: tl.constexpr):
    """(v, r) of a logit x under a soft cap: v = tanh(a x) and r = 1 / (1 + 2^(x cap2)) with
    cap2 = 2 a log2(e), so that v = 1 - 2 r (one exp2 and one reciprocal per element) and
    dv/dx = 4 a r (1 - r), finite for every x (1 - v^2 of a banned logit would not be).

    The model's logits are c tanh(s x / c) (Gemma 2/3's final_logit_softcapping, s a logit
    scale): the kernels read v = tanh(a x), a = s / c, as their logits at temperature T / c.
    A banned logit (-inf, or -finfo.max of its dtype, as masks write it) keeps probability 0
    (v = -inf) rather than becoming -c; its r is 1, so its gradient factor is 0."""
    xf = to_fp32(x)
    r = reciprocal(1.0 + exp2(xf * cap2, FAST_EXP2), FAST_EXP2)
    return tl.where(banned(x), -float("inf"), 1.0 - 2.0 * r), r


@triton.jit
def floored(x, floor):
    """x in fp32, -inf where it lies below its row's sampled-set floor (a NaN stays NaN: the row
    then reads as NaN, as it would from a masked copy)."""
    xf = to_fp32(x)
    return tl.where(xf < floor, -float("inf"), xf)


@triton.jit
def banned(x):
    """Whether a logit bans its token: -inf, or the lowest finite value of its dtype
    (-finfo.max, as attention-style masks write it)."""
    if x.dtype == tl.float16:
        lowest: tl.constexpr = -65504.0
    elif x.dtype == tl.bfloat16:
        lowest: tl.constexpr = -3.3895313892515355e38
    else:
        lowest: tl.constexpr = -3.4028234663852886e38
    return to_fp32(x) <= lowest


@triton.jit
def row_layout(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """(head, full_tiles, body_ptr): the elements before the row's first 16-byte boundary, the
    number of whole BLOCK_V tiles after them, and their 16-byte aligned start pointer."""
    elem_bytes: tl.constexpr = row_ptr.dtype.element_ty.primitive_bitwidth // 8
    address = row_ptr.to(tl.int64, bitcast=True)
    head = tl.minimum(((16 - address % 16) % 16) // elem_bytes, vocab).to(tl.int32)
    full_tiles = (vocab - head) // BLOCK_V
    body_ptr = tl.multiple_of(row_ptr + head, 16)
    return head, full_tiles, body_ptr


@triton.jit
def remainder_offsets(r, head, tail_start, vocab, BLOCK_V: tl.constexpr):
    """Offsets (and mask) of remainder tile r: the head [0, head), then the tail
    [tail_start, vocab). Together they are < BLOCK_V + 16 elements: one or two tiles."""
    idx = r * BLOCK_V + tl.arange(0, BLOCK_V)
    offs = tl.where(idx < head, idx, tail_start + idx - head)
    return offs, offs < vocab


@triton.jit
def remainder_tiles(head, tail_start, vocab, BLOCK_V: tl.constexpr):
    return tl.cdiv(head + vocab - tail_start, BLOCK_V)


@triton.jit
def accumulate_weighted(run_max, sum_exp, sum_exp_w, y, w, FAST_EXP2: tl.constexpr):
    """Per-slot online softmax update of y with one exp2, and the running sum of 2^(y - max) w:
    exp2(-|y - max|) is the new element's weight when y <= max, else the factor that rescales
    the old sums (the new element's weight is 1)."""
    diff = y - run_max
    new_max = diff > 0
    t = exp2(-tl.abs(diff), FAST_EXP2)
    sum_exp = tl.where(new_max, sum_exp * t + 1.0, sum_exp + t)
    sum_exp_w = tl.where(new_max, sum_exp_w * t + w, sum_exp_w + t * w)
    return tl.maximum(run_max, y), sum_exp, sum_exp_w


@triton.jit
def _accumulate(run_max, sum_exp, sum_exp_y, y, FAST_EXP2: tl.constexpr):
    """The online softmax with the running sum of 2^(y - max) y (for the entropy)."""
    return accumulate_weighted(run_max, sum_exp, sum_exp_y, y, y, FAST_EXP2)


@triton.jit
def _offset(
    x,
    scale2,
    ref,
    cap2,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """d = x * scale2 - ref in one FFMA, clamped below at FLOOR (NaN stays NaN); with SOFTCAP,
    of the capped logit; with FLOORED, -inf (so FLOOR) below the row's sampled-set floor."""
    if FLOORED:
        x = floored(x, floor)
    if SOFTCAP:
        x, _ = capped(x, cap2, FAST_EXP2)
    return tl.maximum(x.to(tl.float32) * scale2 - ref, FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _sums_from_reference(
    row_ptr,
    vocab,
    scale2,
    ref,
    cap2,
    EVICT: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    SQUARES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """(sum_j 2^d_j, sum_j 2^d_j d_j, sum_j 2^(2 d_j) or 0 without SQUARES) with d_j = y_j - ref
    (clamped at FLOOR): no running max, so per element one FFMA, one clamp, one exp2, one add and
    one FFMA, no select (and one FFMA for the squares). Overflows (to inf) when some y_j exceeds
    ref by more than ~127 in base 2 (the squares: ~64, i.e. ~44 nats x T), which the caller
    detects. (The squares' lines sit
    under constexpr ifs, not in a helper: the interpreter pays for every call and op.)"""
    head, full_tiles, body_ptr = row_layout(row_ptr, vocab, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    sum_exp = tl.zeros([BLOCK_V], tl.float32)
    sum_exp_d = tl.zeros([BLOCK_V], tl.float32)
    if SQUARES:
        sum_sq = tl.zeros([BLOCK_V], tl.float32)
    if full_tiles > 0:
        x = tl.load(body_ptr + offs, eviction_policy=EVICT)
        for i in range(1, full_tiles):
            x_next = tl.load(body_ptr + i * BLOCK_V + offs, eviction_policy=EVICT)
            d = _offset(x, scale2, ref, cap2, SOFTCAP, FAST_EXP2, floor, FLOORED)
            e = exp2(d, FAST_EXP2)
            sum_exp += e
            sum_exp_d += e * d
            if SQUARES:
                sum_sq += e * e
            x = x_next
        d = _offset(x, scale2, ref, cap2, SOFTCAP, FAST_EXP2, floor, FLOORED)
        e = exp2(d, FAST_EXP2)
        sum_exp += e
        sum_exp_d += e * d
        if SQUARES:
            sum_sq += e * e
    tail_start = head + full_tiles * BLOCK_V
    for r in range(0, remainder_tiles(head, tail_start, vocab, BLOCK_V)):
        roffs, in_row = remainder_offsets(r, head, tail_start, vocab, BLOCK_V)
        x = tl.load(row_ptr + roffs, mask=in_row, other=-float("inf"), eviction_policy=EVICT)
        d = _offset(x, scale2, ref, cap2, SOFTCAP, FAST_EXP2, floor, FLOORED)
        e = exp2(d, FAST_EXP2)
        sum_exp += e
        sum_exp_d += e * d
        if SQUARES:
            sum_sq += e * e
    if SQUARES:
        return tl.sum(sum_exp, axis=0), tl.sum(sum_exp_d, axis=0), tl.sum(sum_sq, axis=0)
    else:
        return tl.sum(sum_exp, axis=0), tl.sum(sum_exp_d, axis=0), 0.0


@triton.jit
def _accumulate_squares(run_max, sum_sq, y, FAST_EXP2: tl.constexpr):
    """The running sum of 2^(2 (y - max)) per slot, updated before the max is (`_accumulate`'s
    rule, squared: the new element's term, or the old sum's factor, is exp2(-|y - max|)^2)."""
    diff = y - run_max
    t = exp2(-tl.abs(diff), FAST_EXP2)
    return tl.where(diff > 0, sum_sq * t * t + 1.0, sum_sq + t * t)


@triton.jit
def _stats_online(
    row_ptr,
    vocab,
    scale2,
    cap2,
    EVICT: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    SQUARES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """(lse2, mean y, sum_j p_j^2 or 0 without SQUARES) by the exact online softmax, a running
    max per element slot; FLOORED: -inf below the row's sampled-set floor."""
    head, full_tiles, body_ptr = row_layout(row_ptr, vocab, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    run_max = tl.full([BLOCK_V], -float("inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_V], tl.float32)
    sum_exp_y = tl.zeros([BLOCK_V], tl.float32)
    if SQUARES:
        sum_sq = tl.zeros([BLOCK_V], tl.float32)
    for i in range(0, full_tiles):
        x = tl.load(body_ptr + i * BLOCK_V + offs, eviction_policy=EVICT)
        if FLOORED:
            x = floored(x, floor)
        if SOFTCAP:
            x, _ = capped(x, cap2, FAST_EXP2)
        y = scaled(x, scale2)
        if SQUARES:
            sum_sq = _accumulate_squares(run_max, sum_sq, y, FAST_EXP2)
        run_max, sum_exp, sum_exp_y = _accumulate(run_max, sum_exp, sum_exp_y, y, FAST_EXP2)
    tail_start = head + full_tiles * BLOCK_V
    for r in range(0, remainder_tiles(head, tail_start, vocab, BLOCK_V)):
        roffs, in_row = remainder_offsets(r, head, tail_start, vocab, BLOCK_V)
        x = tl.load(row_ptr + roffs, mask=in_row, other=-float("inf"), eviction_policy=EVICT)
        if FLOORED:
            x = floored(x, floor)
        if SOFTCAP:
            x, _ = capped(x, cap2, FAST_EXP2)
        y = scaled(x, scale2)
        if SQUARES:
            sum_sq = _accumulate_squares(run_max, sum_sq, y, FAST_EXP2)
        run_max, sum_exp, sum_exp_y = _accumulate(run_max, sum_exp, sum_exp_y, y, FAST_EXP2)
    row_max = tl.max(run_max, axis=0)
    # Slots that saw only masked lanes hold max -inf and sums 0: weight 0, not NaN.
    weight = tl.where(run_max == -float("inf"), 0.0, exp2(run_max - row_max, FAST_EXP2))
    total = tl.sum(sum_exp * weight, axis=0)
    weighted_sq = 0.0
    if SQUARES:
        weighted_sq = tl.sum(sum_sq * weight * weight, axis=0)
    return merged_stats(row_max, total, tl.sum(sum_exp_y * weight, axis=0), weighted_sq, SQUARES)


@triton.jit
def merged_stats(row_max, total, weighted_y, weighted_sq, SQUARES: tl.constexpr):
    """(lse2, mean y, sum_j p_j^2 or 0 without SQUARES) of a row from its max and its sums
    relative to it: total = sum_j 2^(y_j - max), weighted_y = sum_j 2^(y_j - max) y_j,
    weighted_sq = sum_j 2^(2 (y_j - max))."""
    sum_pi_sq = 0.0
    if SQUARES:  # NaN where there is no mass, as lse and the mean say (the padding lanes count)
        sum_pi_sq = weighted_sq / total / total
        sum_pi_sq = tl.where(row_max <= FLOOR, float("nan"), sum_pi_sq)
    lse2 = row_max + tl.log2(total)
    # No logit above FLOOR: no probability mass, lse -inf (a vocab-parallel slice with no mass
    # then drops out of the merge; a whole row of them gives a NaN logp and entropy downstream).
    lse2 = tl.where(row_max <= FLOOR, -float("inf"), lse2)
    lse2 = tl.where(row_max == float("inf"), float("nan"), lse2)
    mean_y = tl.where(row_max <= FLOOR, float("nan"), weighted_y / total)
    return lse2, mean_y, sum_pi_sq


@triton.jit
def reference_stats(ref, total, sum_d, sum_sq, SQUARES: tl.constexpr):
    """(lse2, mean y, sum p^2, inexact) of a row from its sums relative to a reference logit
    `ref` (its label's y): total = sum_j 2^d_j, sum_d = sum_j 2^d_j d_j, sum_sq = sum_j 2^(2 d_j),
    d_j = y_j - ref. `inexact`: the sums cannot be trusted, and the caller takes the exact path.

    A label logit at or below FLOOR (-inf) has p = 0, and sums relative to it mean nothing:
    they overflow when some logit is above FLOOR, and when none is (an all -inf row) every term
    is 2^FLOOR = 0, or 2^0 = 1 for logits that scale to FLOOR exactly (FLOOR - FLOOR = 0: a
    finite lse). So such rows always take the exact path, which returns the label's -inf or
    the row's NaN, instead of hanging the NaN on 0 / 0 (compiled, `/` is div.full.f32)."""
    lse2 = ref + tl.log2(total)
    mean_y = ref + sum_d / total
    sum_pi_sq = 0.0
    if SQUARES:  # divided twice: total^2 alone may overflow where both quotients are finite
        sum_pi_sq = sum_sq / total / total
    overflow = (total == float("inf")) | (tl.abs(sum_d) == float("inf"))
    if SQUARES:  # the squares overflow first: a logit ~64 / log2(e) x T above the label's
        overflow = overflow | (sum_sq == float("inf"))
    return lse2, mean_y, sum_pi_sq, (ref <= FLOOR) | overflow | (mean_y != mean_y)


@triton.jit
def row_stats(
    row_ptr,
    vocab,
    scale2,
    ref_logit,
    cap2,
    EVICT: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    SQUARES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
    label_in_row=True,
):
    """One read of the row: (ref, lse, sum_j p_j z_j, sum_j p_j^2) of z = logits / T, in fp32
    nats; scale2 is log2(e) / T, a kernel argument so that the loop's FFMA reads it from the
    constant bank. `ref`: `ref_logit` as the kernels read it (with SOFTCAP each logit is read as
    `capped(x, cap2)`, this one too), for `logp_of`. The sum of squares (the Optimal Token
    Baseline's input) only with SQUARES, one FFMA per element more; else 0.

    `ref_logit` is a logit of the row (the label's, which the kernels load first anyway): the
    sums are taken relative to it instead of a running max, which is what makes sweep 1 cheap.
    They are >= 1 (the reference's own term) and finite unless some logit exceeds it by more than
    ~110 / log2(e) x T, i.e. the label's probability is below ~1e-33, or the row holds NaN / inf:
    then, and only then, the row is read again by the exact online softmax. lse is NaN when the
    row holds a NaN or +inf logit, -inf when it has no logit above FLOOR (all -inf: no mass), and
    the mean then NaN: the callers surface both as a NaN logp (`logp_of`) and entropy, as the
    reference does.

    FLOORED: the row is read over its sampled set, the logits at or above `floor` (raw logits, no
    soft cap), and its label, which the sweeps drop like any other logit below the floor: its
    term is added back here, 2^0 = 1 to the sums relative to it. The exact path needs no such
    term: it runs when the label's p is 0 (at FLOOR), when the row holds NaN or +inf, or when
    some logit exceeds the label's by ~64 or more in base 2, where the label's share of the sums
    (p < 2^-64, and p |y| with it) lies far below fp32's resolution. `label_in_row` False: the
    row's label is on another rank (a vocab-parallel slice) and `ref_logit` is only a reference,
    kept in the sums only if it is in the set (then, or with every term above it, they stay >= 1).
    """
    if FLOORED:
        label_dropped = label_in_row & (to_fp32(ref_logit) < floor)
    if SOFTCAP:
        ref_logit, _ = capped(ref_logit, cap2, FAST_EXP2)
    ref = scaled(ref_logit, scale2)
    total, sum_d, sum_sq = _sums_from_reference(
        row_ptr,
        vocab,
        scale2,
        ref,
        cap2,
        EVICT,
        FAST_EXP2,
        SQUARES,
        SOFTCAP,
        BLOCK_V,
        floor,
        FLOORED,
    )
    if FLOORED:
        total += tl.where(label_dropped, 1.0, 0.0)
        if SQUARES:
            sum_sq += tl.where(label_dropped, 1.0, 0.0)
    lse2, mean_y, sum_pi_sq, inexact = reference_stats(ref, total, sum_d, sum_sq, SQUARES)
    if inexact:
        # Half tiles: its three running vectors (four with SQUARES) then take no more registers
        # than the fast path.
        HALF_BLOCK_V: tl.constexpr = (BLOCK_V + 1) // 2
        lse2, mean_y, sum_pi_sq = _stats_online(
            row_ptr,
            vocab,
            scale2,
            cap2,
            EVICT,
            FAST_EXP2,
            SQUARES,
            SOFTCAP,
            HALF_BLOCK_V,
            floor,
            FLOORED,
        )
    return ref_logit, lse2 * LN2, mean_y * LN2, sum_pi_sq


@triton.jit
def logp_of(label_logit, inv_temperature, lse):
    """The label's log-prob; NaN for a row with no mass (lse -inf), whose label logit may be a
    finite value at FLOOR that would otherwise give +inf."""
    logp = label_logit.to(tl.float32) * inv_temperature - lse
    return tl.where(lse == -float("inf"), float("nan"), logp)


@triton.jit
def grad_tile(
    x,
    scale2,
    lse2,
    k0,
    k1,
    cap2,
    WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    MIRRORED: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """p (k0 + k1 log2 p): the gradient of one tile except the label's one-hot term. A -inf logit
    gives p = 0 and so 0 without a clamp; only the entropy term's log2 p needs one. With SOFTCAP
    the row is v = tanh(a x) and the tile's gradient w.r.t. x is this times r (1 - r) (`capped`;
    the caller folded 4 a into k0 and k1). MIRRORED: the tanh read through -x (tanh is odd:
    v(x) = -v(-x), and r (1 - r) is the same), so that the compiler cannot merge it with an
    earlier tanh of the same registers (the split-row kernel's statistics: merged, both passes'
    v and r would stay live across its exchange). FLOORED: p = 0 below the row's sampled-set
    floor (the label's entry is stored apart, `label_entry`)."""
    if FLOORED:
        x = floored(x, floor)
    if SOFTCAP:
        if MIRRORED:
            v, r = capped(-x, cap2, FAST_EXP2)
            v = tl.where(banned(x), -float("inf"), -v)
        else:
            v, r = capped(x, cap2, FAST_EXP2)
        log2_p = v * scale2 - lse2
    else:
        log2_p = to_fp32(x) * scale2 - lse2
    if WITH_ENTROPY:
        log2_p = tl.maximum(log2_p, FLOOR, propagate_nan=tl.PropagateNan.ALL)
        grad = exp2(log2_p, FAST_EXP2) * (k0 + k1 * log2_p)
    else:
        grad = exp2(log2_p, FAST_EXP2) * k0
    if SOFTCAP:
        grad = grad * (r - r * r)
    return grad


@triton.jit
def _grad_tiles(
    in_ptr,
    out_ptr,
    first_tile,
    end_tile,
    scale2,
    lse2,
    k0,
    k1,
    cap2,
    EVICT: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    PREFETCH: tl.constexpr,
    BLOCK_V: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """Unmasked tiles [first_tile, end_tile) of sweep 2, last first. With PREFETCH each tile's
    load is issued a trip ahead and carried over the loop's back edge in fp32 (converted at once:
    16-bit values carried as such are packed into pairs for the trip and unpacked again)."""
    offs = tl.arange(0, BLOCK_V)
    if PREFETCH:
        x = to_fp32(tl.load(in_ptr + (end_tile - 1) * BLOCK_V + offs, eviction_policy=EVICT))
    for i in range(first_tile, end_tile):
        start = (end_tile - 1 - i + first_tile) * BLOCK_V
        if PREFETCH:
            # The next tile down (the first tile again on the last trip: an L1 hit).
            next_start = tl.maximum(start - BLOCK_V, first_tile * BLOCK_V)
            x_next = to_fp32(tl.load(in_ptr + next_start + offs, eviction_policy=EVICT))
        else:
            x = tl.load(in_ptr + start + offs, eviction_policy=EVICT)
        grad = grad_tile(
            x, scale2, lse2, k0, k1, cap2, WITH_ENTROPY, SOFTCAP, FAST_EXP2, False, floor, FLOORED
        )
        grad = grad.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + start + offs, grad, eviction_policy="evict_first")
        if PREFETCH:
            x = x_next


@triton.jit
def grad_coefficients(dlogp, dentropy, entropy, inv_temperature, cap2, SOFTCAP: tl.constexpr):
    """(k0, k1, onehot) of a row's gradient p (k0 + k1 log2 p) + onehot [v == label] (times
    r (1 - r) per element under a soft cap, whose 4 a they carry): k0 = -(dlogp + dH H) / T,
    k1 = -dH ln2 / T, onehot = dlogp / T."""
    k0 = -(dlogp + dentropy * entropy) * inv_temperature
    k1 = -dentropy * LN2 * inv_temperature
    onehot = dlogp * inv_temperature
    if SOFTCAP:
        four_a = cap2 * (2.0 * LN2)  # 4 a from cap2 = 2 a log2(e)
        k0 = k0 * four_a
        k1 = k1 * four_a
        onehot = onehot * four_a
    return k0, k1, onehot


@triton.jit
def label_entry(
    label_logit,
    scale2,
    lse2,
    k0,
    k1,
    onehot,
    cap2,
    WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
):
    """The gradient's entry at the label: the row's p-term (`grad_tile`'s) plus the one-hot
    term, from the label's logit. The row kernels store it apart, after the row's other
    stores, so that their loops need no compare with the label."""
    label_value = label_logit
    if SOFTCAP:
        label_value, label_r = capped(label_logit, cap2, FAST_EXP2)
    label_log2_p = scaled(label_value, scale2) - lse2
    label_p = tl.exp2(label_log2_p)
    label_grad = label_p * k0 + onehot
    if WITH_ENTROPY:
        label_grad += label_p * k1 * label_log2_p
    if SOFTCAP:
        label_grad = label_grad * (label_r - label_r * label_r)
    return label_grad


@triton.jit
def write_row_grad(
    row_ptr,
    out_ptr,
    label,
    label_logit,
    vocab,
    inv_temperature,
    scale2,
    lse,
    entropy,
    dlogp,
    dentropy,
    cap2,
    EVICT: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    floor=0.0,
    FLOORED: tl.constexpr = False,
):
    """out = d(loss)/d(logits) of one row: (dlogp (onehot - p) - dH p (log p + H)) / temperature.

    With log2_p = y - lse2 this is p (k0 + k1 log2_p) + onehot dlogp / T, k0 = -(dlogp + dH H) / T
    and k1 = -dH ln2 / T, so the loop has no compare with the label: its entry is stored once
    after the sweep, from `label_logit`, which the caller loaded from the row before this call.
    With SOFTCAP (`capped`) the row is v = tanh(a x): every entry, the label's too, is then
    d(loss)/dv x 4 a r (1 - r), 4 a folded into k0, k1 and the one-hot coefficient here.

    In place (`out_ptr` == `row_ptr`) the row is overwritten while being read, so two orderings
    are enforced here by a barrier each, whatever the caller did before:
    - on entry: every warp has its copy of the label logit before any warp stores into the row
      (without it, a warp running ahead could overwrite the label's element before warp 0, whose
      copy feeds the label's store, has read it; tests/test_kernels_compile.py checks in the SASS
      that no store follows the label's load without a barrier between);
    - before the label's store: every other store that covered the label's element is done.

    The tiles follow the gradient row's 16-byte alignment, so its stores are 128-bit. When the
    logits row is aligned alike (always in place, and for any V that is a multiple of 8) its
    loads are 128-bit too; otherwise (odd V read from a [B, P+T, V] slice into a separately
    allocated gradient) they are 16-bit loads in the same register layout as the stores: Triton
    then needs no shared-memory relayout (with its two barriers per tile) between the two, and
    the split loads of a 16-byte vector hit the same L1 lines.

    The row is walked last tile first: sweep 1 just streamed it front to back, so its tail is the
    part most likely to be still in L2. Loads are the last use of the logits (EVICT), gradient
    stores are never read again here: both evict-first, to keep L2 for rows still to be re-read.
    """
    tl.debug_barrier()
    lse2 = lse * LOG2E
    k0, k1, onehot = grad_coefficients(dlogp, dentropy, entropy, inv_temperature, cap2, SOFTCAP)
    out_ty = out_ptr.dtype.element_ty
    head, _, _ = row_layout(row_ptr, vocab, BLOCK_V)
    out_head, full_tiles, out_body_ptr = row_layout(out_ptr, vocab, BLOCK_V)
    tail_start = out_head + full_tiles * BLOCK_V
    for r in range(0, remainder_tiles(out_head, tail_start, vocab, BLOCK_V)):
        roffs, in_row = remainder_offsets(r, out_head, tail_start, vocab, BLOCK_V)
        x = tl.load(row_ptr + roffs, mask=in_row, other=0.0, eviction_policy=EVICT)
        grad = grad_tile(
            x, scale2, lse2, k0, k1, cap2, WITH_ENTROPY, SOFTCAP, FAST_EXP2, False, floor, FLOORED
        )
        tl.store(out_ptr + roffs, grad.to(out_ty), mask=in_row, eviction_policy="evict_first")
    if full_tiles > 0:
        if out_head == head:
            body_ptr = tl.multiple_of(row_ptr + out_head, 16)
            _grad_tiles(
                body_ptr,
                out_body_ptr,
                0,
                full_tiles,
                scale2,
                lse2,
                k0,
                k1,
                cap2,
                EVICT,
                WITH_ENTROPY,
                SOFTCAP,
                FAST_EXP2,
                True,
                BLOCK_V,
                floor,
                FLOORED,
            )
        else:
            # Unaligned input: its 16-bit loads are not carried over the back edge (see
            # _grad_tiles), and two tiles a trip share the trip's fixed cost (counter, addresses,
            # the stores' cache policy); an odd last tile goes alone.
            pairs = full_tiles // 2
            _grad_tiles(
                row_ptr + out_head,
                out_body_ptr,
                0,
                pairs,
                scale2,
                lse2,
                k0,
                k1,
                cap2,
                EVICT,
                WITH_ENTROPY,
                SOFTCAP,
                FAST_EXP2,
                False,
                2 * BLOCK_V,
                floor,
                FLOORED,
            )
            if full_tiles % 2 != 0:
                _grad_tiles(
                    row_ptr + out_head,
                    out_body_ptr,
                    full_tiles - 1,
                    full_tiles,
                    scale2,
                    lse2,
                    k0,
                    k1,
                    cap2,
                    EVICT,
                    WITH_ENTROPY,
                    SOFTCAP,
                    FAST_EXP2,
                    False,
                    BLOCK_V,
                    floor,
                    FLOORED,
                )
    # The label's entry: the same p-term plus the one-hot term, stored after every other write.
    label_grad = label_entry(
        label_logit, scale2, lse2, k0, k1, onehot, cap2, WITH_ENTROPY, SOFTCAP, FAST_EXP2
    )
    tl.debug_barrier()
    if label >= 0:  # else the label is in another rank's vocab slice (tensor parallelism)
        tl.store(out_ptr + label, label_grad.to(out_ty))


@triton.jit
def write_row_zeros(out_ptr, vocab, BLOCK_V: tl.constexpr):
    """Masked rows get exact zeros and are never read (they may hold NaN padding)."""
    head, full_tiles, body_ptr = row_layout(out_ptr, vocab, BLOCK_V)
    offs = tl.arange(0, BLOCK_V)
    zeros = tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty)
    for i in range(0, full_tiles):
        tl.store(body_ptr + i * BLOCK_V + offs, zeros, eviction_policy="evict_first")
    tail_start = head + full_tiles * BLOCK_V
    for r in range(0, remainder_tiles(head, tail_start, vocab, BLOCK_V)):
        roffs, in_row = remainder_offsets(r, head, tail_start, vocab, BLOCK_V)
        tl.store(out_ptr + roffs, zeros, mask=in_row, eviction_policy="evict_first")
