"""The autograd node every fused backend ends with: a loss whose gradient is already known.

The fused backends compute d(loss)/d(logits) while they compute the loss (that is the point: the
logits are read once), so backward has nothing left to derive; it only scales the stored gradient
by the upstream gradient.
"""

from __future__ import annotations

import torch


class LossWithKnownGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, loss, grad):
        # Held as an attribute, not a saved tensor, so backward can drop the graph's reference:
        # autograd may then hand the buffer on (or accumulate into it) without another copy.
        ctx.grad = grad
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError(
                "fusedrl.policy_loss: backward ran twice through the same graph; the gradient "
                "buffer is released after the first backward (retain_graph is not supported)"
            )
        ctx.grad = None
        # On CPU the check is free; on an accelerator it would sync, so scale unconditionally.
        cpu_eager = grad_loss.device.type == "cpu" and not torch.compiler.is_compiling()
        if not (cpu_eager and bool(grad_loss == 1)):
            grad = grad.mul_(grad_loss.to(grad.dtype))
        return grad, None, None


def attach_grad(logits: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return LossWithKnownGrad.apply(logits, loss, grad)
