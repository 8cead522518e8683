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


def sum_pi_squared_of(logp: torch.Tensor, sharp_logp: torch.Tensor) -> torch.Tensor:
    """sum_v pi_v^2 per token from the log-prob of any one token y at the temperature T and at
    T / 2: with z = logits / T, log pi(y) = z_y - lse(z) and log pi_{T/2}(y) = 2 z_y - lse(2 z),
    so 2 log pi(y) - log pi_{T/2}(y) = lse(2 z) - 2 lse(z) = log sum_v pi_v^2 (exact whenever
    pi(y) > 0; the sampled token's always is)."""
    return torch.exp(2.0 * logp.float() - sharp_logp.float())
