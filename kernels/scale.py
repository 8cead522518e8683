"""Scale a gradient by the upstream gradient of the loss, in place, unless that is exactly 1.

The fused kernels write d(loss)/d(logits) while computing the loss, so backward only has to
multiply it by d(out)/d(loss). When the loss is the terminal node (`loss.backward()`, the usual
case) that factor is 1 and a multiply would be a full read + write of the [B, T, V] gradient:
as much HBM traffic as the fused kernel's own write. Testing `grad_loss == 1` on the host would
sync; here every program loads the scalar and returns at once when it is 1, so the common case
costs one launch and no gradient traffic, and any other factor costs one pass.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import launches_on
from .launch import block_size, launch_options
from .rows import remainder_offsets, remainder_tiles, row_layout, row_offset


@triton.jit
def _scale_rows_unless_one_kernel(
    grad_ptr,
    scale_ptr,
    time,
    vocab,
    stride_b,
    stride_t,
    BLOCK_V: tl.constexpr,
):
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        row_ptr = grad_ptr + row_offset(tl.program_id(0), time, stride_b, stride_t)
        head, full_tiles, body_ptr = row_layout(row_ptr, vocab, BLOCK_V)
        offs = tl.arange(0, BLOCK_V)
        for i in range(0, full_tiles):
            g = tl.load(body_ptr + i * BLOCK_V + offs, eviction_policy="evict_first")
            g = (g.to(tl.float32) * scale).to(grad_ptr.dtype.element_ty)
            tl.store(body_ptr + i * BLOCK_V + offs, g, eviction_policy="evict_first")
        tail_start = head + full_tiles * BLOCK_V
        for r in range(0, remainder_tiles(head, tail_start, vocab, BLOCK_V)):
            roffs, in_row = remainder_offsets(r, head, tail_start, vocab, BLOCK_V)
            g = tl.load(row_ptr + roffs, mask=in_row).to(tl.float32)
            tl.store(row_ptr + roffs, (g * scale).to(grad_ptr.dtype.element_ty), mask=in_row)


def _as_rows(grad: torch.Tensor) -> torch.Tensor | None:
    """`grad` as [B, T, V] rows over the same memory (V its last dim), or None where no view
    has rows the kernel can walk: a last dim that is not contiguous, a broadcast (stride-0) dim
    whose rows share elements, or leading dims that merge into no two strides."""
    if grad.dim() == 0:
        return grad.view(1, 1, 1)
    vocab = grad.shape[-1]
    if vocab > 1 and grad.stride(-1) != 1:
        return None
    if any(stride == 0 and size > 1 for size, stride in zip(grad.shape, grad.stride())):
        return None
    leading = grad.shape[:-1]
    for split in range(len(leading) + 1):
        try:
            return grad.view(math.prod(leading[:split]), math.prod(leading[split:]), vocab)
        except RuntimeError:  # these dims do not merge into one stride: try the next split
            continue
    return None


@launches_on("grad")
def scale_rows_unless_one(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """grad *= scale in place, for a gradient of any shape (0-D to N-D: the [B, T, V] logits,
    the [V, H] weight, the [V] bias of the LM head); `scale` is a one-element tensor on grad's
    device, read on the device (no host sync). Any view whose last dim is contiguous runs as
    rows of that dim, without a copy; a gradient no view can walk is multiplied by torch, still
    in place (the autograd node hands its own buffer on), a half or bf16 one in fp32 as the
    kernel does."""
    if scale.numel() != 1:
        raise ValueError(f"scale must have one element, got shape {tuple(scale.shape)}")
    if scale.device != grad.device:
        raise ValueError(f"scale is on {scale.device}, the gradient on {grad.device}")
    if grad.numel() == 0:
        return
    rows = _as_rows(grad)
    if rows is None:  # (no gradient fusedrl writes comes here)
        factor = scale.reshape(())
        if grad.dtype in (torch.float32, torch.float64):
            grad.mul_(factor.to(grad.dtype))
        else:  # an aten multiply would cast the factor to fp16 (inf past 65504) or bf16
            grad.copy_(grad.float().mul_(factor.float()))
        return
    batch, time, vocab = rows.shape
    block = block_size(vocab, grad.device, grad.element_size())
    _scale_rows_unless_one_kernel[(batch * time,)](
        rows,
        scale.reshape(1).float(),
        time,
        vocab,
        rows.stride(0),
        rows.stride(1),
        BLOCK_V=block,
        **launch_options(block, grad.element_size()),
    )
