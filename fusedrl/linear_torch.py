"""`backend="torch"` of the LM-head loss: the logits exist one block of rows at a time.

A block of rows of the hidden states becomes a [n, V] block of logits (F.linear in the inputs'
dtype, then fp32), which gives the log-prob, lse and entropy of its rows and, once d(loss)/d(logp)
and d(loss)/d(H) of those rows are known, d(loss)/d(logits) of the block; two GEMMs turn that into
the block's dX (written) and its share of dW (accumulated in fp32, cast once at the end). Extra
memory is O(block x V) fp32 plus one fp32 [V, H] accumulator, never O(N x V).

- token-level losses: one sweep. Each token's derivative depends only on its own logp / entropy
  and on weights computed before the sweep (aggregation, IS), so a block's gradient follows its
  logits at once: 3 GEMMs of 2·n·H·V flops each.
- sequence-level losses (GSPO, GMPO, sequence IS) and on-policy configs whose weights need
  old = logp: a sweep for logp / entropy, the [B, T] terms, then a second sweep: 4 GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ._inputs import LossInputs, needs_entropy, temperature_of
from .config import LossConfig
from .fused_backend import needs_two_passes
from .logit_transform import LogitTransform
from .row_blocks import row_blocks, rows_temperature
from .sampling import SamplingMask
from .token_terms import (
    TokenTerms,
    aggregation_weights,
    resolve_is_weights,
    token_terms,
    with_rejection,
)
from .torch_backend import block_floor, block_grad, block_log_probs, block_stats


@dataclass
class LinearInputs:
    """The checked arguments of the LM-head loss."""

    hidden: torch.Tensor  # [B, T, H] view of the caller's hidden states
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None  # [V]
    rows: LossInputs  # every per-token tensor as [B, T] (rows.logits is None)
    saved_stats: tuple | None = None  # (lse, entropy) kept by a backend for backward
    # vLLM's top_k / top_p / min_p: logp and entropy over the sampled sets (None: the vocab)
    sampling: SamplingMask | None = None
    # floors of the sampled sets of the sweep's rows ([B * T], or [n] with `live`), found by the
    # first sweep for the second
    saved_floors: torch.Tensor | None = None
    # (logits block, temperature, sampling) -> the block's floors; tensor parallelism finds them
    # over the group (fusedrl/tp/sampling.py)
    find_floors: Callable = block_floor
    # the vocab width that sizes the row blocks (None: the weight's rows); tensor parallelism
    # gives every rank the widest slice's, so that the ranks' blocks (and collectives) line up
    block_vocab: int | None = None
    # backend="triton": (start, stop, logits [1, n, V], temperature) -> the chunk's rows'
    # sampled-set floors on it ([1, n] fp32), instead of the select kernel's (tensor parallelism:
    # the sets found over the group)
    chunk_floors: Callable | None = None
    # softcap / logit_scale applied to each block or chunk of logits (fusedrl.logit_transform)
    transform: LogitTransform | None = None
    # skip_masked_rows: the flat indices (ascending, int64) of the rows whose logits are made;
    # the sweeps walk these alone and every other row gets logp = entropy = 0 and no gradient,
    # as a masked row does anyway. None: every row.
    live: torch.Tensor | None = None


@dataclass
class LinearGrads:
    """d(loss)/d(hidden, weight, bias); None where that input needs no gradient."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


# (first row, stop, logp, entropy) of a block of the sweep's rows (flat rows, or with
# LinearInputs.live the live ones) -> (dlogp, dentropy) of its rows, or None
RowDerivatives = Callable[
    [int, int, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None],
]


def _grad_buffers(lin: LinearInputs, hidden: torch.Tensor, want: tuple[bool, bool, bool]):
    """dX like `hidden` (each row written once); dW and db accumulate in fp32."""
    want_x, want_w, want_b = want
    acc = _accumulator_dtype(hidden)
    dx = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    dw = torch.zeros(lin.weight.shape, dtype=acc, device=lin.weight.device)
    db = torch.zeros(lin.weight.shape[0], dtype=acc, device=lin.weight.device)
    want_b = want_b and lin.bias is not None
    return dx if want_x else None, dw if want_w else None, db if want_b else None


