"""`backend="triton"` of the LM-head loss: `fusedrl.kernels.linear_loss` plus cuBLAS GEMMs.

Every preset takes the same three steps, none of which holds [N, V]:

1. the stats kernel: logits tiles made on chip, folded into logp, lse and entropy per row;
2. `token_terms` on the [B, T] scalars: the loss, the metrics and d(loss)/d(logp), d(loss)/d(H);
3. per chunk of rows (GRAD_CHUNK_BYTES of gradient): the gradient kernel recomputes the tiles
   and writes the chunk's d(loss)/d(logits) G; dX = G @ W and dW += G.T @ X (fp32 accumulation
   across chunks for fp32 heads; one rounding per chunk in the head's dtype otherwise).

That is 2 + 2 + 4 = 8·N·H·V flops (the logits twice, then the two gradient GEMMs).
"""

from __future__ import annotations

import torch

from .config import LossConfig
from .linear_torch import LinearGrads, LinearInputs
from .token_terms import TokenTerms, token_terms

# Largest d(loss)/d(logits) chunk, in bytes: 256 MiB is 16 x 8 MiB rows of bf16 at V = 151936...
# about 880 rows, enough to keep the GEMMs near their peak rate while far below [N, V].
GRAD_CHUNK_BYTES = 256 * 2**20


def _kernels():
    from fusedrl.kernels import check_triton_version, linear_loss

    check_triton_version()
    return linear_loss


def _check_dtype(lin: LinearInputs) -> None:
    if lin.hidden.dtype == torch.float64:
        raise TypeError(
            "backend='triton' takes bf16 / fp16 / fp32 hidden states, got torch.float64; "
            "use backend='torch' for fp64"
        )


def stats(lin: LinearInputs, temperature: float):
    """logp, lse, entropy [B, T] fp32 (0 on masked rows)."""
    _check_dtype(lin)
    return _kernels().linear_stats(
        lin.hidden, lin.weight, lin.bias, lin.rows.labels, lin.rows.valid, temperature
    )


def _chunk_rows(vocab: int, elem_bytes: int) -> int:
    return max(1, GRAD_CHUNK_BYTES // max(1, vocab * elem_bytes))


def gradients(
    lin: LinearInputs,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    want: tuple[bool, bool, bool],
) -> LinearGrads:
    kernels = _kernels()
    hidden, weight, bias = lin.hidden, lin.weight, lin.bias
    batch, time, hidden_size = hidden.shape
    n_rows, vocab = batch * time, weight.shape[0]
    want_x, want_w, want_b = want[0], want[1], want[2] and bias is not None
    # The rows as [N, H], masked ones zeroed: their gradient rows are 0, but 0 x NaN padding is
    # NaN in dW's GEMM.
    rows = None
    if want_w:
        valid = lin.rows.valid.reshape(-1, 1)
        rows = torch.where(valid, hidden.reshape(n_rows, hidden_size), 0)
    dx = torch.empty(n_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
    acc = torch.float32
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    db = torch.zeros(vocab, dtype=acc, device=weight.device) if want_b else None
    chunk = min(n_rows, _chunk_rows(vocab, hidden.element_size()))
    grad = torch.empty(max(chunk, 1), vocab, dtype=hidden.dtype, device=hidden.device)
    labels = lin.rows.labels
    dlogp = dlogp.float().contiguous()
    dentropy = None if dentropy is None else dentropy.float().contiguous()
    for start in range(0, n_rows, max(chunk, 1)):
        stop = min(n_rows, start + chunk)
        g = grad[: stop - start]
        kernels.linear_logits_grad(
            hidden, weight, bias, labels, lse, entropy, dlogp, dentropy, temperature, start, g
        )
        if want_x:
            torch.mm(g, weight, out=dx[start:stop])
        if want_w:
            if g.dtype == acc:
                dw.addmm_(g.t(), rows[start:stop])
            else:
                dw += g.t() @ rows[start:stop]
        if want_b:
            db += g.sum(0, dtype=acc)
    return LinearGrads(
        hidden=dx.view(hidden.shape) if want_x else None,
        weight=None if dw is None else dw.to(weight.dtype),
        bias=None if db is None else db.to(bias.dtype),
    )


@torch.no_grad()
def policy_loss(
    lin: LinearInputs, cfg: LossConfig, need_entropy: bool, want: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms, LinearGrads | None]:
    need_entropy = need_entropy or cfg.needs_entropy
    logp, lse, entropy = stats(lin, cfg.temperature)
    terms = token_terms(logp, entropy if need_entropy else None, lin.rows, cfg)
    grads = None
    if any(want):
        grads = gradients(lin, cfg.temperature, lse, entropy, terms.dlogp, terms.dentropy, want)
    return logp, entropy if need_entropy else None, terms, grads


@torch.no_grad()
def token_logprobs(
    lin: LinearInputs, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp, lse, entropy = stats(lin, temperature)
    lin.saved_stats = (lse, entropy)  # for backward: the stats need not be swept again
    return logp, entropy if return_entropy else None


@torch.no_grad()
def backward(
    lin: LinearInputs,
    labels: torch.Tensor,
    temperature: float,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    want: tuple[bool, bool, bool],
) -> LinearGrads:
    lse, entropy = lin.saved_stats if lin.saved_stats is not None else stats(lin, temperature)[1:]
    return gradients(lin, temperature, lse, entropy, dlogp, dentropy, want)
