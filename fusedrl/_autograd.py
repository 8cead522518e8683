"""The autograd layer: a loss whose gradient is already known, and how the entry points attach it.

The fused backends compute d(loss)/d(logits) while they compute the loss (that is the point: the
logits are read once), so backward has nothing left to derive; it only scales the stored gradient
by the upstream gradient, and touches nothing when that is 1 (the loss is the terminal node).
"""

from __future__ import annotations

import torch

from .backends import TRITON_INSTALLED
from .double_backward import refuse_double_backward


def scale_unless_one(grad: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """grad * grad_loss, in place, without touching grad when grad_loss == 1 and without a host
    sync on an accelerator:
    - CPU eager: the check is a free host read;
    - CUDA eager: a Triton kernel reads grad_loss on the device and its programs return at once
      when it is 1 (no read or write of grad), else scale in one pass;
    - under torch.compile (or without Triton): a multiply that the compiler can fuse onward.
    Every route multiplies a half or bf16 gradient in fp32 and rounds once (the scaling kernel's
    torch fallback too, for a gradient no row view can walk): the
    factor cast to an fp16 gradient's dtype first would overflow past 65504 (GradScaler's
    2**16, or a small `grad_scale` declared; inf, then NaN where the gradient is 0), and cast to
    bf16 it would lose its low bits.
    """
    if torch.compiler.is_compiling():  # (the dtype is fixed at trace time)
        if grad.dtype in (torch.float32, torch.float64):
            return grad.mul_(grad_loss.to(grad.dtype))
        return grad.copy_(grad.float() * grad_loss.float())  # one fused pass
    if grad_loss.device.type == "cpu":
        factor = grad_loss.item()
        if factor != 1:
            grad.mul_(factor)  # a CPU multiply by a number computes half / bf16 in fp32
        return grad
    if grad.device.type == "cuda" and TRITON_INSTALLED:
        from fusedrl.kernels.scale import scale_rows_unless_one

        scale_rows_unless_one(grad, grad_loss)
        return grad
    _mul_in_fp32(grad, grad_loss.float())
    return grad


# Elements per fp32 temporary of _mul_in_fp32: 64 MiB, not a second gradient.
_FP32_CHUNK = 1 << 24


def _mul_in_fp32(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """grad *= factor in fp32, rounded once, in chunks (a device without the Triton kernel: an
    aten multiply computes in the gradient's own dtype, the factor cast to it)."""
    if grad.dtype in (torch.float32, torch.float64):
        grad.mul_(factor.to(grad.dtype))
        return
    if not grad.is_contiguous():
        grad.copy_(grad.float().mul_(factor))
        return
    for chunk in grad.view(-1).split(_FP32_CHUNK):
        chunk.copy_(chunk.float().mul_(factor))


class LossWithKnownGrads(torch.autograd.Function):
    """loss, differentiable w.r.t. `inputs`, whose gradients `grads` (one per input, None where
    it needs none) are already computed, times `declared` (the caller's `grad_scale`, or None):
    an upstream gradient equal to it leaves them as they are."""

    @staticmethod
    def forward(ctx, loss, grads, declared, *inputs):
        # Held as an attribute, not a saved tensor, so backward can drop the graph's reference:
        # autograd may then hand the buffer on (or accumulate into it) without another copy.
        ctx.grads = list(grads)
        ctx.declared = declared
        # The loss itself, not a copy (one more launch) nor a view, which autograd makes of an
        # input returned as it is and which refuses in-place ops (`loss /= accumulation_steps`):
        # marked dirty, it is this Function's output. (Computed without grad, it is no one's.)
        if loss._base is not None:
            loss = loss.clone()
        ctx.mark_dirty(loss)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "fusedrl: backward ran twice through the same graph; the gradient buffers are "
                "released after the first backward (retain_graph is not supported)"
            )
        refuse_double_backward("fusedrl.policy_loss (or linear_policy_loss, distill_loss)")
        ctx.grads = None
        # Written already times the declared factor: an upstream gradient equal to it divides to
        # exactly 1 (x / x in fp32), and the gradients are left untouched.
        factor = grad_loss if ctx.declared is None else grad_loss / ctx.declared
        scaled = [None if g is None else scale_unless_one(g, factor) for g in grads]
        return None, None, None, *scaled


def attach_grad(
    logits: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor, grad_scale=None
) -> torch.Tensor:
    """`loss` whose gradient w.r.t. `logits` is `grad`, written times `grad_scale` (or None)."""
    return LossWithKnownGrads.apply(loss, (grad,), grad_scale, logits)


def attach_grads(
    loss: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], grads: tuple, grad_scale=None
) -> torch.Tensor:
    """Like attach_grad, for several inputs (hidden, weight, bias); None inputs are skipped."""
    pairs = [(x, g) for x, g in zip(inputs, grads) if x is not None]
    return LossWithKnownGrads.apply(
        loss, tuple(g for _, g in pairs), grad_scale, *(x for x, _ in pairs)
    )


