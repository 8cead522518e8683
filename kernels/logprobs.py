"""Token log-probs (+ entropy) and the gradient sweep, as two Triton kernels and their launchers.

- `logprobs_forward`: one read of each row -> logp of the label, lse and entropy (fp32). It is the
  no-grad fast path for old / reference log-probs and pass 1 of the sequence-level losses.
- `logits_backward`: given per-token d(loss)/d(logp) and d(loss)/d(H), one read + one write of each
  row. It is the backward of `token_logprobs` and pass 2 of the sequence-level losses.

Both read a replayed sampled set through per-row floors (`floors=`, kernels/sampling.py's
`sampled_floors`): the logits below a row's floor, its label excepted, count as -inf.

Both take [B, T, V] logits with any batch/time strides (vocab contiguous) and run one program per
row; masked rows (valid == 0) are skipped and get zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import block_size, fast_exp2, launch_options
from .rows import (
    LOG2E,
    cap_arg,
    check_floors,
    logp_of,
    row_offset,
    row_stats,
    row_temperature,
    row_temperature_arg,
    rows_buffer,
    write_row_grad,
    write_row_zeros,
)

# Switches compiled together on top of the base configuration (aot.variants), beside each alone:
# the soft cap with what else its sweeps may carry.
CROSSED_SWITCHES = (("SOFTCAP", "SUM_PI_SQUARED"), ("SOFTCAP", "ROW_TEMPERATURE"))


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr,
    labels_ptr,
    valid_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    sum_sq_ptr,
    temperature_ptr,
    floor_ptr,
    time,
    vocab,
    stride_b,
    stride_t,
    inv_temperature,
    scale2,
    cap2,
    HAS_VALID: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    SUM_PI_SQUARED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FLOORED: tl.constexpr,
):
    """SUM_PI_SQUARED: also sum_v pi_v^2 per row into sum_sq_ptr, from the same read. SOFTCAP:
    the row is read as tanh(a x) (`rows.capped`, cap2 = 2 a log2(e)). FLOORED: over the row's
    sampled set, the logits at or above floor_ptr[row] and the label (if in [0, V))."""
    row = tl.program_id(0).to(tl.int64)
    valid = 1
    if HAS_VALID:
        valid = tl.load(valid_ptr + row)
    if valid != 0:
        row_inv_t, row_scale2 = row_temperature(
            temperature_ptr, row, inv_temperature, scale2, ROW_TEMPERATURE
        )
        row_ptr = logits_ptr + row_offset(row, time, stride_b, stride_t)
        # A label outside [0, V) is read as 0, never out of the row (the loss's two-pass path
        # reads its labels unchecked: its terms kernel counts such labels and the host raises).
        # FLOORED: such a label is not in the set (a label < 0 lies in another rank's slice).
        label = tl.load(labels_ptr + row)
        label_in_row = (label >= 0) & (label < vocab)
        label = tl.where(label_in_row, label, 0)
        floor = 0.0
        if FLOORED:
            floor = tl.load(floor_ptr + row)
        label_value, lse, mean_z, sum_pi_sq = row_stats(
            row_ptr,
            vocab,
            row_scale2,
            tl.load(row_ptr + label),
            cap2,
            "evict_first",
            FAST_EXP2,
            SUM_PI_SQUARED,
            SOFTCAP,
            BLOCK_V,
            floor,
            FLOORED,
            label_in_row,
        )
        tl.store(logp_ptr + row, logp_of(label_value, row_inv_t, lse))
        tl.store(lse_ptr + row, lse)
        tl.store(entropy_ptr + row, lse - mean_z)
        if SUM_PI_SQUARED:
            tl.store(sum_sq_ptr + row, sum_pi_sq)
    else:
        tl.store(logp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)
        if SUM_PI_SQUARED:
            tl.store(sum_sq_ptr + row, 0.0)


@triton.jit
def _logits_grad_kernel(
    logits_ptr,
    out_ptr,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    dlogp_ptr,
    dentropy_ptr,
    temperature_ptr,
    floor_ptr,
    time,
    vocab,
    stride_b,
    stride_t,
    out_stride_b,
    out_stride_t,
    inv_temperature,
    scale2,
    cap2,
    WITH_ENTROPY: tl.constexpr,
    ROW_TEMPERATURE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FAST_EXP2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FLOORED: tl.constexpr,
):
    """FLOORED: the gradient over the row's sampled set (0 below floor_ptr[row], the label
    excepted), as `_logprobs_fwd_kernel` read it."""
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row_offset(row, time, out_stride_b, out_stride_t)
    dlogp = tl.load(dlogp_ptr + row)
    dentropy = 0.0
    if WITH_ENTROPY:
        dentropy = tl.load(dentropy_ptr + row)
    if (dlogp != 0) | (dentropy != 0):
        row_inv_t, row_scale2 = row_temperature(
            temperature_ptr, row, inv_temperature, scale2, ROW_TEMPERATURE
        )
        row_ptr = logits_ptr + row_offset(row, time, stride_b, stride_t)
        # label < 0: the label lies outside this row (a vocab-parallel slice): no one-hot term;
        # so does one >= V (an unchecked label, which the host reports), never read past the row.
        label = tl.load(labels_ptr + row)
        label = tl.where(label < vocab, label, -1)
        floor = 0.0
        if FLOORED:
            floor = tl.load(floor_ptr + row)
        write_row_grad(
            row_ptr,
            out_row,
            label,
            tl.load(row_ptr + tl.maximum(label, 0)),
            vocab,
            row_inv_t,
            row_scale2,
            tl.load(lse_ptr + row),
            tl.load(entropy_ptr + row),
            dlogp,
            dentropy,
            cap2,
            "evict_first",
            WITH_ENTROPY,
            SOFTCAP,
            FAST_EXP2,
            BLOCK_V,
            floor,
            FLOORED,
        )
    else:
        write_row_zeros(out_row, vocab, BLOCK_V)


@launches_on("logits")
def logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    temperature: float,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
    sum_sq: torch.Tensor | None = None,
    floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, V] logits, [B, T] labels (and valid) -> logp, lse, entropy, each [B, T] fp32; with
    `sum_sq` (a [B, T] fp32 buffer) also sum_v pi_v^2 per row (0 on invalid rows) into it, from
    the same read. `row_temps`: [B, T] per-token temperatures, in place of `temperature`. `cap`:
    a soft cap's a = s / c: the rows are read as tanh(a x) (`rows.capped`), at `temperature`
    T / c. `floors`: [B, T] fp32, each row's sampled-set floor on the raw logits
    (`sampling.sampled_floors`): the statistics over the set."""
    check_floors(floors, labels, cap)
    batch, time, vocab = logits.shape
    rows = batch * time
    logp, lse, entropy = (
        torch.empty(batch, time, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    if sum_sq is not None:
        rows_buffer(sum_sq, labels, "sum_sq")
    if rows == 0:
        return logp, lse, entropy
    block = block_size(vocab, logits.device, logits.element_size())
    labels = labels.contiguous()
    # bool: read as is (a conversion would be one more launch)
    valid_arg = valid.contiguous() if valid is not None else labels
    _logprobs_fwd_kernel[(rows,)](
        logits,
        labels,
        valid_arg,
        logp,
        lse,
        entropy,
        logp if sum_sq is None else sum_sq,  # never written without SUM_PI_SQUARED
        row_temperature_arg(row_temps, logp),
        logp if floors is None else floors,
        time,
        vocab,
        logits.stride(0),
        logits.stride(1),
        1.0 / temperature,
        LOG2E.value / temperature,  # log2(e) / T: sweep 1 works in base 2
        cap_arg(cap),
        HAS_VALID=valid is not None,
        ROW_TEMPERATURE=row_temps is not None,
        SUM_PI_SQUARED=sum_sq is not None,
        SOFTCAP=cap is not None,
        FAST_EXP2=fast_exp2(logits.device),
        BLOCK_V=block,
        FLOORED=floors is not None,
        **launch_options(block, logits.element_size()),
    )
    return logp, lse, entropy


@launches_on("logits")
def logits_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
    floors: torch.Tensor | None = None,
) -> None:
    """out[b, t] = d(loss)/d(logits[b, t]); `out` may be `logits` itself (in place). A negative
    label means the row's label is not in these logits (tensor parallelism: another rank holds
    its vocab slice): the row gets the softmax terms only, no one-hot term. `row_temps`: [B, T]
    per-token temperatures, in place of `temperature`; `cap`, `floors`: as `logprobs_forward`."""
    check_floors(floors, labels, cap)
    batch, time, vocab = logits.shape
    if batch * time == 0:
        return
    block = block_size(vocab, logits.device, logits.element_size())
    dlogp = dlogp.float().contiguous()
    dentropy_arg = dentropy.float().contiguous() if dentropy is not None else dlogp
    _logits_grad_kernel[(batch * time,)](
        logits,
        out,
        labels.contiguous(),
        lse.contiguous(),
        entropy.contiguous(),
        dlogp,
        dentropy_arg,
        row_temperature_arg(row_temps, dlogp),
        dlogp if floors is None else floors,
        time,
        vocab,
        logits.stride(0),
        logits.stride(1),
        out.stride(0),
        out.stride(1),
        1.0 / temperature,
        LOG2E.value / temperature,  # log2(e) / T: sweep 1 works in base 2
        cap_arg(cap),
        WITH_ENTROPY=dentropy is not None,
        ROW_TEMPERATURE=row_temps is not None,
        SOFTCAP=cap is not None,
        FAST_EXP2=fast_exp2(logits.device),
        BLOCK_V=block,
        FLOORED=floors is not None,
        **launch_options(block, logits.element_size()),
    )
