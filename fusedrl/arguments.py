"""The two argument objects a policy-loss call carries from its entry point to the family that
runs it: what the rollout brought (`RolloutInputs`) and how the model's head makes the policy's
logits (`ModelHead`).

An entry point (`policy_loss`, `linear_policy_loss`) builds each once, after settling its
keywords (the temperature set one way, the soft cap resolved), and hands them unchanged to
whichever family runs the call: one process (single_process, linear_single_process), packed
sequences (packed), tensor parallelism (tp/). A family that must change them (tensor
parallelism's local values, packed sequences' padded layout) makes a new one with `map`; none
spells their fields out again. `checked_inputs` is the one place they meet the argument checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._inputs import LossInputs, prepare_loss_inputs
from .config import LossConfig
from .logit_transform import LogitTransform


@dataclasses.dataclass(frozen=True)
class RolloutInputs:
    """The per-token log-probs and weights a rollout brings beside its tokens and advantages,
    each None where not given: `old_logp` (the behaviour policy's; None: on-policy),
    `ref_logp` (the reference's, for a KL penalty), `rollout_logp` (the inference engine's, for
    the train / inference correction), `prox_logp` (decoupled PPO's proximal policy),
    `is_weights` (precomputed train / inference IS weights)."""

    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    prox_logp: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    def map(self, function: Callable[[str, object], object]) -> RolloutInputs:
        """A new one, each field given (not None) replaced by `function(name, value)`."""
        changed = {
            field.name: function(field.name, value)
            for field in dataclasses.fields(self)
            if (value := getattr(self, field.name)) is not None
        }
        return dataclasses.replace(self, **changed)

    def per_token(self) -> dict[str, torch.Tensor | None]:
        """The log-probs by name: one value a token each (`is_weights` may be one a sequence)."""
        names = ("old_logp", "ref_logp", "rollout_logp", "prox_logp")
        return {name: getattr(self, name) for name in names}


@dataclasses.dataclass(frozen=True)
class ModelHead:
    """How the policy's logits come from the model's: `temperature`, per-token temperatures
    (a tensor) or None for config.temperature (the entry point moves a number there: one
    way to set it); `transform`, the soft cap the kernels apply as they read a row, or None."""

    temperature: torch.Tensor | None = None
    transform: LogitTransform | None = None

    def map_temperature(self, function: Callable[[torch.Tensor], object]) -> ModelHead:
        """A new one, per-token temperatures (if any) replaced by `function(temperature)`."""
        if self.temperature is None:
            return self
        return dataclasses.replace(self, temperature=function(self.temperature))


def checked_inputs(
    rows,
    labels,
    advantages,
    mask,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig,
    normalizer,
    **checks,
) -> LossInputs:
    """`prepare_loss_inputs` of a call's arguments as the families hold them: `rows`, the
    logits (or hidden states, `source="hidden"`); `checks`, its keyword options (`source=`,
    `vocab=`, `mask_rows=`, `ref_logits=`, ...)."""
    return prepare_loss_inputs(
        rows,
        labels,
        advantages,
        mask,
        rollout.old_logp,
        rollout.ref_logp,
        rollout.rollout_logp,
        config,
        normalizer,
        rollout.is_weights,
        prox_logp=rollout.prox_logp,
        temperature=head.temperature,
        # the transform the backend applies as it reads the logits; from hidden states, the
        # LM-head form applies it as it makes each chunk of logits (`LinearInputs.transform`)
        transform=head.transform if checks.get("source", "logits") == "logits" else None,
        **checks,
    )
