"""The row chunking every torch path shares: [B, T, X] tensors walked in blocks of flat rows.

The torch backend's passes, the fused driver's fallbacks (the sampled sets, the sum of p^2 at
half the temperature), the LM-head form's chunks, distillation's torch rows and tensor
parallelism's selects all visit the logits (or hidden states) this way, so that the extra
memory is O(block x V) fp32, never a full fp32 copy of [N, V].
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Rows per block are chosen so that one fp32 temporary of the block holds about this many elements
# (16 MiB): large enough to amortise the Python loop, small next to any real logits tensor.
BLOCK_ELEMENTS = 1 << 22


def block_rows(vocab: int, elements: int | None = None) -> int:
    """Rows of a block of about `elements` (default BLOCK_ELEMENTS, read at the call: a test's
    smaller blocks reach every caller) elements of [rows, vocab]."""
    elements = BLOCK_ELEMENTS if elements is None else elements
    return max(1, elements // max(vocab, 1))


def row_blocks(
    *tensors: torch.Tensor, vocab: int | None = None, elements: int | None = None
) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """(first flat row, [n, X] views of each tensor) over [B, T, X] tensors, never copying them.

    Blocks hold about `elements` (default BLOCK_ELEMENTS) elements of a [n, vocab] temporary
    (vocab: the last dimension unless given, as for hidden states whose logits are only made
    block by block).
    A [B, P+T, X] slice cannot be flattened to [B*T, X] without a copy, so when any tensor is
    such a view all of them are walked sequence by sequence (the blocks must line up).
    """
    batch, time, _ = tensors[0].shape
    vocab = tensors[0].shape[-1] if vocab is None else vocab
    rows = block_rows(vocab, elements)
    # Decided from the strides, not by trying the view: under torch.compile a view that cannot
    # be made raises from the tracer (a hard error, not the eager RuntimeError).
    if all(_flattens(t) for t in tensors):
        flats = [t.view(batch * time, t.shape[-1]) for t in tensors]
        for start in range(0, batch * time, rows):
            yield start, tuple(f[start : start + rows] for f in flats)
        return
    for b in range(batch):
        for t0 in range(0, time, rows):
            yield b * time + t0, tuple(t[b, t0 : t0 + rows] for t in tensors)


def rows_temperature(temperature, start: int, stop: int):
    """The temperature of flat rows [start, stop): a float, or of per-token temperatures
    ([B, T] tensor) the rows' own as an [n, 1] column that divides their block."""
    if isinstance(temperature, torch.Tensor):
        return temperature.reshape(-1)[start:stop, None]
    return temperature


def _flattens(t: torch.Tensor) -> bool:
    """Whether [B, T, X] `t` views as [B * T, X]: its sequences lie one after another."""
    batch, time = t.shape[0], t.shape[1]
    return batch <= 1 or time <= 1 or t.stride(0) == t.stride(1) * time
