"""Two LM heads swept together, no [tokens x vocab] logits: the machinery of
`linear_distill_loss` and of the exact KL of `linear_policy_loss(ref_weight=...)`.

The student's (policy's) and the teacher's (reference's) logits are made a chunk of rows at a
time by two GEMMs into two reused buffers ([C, V] each, in the hidden states' dtype, as the
models' own heads would round them); the two-row ops (Triton kernels, or torch_rows' blocks)
read both chunks once for the per-token divergence, the student's log-prob and entropy, and write
d(loss)/d(student logits) over the student's chunk, which two more GEMMs turn into dX and dW.
The teacher gets no gradient. Flops: 2·N·H·V per head forward, 4·N·H·V for dX and dW, so
8·N·H·V for a token-level loss (one sweep); sequence-level policy losses sweep twice (12·N·H·V).
Memory: the two chunk buffers (PAIR_CHUNK_BYTES together) and the [N, H] gradient, never [N, V].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .._inputs import check_lm_head, check_logits, needs_entropy, temperature_of
from ..config import LossConfig
from ..fused_backend import TwoRowOps, needs_two_passes, temperature_keywords
from ..linear_torch import (
    GradSums,
    LinearGrads,
    LinearInputs,
    flat_rows,
    masked_rows,
    spread_rows,
    token_level_derivatives,
)
from ..logit_transform import LogitTransform
from ..token_terms import (
    TokenTerms,
    aggregation_weights,
    scaled_by,
    token_terms,
    with_rejection,
)

# Both heads' logits chunks together: 256 MiB (441 rows of each at V = 151936 in bf16).
PAIR_CHUNK_BYTES = 256 * 2**20


@dataclass
class TeacherHead:
    """The second distribution's hidden states and head (no gradient)."""

    hidden: torch.Tensor  # [B, T, H'] (the student's leading shape)
    weight: torch.Tensor  # [V, H']
    bias: torch.Tensor | None  # [V]
    transform: LogitTransform | None = None  # softcap / logit_scale of its logits


def check_teacher_head(
    hidden: object,
    weight: object,
    bias: object,
    student_hidden: torch.Tensor,
    vocab: int,
    names: tuple[str, str, str],
) -> TeacherHead:
    """The teacher's (reference's) head for the student's [B, T, H] (or [N, H]) hidden states:
    the same leading shape and device, a head of the same vocabulary. `names`: (hidden,
    weight, bias) argument names for the messages."""
    hidden_name, weight_name, bias_name = names
    hidden = check_logits(hidden, name=hidden_name)
    if tuple(hidden.shape[:-1]) != tuple(student_hidden.shape[:-1]):
        raise ValueError(
            f"{hidden_name} shape {tuple(hidden.shape)} must have the leading shape "
            f"{tuple(student_hidden.shape[:-1])} of the student's hidden states (the same tokens)"
        )
    if hidden.device != student_hidden.device:
        raise ValueError(
            f"{hidden_name} is on {hidden.device} but the student's hidden states are on "
            f"{student_hidden.device}"
        )
    if hidden.dtype != student_hidden.dtype:
        raise TypeError(
            f"{hidden_name} dtype {hidden.dtype} must equal the student's hidden states' "
            f"({student_hidden.dtype}): both heads' logits share one chunk dtype"
        )
    weight, bias = check_lm_head(weight, bias, hidden, names=(weight_name, bias_name, hidden_name))
    if weight.shape[0] != vocab:
        raise ValueError(
            f"{weight_name} has {weight.shape[0]} rows but the student's head has {vocab}: both "
            "heads must cover the same vocabulary"
        )
    hidden3 = hidden.unsqueeze(0) if hidden.dim() == 2 else hidden
    detach = None if bias is None else bias.detach()
    return TeacherHead(hidden=hidden3.detach(), weight=weight.detach(), bias=detach)


