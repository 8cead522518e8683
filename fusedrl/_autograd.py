"""The autograd node every fused backend ends with: a loss whose gradient is already known.

The fused backends compute d(loss)/d(logits) while they compute the loss (that is the point: the
logits are read once), so backward has nothing left to derive; it only scales the stored gradient
by the upstream gradient, and touches nothing when that is 1 (the loss is the terminal node).
"""

from __future__ import annotations

import importlib.util

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def scale_unless_one(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """grad * grad_loss, in place, without touching grad when grad_loss == 1 and without a host
    sync on an accelerator:
    - CPU eager: the check is a free host read;
    - CUDA eager: a Triton kernel reads grad_loss on the device and its programs return at once
      when it is 1 (no read or write of grad), else scale in one pass;
    - under torch.compile (or without Triton): a multiply that the compiler can fuse onward.
    """
    if torch.compiler.is_compiling():
        return grad.mul_(grad_loss.to(grad.dtype))
    if grad_loss.device.type == "cpu":
        if not bool(grad_loss == 1):
            grad.mul_(grad_loss.to(grad.dtype))
        return grad
    if grad.device.type == "cuda" and _HAS_TRITON:
        from fusedrl.kernels.scale import scale_rows_unless_one

        scale_rows_unless_one(grad, grad_loss)
        return grad
    return grad.mul_(grad_loss.to(grad.dtype))


class LossWithKnownGrads(torch.autograd.Function):
    """loss, differentiable w.r.t. `inputs`, whose gradients `grads` (one per input, None where
    it needs none) are already computed."""

    @staticmethod
    def forward(ctx, loss, grads, *inputs):
        # Held as an attribute, not a saved tensor, so backward can drop the graph's reference:
        # autograd may then hand the buffer on (or accumulate into it) without another copy.
        ctx.grads = list(grads)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fusedrl: backward ran twice through the same graph; the gradient buffers are "
                "released after the first backward (retain_graph is not supported)"
            )
        ctx.grads = None
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(
                "fusedrl.policy_loss (or linear_policy_loss) does not support double backward "
                "(create_graph=True): its gradient is computed by the fused kernel and carries "
                "no graph, so a "
                "second-order term would silently be 0. fusedrl.reference.policy_loss (plain "
                "autograd) gives higher-order derivatives"
            )
        scaled = [None if g is None else scale_unless_one(g, grad_loss) for g in grads]
        return None, None, *scaled


def attach_grad(logits: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return LossWithKnownGrads.apply(loss, (grad,), logits)


def attach_grads(
    loss: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], grads: tuple
) -> torch.Tensor:
    """Like attach_grad, for several inputs (hidden, weight, bias); None inputs are skipped."""
    pairs = [(x, g) for x, g in zip(inputs, grads) if x is not None]
    return LossWithKnownGrads.apply(loss, tuple(g for _, g in pairs), *(x for x, _ in pairs))
