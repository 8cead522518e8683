"""The two row ops the tensor-parallel path needs from a backend, on a vocab slice.

- `stats(logits, labels, valid, temperature) -> (logp, lse, entropy)` (`temperature`: a number
  or per-token ones, [B, T]): each [B, T] fp32, of the
  slice alone; `labels` are column indices in the slice (any column where the label is not
  there: only the owner's logp is used); rows where `valid` is False give 0.
- `grad(logits, labels, lse, entropy, dlogp, dentropy, temperature, out)`: the slice of
  d(loss)/d(logits) from the whole row's lse and entropy; a label < 0 is in another rank's slice
  (no one-hot term here).

The Triton backend's `logprobs_fwd` / `logits_grad` ops are exactly these, and both take
`floors=` (`reads_floors`): [B, T] fp32, each row's sampled-set floor on the slice's raw logits
(`sampling.slice_floors(raw=True)`), the slice read over the set and, in `stats`, the label kept
only where it is a column of the slice (labels < 0 then: not here). The torch backend gets them
from its block helpers; they take `floors=` and refuse any (their callers mask the slice
instead). A soft cap (`transform`) is elementwise: each slice is capped as it is read (the Triton
kernels' `cap=`, the torch blocks in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import fusedrl.backends as backends
import fusedrl.torch_backend as torch_backend

from ..fused_backend import temperature_keywords
from ..logit_transform import LogitTransform, capped_rows
from ..row_blocks import row_blocks, rows_temperature


@dataclass(frozen=True)
class SliceOps:
    stats: Callable
    grad: Callable
    reads_floors: bool = False


@torch.no_grad()
def _torch_stats(logits, labels, valid, temperature, transform=None):
    batch, time, _ = logits.shape
    logp, lse, entropy = (
        torch.empty(batch * time, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    flat_labels = labels.reshape(-1)
    for start, (block,) in row_blocks(logits):
        stop = start + block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        log_probs, block_lse = torch_backend.block_log_probs(capped_rows(block, transform), rows_t)
        logp[start:stop], entropy[start:stop] = torch_backend.block_stats(
            log_probs, block_lse, flat_labels[start:stop], True
        )
        lse[start:stop] = block_lse.squeeze(-1)
    out = tuple(t.view(batch, time) for t in (logp, lse, entropy))
    if valid is None:
        return out
    # Masked rows may hold anything (NaN padding): they must not reach the all-gather.
    return tuple(torch.where(valid, t, 0.0) for t in out)


def _torch_grad(logits, labels, lse, entropy, dlogp, dentropy, temperature, out, transform=None):
    torch_backend.write_logits_grad(
        logits,
        labels,
        temperature,
        dlogp,
        dentropy,
        out,
        lse=lse,
        entropy=entropy,
        transform=transform,
    )


WORKING_BACKENDS = "backend='triton' (CUDA tensors), 'torch', or 'auto'"


def refuse_unsupported(backend: str) -> None:
    """NotImplementedError for what has no tensor-parallel path yet. Decided from the arguments
    alone, so every rank raises it, before any collective."""
    if backend == "cuda":
        raise NotImplementedError(
            "backend='cuda' (the csrc/ extension) has no tensor-parallel path yet: with "
            f"tp_group use {WORKING_BACKENDS}"
        )


def slice_ops(
    backend: str, device: torch.device, transform: LogitTransform | None = None
) -> SliceOps:
    """The backend's two slice ops; `transform`: a soft cap they apply as they read."""

    impl = backends.resolve(backend, device)
    if impl is torch_backend:
        # The same signature as the Triton ops'; floors never reach them (reads_floors is
        # False: their callers mask the slice instead).
        def torch_stats(logits, labels, valid, temperature, floors=None):
            assert floors is None, "the torch slice ops read no floors"
            return _torch_stats(logits, labels, valid, temperature, transform)

        def torch_grad(*args, floors=None):
            assert floors is None, "the torch slice ops read no floors"
            _torch_grad(*args, transform=transform)

        return SliceOps(torch_stats, torch_grad)
    ops = impl.OPS

    def stats(logits, labels, valid, temperature, floors=None):
        scalar, rows = temperature_keywords(temperature, transform=transform, floors=floors)
        return ops.logprobs_fwd(logits, labels, valid, scalar, **rows)

    def grad(logits, labels, lse, entropy, dlogp, dentropy, temperature, out, floors=None):
        scalar, rows = temperature_keywords(temperature, transform=transform, floors=floors)
        ops.logits_grad(logits, labels, lse, entropy, dlogp, dentropy, scalar, out, **rows)

    # A soft cap's sets are the capped logits': no threshold on the raw ones holds them.
    capped = transform is not None and transform.softcap is not None
    return SliceOps(stats, grad, reads_floors=not capped)