def _pair_chunks(
    lin: LinearInputs, head: TeacherHead, rows: torch.Tensor, want_derivative: bool
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(start, stop, student logits [1, n, V], teacher logits [1, n, V], the student's dy/dx
    of lin.transform or None) of consecutive row chunks, each made by one GEMM into a reused
    buffer (and transformed there): valid until the next chunk. `rows`: the student's hidden
    states as the sweep's rows (`masked_rows`); the teacher's are taken alike (their padding
    may be NaN)."""
    teacher_rows = masked_rows(lin, head.hidden)
    n_rows, vocab = rows.shape[0], lin.weight.shape[0]
    size = PAIR_CHUNK_BYTES // max(1, 2 * vocab * rows.element_size())
    size = max(1, min(n_rows, size))
    buffers = [
        torch.empty(size, vocab, dtype=rows.dtype, device=rows.device)
        for _head in ("student", "teacher")
    ]
    heads = (
        (rows, lin.weight, lin.bias, lin.transform, want_derivative),
        (teacher_rows, head.weight, head.bias, head.transform, False),
    )
    for start in range(0, n_rows, size):
        stop = min(n_rows, start + size)
        outs, derivatives = [], []
        for buffer, (x, weight, bias, transform, wanted) in zip(buffers, heads):
            out = buffer[: stop - start]
            if bias is None:
                torch.mm(x[start:stop], weight.t(), out=out)
            else:
                torch.addmm(bias, x[start:stop], weight.t(), out=out)
            derivatives.append(None if transform is None else transform.apply_(out, wanted))
            outs.append(out.unsqueeze(0))
        yield start, stop, outs[0], outs[1], derivatives[0]


# (start, stop, logp [n], entropy [n]) of a chunk -> the policy loss's (dlogp, dentropy) of its
# rows ([n] each; dentropy may be None)
PolicyDerivatives = Callable[
    [int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]
]


@torch.no_grad()
def pair_sweep(
    lin: LinearInputs,
    head: TeacherHead,
    ops: TwoRowOps,
    code: str,
    beta: float,
    temperature: float | torch.Tensor,
    want: tuple[bool, bool, bool],
    weight: torch.Tensor | None = None,
    policy: PolicyDerivatives | None = None,
    saved: tuple[torch.Tensor, ...] | None = None,
) -> tuple[tuple[torch.Tensor, ...], LinearGrads | None]:
    """One pass over both heads' logits. Returns the two-row forward's six [B, T] rows (logp,
    lse_s, lse_q, D, aux, entropy; `saved`: those of an earlier pass, not computed again) and,
    when `want` asks for any, the gradients of `weight` [B, T] x D plus, with `policy`, the
    policy loss's own terms."""
    # The sweep's rows (`flat_rows`): every row, or with lin.live the live ones alone.
    labels, valid = flat_rows(lin, lin.rows.labels), flat_rows(lin, lin.rows.valid)
    shape = lin.rows.labels.shape
    if saved is None:
        # fp32 rows, as the kernels write; fp64 for fp64 input (so that gradcheck can run)
        dtype = torch.float64 if lin.hidden.dtype == torch.float64 else torch.float32
        stats = [torch.zeros_like(labels, dtype=dtype) for _ in range(6)]
    else:
        stats = [flat_rows(lin, t) for t in saved]
    flat_weight = flat_rows(lin, weight)
    temperature = flat_rows(lin, temperature)
    rows = masked_rows(lin)  # the student's sweep rows (masked ones zeroed, or skipped)
    sums = GradSums(lin, rows, want) if any(want) else None
    chunks = _pair_chunks(lin, head, rows, sums is not None)
    for start, stop, student, teacher, derivative in chunks:
        cut = [t[:, start:stop] for t in stats]
        scalar, chunk_rows_t = temperature_keywords(temperature, slice(start, stop))
        rows_labels = labels[:, start:stop]
        if saved is None:
            chunk = ops.forward(
                student,
                teacher,
                rows_labels,
                valid[:, start:stop],
                scalar,
                code,
                beta,
                **chunk_rows_t,
            )
            for whole, part in zip(cut, chunk):
                whole.copy_(part)
        if sums is None:
            continue
        logp, lse_s, lse_q, value, aux, entropy = cut
        dlogp = dentropy = None
        if policy is not None:
            dlogp, dentropy = policy(start, stop, logp[0], entropy[0])
            dlogp = dlogp.reshape(1, -1)
            dentropy = None if dentropy is None else dentropy.reshape(1, -1)
        ops.grad(
            student,
            teacher,
            lse_s,
            lse_q,
            value,
            aux,
            flat_weight[:, start:stop],
            scalar,
            code,
            beta,
            student,
            rows_labels if policy is not None else None,
            entropy if policy is not None else None,
            dlogp,
            dentropy,
            **chunk_rows_t,
        )
        grad = student[0]
        if lin.transform is not None:
            grad = lin.transform.chain_(grad, derivative)
        sums.add(start, stop, grad)
    stats = tuple(spread_rows(lin, t, shape) for t in stats)
    return stats, None if sums is None else sums.result()


_KL_CODE = {"full": "kl", "full_reverse": "kl_rev"}


@torch.no_grad()
def policy_loss_with_reference(
    lin: LinearInputs,
    head: TeacherHead,
    ops: TwoRowOps,
    cfg: LossConfig,
    need_entropy: bool,
    want: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms, LinearGrads | None]:
    """`linear_policy_loss` with config.kl="full" / "full_reverse" against the reference head:
    logp, entropy, the [B, T] terms and the gradients flagged in `want`. Token-level losses: one
    sweep (the policy's per-token derivatives of a chunk right after its forward); the others:
    a forward sweep, the terms, a gradient sweep."""
    inp = lin.rows
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    code = _KL_CODE[cfg.kl]
    temperature = temperature_of(inp, cfg)
    if any(want) and not needs_two_passes(inp, cfg):
        agg = aggregation_weights(with_rejection(inp, cfg), cfg)
        dfull_kl = scaled_by(torch.where(inp.valid, cfg.beta * agg, 0.0), inp.grad_scale)
        stats, grads = pair_sweep(
            lin,
            head,
            ops,
            code,
            0.0,
            temperature,
            want,
            dfull_kl,
            # the exact KL's share goes to the kernel as its own weight (dfull_kl): the policy's
            # per-token derivatives are those of the loss without it
            token_level_derivatives(lin, cfg.replace(kl=None, beta=0.0)),
        )
    else:
        stats, grads = pair_sweep(lin, head, ops, code, 0.0, temperature, (False,) * 3)
    logp, kl, entropy = stats[0], stats[3], stats[5] if need_entropy else None
    terms = token_terms(logp, entropy, inp, cfg, full_kl=kl)
    if any(want) and grads is None:
        dlogp_rows, dentropy_rows = flat_rows(lin, terms.dlogp), flat_rows(lin, terms.dentropy)

        def known(start, stop, logp, entropy):
            return (
                dlogp_rows[0, start:stop],
                None if dentropy_rows is None else dentropy_rows[0, start:stop],
            )

        _, grads = pair_sweep(
            lin, head, ops, code, 0.0, temperature, want, terms.dfull_kl, known, saved=stats
        )
    return logp, entropy, terms, grads
