"""Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's `use_adaptive_entropy`).

The entropy bonus's coefficient is steered toward a target entropy between optimizer steps:
after each step, the mean per-token entropy of the step's tokens (over every data-parallel
rank) is compared with the target; at or below it the coefficient grows by `delta`, above it
shrinks by `delta`, within [low, high]. The bonus applies only while the last measured entropy
is at or below the target (0 before the first measurement): TRL 1.16's rule exactly.

The loss takes the coefficient as a device scalar (`fusedrl.policy_loss(entropy_coef=)`): a new
value is new data for the fused kernel, never a recompile, and setting it is no host sync. The
rule serves `fusedrl-train --entropy-target` and FusedGRPOTrainer's `use_adaptive_entropy` (on
TRL's own attributes there, so that TRL's checkpointing of them carries over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdaptiveEntropy:
    target: float  # the entropy (nats per token) the coefficient steers toward
    delta: float  # the coefficient's change per optimizer step
    low: float  # its bounds
    high: float
    coef: float  # the controller's coefficient, starting at --entropy-coef
    last_entropy: float = math.inf  # the last step's measured entropy (none yet: inf)

    def applied(self) -> float:
        """The coefficient the next step's loss uses: the controller's while the entropy is at
        or below the target, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose tokens' mean entropy was `entropy`."""
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
