"""What every policy-loss implementation returns (the backends and the reference alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor | None
    metrics: dict[str, torch.Tensor]
