"""distill_loss over two logits tensors: the two-row ops (`fusedrl.kernels.two_rows` as torch
custom ops on the Triton backend, torch_rows.py's blocks on the torch backend) read both rows once
for the per-token divergence (and the student's log-prob of its label), the [B, T] aggregation
weights are taken on the side, and the second op writes the student's gradient (jsd: one more
sweep in the forward, for log m)."""

from __future__ import annotations

import torch

from .._inputs import LossInputs
from ..config import LossConfig
from ..fused_backend import TwoRowOps, temperature_keywords
from ..logit_transform import LogitTransform
from ..token_terms import aggregation_weights, scaled_by

# distill kind -> the two-row ops' kind ("kl": KL(student || teacher))
KERNEL_KIND = {"reverse_kl": "kl", "forward_kl": "kl_rev", "jsd": "jsd"}


def distill(
    ops: TwoRowOps,
    inp: LossInputs,
    teacher: torch.Tensor,
    kind: str,
    beta: float,
    temperature: float,
    cfg: LossConfig,
    grad_out: torch.Tensor | None,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, the student's logp of the labels [B, T], the divergence per token [B, T]); writes
    d(loss)/d(student logits) into grad_out (which may be the student's logits). `kind` is
    resolved (jsd at beta 0 / 1 is a KL). `transform`: a soft cap both rows are read under."""
    code = KERNEL_KIND[kind]
    temperature, rows_t = temperature_keywords(temperature, transform=transform)
    logp, lse_s, lse_q, value, aux, _ = ops.forward(
        inp.logits, teacher, inp.labels, inp.valid, temperature, code, beta, **rows_t
    )
    agg_w = aggregation_weights(inp, cfg)  # the mask and counts alone: 0 off the counted tokens
    divergence = torch.where(inp.valid, value, 0.0)
    loss = (agg_w * divergence).sum()
    if grad_out is not None:
        ops.grad(  # (written times the caller's loss factor, `grad_scale`)
            inp.logits,
            teacher,
            lse_s,
            lse_q,
            value,
            aux,
            scaled_by(agg_w, inp.grad_scale),
            temperature,
            code,
            beta,
            grad_out,
            None,
            None,
            None,
            None,
            **rows_t,
        )
    return loss, torch.where(inp.valid, logp, 0.0), divergence


def two_row_ops(backend: str, device: torch.device):
    """The two-row ops where policy_loss's dispatch picks Triton ("triton", or "auto" on CUDA):
    the kernels of fusedrl.kernels.two_rows; else torch_rows' blocks ("cuda" is refused
    before: csrc/ has no two-row kernel)."""
    import fusedrl.backends as backends
    import fusedrl.torch_backend as torch_backend

    if backends.resolve(backend, device) is torch_backend:
        from .torch_rows import TORCH_TWO_ROWS

        return TORCH_TWO_ROWS
    from ..triton_backend import TWO_ROWS

    return TWO_ROWS
