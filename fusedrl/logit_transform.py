"""What some models do to the LM head's output before the softmax: a logit scale (Cohere's
`logit_scale`, Granite's 1 / `logits_scaling`) and a soft cap (Gemma 2/3's
`final_logit_softcapping`):

    y = c tanh(s x / c)        (s x without a cap)        dy/dx = s (1 - (y / c)^2)

The LM-head losses apply it to each chunk of logits they make (in the logits' dtype, as the
model's own forward does) and multiply the chunk's d(loss)/d(y) by dy/dx before the GEMMs that
take it to the hidden states and the head; the temperature divides y afterwards, as vLLM's
sampler divides the model's final logits.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitTransform:
    scale: float = 1.0  # s
    softcap: float | None = None  # c; None: no cap

    def apply_(self, logits: torch.Tensor, want_derivative: bool) -> torch.Tensor | None:
        """y = transform(x) in place on a chunk of logits; with `want_derivative`, dy/dx (a
        tensor like `logits`) or, for a bare scale, None (the caller multiplies by `scale`)."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is None:
            return None
        logits.div_(self.softcap).tanh_()
        derivative = None
        if want_derivative:
            # 1 - tanh^2, from the tanh itself: no second transcendental per element
            derivative = torch.addcmul(torch.ones_like(logits), logits, logits, value=-1.0)
            if self.scale != 1.0:
                derivative.mul_(self.scale)
        logits.mul_(self.softcap)
        return derivative

    def rows(self, block: torch.Tensor, want_derivative: bool = False):
        """y = transform(x) of a block of the caller's logits, in fp32 (fp64 stays fp64), not in
        place; with `want_derivative`, (y, dy/dx). Under a cap a banned logit (`banned`) stays
        -inf, as in the kernels (`kernels/rows.capped`), instead of becoming -c; its derivative
        is 0."""
        dtype = torch.float64 if block.dtype == torch.float64 else torch.float32
        work = block.to(dtype, copy=True)  # (apply_ works in place)
        derivative = self.apply_(work, want_derivative)
        if self.softcap is not None:
            work = work.masked_fill(banned(block), float("-inf"))
        if not want_derivative:
            return work
        if derivative is None:
            derivative = torch.full_like(work, self.scale)
        return work, derivative

    def chain_(self, grad: torch.Tensor, derivative: torch.Tensor | None) -> torch.Tensor:
        """d(loss)/dx = d(loss)/dy dy/dx, in place on `grad` (d(loss)/dy of the chunk)."""
        if derivative is not None:
            return grad.mul_(derivative)
        if self.scale != 1.0:
            return grad.mul_(self.scale)
        return grad


def capped_rows(block: torch.Tensor, transform: LogitTransform | None) -> torch.Tensor:
    """`transform.rows(block)`, or the block as it is without a transform."""
    return block if transform is None else transform.rows(block)


def banned(logits: torch.Tensor) -> torch.Tensor:
    """Where a logit bans its token under a soft cap: -inf, or the lowest finite value of its
    dtype (-finfo.max, as attention-style masks write it), which the cap would otherwise turn
    into -c, a probability > 0."""
    return logits <= -torch.finfo(logits.dtype).max


def check_logit_transform(
    softcap: object = None, logit_scale: object = None
) -> LogitTransform | None:
    """The transform of `softcap=` / `logit_scale=` (None where both leave the logits as they
    are)."""
    for name, value in (("softcap", softcap), ("logit_scale", logit_scale)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a number or None, got {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    scale = 1.0 if logit_scale is None else float(logit_scale)
    cap = None if softcap is None else float(softcap)
    # The kernels multiply by s and read tanh(a x), a = s / c, in fp32: a factor that is not a
    # normal fp32 number would read every logit as inf, or (a subnormal, flushed to 0) as 0.
    fp32 = torch.finfo(torch.float32)
    for name, factor in (("logit_scale", scale), ("logit_scale / softcap", scale / (cap or 1.0))):
        if not fp32.tiny <= factor <= fp32.max:
            raise ValueError(
                f"{name} must be a normal float32 number (in [{fp32.tiny:.3g}, {fp32.max:.3g}]), "
                f"got {factor!r}"
            )
    if scale == 1.0 and cap is None:
        return None
    return LogitTransform(scale=scale, softcap=cap)


def capping_keywords(transform: LogitTransform | None) -> dict:
    """`softcap=` / `logit_scale=` of the logits entry points that give `transform` back."""
    if transform is None:
        return {}
    scale = None if transform.scale == 1.0 else transform.scale
    return {"softcap": transform.softcap, "logit_scale": scale}


def model_logit_transform(model) -> dict[str, float | None]:
    """softcap / logit_scale of a transformers model's LM head output, from its config
    (Gemma 2/3 `final_logit_softcapping`, Cohere `logit_scale`, Granite `logits_scaling`):
    keyword arguments for the LM-head losses."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    divide = getattr(text, "logits_scaling", None)
    if divide not in (None, 1, 1.0):
        scale = (1.0 if scale is None else scale) / divide
    return {
        "softcap": None if softcap in (None, 0) else float(softcap),
        "logit_scale": None if scale in (None, 1, 1.0) else float(scale),
    }
