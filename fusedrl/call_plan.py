"""Decide once, then run: a `policy_loss` call of a kind already seen goes straight to its kernels.

At a 4k-token micro-batch the loss is host-bound: a call's checks and decisions (which backend,
which path, which terms; tensor parallel or not) cost more host time than its two launches.
They depend on the call's kind alone: the config object, the backend, the tensors' types, dtypes,
shapes and devices, which inputs are given, whether a gradient is wanted. The first call of a
kind takes the general path's checks (`prepare_loss_inputs`, every message as there) and asks the
backend whether the call is one fused kernel whose own sums are the loss (`planned_call`); if so,
the decision is kept, and every call of that kind (the first included) runs `_Plan.run`: the
inputs as `prepare_loss_inputs(mask_rows=False)` leaves them (tests/test_call_plan.py compares
the two), the backend's fused call, the gradient attached. Anything else (tensor parallelism,
the options `PLANNED` does not list, torch.compile tracing, a tensor subclass) is not planned.

What a call's data decides (labels in range, mask weights, a normalizer's value) is checked on
every call, as on the general path: in the kernels, or by the same checks.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

import fusedrl.backends as backends

from ._autograd import with_known_grad
from ._inputs import (
    LossInputs,
    check_grad_scale,
    check_mask,
    check_normalizer,
    detached,
    prepare_loss_inputs,
)
from .config import LossConfig
from .output import LossOutputOfSums


class Call(NamedTuple):
    """The arguments of `fusedrl.policy_loss` a planned call may have, as the entry point gives
    them: one object from there to the plan. Every other argument must be at its default (the
    entry point checks them, tests/test_call_plan.py that the two lists cover them)."""

    logits: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    rollout_logp: torch.Tensor | None
    config: LossConfig | None
    normalizer: torch.Tensor | float | None
    backend: str
    return_entropy: bool
    grad_scale: torch.Tensor | float | None
    inplace: bool


PLANNED = Call._fields
MAX_PLANS = 64  # kinds kept (least recently used dropped): a config per step must not leak
_PLANS: OrderedDict[tuple, _Plan | None] = OrderedDict()


@dataclass(frozen=True)
class _Plan:
    """What the first call of a kind decided. `config` is held so that its id, in the key, is not
    reused while the plan lives."""

    config: LossConfig | None
    run_call: object  # the backend's planned call: (inputs, gradient buffer) -> (logp, H, terms)
    flat_input: bool  # [N, V] logits: the per-token tensors become [1, N]
    per_sequence_advantages: bool  # [B] advantages, broadcast over T
    inplace: bool  # the gradient written into the logits (checked writable on every call)

    def run(self, call: Call) -> LossOutputOfSums:
        inp = self.inputs(call)

        def compute(grad):
            logp, entropy, terms = self.run_call(inp, grad_out=grad)
            return terms.loss, (logp, entropy, terms)

        loss, (logp, entropy, terms) = with_known_grad(
            call.logits, inp.logits, self.inplace, self.flat_input, compute, inp.grad_scale
        )
        if self.flat_input:
            logp = logp[0]
            entropy = None if entropy is None else entropy[0]
        return LossOutputOfSums(loss=loss, logp=logp, entropy=entropy, metrics=terms.metrics)

    def inputs(self, call: Call) -> LossInputs:
        """`prepare_loss_inputs(..., mask_rows=False)` of a call of this kind, its metadata
        checks already passed (the kind's first call took them)."""
        logits, labels, mask = call.logits, call.labels, call.mask
        shape = labels.shape
        if mask.dtype == torch.bool:  # (its metadata is the kind's: nothing else to check)
            checked_mask = valid = detached(mask)
        else:  # a weight mask: its values, on every call
            checked_mask = check_mask(mask, shape, logits.device)
            valid = checked_mask != 0
        advantages = detached(call.advantages).float()
        if self.per_sequence_advantages:  # [B] over T: one view (unsqueeze + expand is two)
            advantages = advantages.as_strided(shape, (advantages.stride(0), 0))
        old = None if call.old_logp is None else detached(call.old_logp).float()
        ref = None if call.ref_logp is None else detached(call.ref_logp).float()
        rollout = None if call.rollout_logp is None else detached(call.rollout_logp).float()
        tensors = (logits, labels.long(), advantages, checked_mask, valid, old, ref, rollout)
        if self.flat_input:  # [N, V]: one row of tokens
            tensors = tuple(None if t is None else t.unsqueeze(0) for t in tensors)
        return LossInputs(
            *tensors,
            is_weights=None,
            normalizer=check_normalizer(call.normalizer, logits.device),
            flat_input=self.flat_input,
            rows_masked=False,
            grad_scale=check_grad_scale(call.grad_scale, logits.device),
        )


_TENSOR = torch.Tensor


def _number_or_kind(value) -> object:
    """A number's or a tensor's part of the key (False: neither, the call is not planned)."""
    if value is None:
        return None
    if type(value) is _TENSOR:
        return value.dtype, value.shape, value.device
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return "number"  # (its value checked on every call)
    return False


def _key(call: Call) -> tuple | None:
    """The call's kind; None where it is not planned. (Written out, not looped or factored: at
    a host-bound size each helper call or generator costs more than the check it makes.)"""
    logits, labels, advantages, mask, old_logp, ref_logp, rollout_logp = call[:7]
    if not (
        type(logits) is _TENSOR
        and type(labels) is _TENSOR
        and type(advantages) is _TENSOR
        and type(mask) is _TENSOR
        and logits.dim() > 0
        and (old_logp is None or type(old_logp) is _TENSOR)
        and (ref_logp is None or type(ref_logp) is _TENSOR)
        and (rollout_logp is None or type(rollout_logp) is _TENSOR)
    ):  # (subclasses: DTensor, or a mistake the general path names)
        return None
    norm, scale = _number_or_kind(call.normalizer), _number_or_kind(call.grad_scale)
    if norm is False or scale is False:
        return None
    return (
        id(call.config),
        call.backend,
        call.return_entropy,
        torch.is_grad_enabled(),
        logits.requires_grad,
        logits.stride(-1),
        norm,
        scale,
        bool(call.inplace),
        logits.dtype,
        logits.shape,
        logits.device,
        labels.dtype,
        labels.shape,
        labels.device,
        advantages.dtype,
        advantages.shape,
        advantages.device,
        mask.dtype,
        mask.shape,
        mask.device,
        None if old_logp is None else (old_logp.dtype, old_logp.shape, old_logp.device),
        None if ref_logp is None else (ref_logp.dtype, ref_logp.shape, ref_logp.device),
        None
        if rollout_logp is None
        else (rollout_logp.dtype, rollout_logp.shape, rollout_logp.device),
    )


def policy_loss(call: Call) -> LossOutputOfSums | None:
    """The planned call's output, or None where the call takes the general path."""
    if torch.compiler.is_compiling():  # (the plans are the eager host's; compile traces ops)
        return None
    key = _key(call)
    if key is None:
        return None
    plan = _PLANS.get(key, False)
    if plan is False or (plan is not None and plan.config is not call.config):
        plan = _decide(call)
        _PLANS[key] = plan
        while len(_PLANS) > MAX_PLANS:
            try:
                _PLANS.popitem(last=False)
            except KeyError:  # emptied by another thread's call meanwhile
                break
    else:
        try:
            _PLANS.move_to_end(key)
        except KeyError:  # another thread's call dropped it meanwhile: the plan still holds
            pass
    if plan is None:
        return None
    return plan.run(call)


def _decide(call: Call) -> _Plan | None:
    """The general path's checks (they raise as there) and the backend's decision."""
    cfg = call.config if call.config is not None else LossConfig()
    inp = prepare_loss_inputs(
        *call[:7], cfg, call.normalizer, mask_rows=False, grad_scale=call.grad_scale
    )
    impl = backends.resolve(call.backend, inp.logits.device)
    if not (torch.is_grad_enabled() and call.logits.requires_grad):
        return None
    run_call = impl.planned_call(inp, cfg, call.return_entropy)
    if run_call is None:
        return None
    per_sequence = call.advantages.dim() == 1 and not inp.flat_input
    return _Plan(call.config, run_call, inp.flat_input, per_sequence, bool(call.inplace))


def clear() -> None:
    """Forget every plan (tests that replace a backend's code between calls)."""
    _PLANS.clear()
