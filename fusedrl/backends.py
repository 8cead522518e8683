"""Which backend module runs a call: one resolution for every entry point and family.

`resolve(backend, device)`: the logits ops (`torch_backend`, `triton_backend`, `cuda_backend`);
`resolve_linear(backend, device)`: the LM-head loss's (`linear_torch`, `linear_triton`). "auto"
picks Triton for CUDA tensors and the torch code elsewhere. Callers look these up as
`backends.resolve(...)` at call time (tests route the CUDA extension's code on the host by
replacing it here).
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "cuda", "torch")
LINEAR_BACKENDS = ("auto", "triton", "torch")

# Looked up once: torch.compile cannot trace importlib (a graph break under fullgraph=True).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU ones under TRITON_INTERPRET=1."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return TRITON_INSTALLED


def _needs_triton(device: torch.device) -> None:
    if not triton_usable(device):
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device.type}) and the triton package; "
            "on CPU set TRITON_INTERPRET=1 before triton is imported, or use backend='torch'"
        )


def resolve(backend: str, device: torch.device):
    """The backend module for `backend` on `device` (auto: Triton on CUDA, torch elsewhere)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_usable(device) else "torch"
    if backend == "triton":
        _needs_triton(device)
        from . import triton_backend

        return triton_backend
    if backend == "cuda":
        if device.type != "cuda":
            raise RuntimeError(
                f"backend='cuda' (the csrc/ extension) needs CUDA tensors, got {device.type}; "
                "use backend='torch' (or 'auto')"
            )
        from . import cuda_backend

        return cuda_backend
    from . import torch_backend

    return torch_backend


def resolve_linear(backend: str, device: torch.device):
    """The LM-head loss's backend module: the Triton kernels for CUDA tensors ("auto"), the
    block-wise torch code elsewhere."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not one of {LINEAR_BACKENDS} (the LM-head loss has no "
            "CUDA C++ kernel)"
        )
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and TRITON_INSTALLED else "torch"
    if backend == "torch":
        from . import linear_torch

        return linear_torch
    _needs_triton(device)
    from . import linear_triton

    return linear_triton
