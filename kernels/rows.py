"""Per-row building blocks shared by every fused kernel: one sweep of statistics, one of gradient.

A "row" is the vocab vector of one token. Rows are addressed as [B, T, V] with arbitrary batch and
time strides (a [B, P+T, V] slice is read in place) and int64 offsets, so no tensor is copied and
no row index can overflow.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offset(row, time, stride_b, stride_t):
    """int64 element offset of flat row `row` of a [B, T, V] tensor with the given strides."""
    row = row.to(tl.int64)
    return (row // time) * stride_b + (row % time) * stride_t


@triton.jit
def row_stats(row_ptr, vocab, inv_temperature, BLOCK_V: tl.constexpr):
    """One read of the row: (lse, sum_j p_j z_j) of z = logits * inv_temperature, in fp32.

    Online softmax: the running max starts at -inf; while it is still -inf (a prefix of banned
    tokens) it is replaced by 0 so that exp(-inf - max) gives 0 instead of NaN. p z is only
    accumulated where p > 0, so -inf logits contribute 0 (not 0 * -inf). A +inf logit makes the
    max +inf and the statistics NaN, which the callers surface as a NaN logp.
    """
    running_max = -float("inf")
    sum_exp = 0.0
    sum_exp_z = 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < vocab, other=-float("inf")).to(tl.float32)
        z = z * inv_temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        e = tl.exp(z - safe_max)
        sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
        sum_exp_z = sum_exp_z * rescale + tl.sum(e * tl.where(e > 0, z, 0.0), axis=0)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    return lse, sum_exp_z / sum_exp


@triton.jit
def write_row_grad(
    row_ptr,
    out_ptr,
    label,
    vocab,
    inv_temperature,
    lse,
    entropy,
    dlogp,
    dentropy,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """out = d(loss)/d(logits) of one row: (dlogp (onehot - p) - dH p (log p + H)) / temperature.

    `out_ptr` may equal `row_ptr` (in-place): every block is loaded before it is stored.
    The row is walked last tile first: the statistics sweep just streamed it front to back, so
    its tail is the part most likely to still be in L2.
    """
    num_tiles = tl.cdiv(vocab, BLOCK_V)
    for i in range(0, num_tiles):
        offs = (num_tiles - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = offs < vocab
        z = tl.load(row_ptr + offs, mask=in_row, other=-float("inf")).to(tl.float32)
        log_p = z * inv_temperature - lse
        p = tl.exp(log_p)
        grad = tl.where(offs == label, dlogp, 0.0) - dlogp * p
        if WITH_ENTROPY:
            grad -= dentropy * p * tl.where(p > 0, log_p + entropy, 0.0)
        grad = grad * inv_temperature
        tl.store(out_ptr + offs, grad.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def write_row_zeros(out_ptr, vocab, BLOCK_V: tl.constexpr):
    """Masked rows get exact zeros and are never read (they may hold NaN padding)."""
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        tl.store(
            out_ptr + offs, tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty), mask=offs < vocab
        )
