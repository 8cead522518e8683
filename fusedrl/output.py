"""What every policy-loss implementation returns (the backends and the reference alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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


class MetricSlots(NamedTuple):
    """A call's metrics not yet made: named slots of one fp32 tensor of means (the fused
    kernel's sums), and the metrics already made (`extra`)."""

    means: torch.Tensor
    count: int  # the leading slots that hold metrics
    slots: tuple[tuple[str, int], ...]  # (name, slot) of each
    extra: dict[str, torch.Tensor]

    def views(self) -> dict[str, torch.Tensor]:
        views = self.means[: self.count].unbind()  # one op for all the 0-dim views
        return {**{name: views[slot] for name, slot in self.slots}, **self.extra}


class LossOutputOfSums(LossOutput):
    """A `LossOutput` whose metrics may arrive as `MetricSlots`: `metrics` makes their 0-dim
    views when first read, and is a plain dict from then on, as every other output's. At a
    4k-token micro-batch the loss is host-bound: eight views cost some 4 us of a 60 us call,
    which a caller that reads no metrics on this micro-batch does not pay."""

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        metrics = self.__dict__["metrics"]
        if isinstance(metrics, MetricSlots):
            metrics = self.__dict__["metrics"] = metrics.views()
        return metrics

    @metrics.setter
    def metrics(self, value: dict[str, torch.Tensor] | MetricSlots) -> None:
        self.__dict__["metrics"] = value


def sum_pi_squared_of(logp: torch.Tensor, sharp_logp: torch.Tensor) -> torch.Tensor:
    """sum_v pi_v^2 per token from the log-prob of any one token y at the temperature T and at
    T / 2: with z = logits / T, log pi(y) = z_y - lse(z) and log pi_{T/2}(y) = 2 z_y - lse(2 z),
    so 2 log pi(y) - log pi_{T/2}(y) = lse(2 z) - 2 lse(z) = log sum_v pi_v^2 (exact whenever
    pi(y) > 0; the sampled token's always is)."""
    return torch.exp(2.0 * logp.float() - sharp_logp.float())
