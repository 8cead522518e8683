"""distill_loss on the Triton backend: the two-row ops (`fusedrl.kernels.two_rows` as torch custom
ops, in fusedrl.triton_backend) read both rows once for the per-token divergence (and the
student's log-prob of its label), the [B, T] aggregation weights are taken on the side, and the
second op writes the student's gradient (jsd: one more sweep in the forward kernel, for log m).
The kernels' formulas are in kernels/two_rows.py."""

from __future__ import annotations

import torch

from .._inputs import LossInputs
from ..config import LossConfig
from ..token_terms import aggregation_weights
from . import resolved_kind

_KERNEL_KIND = {"reverse_kl": "kl", "forward_kl": "kl_rev", "jsd": "jsd"}


def distill(
    inp: LossInputs,
    teacher: torch.Tensor,
    kind: str,
    beta: float,
    temperature: float,
    cfg: LossConfig,
    grad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As torch_rows.distill: (loss, the student's logp [B, T], the divergence [B, T])."""
    from ..triton_backend import TWO_ROWS

    code = _KERNEL_KIND[resolved_kind(kind, beta)]
    logp, lse_s, lse_q, value, aux, _ = TWO_ROWS.forward(
        inp.logits, teacher, inp.labels, inp.valid, temperature, code, beta
    )
    agg_w = aggregation_weights(inp, cfg)  # 0 off the counted tokens
    divergence = torch.where(inp.valid, value, 0.0)
    loss = (agg_w * divergence).sum()
    if grad_out is not None:
        TWO_ROWS.grad(
            inp.logits, teacher, lse_s, lse_q, value, aux, agg_w, temperature, code, beta,
            grad_out, None, None, None, None,
        )  # fmt: skip
    return loss, torch.where(inp.valid, logp, 0.0), divergence
