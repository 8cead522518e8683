"""Scale a gradient by the upstream gradient of the loss, in place, unless that is exactly 1.

The fused kernels write d(loss)/d(logits) while computing the loss, so backward only has to
multiply it by d(out)/d(loss). When the loss is the terminal node (`loss.backward()`, the usual
case) that factor is 1 and a multiply would be a full read + write of the [B, T, V] gradient:
as much HBM traffic as the fused kernel's own write. Testing `grad_loss == 1` on the host would
sync; here every program loads the scalar and returns at once when it is 1, so the common case
costs one launch and no gradient traffic, and any other factor costs one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logprobs import block_size, launch_options
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


def scale_rows_unless_one(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """grad *= scale in place, rows of [N, V] or [B, T, V] (vocab contiguous, any other strides);
    `scale` is a one-element tensor on grad's device, read on the device (no host sync)."""
    grad3 = grad.unsqueeze(0) if grad.dim() == 2 else grad
    batch, time, vocab = grad3.shape
    if batch * time == 0:
        return
    block = block_size(vocab, grad.device, grad.element_size())
    _scale_rows_unless_one_kernel[(batch * time,)](
        grad3,
        scale.reshape(1).float(),
        time,
        vocab,
        grad3.stride(0),
        grad3.stride(1),
        BLOCK_V=block,
        **launch_options(block, grad.element_size()),
    )