def _accumulator_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 input (so that the whole loss can be gradchecked)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def masked_rows(lin: LinearInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden states as [N, H] with masked rows zeroed: whatever padding they hold (NaN), their
    logits are then finite and they add 0 to dW (0 x NaN would be NaN in its GEMM). With
    `lin.live`, the live rows alone ([n, H], gathered by (sequence, position) so that a strided
    [B, P+T, H] view is not copied whole first). `hidden`: another model's [B, T, H'] states of
    the same tokens (a teacher's, a reference's) in place of `lin.hidden`."""
    hidden = lin.hidden if hidden is None else hidden
    if lin.live is not None:
        time = hidden.shape[1]
        return hidden[lin.live // time, lin.live % time]
    flat = hidden.reshape(-1, hidden.shape[-1])
    return torch.where(lin.rows.valid.reshape(-1, 1), flat, 0)


def sweep_hidden(lin: LinearInputs) -> torch.Tensor:
    """The hidden states the sweeps read as [B, T, H]: the caller's, or with `lin.live` the live
    rows' as [1, n, H]."""
    return lin.hidden if lin.live is None else masked_rows(lin).unsqueeze(0)


def live_row_indices(valid: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """The flat indices of the rows where `valid` ([B, T] bool), ascending. `count` (the caller's
    number of such rows, known on its host) spares the host the wait for the device that
    torch.nonzero costs: a stable sort puts the valid rows first, in order, and the first
    `count` are taken (any torch, any device). A wrong count is a device-side assert (raised at
    once on CPU, at the next sync on CUDA); where device asserts are compiled out (ROCm's
    default) a count too high adds masked rows, which change nothing, and one too low drops
    live rows from the loss."""
    flat = valid.reshape(-1)
    if count is None:
        return flat.nonzero().squeeze(1)
    if count > flat.numel():
        raise ValueError(f"live_rows={count} exceeds the {flat.numel()} rows of the batch")
    torch._assert_async(
        flat.sum() == count, "live_rows does not equal the number of rows whose mask is nonzero"
    )
    order = torch.sort((~flat).to(torch.uint8), stable=True).indices
    return order[:count]


def flat_rows(lin: LinearInputs, t):
    """A [B, T] per-token tensor as the [1, n] rows the sweeps walk: every row, or with
    `lin.live` the live rows' values (a gather of n elements). Non-tensors pass through."""
    if not isinstance(t, torch.Tensor):
        return t
    flat = t.reshape(1, -1)
    return flat if lin.live is None else flat[:, lin.live]


def spread_rows(lin: LinearInputs, rows: torch.Tensor, shape) -> torch.Tensor:
    """The sweeps' per-row results ([1, n, ...] or [n, ...]) as a tensor of `shape` ([B, T, ...]):
    a view, or with `lin.live` scattered into zeros (skipped rows: 0, as masked rows are)."""
    if lin.live is None:
        return rows.view(shape)
    tail = tuple(shape[2:])
    out = rows.new_zeros((shape[0] * shape[1],) + tail)
    out.index_copy_(0, lin.live, rows.reshape((-1,) + tail))
    return out.view(shape)


class GradSums:
    """dX written chunk by chunk, dW and db accumulated in fp32 (fp64 for fp64 input) over the
    chunks' d(loss)/d(logits), for the backends that make the logits a chunk of rows at a time."""

    def __init__(self, lin: LinearInputs, rows: torch.Tensor, want: tuple[bool, bool, bool]):
        self.lin, self.rows = lin, rows
        weight, bias = lin.weight, lin.bias
        acc = _accumulator_dtype(rows)
        self.dx = torch.empty_like(rows) if want[0] else None
        self.dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want[1] else None
        want_b = want[2] and bias is not None
        self.db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if want_b else None

    def add(self, start: int, stop: int, grad: torch.Tensor) -> None:
        """grad: d(loss)/d(logits) of rows [start, stop), [n, V] in the head's dtype."""
        if self.dx is not None:
            torch.mm(grad, self.lin.weight, out=self.dx[start:stop])
        if self.dw is not None:
            if grad.dtype == self.dw.dtype:
                self.dw.addmm_(grad.t(), self.rows[start:stop])
            else:  # one rounding per chunk in the head's dtype, then fp32 accumulation
                self.dw += grad.t() @ self.rows[start:stop]
        if self.db is not None:
            self.db += grad.sum(0, dtype=self.db.dtype)

    def result(self) -> LinearGrads:
        lin = self.lin
        return LinearGrads(
            hidden=None if self.dx is None else spread_rows(lin, self.dx, lin.hidden.shape),
            weight=None if self.dw is None else self.dw.to(lin.weight.dtype),
            bias=None if self.db is None else self.db.to(lin.bias.dtype),
        )


@torch.no_grad()
def sweep(
    lin: LinearInputs,
    labels: torch.Tensor,
    temperature: float,
    need_entropy: bool,
    derivatives: RowDerivatives | None = None,
    want: tuple[bool, bool, bool] = (False, False, False),
    *,
    lse_out: torch.Tensor | None = None,
    whole_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, LinearGrads | None]:
    """One pass over the vocab: logp [B, T] and entropy of every row, and with `derivatives` the
    gradients of the inputs flagged in `want` (hidden, weight, bias).

    When `weight` is a vocab slice of the head (tensor parallelism, fusedrl/tp): `lse_out`
    ([B * T]) receives each row's lse over the slice (0 on rows `lin.live` skips); given
    `whole_rows` = (lse, entropy) [B, T]
    of the whole rows, the gradient is the slice of the whole rows' (labels < 0: in another
    slice), and logp / entropy are left at 0."""
    weight, bias = lin.weight, lin.bias
    shape = lin.hidden.shape[:2]
    hidden = sweep_hidden(lin)
    n_rows = hidden.shape[0] * hidden.shape[1]
    # The sweep's rows: with lin.live the live ones alone (`flat_rows`), their lse spread back
    if whole_rows is not None:
        whole_rows = tuple(flat_rows(lin, t).reshape(-1) for t in whole_rows)
    rows_lse = None
    if lse_out is not None:
        rows_lse = lse_out if lin.live is None else lse_out.new_zeros(n_rows)
    vocab = weight.shape[0] if lin.block_vocab is None else lin.block_vocab
    acc = _accumulator_dtype(hidden)
    logp = torch.zeros(n_rows, dtype=acc, device=hidden.device)
    entropy = torch.zeros_like(logp) if need_entropy else None
    no_grads = (None, None, None)
    dx, dw, db = _grad_buffers(lin, hidden, want) if derivatives is not None else no_grads
    valid = flat_rows(lin, lin.rows.valid).reshape(-1)
    flat_labels = flat_rows(lin, labels).reshape(-1)
    temperature = flat_rows(lin, temperature)
    find_floors = lin.sampling is not None and lin.saved_floors is None
    if find_floors:
        lin.saved_floors = torch.empty(n_rows, dtype=acc, device=hidden.device)
    tensors = (hidden,) if dx is None else (hidden, dx)
    for start, blocks in row_blocks(*tensors, vocab=vocab):
        stop = start + blocks[0].shape[0]
        live = valid[start:stop, None]
        # Masked rows may hold anything (NaN padding): zero them so that they reach no sum.
        h = torch.where(live, blocks[0], 0.0)
        logits = torch.nn.functional.linear(h, weight, bias)
        derivative = None
        if lin.transform is not None:
            derivative = lin.transform.apply_(logits, derivatives is not None)
        rows_t = rows_temperature(temperature, start, stop)
        floor = None
        if lin.sampling is not None:
            floor = lin.saved_floors[start:stop]
            if find_floors:
                floor.copy_(lin.find_floors(logits, rows_t, lin.sampling))
        log_probs, lse = block_log_probs(
            logits, rows_t, flat_labels[start:stop], lin.sampling, floor
        )
        del logits  # log_probs replaces it: one [n, V] block less at the peak
        if rows_lse is not None:
            rows_lse[start:stop] = lse[:, 0]
        if whole_rows is not None:
            # Rebased on the whole rows' lse. A slice of a row with no mass (all -inf here, or
            # outside the sampled set) has lse -inf and log_probs -inf - -inf = NaN: p = 0.
            log_probs += lse - whole_rows[0][start:stop, None]
            log_probs.masked_fill_(lse == -float("inf"), -float("inf"))
            block_entropy = whole_rows[1][start:stop]
        else:
            block_logp, block_entropy = block_stats(
                log_probs, lse, flat_labels[start:stop], need_entropy
            )
            logp[start:stop] = torch.where(live[:, 0], block_logp, 0.0)
            if entropy is not None:
                entropy[start:stop] = torch.where(live[:, 0], block_entropy, 0.0)
        if derivatives is None:
            continue
        dlogp, dentropy = derivatives(start, stop, logp[start:stop], block_entropy)
        grad = block_grad(
            log_probs, flat_labels[start:stop], rows_t, dlogp, dentropy, block_entropy
        )
        if lin.transform is not None:
            grad = lin.transform.chain_(grad, derivative)
        if dx is not None:
            blocks[1].copy_(grad.to(weight.dtype) @ weight)
        if dw is not None:
            dw.addmm_(grad.t(), h.to(acc))
        if db is not None:
            db += grad.sum(0)
    if rows_lse is not None and lin.live is not None:
        lse_out.copy_(spread_rows(lin, rows_lse, (1, lse_out.numel())).view(-1))
    grads = None
    if derivatives is not None:
        grads = LinearGrads(
            hidden=None if dx is None else spread_rows(lin, dx, lin.hidden.shape),
            weight=None if dw is None else dw.to(weight.dtype),
            bias=None if db is None else db.to(bias.dtype),
        )
    logp = spread_rows(lin, logp, shape)
    return logp, None if entropy is None else spread_rows(lin, entropy, shape), grads


def _rows_slice(lin: LinearInputs, inp: LossInputs, start: int, stop: int, **fields) -> LossInputs:
    """Rows [start, stop) of the sweep's rows (`flat_rows`) of every per-token tensor, as a
    [1, n] batch."""

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else flat_rows(lin, t)[:, start:stop]

    sliced = {
        name: cut(getattr(inp, name))
        for name in ("labels", "advantages", "mask", "valid", "old_logp", "ref_logp", "agg_weights")
    }
    return replace(inp, **sliced, rollout_logp=None, **fields)


def token_level_derivatives(lin: LinearInputs, cfg: LossConfig) -> RowDerivatives:
    """Per-token d(loss)/d(logp), d(loss)/d(H) of a block, with the weights that do not depend on
    the logits (aggregation, IS) computed once for the whole batch."""
    inp = lin.rows
    agg = flat_rows(lin, aggregation_weights(with_rejection(inp, cfg), cfg))
    # One sweep only when these need no logp (fused_backend.needs_two_passes).
    flat_is = flat_rows(lin, resolve_is_weights(inp.old_logp, inp, cfg))

    def derivatives(start, stop, logp, entropy):
        block = _rows_slice(
            lin, inp, start, stop, is_weights=None if flat_is is None else flat_is[:, start:stop]
        )
        ent = None if entropy is None else entropy[None]
        terms = token_terms(logp[None], ent, block, cfg, agg_weights=agg[:, start:stop])
        return terms.dlogp[0], None if terms.dentropy is None else terms.dentropy[0]

    return derivatives


@torch.no_grad()
def policy_loss(
    lin: LinearInputs, cfg: LossConfig, need_entropy: bool, want: tuple[bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms, LinearGrads | None]:
    """logp, entropy, the [B, T] terms (loss, metrics) and the gradients flagged in `want`."""
    inp = lin.rows
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    temperature = temperature_of(inp, cfg)
    if any(want) and not needs_two_passes(inp, cfg):
        derivatives = token_level_derivatives(lin, cfg)
        logp, entropy, grads = sweep(lin, inp.labels, temperature, need_entropy, derivatives, want)
        return logp, entropy, token_terms(logp, entropy, inp, cfg), grads
    logp, entropy, _ = sweep(lin, inp.labels, temperature, need_entropy)
    terms = token_terms(logp, entropy, inp, cfg)
    grads = None
    if any(want):
        grads = backward(lin, inp.labels, temperature, terms.dlogp, terms.dentropy, want)
    return logp, entropy, terms, grads


def backward(
    lin: LinearInputs,
    labels: torch.Tensor,
    temperature: float,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    want: tuple[bool, bool, bool],
    whole_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LinearGrads:
    """The gradient sweep for known per-token dlogp / dentropy ([B, T]); `whole_rows`: see
    `sweep`."""
    flat_dlogp = flat_rows(lin, dlogp).reshape(-1).float()
    flat_dent = None if dentropy is None else flat_rows(lin, dentropy).reshape(-1).float()

    def derivatives(start, stop, logp, entropy):
        return flat_dlogp[start:stop], None if flat_dent is None else flat_dent[start:stop]

    need_entropy = flat_dent is not None
    out = sweep(lin, labels, temperature, need_entropy, derivatives, want, whole_rows=whole_rows)
    return out[2]


def logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    sampling: SamplingMask | None = None,
) -> LinearInputs:
    """LinearInputs of `linear_token_logprobs`: every row counts, no loss fields."""
    ones = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
    rows = LossInputs(
        logits=None,
        labels=labels,
        advantages=ones,
        mask=ones,
        valid=ones.bool(),
        old_logp=None,
        ref_logp=None,
        rollout_logp=None,
        is_weights=None,
        normalizer=None,
        flat_input=False,
    )
    return LinearInputs(hidden=hidden, weight=weight, bias=bias, rows=rows, sampling=sampling)


def token_logprobs(
    lin: LinearInputs, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp, entropy, _ = sweep(lin, lin.rows.labels, temperature, return_entropy)
    return logp, entropy


def squares_in_sweep() -> bool:
    """backends.LinearBackend: no; pi^2 takes one more sweep of the head at half the
    temperature."""
    return False