def with_known_grad(logits, logits3, inplace: bool, flat_input: bool, compute, grad_scale=None):
    """Runs `compute(grad)` without autograd, where `grad` is the buffer the backend writes
    d(loss)/d(logits) into (the logits themselves when `inplace`; None when no gradient is
    wanted), and returns (loss attached to `logits` with that gradient, what compute returned).
    `compute` returns (loss, result); `logits3` is the [B, T, V] view of `logits`; the backend
    writes the gradient times `grad_scale` (None: 1)."""
    wants_grad = logits.requires_grad and torch.is_grad_enabled()
    grad = None
    if wants_grad:
        if inplace:
            check_writable(logits)
            grad = logits3
        else:
            grad = torch.empty_like(logits3, memory_format=torch.contiguous_format)
    if torch.compiler.is_compiling():
        with torch.no_grad():
            loss, result = compute(grad)
    else:  # torch.no_grad's own switch, without its context object (a microsecond a call)
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            loss, result = compute(grad)
        finally:
            torch._C._set_grad_enabled(enabled)
    if wants_grad and inplace:
        # The kernels wrote through a raw pointer: tell autograd, so that a graph that saved the
        # logits (logits = x.exp(), say) raises at backward instead of using the gradient values.
        torch.autograd.graph.increment_version(logits)
    if wants_grad:
        # Attach to the caller's tensor itself (not the [1, N, V] view made for [N, V] input) so
        # that autograd hands the gradient buffer on without a copy.
        loss = attach_grad(logits, loss, grad[0] if flat_input else grad, grad_scale)
    return loss, result


def check_writable(logits: torch.Tensor) -> None:
    """inplace=True writes one gradient per element: the logits must not alias themselves."""
    if any(stride == 0 and size > 1 for stride, size in zip(logits.stride(), logits.shape)):
        raise ValueError(
            f"inplace=True needs logits whose elements are distinct memory, got strides "
            f"{tuple(logits.stride())} for shape {tuple(logits.shape)} (an expand()ed tensor); "
            "pass inplace=False or a materialised tensor"
        )
    if torch._debug_has_internal_overlap(logits) == 1:  # 1: overlap for sure
        raise ValueError(
            f"inplace=True needs logits without overlapping elements, got strides "
            f"{tuple(logits.stride())} for shape {tuple(logits.shape)}"
        )


def wanted_grads(hidden, weight, bias) -> tuple[bool, bool, bool]:
    if not torch.is_grad_enabled():
        return False, False, False
    return (
        hidden.requires_grad,
        weight.requires_grad,
        bias is not None and bias.requires_grad,
    )


def attach_linear_grads(loss, hidden, weight, bias, flat, want, grads, grad_scale=None):
    grad_hidden = grads.hidden
    if grad_hidden is not None and flat:
        grad_hidden = grad_hidden[0]
    inputs = (hidden if want[0] else None, weight if want[1] else None, bias if want[2] else None)
    return attach_grads(loss, inputs, (grad_hidden, grads.weight, grads.bias), grad_scale)
