"""The token-level loss kernels' arguments, by name: one object from the driver to the launchers.

`fusedrl.fused_backend.fused_token_args` builds a `TokenLossArgs` from a call's inputs and config;
the fused loss's launchers (token_loss.py, split_rows.py), the two-pass terms launcher
(sequence_terms.py) and the CUDA extension's adapter (cuda.py) read its fields by name. A torch
custom op cannot take an object, so the ops' schemas are generated from these fields
(`op_schema`), the op is called with `keywords()` and its body rebuilds the object
(`from_keywords`): one list of the arguments, not one per layer.

NamedTuples (not dataclasses): built on every loss call, and a frozen dataclass's construction
costs microseconds that a 4k-token micro-batch's host time cannot spare. `LossVariant` is
hashable: the launchers key their per-variant work (constexprs, scalars) on it.

Pure Python: imported by the CUDA backend on machines without triton.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import NamedTuple

import torch


class LossVariant(NamedTuple):
    """The numbers and names a loss kernel is specialised or configured on: every field a
    function of the config (and of which inputs a call has), none of the data."""

    # The kernels' loss: "ppo" (every ratio-clipped loss), "dcpo" (bounds per token), "cispo",
    # "sapo", "pg" (kernels/terms.py LOSS_CODES).
    loss: str = "ppo"
    temperature: float = 1.0  # T, or T / c under a soft cap (`cap`)
    cap: float | None = None  # a soft cap's a = s / c: rows read as tanh(a x)
    dual_clip_c: float | None = None
    delta: float | None = None  # `LossConfig.delta`: the ratio capped at it (TRL's two-sided)
    tau_pos: float = 1.0  # SAPO's temperatures
    tau_neg: float = 1.0
    kl: str | None = None  # the KL estimator (its value is a metric wherever ref_logp is given)
    beta: float = 0.0
    entropy_coef: float = 0.0
    low_bound: float = 0.0  # constant ratio bounds (where `low` / `high` are not tensors)
    high_bound: float = 0.0
    # The aggregation weights are the mask weights over `agg_denominator` (or over their total
    # where that is 0), weighed in the kernel: `agg_weight` is not read.
    agg_from_mask: bool = False


# The variant's runtime numbers, in the order of the one tuple the loss kernels take
# (`loss_scalars`; kernels/terms.py names an index for each): a new number of the loss is one
# more LossVariant field and one more name here, and no kernel signature changes.
KERNEL_SCALARS = (
    "low_bound",
    "high_bound",
    "dual_clip_c",
    "delta",
    "tau_pos",
    "tau_neg",
    "beta",
    "entropy_coef",
)


def variant_scalars(variant: LossVariant) -> tuple[float, ...]:
    """The loss kernels' `loss_scalars` of a variant (an option that is off, None, as 0.0: its
    constexpr switch keeps the kernel from reading it)."""
    return tuple(float(getattr(variant, name) or 0.0) for name in KERNEL_SCALARS)


class TokenLossArgs(NamedTuple):
    """What a token-level loss kernel reads beside the logits (or the log-probs of a pass) and
    the gradient buffer. Per-token tensors are [B, T] (a chunk of flat rows: [1, n]), read on
    counted rows only (`valid`); the advantages may be strided ([B] expanded)."""

    labels: torch.Tensor
    valid: torch.Tensor  # bool: the counted tokens
    advantages: torch.Tensor
    variant: LossVariant
    agg_weight: torch.Tensor | None = None  # each token's aggregation weight (see agg_from_mask)
    mask: torch.Tensor | None = None  # the metrics' weights, bool or fp32 (None: `valid`)
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    is_weight: torch.Tensor | None = None  # the train / inference IS weights
    low: torch.Tensor | None = None  # per-token ratio bounds (DCPO; the CUDA op: every loss)
    high: torch.Tensor | None = None
    row_temps: torch.Tensor | None = None  # per-token temperatures, in place of the variant's
    entropy_coef_tensor: torch.Tensor | None = None  # a device scalar: the bonus always applies
    grad_scale_tensor: torch.Tensor | None = None  # a device scalar in place of `grad_scale`
    sum_sq: torch.Tensor | None = None  # a [B, T] fp32 buffer that gets sum_v pi_v^2 per row
    grad_scale: float = 1.0  # the factor the gradient is written times (the loss multiplier)
    agg_denominator: float = 0.0  # (agg_from_mask)
    # [B, T] fp32 sampled-set floors on the raw logits (kernels/sampling.py): each row read over
    # the logits at or above its floor and its label
    floors: torch.Tensor | None = None

    def keywords(self, names: tuple[str, ...] | None = None) -> dict:
        """The fields as an op's keywords, the variant's flattened; `names`: only those."""
        found = {**self._asdict(), **self.variant._asdict()}
        del found["variant"]
        return found if names is None else {name: found[name] for name in names}

    @classmethod
    def from_keywords(cls, keywords: dict) -> TokenLossArgs:
        """The object an op's keywords (`keywords()`) were made of."""
        variant = LossVariant(**{k: keywords[k] for k in LossVariant._fields if k in keywords})
        rest = {k: v for k, v in keywords.items() if k not in LossVariant._fields}
        return cls(**rest, variant=variant)

    def rows(self, cut: Callable[[torch.Tensor], torch.Tensor]) -> TokenLossArgs:
        """The same arguments with `cut` applied to every per-token tensor (a chunk of rows)."""
        given = {name: getattr(self, name) for name in ROW_FIELDS}
        return self._replace(**{name: cut(t) for name, t in given.items() if t is not None})

    def per_token_pointers(self, placeholder: torch.Tensor) -> tuple:
        """The per-token tensors in the loss kernels' order, labels to high, as they read them
        (an absent one as `placeholder`, which its constexpr switch keeps them from reading)."""

        def flat(t: torch.Tensor | None) -> torch.Tensor:
            return placeholder if t is None else t.float().contiguous()

        return (
            self.labels.contiguous(),
            self.valid.contiguous(),  # bool: read as is (a conversion would be one more launch)
            (self.valid if self.mask is None else self.mask).contiguous(),  # bool or fp32
            self.advantages.float(),  # strided: a [B] advantage over T is read in place
            flat(self.old_logp),
            flat(self.ref_logp),
            flat(self.is_weight),
            flat(None if self.variant.agg_from_mask else self.agg_weight),
            flat(self.low),
            flat(self.high),
        )

    def scalar_pointers(self, placeholder: torch.Tensor) -> tuple:
        """The per-token temperatures and the device scalars (entropy coefficient, grad_scale)
        as the fused kernels read them, `placeholder` where absent."""
        temps, coef, scale = self.row_temps, self.entropy_coef_tensor, self.grad_scale_tensor
        return (  # (written out: a generator costs more than the three lines)
            placeholder if temps is None else temps.float().contiguous(),
            placeholder if coef is None else coef.float().reshape(1),
            placeholder if scale is None else scale.float().reshape(1),
        )

    def presence(self) -> tuple[bool, ...]:
        """Which optional tensors are given (a launch variant's switches), in the order
        `token_loss._variant_launch` unpacks them."""
        return (
            self.old_logp is not None,
            self.ref_logp is not None,
            self.is_weight is not None,
            self.low is not None,
            self.row_temps is not None,
            self.entropy_coef_tensor is not None,
            self.sum_sq is not None,
            self.grad_scale_tensor is not None,
            self.floors is not None,
        )


