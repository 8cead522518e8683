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
    # sum_v pi_v^2 per token ([B, T] fp32, 0 on masked tokens) when asked for
    # (return_sum_pi_squared=True), else None
    sum_pi_squared: torch.Tensor | None = None
