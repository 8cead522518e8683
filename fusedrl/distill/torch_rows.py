"""distill_loss on the torch backend: blocks of rows of both logits, one read each, the student's
gradient written from the same blocks (no fp32 copy of [N, V] beyond a block).

Per row, with log s and log q the log-softmax of the student's and the teacher's logits / T:

    reverse_kl   D = sum s (log s - log q)           dD/dz = s (log s - log q - D) / T
    forward_kl   D = sum q (log q - log s)           dD/dz = (s - q) / T
    jsd          log m = logaddexp(log s + log(1 - beta), log q + log beta)
                 D = beta sum q (log q - log m) + (1 - beta) sum s (log s - log m)
                 dD/ds = (1 - beta) (log s - log m)  (the terms in dm cancel: sum dm = 0), so
                 dD/dz = s (g - sum s g) / T with g = (1 - beta) (log s - log m)

jsd with beta = 0 or 1 is forward_kl or reverse_kl (TRL's and Liger's endpoints).
"""

from __future__ import annotations

import math

import torch

from .._inputs import LossInputs
from ..config import LossConfig
from ..token_terms import aggregation_weights
from ..torch_backend import block_log_probs, full_kl_grad, full_kl_of, row_blocks, row_sum
from . import resolved_kind

# kind -> the exact-KL direction of torch_backend ("full": KL(pi || ref), pi the student)
_KL_DIRECTION = {"reverse_kl": "full", "forward_kl": "full_reverse"}


def _jsd(log_s: torch.Tensor, log_q: torch.Tensor, beta: float):
    """Per-row generalized JSD and its gradient in logits / T, 0 < beta < 1."""
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_q + math.log(beta))
    s, q = log_s.exp(), log_q.exp()
    # 0 log 0 = 0: a token either distribution cannot emit adds nothing on that side
    teacher_side = row_sum(torch.where(q > 0, q * (log_q - log_m), 0.0))
    student_side = row_sum(torch.where(s > 0, s * (log_s - log_m), 0.0))
    value = beta * teacher_side + (1.0 - beta) * student_side
    g = torch.where(s > 0, (1.0 - beta) * (log_s - log_m), 0.0)
    grad = s * (g - row_sum(s * g)[:, None])
    return value, grad


def distill(
    inp: LossInputs,
    teacher: torch.Tensor,
    kind: str,
    beta: float,
    temperature: float,
    cfg: LossConfig,
    grad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, the student's logp of the labels [B, T], the divergence per token [B, T]); writes
    d(loss)/d(student logits) into grad_out (which may be the student's logits)."""
    kind = resolved_kind(kind, beta)
    agg_w = aggregation_weights(inp, cfg)  # the mask and counts alone: known before the pass
    batch, time, _ = inp.logits.shape
    logp = torch.zeros(batch * time, dtype=torch.float32, device=inp.logits.device)
    divergence = torch.zeros_like(logp)
    flat_w = agg_w.reshape(-1)
    flat_labels = inp.labels.reshape(-1)
    tensors = (inp.logits, teacher) if grad_out is None else (inp.logits, teacher, grad_out)
    for start, (student_block, teacher_block, *out_block) in row_blocks(*tensors):
        stop = start + student_block.shape[0]
        log_s, _ = block_log_probs(student_block, temperature)
        log_q, _ = block_log_probs(teacher_block, temperature)
        if kind == "jsd":
            value, grad = _jsd(log_s, log_q, beta)
        else:
            direction = _KL_DIRECTION[kind]
            value = full_kl_of(log_s, log_q, direction)
            grad = full_kl_grad(log_s, log_q, value, direction) if out_block else None
        divergence[start:stop] = value
        logp[start:stop] = log_s.gather(-1, flat_labels[start:stop, None]).squeeze(-1)
        if out_block:
            weight = flat_w[start:stop, None]
            # masked rows (weight 0) get exact zeros, whatever their logits hold (NaN padding)
            out_block[0].copy_(torch.where(weight != 0, weight * grad / temperature, 0.0))
    valid = inp.valid.reshape(-1)
    divergence = torch.where(valid, divergence, 0.0).view(batch, time)
    logp = torch.where(valid, logp, 0.0).view(batch, time)
    loss = (agg_w * divergence).sum()
    return loss, logp, divergence
