"""The two-row ops on the torch backend: blocks of rows of both logits, one read each, with the
signatures and outputs of the Triton kernels (kernels/two_rows.py), so that one driver serves
both (`TORCH_TWO_ROWS`; rows.py, linear.py). Memory: O(block x V) fp32, never a copy of [N, V].

Per row, with log s and log q the log-softmax of the student's and the teacher's logits / T:

    kl (reverse_kl)      D = sum s (log s - log q)          dD/dz = s (log s - log q - D) / T
    kl_rev (forward_kl)  D = sum q (log q - log s)          dD/dz = (s - q) / T
    jsd                  log m = logaddexp(log s + log(1 - beta), log q + log beta)
                         D = beta sum q (log q - log m) + (1 - beta) sum s (log s - log m)
                         dD/ds = (1 - beta) (log s - log m)  (the terms in dm cancel: sum dm = 0),
                         so dD/dz = s (g - sum s g) / T with g = (1 - beta) (log s - log m)

`aux` is sum s g for jsd (0 otherwise), as the kernels keep it between their two ops.
"""

from __future__ import annotations

import math

import torch

from ..fused_backend import TwoRowOps
from ..logit_transform import LogitTransform, banned, capped_rows
from ..row_blocks import row_blocks, rows_temperature
from ..torch_backend import (
    block_grad,
    block_log_probs,
    entropy_of,
    full_kl_grad,
    full_kl_of,
    row_sum,
)

# kernel kind -> the exact-KL direction of torch_backend ("full": KL(s || q))
_KL_DIRECTION = {"kl": "full", "kl_rev": "full_reverse"}


