"""Token log-probs (+ entropy) and the gradient sweep, as two Triton kernels and their launchers.

- `logprobs_forward`: one read of each row -> logp of the label, lse and entropy (fp32). It is the
  no-grad fast path for old / reference log-probs and pass 1 of the sequence-level losses.
- `logits_backward`: given per-token d(loss)/d(logp) and d(loss)/d(H), one read + one write of each
  row. It is the backward of `token_logprobs` and pass 2 of the sequence-level losses.

Both take [B, T, V] logits with any batch/time strides (vocab contiguous) and run one program per
row; masked rows (valid == 0) are skipped and get zeros.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .device import launches_on
from .rows import (
    LOG2E,
    cap_arg,
    logp_of,
    row_offset,
    row_stats,
    row_temperature,
    row_temperature_arg,
    rows_buffer,
    write_row_grad,
    write_row_zeros,
)

# Vocab tiles. On a GPU a tile is one 16-byte vector per thread of a 16-warp program (4096 bf16
# or 2048 fp32 elements): sweep 1 keeps two fp32 running sums per element slot in registers and
# prefetches the next tile, so a wider tile costs registers, not speed (the loop has no barrier to
# amortise). Under the interpreter every tile is a numpy array; tests lower the CPU cap to force
# many tiles and a partial last one.
BYTES_PER_THREAD = 16
# Switches compiled together on top of the base configuration (aot.variants), beside each alone:
# the soft cap with what else its sweeps may carry.
CROSSED_SWITCHES = (("SOFTCAP", "SUM_PI_SQUARED"), ("SOFTCAP", "ROW_TEMPERATURE"))
MAX_WARPS = 16
MAX_BLOCK_V_INTERPRETED = 2048


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    if device.type == "cuda":
        cap = MAX_WARPS * 32 * BYTES_PER_THREAD // elem_bytes
    else:
        cap = MAX_BLOCK_V_INTERPRETED
    return min(triton.next_power_of_2(vocab), cap)


def num_warps(block: int, elem_bytes: int = 2) -> int:
    return max(4, min(MAX_WARPS, block * elem_bytes // (32 * BYTES_PER_THREAD)))


def fast_exp2(device: torch.device) -> bool:
    """ex2.approx.ftz through inline PTX: compiled kernels only (the interpreter runs no PTX)."""
    return device.type == "cuda"


# Registers per SM on sm_80 and sm_90 (and the most one thread may hold).
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
MIN_CTAS_PER_SM = 2


def max_registers(warps: int) -> int:
    """The register cap (ptxas .maxnreg) that keeps MIN_CTAS_PER_SM programs resident per SM:
    while one row's program waits on a block reduction, the other's loads keep HBM busy. Without
    it ptxas gives some variants (odd V on sm_90: 72) more than 64 registers at 16 warps, which
    halves the rows in flight. tests/test_kernels_compile.py checks that no variant spills."""
    return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (MIN_CTAS_PER_SM * 32 * warps))


# Programs of a persistent kernel under the interpreter: a few, so that tests run the row loop.
INTERPRETED_PROGRAMS = 3


@functools.cache
def _sms_and_l2(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    return props.multi_processor_count, props.L2_cache_size


def persistent_programs(rows: int, row_bytes: int, device: torch.device) -> int:
    """Programs of a two-sweep kernel: as many rows in flight as L2 holds, one per SM at least.

    Sweep 2 re-reads the row that sweep 1 just streamed, back to front, with its own loads and
    the gradient stores marked evict-first: a line is still in L2 when sweep 2 comes back for it
    if every row in flight fits there, i.e. programs x row_bytes <= L2. On an H100 (50 MB, 132
    SMs) bf16 rows of V = 151936 (297 KB) get one program per SM (39 MB), V = 32000 two (17 MB).
    Fewer than one per SM would leave SMs idle, so V = 262144 (512 KB rows, 67 MB) overflows L2
    and re-reads part of each row from HBM (docs/benchmarks.md has the traffic model).
    """
    if device.type != "cuda":
        return max(1, min(rows, INTERPRETED_PROGRAMS))
    # A tensor's device always has an index; a bare torch.device("cuda") means the current one.
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, l2_bytes = _sms_and_l2(index)
    per_sm = max(1, min(MIN_CTAS_PER_SM, l2_bytes // max(1, row_bytes * sms)))
    return max(1, min(rows, sms * per_sm))


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    """num_warps and maxnreg of a row kernel with vocab tile `block` of elem_bytes elements."""
    warps = num_warps(block, elem_bytes)
    return {"num_warps": warps, "maxnreg": max_registers(warps)}


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
):
    """SUM_PI_SQUARED: also sum_v pi_v^2 per row into sum_sq_ptr, from the same read. SOFTCAP:
    the row is read as tanh(a x) (`rows.capped`, cap2 = 2 a log2(e))."""
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
        label = tl.load(labels_ptr + row)
        label = tl.where((label >= 0) & (label < vocab), label, 0)
        label_value, lse, mean_z, sum_pi_sq = row_stats(
            row_ptr, vocab, row_scale2, tl.load(row_ptr + label), cap2,
            "evict_first", FAST_EXP2, SUM_PI_SQUARED, SOFTCAP, BLOCK_V,
        )  # fmt: skip
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
):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, V] logits, [B, T] labels (and valid) -> logp, lse, entropy, each [B, T] fp32; with
    `sum_sq` (a [B, T] fp32 buffer) also sum_v pi_v^2 per row (0 on invalid rows) into it, from
    the same read. `row_temps`: [B, T] per-token temperatures, in place of `temperature`. `cap`:
    a soft cap's a = s / c: the rows are read as tanh(a x) (`rows.capped`), at `temperature`
    T / c."""
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
) -> None:
    """out[b, t] = d(loss)/d(logits[b, t]); `out` may be `logits` itself (in place). A negative
    label means the row's label is not in these logits (tensor parallelism: another rank holds
    its vocab slice): the row gets the softmax terms only, no one-hot term. `row_temps`: [B, T]
    per-token temperatures, in place of `temperature`; `cap`: as `logprobs_forward`."""
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
        **launch_options(block, logits.element_size()),
    )
