"""The LM head and the log-softmax fused: logits tiles made on chip, never stored whole.

- `linear_stats`: per block of BLOCK_M rows, the vocab is swept in BLOCK_V tiles; each tile of
  logits is hidden[rows] @ weight[tile].T (tl.dot over BLOCK_H slices of H, fp32 accumulation)
  and is folded at once into an online max, sum-exp and entropy sum per row, with the label's
  logit picked out. Out: logp, lse, entropy per row (fp32). 2·N·H·V flops; the logits never
  leave the chip.
- `linear_logits_grad`: the same tiles recomputed for a chunk of rows, turned into
  d(loss)/d(logits) = (dlogp (onehot - p) - dH p (log p + H)) / temperature, and written for
  that chunk only ([C, V] in the inputs' dtype). The launcher's caller then takes
  dX = G @ W and dW += G.T @ X with cuBLAS: fp32 atomics of every row block into [V, H] would
  move (N / BLOCK_M) x V x H x 4 bytes, far more than the chunk's G written once, read twice.

Rows are those of [B, T, H] hidden states with any batch/time strides (H contiguous); masked
rows (valid == 0) are computed as zeros and get zero statistics and gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import launches_on

# GPU tiles: a [64 x 128] fp32 accumulator over 8 warps (32 registers a thread) with H in slices
# of 64 (a 128-byte row of bf16 per load). Interpreted: small tiles, so that the tests' odd
# shapes (H = 24, V = 1031) cover several tiles and partial last ones on every axis.
GPU_TILES = {"BLOCK_M": 64, "BLOCK_H": 64}
GPU_BLOCK_V = 128
# fp32 inputs multiply in full fp32 on the CUDA cores (not tensor cores), whose operand tiles
# live in registers: [32 x 64] tiles in slices of 32, or ptxas spills (at [64 x 128] x 64: 255
# registers and a stack frame on every arch; [32 x 64] x 32 holds 80-148 and none).
FP32_GPU_TILES = {"BLOCK_M": 32, "BLOCK_H": 32}
FP32_GPU_BLOCK_V = 64
INTERPRETED_TILES = {"BLOCK_M": 16, "BLOCK_H": 16}
INTERPRETED_BLOCK_V = 64
UPCAST_DOT_CODES = {"cuda": False}


# Compute-bound tiles, not memory-bound row sweeps: fusedrl.kernels.aot leaves these kernels out
# of the row sweeps' SASS budgets, and one program per SM may hold up to 255 registers a thread.
KERNEL_FAMILY = "gemm"
MIN_CTAS_PER_SM = 1


def max_registers(warps: int) -> int:
    return min(255, 65536 // (MIN_CTAS_PER_SM * 32 * warps))


def fp32_exact(dtype: torch.dtype) -> bool:
    """fp32 inputs get full fp32 products (not TF32): the reference's precision."""
    return dtype == torch.float32


def gpu_tiles(dtype: torch.dtype) -> dict[str, int]:
    return dict(FP32_GPU_TILES if fp32_exact(dtype) else GPU_TILES)


# Constexprs that follow the input dtype: fusedrl.kernels.aot compiles each dtype with the value
# its launch gets (and never a pair no launch makes, such as fp32 inputs with TF32 products).
# UPCAST_DOT is compiled off only (the interpreter's workaround is never launched on a GPU).
DTYPE_CONSTEXPRS = {
    "FP32_EXACT": fp32_exact,
    "BLOCK_M": lambda dtype: gpu_tiles(dtype)["BLOCK_M"],
    "BLOCK_H": lambda dtype: gpu_tiles(dtype)["BLOCK_H"],
}