def _log_mixture(log_s: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.logaddexp(log_s + math.log1p(-beta), log_q + math.log(beta))


def _jsd_g(log_s: torch.Tensor, log_m: torch.Tensor, beta: float) -> torch.Tensor:
    """g = dD/ds of jsd (0 where s = 0: 0 log 0 = 0)."""
    return torch.where(log_s > -float("inf"), (1.0 - beta) * (log_s - log_m), 0.0)


def _jsd(log_s: torch.Tensor, log_q: torch.Tensor, beta: float):
    """Per-row generalized JSD and sum s g, 0 < beta < 1."""
    log_m = _log_mixture(log_s, log_q, beta)
    s, q = log_s.exp(), log_q.exp()
    # 0 log 0 = 0: a token either distribution cannot emit adds nothing on that side
    teacher_side = row_sum(torch.where(q > 0, q * (log_q - log_m), 0.0))
    student_side = row_sum(torch.where(s > 0, s * (log_s - log_m), 0.0))
    value = beta * teacher_side + (1.0 - beta) * student_side
    return value, row_sum(s * _jsd_g(log_s, log_m, beta))


def _out_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 rows, as the kernels write; fp64 for fp64 logits (so that gradcheck can run)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


@torch.no_grad()
def forward(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    temperature: float,
    kind: str,
    beta: float,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """[B, T, V] student and teacher logits -> (student logp of labels, lse of student, lse of
    teacher, D, aux, student entropy), each [B, T]; masked rows (valid False) get zeros.
    `row_temps`: [B, T] per-token temperatures, in place of `temperature`. `cap`: both rows are
    read as tanh(cap x) (a soft cap, as the Triton kernels' `cap=`; banned logits stay -inf)."""
    temperature = temperature if row_temps is None else row_temps
    batch, time, _ = student.shape
    outs = [
        torch.zeros(batch * time, dtype=_out_dtype(student), device=student.device)
        for _ in range(6)
    ]
    logp, lse_s, lse_q, value, aux, entropy = outs
    flat_labels = labels.reshape(-1)
    for start, (s_block, q_block) in row_blocks(student, teacher):
        stop = start + s_block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        s_block, q_block = _read(s_block, cap), _read(q_block, cap)
        log_s, block_lse_s = block_log_probs(s_block, rows_t)
        log_q, block_lse_q = block_log_probs(q_block, rows_t)
        if kind == "jsd":
            value[start:stop], aux[start:stop] = _jsd(log_s, log_q, beta)
        else:
            value[start:stop] = full_kl_of(
                log_s, log_q, _KL_DIRECTION[kind], banned(s_block), banned(q_block)
            )
        picked = flat_labels[start:stop].clamp(0, log_s.shape[-1] - 1)
        logp[start:stop] = log_s.gather(-1, picked[:, None]).squeeze(-1)
        lse_s[start:stop], lse_q[start:stop] = block_lse_s[:, 0], block_lse_q[:, 0]
        entropy[start:stop] = entropy_of(log_s)
    outs = [t.view(batch, time) for t in outs]
    if valid is not None:  # masked rows may hold anything (NaN padding): they must not leak
        outs = [torch.where(valid, t, 0.0) for t in outs]
    return tuple(outs)


@torch.no_grad()
def grad(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse_s: torch.Tensor,
    lse_q: torch.Tensor,
    value: torch.Tensor,
    aux: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    kind: str,
    beta: float,
    out: torch.Tensor,
    labels: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    dlogp: torch.Tensor | None = None,
    dentropy: torch.Tensor | None = None,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> None:
    """out = weight x dD/d(student) ([B, T, V]; out may be `student`), plus with `dlogp` the
    policy loss's own terms dlogp (onehot - s) / T + dentropy dH/dx. Rows with nothing to
    write get exact zeros, whatever their logits hold. `row_temps`, `cap`: as forward (the
    gradient taken through the cap)."""
    temperature = temperature if row_temps is None else row_temps
    flat = [
        None if t is None else t.reshape(-1)
        for t in (value, aux, weight, labels, entropy, dlogp, dentropy)
    ]
    flat_value, flat_aux, flat_weight, flat_labels, flat_entropy, flat_dlogp, flat_dent = flat
    for start, (s_block, q_block, out_block) in row_blocks(student, teacher, out):
        stop = start + s_block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        derivative = None
        if cap is not None:
            s_block, derivative = _capping(cap).rows(s_block, want_derivative=True)
        log_s, _ = block_log_probs(s_block, rows_t)
        log_q, _ = block_log_probs(_read(q_block, cap), rows_t)
        w = flat_weight[start:stop, None].to(log_s.dtype)
        if kind == "jsd":
            log_m = _log_mixture(log_s, log_q, beta)
            d_value = log_s.exp() * (_jsd_g(log_s, log_m, beta) - flat_aux[start:stop, None])
        else:
            d_value = full_kl_grad(log_s, log_q, flat_value[start:stop], _KL_DIRECTION[kind])
        live = w != 0
        block = torch.where(live, w * d_value / rows_t, 0.0)  # (a NaN of an unweighted +inf KL)
        if flat_dlogp is not None:
            block_dlogp = flat_dlogp[start:stop]
            block_dent = None if flat_dent is None else flat_dent[start:stop]
            block = block + block_grad(
                log_s,
                flat_labels[start:stop],
                rows_t,
                block_dlogp,
                block_dent,
                flat_entropy[start:stop],
            )
            live = live | (block_dlogp != 0)[:, None]
            if block_dent is not None:
                live = live | (block_dent != 0)[:, None]
        if derivative is not None:
            block = block * derivative
        # masked rows (nothing to write) get exact zeros, whatever their logits hold (NaN)
        out_block.copy_(torch.where(live, block, 0.0))


def _capping(cap: float) -> LogitTransform:
    """tanh(cap x) as a transform: c tanh(s x / c) with c = 1, s = cap."""
    return LogitTransform(scale=cap, softcap=1.0)


def _read(block: torch.Tensor, cap: float | None) -> torch.Tensor:
    return capped_rows(block, None if cap is None else _capping(cap))


TORCH_TWO_ROWS = TwoRowOps(forward, grad)
