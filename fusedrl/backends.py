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
from typing import Protocol

import torch

BACKENDS = ("auto", "triton", "cuda", "torch")
LINEAR_BACKENDS = ("auto", "triton", "torch")

# Looked up once: torch.compile cannot trace importlib (a graph break under fullgraph=True).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


class Backend(Protocol):
    """What a logits backend module (torch_backend, triton_backend, cuda_backend) provides to
    `single_process` and `tp.ops`. tests/test_backends.py checks every module against it."""

    # Sums pi^2 in the call's own read of the logits: then `policy_loss_squares` and
    # `token_logprobs_squares` exist (else the entry points take one more read at T / 2).
    SUMS_PI_SQUARED_IN_PASS: bool
    # Takes `LossInputs` as the caller gave them (`prepare_loss_inputs(mask_rows=False)`): its
    # kernels read counted tokens only, and it masks the rows itself where torch code needs it.
    READS_RAW_ROWS: bool

    def policy_loss(self, inp, cfg, return_entropy: bool, grad) -> tuple: ...

    def planned_call(self, inp, cfg, return_entropy: bool):
        """`policy_loss` of calls of this kind with a gradient as a function of (inputs, the
        gradient buffer) -> (logp, entropy, terms), decided once for the kind (`call_plan`);
        None: the general path. Its terms' metrics may be `output.MetricSlots` (made when read)."""
        ...

    def token_logprobs(
        self, logits, labels, temperature, return_entropy: bool, **kwargs
    ) -> tuple: ...

    def terms(self, logp, entropy, inp, cfg, need_entropy: bool):
        """The loss, metrics and d(loss)/d(logp), d(loss)/d(entropy) (`TokenTerms`) of given
        log-probs and entropy, as the two-pass path takes them between its passes: for a caller
        that ran the log-prob pass itself (packed sequences' padded layout)."""
        ...


class LinearBackend(Protocol):
    """What an LM-head loss backend module (linear_torch, linear_triton) provides to
    `linear_single_process` and `tp.linear`."""

    def squares_in_sweep(self) -> bool:
        """Whether `token_logprobs_squares` serves: pi^2 summed in the log-prob sweep itself."""
        ...

    def policy_loss(self, lin, cfg, return_entropy: bool, want) -> tuple: ...

    def token_logprobs(self, lin, temperature, return_entropy: bool) -> tuple: ...

    def backward(self, lin, labels, temperature, grad_logp, grad_entropy, want): ...


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
        import fusedrl.triton_backend as triton_backend

        return triton_backend
    if backend == "cuda":
        if device.type != "cuda":
            raise RuntimeError(
                f"backend='cuda' (the csrc/ extension) needs CUDA tensors, got {device.type}; "
                "use backend='torch' (or 'auto')"
            )
        import fusedrl.cuda_backend as cuda_backend

        return cuda_backend
    import fusedrl.torch_backend as torch_backend

    return torch_backend


def check_runnable(backend: str, device: torch.device, argument: str) -> None:
    """ValueError "`argument`: why" where `backend` cannot run on `device`: a front end's check
    before it loads models (`resolve` itself raises RuntimeError at the call)."""
    try:
        resolve(backend, device)
    except RuntimeError as exc:
        raise ValueError(f"{argument}: {exc}") from None


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
        import fusedrl.linear_torch as linear_torch

        return linear_torch
    _needs_triton(device)
    import fusedrl.linear_triton as linear_triton

    return linear_triton
