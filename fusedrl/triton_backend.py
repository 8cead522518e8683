"""`backend="triton"`: the kernels of `fusedrl.kernels`, registered as torch custom ops.

The ops have fake implementations so that `torch.compile` traces through them; under
`TRITON_INTERPRET=1` they also run on CPU tensors. How they are used (fused single kernel vs two
passes) is `fusedrl.fused_backend`.
"""

from __future__ import annotations

import functools

import torch

from . import fused_backend
from .fused_backend import FUSED_ARGS, FusedOps


def _kernels():
    # Imported lazily: importing triton is slow and fails on machines without it.
    from fusedrl.kernels import logprobs, token_loss

    return logprobs, token_loss


def _empty_rows_like(labels: torch.Tensor) -> torch.Tensor:
    return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)


# ------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("fusedrl::logprobs_fwd", mutates_args=())
def logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs, _ = _kernels()
    return logprobs.logprobs_forward(logits, labels, valid, temperature)


@logprobs_fwd.register_fake
def _(logits, labels, valid, temperature):
    return _empty_rows_like(labels), _empty_rows_like(labels), _empty_rows_like(labels)


@torch.library.custom_op("fusedrl::logits_grad", mutates_args=("out",))
def logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    logprobs, _ = _kernels()
    logprobs.logits_backward(logits, labels, lse, entropy, dlogp, dentropy, temperature, out)


@logits_grad.register_fake
def _(logits, labels, lse, entropy, dlogp, dentropy, temperature, out):
    return None


# One schema string serves the out-of-place op (writes `grad`) and the in-place one.
torch.library.define(
    "fusedrl::fused_token_loss",
    f"(Tensor logits, Tensor(a!) grad, {FUSED_ARGS}) -> (Tensor, Tensor)",
)
torch.library.define(
    "fusedrl::fused_token_loss_inplace", f"(Tensor(a!) logits, {FUSED_ARGS}) -> (Tensor, Tensor)"
)


@torch.library.impl("fusedrl::fused_token_loss", "default")
def _fused_token_loss(logits, grad, *args):
    return _kernels()[1].fused_token_loss(logits, grad, *args)


@torch.library.impl("fusedrl::fused_token_loss_inplace", "default")
def _fused_token_loss_inplace(logits, *args):
    return _kernels()[1].fused_token_loss(logits, logits, *args)


@torch.library.register_fake("fusedrl::fused_token_loss")
def _(logits, grad, labels, *args):
    return _empty_rows_like(labels), _empty_rows_like(labels)


@torch.library.register_fake("fusedrl::fused_token_loss_inplace")
def _(logits, labels, *args):
    return _empty_rows_like(labels), _empty_rows_like(labels)


fused_token_loss = torch.ops.fusedrl.fused_token_loss.default
fused_token_loss_inplace = torch.ops.fusedrl.fused_token_loss_inplace.default


# ------------------------------------------------------------------------------ backends
OPS = FusedOps(logprobs_fwd, logits_grad, fused_token_loss, fused_token_loss_inplace)
policy_loss = functools.partial(fused_backend.policy_loss, OPS)
token_logprobs = functools.partial(fused_backend.token_logprobs, OPS)