def tiles(device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    return gpu_tiles(dtype) if device.type == "cuda" else dict(INTERPRETED_TILES)


def block_size(vocab: int, device: torch.device, elem_bytes: int = 2) -> int:
    """The vocab tile (BLOCK_V): see FP32_GPU_TILES."""
    if device.type != "cuda":
        return INTERPRETED_BLOCK_V
    return FP32_GPU_BLOCK_V if elem_bytes == 4 else GPU_BLOCK_V


def launch_options(block: int, elem_bytes: int = 2) -> dict[str, int]:
    return {"num_warps": 8, "num_stages": 3}


@triton.jit
def _row_offsets(rows, row_ok, time, stride_b, stride_t):
    """int64 element offsets of flat rows r = b * time + t of a [B, T, H] strided tensor."""
    rows64 = rows.to(tl.int64)
    return tl.where(row_ok, (rows64 // time) * stride_b + (rows64 % time) * stride_t, 0)


@triton.jit
def _logits_tile(
    hidden_ptr,
    x_offsets,
    row_ok,
    weight_ptr,
    stride_wv,
    bias_ptr,
    cols,
    col_ok,
    hidden_size,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    FP32_EXACT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """(hidden[rows] @ weight[cols].T + bias[cols]) / temperature, fp32 [BLOCK_M, BLOCK_V]; -inf
    outside the vocab."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    w_offsets = cols.to(tl.int64) * stride_wv
    for k0 in range(0, hidden_size, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < hidden_size
        x = tl.load(
            hidden_ptr + x_offsets[:, None] + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            weight_ptr + w_offsets[:, None] + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if FP32_EXACT:  # fp32 inputs: full fp32 products, not TF32 (10-bit mantissas)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        elif UPCAST_DOT:  # the interpreter multiplies bf16 tiles wrongly: exact fp32 products
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(col_ok[None, :], acc * inv_temperature, float("-inf"))


@triton.jit
def _linear_stats_kernel(
    hidden_ptr,
    stride_b,
    stride_t,
    time,
    weight_ptr,
    stride_wv,
    bias_ptr,
    labels_ptr,
    valid_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    n_rows,
    vocab,
    hidden_size,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    FP32_EXACT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = rows < n_rows
    row_ok = in_range & (tl.load(valid_ptr + rows, mask=in_range, other=0) != 0)
    x_offsets = _row_offsets(rows, row_ok, time, stride_b, stride_t)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    # Running max m, S = sum exp(z - m) and U = sum exp(z - m) (z - m) per row: rescaled when m
    # grows, so that the entropy log S - U / S needs no second sweep. m starts finite so that the
    # first rescale multiplies 0 by a finite number.
    m = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)
    u = tl.zeros((BLOCK_M,), dtype=tl.float32)
    label_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        z = _logits_tile(
            hidden_ptr,
            x_offsets,
            row_ok,
            weight_ptr,
            stride_wv,
            bias_ptr,
            cols,
            col_ok,
            hidden_size,
            inv_temperature,
            HAS_BIAS,
            FP32_EXACT,
            UPCAST_DOT,
            BLOCK_M,
            BLOCK_V,
            BLOCK_H,
        )
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        shifted = z - m_new[:, None]
        p = tl.exp(shifted)
        u = alpha * (u + (m - m_new) * s) + tl.sum(p * tl.where(p > 0, shifted, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
        hit = cols[None, :] == labels[:, None]
        label_logit += tl.sum(tl.where(hit, z, 0.0), axis=1)
    log_s = tl.log(s)
    lse = m + log_s
    # A +inf logit (m = +inf) leaves the row undefined: NaN, never a quiet finite value.
    corrupt = m == float("inf")
    logp = tl.where(corrupt, float("nan"), label_logit - lse)
    entropy = tl.where(corrupt, float("nan"), log_s - u / s)
    tl.store(logp_ptr + rows, tl.where(row_ok, logp, 0.0), mask=in_range)
    tl.store(lse_ptr + rows, tl.where(row_ok, lse, 0.0), mask=in_range)
    tl.store(entropy_ptr + rows, tl.where(row_ok, entropy, 0.0), mask=in_range)


@triton.jit
def _linear_logits_grad_kernel(
    hidden_ptr,
    stride_b,
    stride_t,
    time,
    weight_ptr,
    stride_wv,
    bias_ptr,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    dlogp_ptr,
    dentropy_ptr,
    grad_ptr,
    stride_g,
    first_row,
    n_rows,
    vocab,
    hidden_size,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    HAS_DENTROPY: tl.constexpr,
    FP32_EXACT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """grad[r - first_row, tile] for rows [first_row, n_rows) of the chunk, one tile a program."""
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = first_row + local
    in_range = rows < n_rows
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < vocab
    dlogp = tl.load(dlogp_ptr + rows, mask=in_range, other=0.0)
    live = dlogp != 0
    if HAS_DENTROPY:
        dentropy = tl.load(dentropy_ptr + rows, mask=in_range, other=0.0)
        live = live | (dentropy != 0)
    row_ok = in_range & live  # rows without a derivative (masked) are not recomputed
    x_offsets = _row_offsets(rows, row_ok, time, stride_b, stride_t)
    z = _logits_tile(
        hidden_ptr,
        x_offsets,
        row_ok,
        weight_ptr,
        stride_wv,
        bias_ptr,
        cols,
        col_ok,
        hidden_size,
        inv_temperature,
        HAS_BIAS,
        FP32_EXACT,
        UPCAST_DOT,
        BLOCK_M,
        BLOCK_V,
        BLOCK_H,
    )
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    onehot = tl.where(cols[None, :] == labels[:, None], 1.0, 0.0)
    grad = dlogp[:, None] * (onehot - p)
    if HAS_DENTROPY:
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        grad -= dentropy[:, None] * p * tl.where(p > 0, log_p + entropy[:, None], 0.0)
    grad = tl.where(row_ok[:, None], grad * inv_temperature, 0.0)
    g_offsets = local.to(tl.int64)[:, None] * stride_g + cols[None, :]
    tl.store(
        grad_ptr + g_offsets,
        grad.to(grad_ptr.dtype.element_ty),
        mask=in_range[:, None] & col_ok[None, :],
    )


def _head_args(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    return (
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        hidden.shape[1],
        weight,
        weight.stride(0),
        weight if bias is None else bias,  # a placeholder pointer when HAS_BIAS is off
    )


@launches_on("hidden")
def linear_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B, T, H], weight [V, H], labels / valid [B, T] -> logp, lse, entropy [B, T] fp32."""
    batch, time, hidden_size = hidden.shape
    n_rows = batch * time
    out = [torch.empty(batch, time, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    if n_rows == 0:
        return tuple(out)
    sizes = tiles(hidden.device, hidden.dtype)
    block_v = block_size(weight.shape[0], hidden.device, hidden.element_size())
    grid = (triton.cdiv(n_rows, sizes["BLOCK_M"]),)
    _linear_stats_kernel[grid](
        *_head_args(hidden, weight, bias),
        labels.contiguous(),
        valid.contiguous(),
        *out,
        n_rows,
        weight.shape[0],
        hidden_size,
        1.0 / temperature,
        HAS_BIAS=bias is not None,
        FP32_EXACT=fp32_exact(hidden.dtype),
        UPCAST_DOT=hidden.device.type != "cuda",
        BLOCK_V=block_v,
        **sizes,
        **launch_options(block_v),
    )
    return tuple(out)


@launches_on("hidden")
def linear_logits_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    first_row: int,
    out: torch.Tensor,
) -> None:
    """out[i] = d(loss)/d(logits) of flat row first_row + i, for the rows out holds ([C, V])."""
    batch, time, hidden_size = hidden.shape
    n_rows = min(batch * time, first_row + out.shape[0])
    if n_rows <= first_row:
        return
    sizes = tiles(hidden.device, hidden.dtype)
    vocab = weight.shape[0]
    block_v = block_size(vocab, hidden.device, hidden.element_size())
    grid = (triton.cdiv(n_rows - first_row, sizes["BLOCK_M"]), triton.cdiv(vocab, block_v))
    _linear_logits_grad_kernel[grid](
        *_head_args(hidden, weight, bias),
        labels.contiguous(),
        lse,
        entropy,
        dlogp.contiguous(),
        dlogp if dentropy is None else dentropy.contiguous(),
        out,
        out.stride(0),
        first_row,
        n_rows,
        vocab,
        hidden_size,
        1.0 / temperature,
        HAS_BIAS=bias is not None,
        HAS_DENTROPY=dentropy is not None,
        FP32_EXACT=fp32_exact(hidden.dtype),
        UPCAST_DOT=hidden.device.type != "cuda",
        BLOCK_V=block_v,
        **sizes,
        **launch_options(block_v),
    )