# The per-token tensors (what a chunk of rows cuts).
ROW_FIELDS = (
    "labels",
    "valid",
    "advantages",
    "agg_weight",
    "mask",
    "old_logp",
    "ref_logp",
    "is_weight",
    "low",
    "high",
    "row_temps",
    "sum_sq",
    "floors",
)

# The CUDA extension's fused op takes these (csrc/bindings.cpp, FUSEDRL_FUSED_ARGS and its
# keywords): no sums, so no mask, constant bounds or grad_scale (its aggregation weights carry
# the scale, its bounds are tensors).
CUDA_FIELDS = (
    "labels",
    "valid",
    "advantages",
    "old_logp",
    "ref_logp",
    "is_weight",
    "agg_weight",
    "low",
    "high",
    "temperature",
    "loss",
    "dual_clip_c",
    "delta",
    "tau_pos",
    "tau_neg",
    "kl",
    "beta",
    "entropy_coef",
    "row_temps",
    "cap",
    "entropy_coef_tensor",
)

_SCHEMA_TYPES = {
    torch.Tensor: "Tensor",
    float: "float",
    str: "str",
    bool: "bool",
}
MUTATED = {"sum_sq": "b"}  # written by the op: its alias set in the schema


def _schema_type(hint) -> str:
    optional = type(None) in typing.get_args(hint)
    base = next(a for a in (typing.get_args(hint) or (hint,)) if a is not type(None))
    return _SCHEMA_TYPES[base] + ("?" if optional else "")


def op_schema(names: tuple[str, ...] | None = None) -> str:
    """The fields (the variant's flattened; `names`: only those, in that order) as the
    keyword-only part of a torch op schema, with the NamedTuples' defaults."""
    hints = {**typing.get_type_hints(LossVariant), **typing.get_type_hints(TokenLossArgs)}
    defaults = {**LossVariant._field_defaults, **TokenLossArgs._field_defaults}
    if names is None:
        names = tuple(n for n in TokenLossArgs._fields if n != "variant") + LossVariant._fields
    parts = []
    for name in names:
        kind = _schema_type(hints[name])
        if name in MUTATED:
            kind = kind.replace("Tensor", f"Tensor({MUTATED[name]}!)")
        part = f"{kind} {name}"
        if name in defaults:
            part += f"={defaults[name]!r}".replace("'", '"')
        parts.append(part)
    return ", ".join(parts)
