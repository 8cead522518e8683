"""`backend="triton"` of the LM-head loss: cuBLAS GEMMs around the fused row kernels.

Two designs; neither ever holds [N, V]. `FUSEDRL_LINEAR_DESIGN` picks one (read at each call, so
that bench/bench_linear.py measures both in one run):

- "gemm" (default): cuBLAS makes the logits one chunk of rows at a time ([C, V] in the hidden
  states' dtype, GRAD_CHUNK_BYTES at most, the buffer reused); the row kernels of `policy_loss`
  read the chunk and write its d(loss)/d(logits) G over it; cuBLAS takes dX = G @ W and
  dW += G.T @ X. Token-level losses need one sweep: each token's derivative depends only on its
  own logp / entropy and on weights computed before the sweep (aggregation, IS, bounds), so the
  fused kernel gives a chunk's G right after its logits: 2 + 4 = 6·N·H·V flops, the minimum, all
  in cuBLAS. Sequence-level losses sweep twice (logp first, then G): 8·N·H·V. No-grad log-probs:
  2·N·H·V. The chunk's extra traffic (write C x V, then read it twice) is small against its GEMM
  (H / 2 multiply-adds per byte).
- "on-chip": `fusedrl.kernels.linear_loss` makes each logits tile in registers (tl.dot) and folds
  it into logp / lse / entropy at once; the gradient kernel makes the tiles again and writes a
  chunk's G for the cuBLAS GEMMs: 2 + 2 + 4 = 8·N·H·V flops with a gradient, for every loss, and
  no [C, V] buffer in the no-grad path.

The bf16 logits of "gemm" are rounded to bf16 once (as the model's own LM head would round them);
"on-chip" keeps them in fp32.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from ._inputs import needs_entropy, temperature_of
from .config import LossConfig
from .fused_backend import (
    fused_token_args,
    needs_two_passes,
    temperature_keywords,
)
from .linear_torch import (
    GradSums,
    LinearGrads,
    LinearInputs,
    flat_rows,
    masked_rows,
    spread_rows,
    sweep_hidden,
)
from .row_blocks import block_rows
from .token_terms import TokenTerms, token_terms

DESIGNS = ("gemm", "on-chip")
DESIGN_ENV = "FUSEDRL_LINEAR_DESIGN"

# Largest logits / d(loss)/d(logits) chunk, in bytes: 256 MiB is 883 rows of bf16 at V = 151936,
# enough to keep the GEMMs near their peak rate while far below [N, V].
GRAD_CHUNK_BYTES = 256 * 2**20


def design(lin: LinearInputs | None = None) -> str:
    name = os.environ.get(DESIGN_ENV, "gemm")
    if name not in DESIGNS:
        raise ValueError(f"{DESIGN_ENV}={name!r} is not one of {DESIGNS}")
    if name == "on-chip" and lin is not None and lin.transform is not None:
        raise ValueError(
            f"{DESIGN_ENV}=on-chip does not apply softcap / logit_scale: its logits tiles are "
            "made in registers; unset it (the 'gemm' design applies them to each chunk)"
        )
    if name == "on-chip" and lin is not None and lin.sampling is not None:
        raise ValueError(
            f"{DESIGN_ENV}=on-chip does not replay sampling masks (top_k / top_p / min_p): its "
            "logits tiles never exist as whole rows; unset it (the 'gemm' design replays them)"
        )
    return name


def _on_chip_kernels():
    from fusedrl.kernels import check_triton_version, linear_loss

    check_triton_version()
    return linear_loss


def _row_ops():
    import fusedrl.triton_backend as triton_backend

    return triton_backend.OPS


def check_hidden_dtype(hidden: torch.Tensor) -> None:
    if hidden.dtype == torch.float64:
        raise TypeError(
            "backend='triton' takes bf16 / fp16 / fp32 hidden states, got torch.float64; "
            "use backend='torch' for fp64"
        )


def _cut(t, start: int, stop: int):
    return t[:, start:stop] if isinstance(t, torch.Tensor) else t


def _chunk_rows(lin: LinearInputs, rows: torch.Tensor) -> int:
    """Rows of a chunk: GRAD_CHUNK_BYTES of logits at most. With `lin.block_vocab` (tensor
    parallelism) sized by that width on every rank, and a whole number of the torch backend's
    row blocks, on which the sampled sets' selects run their collectives (fusedrl/tp)."""
    vocab = lin.weight.shape[0] if lin.block_vocab is None else lin.block_vocab
    size = max(1, GRAD_CHUNK_BYTES // max(1, vocab * rows.element_size()))
    if lin.block_vocab is not None:
        step = block_rows(lin.block_vocab)
        size = max(step, size // step * step)
    return size


def _chunks(lin: LinearInputs, rows: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, [stop - start, V] slice of one reused buffer in the rows' dtype) of
    consecutive row chunks (`_chunk_rows`): a slice is valid until the next one."""
    n_rows, vocab = rows.shape[0], lin.weight.shape[0]
    size = max(1, min(n_rows, _chunk_rows(lin, rows)))
    buffer = torch.empty(size, vocab, dtype=rows.dtype, device=rows.device)
    for start in range(0, n_rows, size):
        stop = min(n_rows, start + size)
        yield start, stop, buffer[: stop - start]


def _logits_chunks(
    lin: LinearInputs, rows: torch.Tensor, temperature: float, want_derivative: bool = False
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """(start, stop, logits [1, stop - start, V], dy/dx of lin.transform or None, floors or None)
    of consecutive row chunks, made by cuBLAS in one reused buffer: a chunk is valid until the
    next one is made. With `lin.transform` (softcap / logit_scale) applied to the chunk in
    place; with `lin.sampling`, the select kernel's floors of the chunk's rows ([1, n] fp32),
    through which the row kernels read the sampled sets (`floors=`: no masked write of the
    chunk); under tensor parallelism those of `lin.chunk_floors` (the sets found over the
    group). `temperature`: a float or the sweep's rows' own ([1, n], `flat_rows`)."""
    weight, bias = lin.weight, lin.bias
    sampling, labels = lin.sampling, flat_rows(lin, lin.rows.labels)
    for start, stop, out in _chunks(lin, rows):
        if bias is None:
            torch.mm(rows[start:stop], weight.t(), out=out)
        else:
            torch.addmm(bias, rows[start:stop], weight.t(), out=out)
        derivative = None
        if lin.transform is not None:
            derivative = lin.transform.apply_(out, want_derivative)
        logits = out.unsqueeze(0)
        floors = None
        if lin.chunk_floors is not None:  # tensor parallelism: the sets found over the group
            floors = lin.chunk_floors(start, stop, logits, _cut(temperature, start, stop))
        elif sampling is not None:
            scalar, rows_t = temperature_keywords(temperature, slice(start, stop))
            floors = _row_ops().sampled_floors(
                logits,
                _cut(labels, start, stop),
                scalar,
                sampling.top_k,
                sampling.top_p,
                sampling.min_p,
                **rows_t,
            )
        yield start, stop, logits, derivative, floors


def _chained(lin: LinearInputs, grad: torch.Tensor, derivative) -> torch.Tensor:
    """d(loss)/d(the head's output) of a chunk from d(loss)/d(its transformed logits)."""
    return grad if lin.transform is None else lin.transform.chain_(grad, derivative)


def _check_design_temperature(lin: LinearInputs, temperature) -> None:
    if isinstance(temperature, torch.Tensor) and design(lin) == "on-chip":
        raise ValueError(
            f"{DESIGN_ENV}=on-chip takes one temperature, not per-token ones: unset it (the "
            "'gemm' design takes them)"
        )


def stats(lin: LinearInputs, temperature, squares: bool = False):
    """logp, lse, entropy [B, T] fp32 (0 on masked rows); `temperature` a float or per-token
    ([B, T]). `squares` ("gemm" design, the log-prob calls whose rows all count): a fourth,
    sum_v pi_v^2, from the same sweep."""
    check_hidden_dtype(lin.hidden)
    _check_design_temperature(lin, temperature)
    if squares and (design(lin) != "gemm" or lin.live is not None):
        raise AssertionError("stats(squares=True) serves the gemm design's unmasked log-probs")
    shape = lin.rows.labels.shape
    labels, valid = flat_rows(lin, lin.rows.labels), flat_rows(lin, lin.rows.valid)
    if design(lin) == "on-chip":
        out = _on_chip_kernels().linear_stats(
            sweep_hidden(lin), lin.weight, lin.bias, labels, valid, temperature
        )
        return tuple(spread_rows(lin, t, shape) for t in out)
    ops = _row_ops()
    temperature = flat_rows(lin, temperature)
    outputs = 4 if squares else 3
    out = [
        torch.empty(labels.shape, dtype=torch.float32, device=labels.device) for _ in range(outputs)
    ]
    for start, stop, logits, _, floors in _logits_chunks(lin, masked_rows(lin), temperature):
        scalar, rows_t = temperature_keywords(temperature, slice(start, stop), floors=floors)
        chunk_labels = _cut(labels, start, stop)
        if squares:  # (the log-prob calls, whose rows all count)
            chunk = ops.logprobs_squares(logits, chunk_labels, scalar, rows_t.get("row_temps"))
        else:
            chunk = ops.logprobs_fwd(
                logits, chunk_labels, _cut(valid, start, stop), scalar, **rows_t
            )
        for whole, part in zip(out, chunk):
            whole[:, start:stop] = part
    return tuple(spread_rows(lin, t, shape) for t in out)


def _grad_chunks_on_chip(lin, rows, temperature, lse, entropy, dlogp, dentropy):
    """(start, stop, d(loss)/d(logits) [n, V]) of consecutive row chunks, tiles made on chip."""
    kernels = _on_chip_kernels()
    labels, lse, entropy = (flat_rows(lin, t) for t in (lin.rows.labels, lse, entropy))
    dlogp = flat_rows(lin, dlogp).float().contiguous()
    dentropy = None if dentropy is None else flat_rows(lin, dentropy).float().contiguous()
    hidden = lin.hidden if lin.live is None else rows.unsqueeze(0)  # the gathered rows, once
    for start, stop, grad in _chunks(lin, rows):
        kernels.linear_logits_grad(
            hidden,
            lin.weight,
            lin.bias,
            labels,
            lse.contiguous(),
            entropy.contiguous(),
            dlogp,
            dentropy,
            temperature,
            start,
            grad,
        )
        yield start, stop, grad


def _grad_chunks_gemm(lin, rows, temperature, lse, entropy, dlogp, dentropy):
    """(start, stop, d(loss)/d(logits) [n, V]) of consecutive row chunks: cuBLAS logits, then the
    gradient kernel writes G over them."""
    ops = _row_ops()
    labels, lse, entropy = (flat_rows(lin, t) for t in (lin.rows.labels, lse, entropy))
    dlogp = flat_rows(lin, dlogp).float()
    dentropy = None if dentropy is None else flat_rows(lin, dentropy).float()
    temperature = flat_rows(lin, temperature)
    for start, stop, logits, derivative, floors in _logits_chunks(lin, rows, temperature, True):
        scalar, rows_t = temperature_keywords(temperature, slice(start, stop), floors=floors)
        ops.logits_grad(
            logits,
            _cut(labels, start, stop),
            _cut(lse, start, stop),
            _cut(entropy, start, stop),
            _cut(dlogp, start, stop),
            _cut(dentropy, start, stop),
            scalar,
            logits,
            **rows_t,
        )
        yield start, stop, _chained(lin, logits[0], derivative)


def gradients(
    lin: LinearInputs,
    temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    want: tuple[bool, bool, bool],
) -> LinearGrads:
    _check_design_temperature(lin, temperature)
    rows = masked_rows(lin)
    sums = GradSums(lin, rows, want)
    chunks = _grad_chunks_on_chip if design(lin) == "on-chip" else _grad_chunks_gemm
    for start, stop, grad in chunks(lin, rows, temperature, lse, entropy, dlogp, dentropy):
        sums.add(start, stop, grad)
    return sums.result()


def _one_sweep(lin: LinearInputs, cfg: LossConfig, want: tuple[bool, bool, bool]):
    """Token-level losses, "gemm": per chunk, cuBLAS logits -> the fused loss kernel (logp,
    entropy, G written over the logits) -> cuBLAS dX, dW."""
    ops = _row_ops()
    args = fused_token_args(lin.rows, cfg).rows(lambda t: flat_rows(lin, t))
    rows = masked_rows(lin)
    sums = GradSums(lin, rows, want)
    shape = lin.rows.labels.shape
    flat_logp, flat_entropy = (
        torch.empty(args.labels.shape, dtype=torch.float32, device=rows.device)
        for _stat in ("logp", "entropy")
    )
    temperature = flat_rows(lin, temperature_of(lin.rows, cfg))
    for start, stop, logits, derivative, floors in _logits_chunks(lin, rows, temperature, True):
        chunk = args.rows(lambda t, start=start, stop=stop: t[:, start:stop])
        chunk = chunk if floors is None else chunk._replace(floors=floors)
        # (the chunk's sums of the loss and metrics are not used: token_terms takes them)
        flat_logp[:, start:stop], flat_entropy[:, start:stop], _ = ops.fused_token_loss_inplace(
            logits, chunk
        )
        sums.add(start, stop, _chained(lin, logits[0], derivative))
    return spread_rows(lin, flat_logp, shape), spread_rows(lin, flat_entropy, shape), sums.result()


@torch.no_grad()
def policy_loss(
    lin: LinearInputs, cfg: LossConfig, need_entropy: bool, want: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms, LinearGrads | None]:
    check_hidden_dtype(lin.hidden)
    need_entropy = need_entropy or needs_entropy(lin.rows, cfg)
    if any(want) and design(lin) == "gemm" and not needs_two_passes(lin.rows, cfg):
        logp, entropy, grads = _one_sweep(lin, cfg, want)
        entropy = entropy if need_entropy else None
        return logp, entropy, token_terms(logp, entropy, lin.rows, cfg, grads=False), grads
    temperature = temperature_of(lin.rows, cfg)
    logp, lse, entropy = stats(lin, temperature)
    terms = token_terms(logp, entropy if need_entropy else None, lin.rows, cfg)
    grads = None
    if any(want):
        grads = gradients(lin, temperature, lse, entropy, terms.dlogp, terms.dentropy, want)
    return logp, entropy if need_entropy else None, terms, grads


@torch.no_grad()
def token_logprobs(
    lin: LinearInputs, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp, lse, entropy = stats(lin, temperature)
    lin.saved_stats = (lse, entropy)  # for backward: the stats need not be swept again
    return logp, entropy if return_entropy else None


def squares_in_sweep() -> bool:
    """Whether `token_logprobs_squares` serves: the "gemm" design's row kernels sum pi^2."""
    return design() == "gemm"


@torch.no_grad()
def token_logprobs_squares(
    lin: LinearInputs, temperature, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`token_logprobs` and sum_v pi_v^2 per token from the same sweep of the head."""
    logp, lse, entropy, sum_sq = stats(lin, temperature, squares=True)
    lin.saved_stats = (lse, entropy)
    return logp, entropy if return_entropy else None, sum_sq


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
