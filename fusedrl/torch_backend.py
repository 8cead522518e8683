"""`backend="torch"`: the fused loss in chunked PyTorch, for CPUs and machines without Triton.

The logits are visited in blocks of rows so that the extra memory is O(block x V) fp32, never a
full fp32 copy of [N, V]:

  pass 1  per block: lse, logp of the label and (when needed) the entropy, all at the temperature;
  scalar  `token_terms`: the loss and d(loss)/d(logp), d(loss)/d(H) per token ([B, T] only);
  pass 2  per block: d(loss)/d(logits) = (dlogp (onehot - p) + dH (-p (log p + H))) / temperature,
          written into a gradient buffer, or into the logits themselves when `inplace=True`.

Backward then only scales the stored gradient by the upstream gradient. The Triton kernels do the
same work with pass 1 and pass 2 fused into a single read for token-level variants.
"""

from __future__ import annotations

import torch

from ._inputs import LossInputs, masked_rows, needs_entropy, temperature_of
from .config import LossConfig
from .double_backward import refuse_double_backward
from .logit_transform import LogitTransform, banned, capped_rows
from .row_blocks import row_blocks, rows_temperature
from .sampling import SamplingMask, apply_floor, sampling_floor
from .token_terms import TokenTerms, token_terms

# backends.Backend: pi^2 takes one more read at half the temperature (no *_squares ops)
SUMS_PI_SQUARED_IN_PASS = False
READS_RAW_ROWS = False  # backends.Backend


# Batch invariance: ATen sums a lone long row in pieces across threads, several rows a row per
# thread, so a row's sum would depend on how many rows share its block. Sums of fixed pieces of
# SUM_PIECE elements, then of the pieces and the tail, add in one order whatever the block holds.
SUM_PIECE = 512


def row_sum(values: torch.Tensor) -> torch.Tensor:
    """[n, V] -> [n]: each row's sum, bitwise independent of n and of the other rows."""
    rows, vocab = values.shape
    whole = vocab - vocab % SUM_PIECE
    total = values[:, :whole].reshape(rows, -1, SUM_PIECE).sum(-1).sum(-1)
    if whole < vocab:
        total = total + values[:, whole:].sum(-1)
    return total


def _divides(temperature) -> bool:
    return isinstance(temperature, torch.Tensor) or temperature != 1.0


def _scaled(block: torch.Tensor, temperature) -> torch.Tensor:
    scaled = block.double() if block.dtype == torch.float64 else block.float()
    return scaled / temperature if _divides(temperature) else scaled


def block_floor(block: torch.Tensor, temperature: float, sampling: SamplingMask) -> torch.Tensor:
    """[n] floors of a block's sampled sets (`fusedrl.sampling.sampling_floor`), so that a second
    sweep over the same logits need not find them again (top_p sorts each row)."""
    return sampling_floor(_scaled(block, temperature), sampling)


def block_log_probs(
    block: torch.Tensor,
    temperature: float,
    labels: torch.Tensor | None = None,
    sampling: SamplingMask | None = None,
    floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(block / temperature) in fp32 (fp64 for fp64 input) and its lse ([n, 1]); with
    an active `sampling`, over the set vLLM sampled from (`fusedrl.sampling`; needs `labels`),
    whose floors are found here unless given (`block_floor`)."""
    scaled = _scaled(block, temperature)
    if sampling is not None and sampling.active:
        floor = sampling_floor(scaled, sampling) if floor is None else floor
        scaled = apply_floor(scaled, floor, labels)
    top = scaled.amax(-1, keepdim=True)
    # All -inf: lse = log(0) = -inf; a +inf: lse = +inf (block_stats turns it into NaN).
    shift = torch.where(torch.isfinite(top), top, 0.0)
    lse = torch.log(row_sum(torch.exp(scaled - shift)))[:, None] + shift
    return scaled - lse, lse


def entropy_of(log_probs: torch.Tensor) -> torch.Tensor:
    probs = log_probs.exp()
    # -inf logits: p = 0 contributes 0 (not 0 * -inf).
    return -row_sum(torch.where(probs > 0, probs * log_probs, 0.0))


def block_stats(
    log_probs: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, need_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp of `labels` and the entropy of a block's rows; NaN for rows holding +inf or NaN and
    for rows with no logit above -inf."""
    # +inf anywhere in the row (lse = +inf): NaN, as in the reference, never a quiet -inf. All
    # -inf (lse = -inf): no distribution, NaN as in the reference and the kernels, where
    # `entropy_of` alone would sum no term and say 0.
    corrupt = ~torch.isfinite(lse.squeeze(-1))  # (a NaN logit makes lse NaN)
    # A label outside [0, V) is in another vocab slice (tensor parallelism): its logp here is
    # never used.
    picked = log_probs.gather(-1, labels.clamp(0, log_probs.shape[-1] - 1)[:, None]).squeeze(-1)
    logp = torch.where(corrupt, float("nan"), picked)
    if not need_entropy:
        return logp, None
    return logp, torch.where(corrupt, float("nan"), entropy_of(log_probs))


def block_grad(
    log_probs: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(loss)/d(logits) of a block, fp32, from per-row dlogp / dentropy ([n]).

    Rows whose dlogp and dentropy are 0 (masked) get exact zeros even if their logits are NaN.
    A label outside [0, V) gets no one-hot term: under tensor parallelism the block is a vocab
    slice and another rank holds the label.
    """
    probs = log_probs.exp()
    g_logp = dlogp[:, None].to(log_probs.dtype)
    grad = -g_logp * probs
    here = (labels >= 0) & (labels < grad.shape[-1])
    grad.scatter_add_(
        -1, torch.where(here, labels, 0)[:, None], torch.where(here[:, None], g_logp, 0.0)
    )
    live = g_logp != 0
    if dentropy is not None:
        if entropy is None:
            entropy = entropy_of(log_probs)
        grad -= dentropy[:, None].to(grad.dtype) * torch.where(
            probs > 0, probs * (log_probs + entropy[:, None]), 0.0
        )
        live = live | (dentropy[:, None] != 0)
    if _divides(temperature):
        grad /= temperature
    return torch.where(live, grad, 0.0)


def full_kl_of(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    kind: str,
    bans: torch.Tensor,
    ref_bans: torch.Tensor,
) -> torch.Tensor:
    """[n] exact KL per row over the vocabulary: KL(pi || ref) for "full", KL(ref || pi) for
    "full_reverse". `bans` / `ref_bans` ([n, V] bool, `logit_transform.banned` of each block):
    the tokens each side cannot emit. 0 log 0 = 0: a token the weighting side bans adds nothing;
    a token it can emit (any other logit: its probability is > 0, however small it rounds) that
    the other side bans makes the row's KL +inf (docs/losses.md, "Exact KL")."""
    if kind == "full_reverse":
        log_probs, ref_log_probs, bans, ref_bans = ref_log_probs, log_probs, ref_bans, bans
    both = ~bans & ~ref_bans
    finite = row_sum(torch.where(both, log_probs.exp() * (log_probs - ref_log_probs), 0.0))
    return torch.where((~bans & ref_bans).any(-1), float("inf"), finite)


def full_kl_grad(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl: torch.Tensor, kind: str
) -> torch.Tensor:
    """[n, V] d KL / d(logits / temperature): p (log p - log ref - KL) for "full", p - ref for
    "full_reverse". A "full" row whose KL is +inf has no derivative: NaN (the reverse KL's p - ref
    stays the exact, finite derivative of its +inf)."""
    probs = log_probs.exp()
    if kind == "full_reverse":
        return probs - ref_log_probs.exp()
    finite = torch.where(probs > 0, probs * (log_probs - ref_log_probs - kl[:, None]), 0.0)
    return torch.where(kl[:, None] == float("inf"), float("nan"), finite)


@torch.no_grad()
def forward_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    need_entropy: bool,
    valid: torch.Tensor | None = None,
    sampling: SamplingMask | None = None,
    floors: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    kl_kind: str | None = None,
    full_kl: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logp [B, T] and entropy [B, T] (or None) of [B, T, V] logits, block by block, fp32. With
    `sampling` and a [B * T] `floors` buffer, each row's floor is kept there for pass 2. With
    `ref_logits` (and `kl_kind`), each row's exact KL goes into the [B * T] `full_kl` buffer,
    from the same blocks. `transform`: a soft cap applied to each block (the reference's too)."""
    batch, time, _ = logits.shape
    logp = torch.empty(batch * time, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if need_entropy else None
    flat_labels = labels.reshape(-1)
    pairs = row_blocks(logits) if ref_logits is None else row_blocks(logits, ref_logits)
    for start, (block, *ref_block) in pairs:
        stop = start + block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        block = capped_rows(block, transform)
        ref_block = [capped_rows(ref, transform) for ref in ref_block]
        floor = None
        if floors is not None and sampling is not None:
            floor = floors[start:stop] = block_floor(block, rows_t, sampling)
        log_probs, lse = block_log_probs(block, rows_t, flat_labels[start:stop], sampling, floor)
        block_logp, block_entropy = block_stats(
            log_probs, lse, flat_labels[start:stop], need_entropy
        )
        logp[start:stop] = block_logp
        if entropy is not None:
            entropy[start:stop] = block_entropy
        if ref_block:
            ref_log_probs, _ = block_log_probs(ref_block[0], rows_t)
            full_kl[start:stop] = full_kl_of(
                log_probs, ref_log_probs, kl_kind, banned(block), banned(ref_block[0])
            )
    logp = logp.view(batch, time)
    entropy = None if entropy is None else entropy.view(batch, time)
    if valid is not None:  # masked rows may hold anything (NaN padding): they must not leak
        logp = torch.where(valid, logp, 0.0)
        entropy = None if entropy is None else torch.where(valid, entropy, 0.0)
    return logp, entropy


@torch.no_grad()
def write_logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    out: torch.Tensor,
    sampling: SamplingMask | None = None,
    floors: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    kl_kind: str | None = None,
    dfull_kl: torch.Tensor | None = None,
    full_kl: torch.Tensor | None = None,
    transform: LogitTransform | None = None,
) -> None:
    """out[b, t, :] = d(loss)/d(logits[b, t, :]) given per-token dlogp / dentropy ([B, T]);
    with `ref_logits`, plus dfull_kl x d KL_t / d(logits) of the exact KL (`full_kl`: [B, T]);
    `floors`: the sampled sets' floors that pass 1 kept (else found again). `lse` / `entropy`
    ([B, T], no sampling): the rows' own, given when `logits` is a vocab slice of them (tensor
    parallelism; labels < 0 are then in another slice), else found from `logits`.

    `out` may be `logits` itself (in-place): each block is read completely before it is written.
    `transform`: a soft cap applied to each block (the reference's too), the gradient taken
    through it.
    """
    flat_labels = labels.reshape(-1)
    flat_dlogp = dlogp.reshape(-1)
    flat_dent = None if dentropy is None else dentropy.reshape(-1)
    tensors = (logits, out) if ref_logits is None else (logits, out, ref_logits)
    for start, (block, out_block, *ref_block) in row_blocks(*tensors):
        stop = start + block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        floor = None if floors is None else floors[start:stop]
        derivative = None
        if transform is not None:
            block, derivative = transform.rows(block, want_derivative=True)
            ref_block = [transform.rows(ref) for ref in ref_block]
        if lse is None:
            log_probs, _ = block_log_probs(block, rows_t, flat_labels[start:stop], sampling, floor)
        else:
            log_probs = _scaled(block, rows_t) - lse.reshape(-1)[start:stop, None]
        dent = None if flat_dent is None else flat_dent[start:stop]
        rows_entropy = None if entropy is None else entropy.reshape(-1)[start:stop]
        grad = block_grad(
            log_probs,
            flat_labels[start:stop],
            rows_t,
            flat_dlogp[start:stop],
            dent,
            rows_entropy,
        )
        if ref_block:
            weight = dfull_kl.reshape(-1)[start:stop, None]
            ref_log_probs, _ = block_log_probs(ref_block[0], rows_t)
            kl = full_kl.reshape(-1)[start:stop]
            kl_grad = full_kl_grad(log_probs, ref_log_probs, kl, kl_kind) / rows_t
            grad += torch.where(weight != 0, weight * kl_grad, 0.0)
        if derivative is not None:  # (not on rows without a gradient: NaN padding stays out)
            grad = torch.where(grad != 0, grad * derivative, grad)
        out_block.copy_(grad)


def _floors_buffer(logits: torch.Tensor, sampling: SamplingMask | None) -> torch.Tensor | None:
    """[B * T] fp32/fp64 floors of pass 1, for pass 2 (None without an active sampling mask)."""
    if sampling is None or not sampling.active:
        return None
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.empty(logits.shape[0] * logits.shape[1], dtype=dtype, device=logits.device)


class _TorchLogprobs(torch.autograd.Function):
    """token_logprobs with the logits kept by reference (no fp32 copy saved for backward)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, return_entropy, sampling, transform):
        floors = _floors_buffer(logits, sampling)
        logp, entropy = forward_stats(
            logits,
            labels,
            temperature,
            return_entropy,
            sampling=sampling,
            floors=floors,
            transform=transform,
        )
        ctx.save_for_backward(logits, labels, floors)
        ctx.temperature, ctx.sampling, ctx.transform = temperature, sampling, transform
        return (logp, entropy) if return_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        refuse_double_backward("fusedrl.token_logprobs")
        logits, labels, floors = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        write_logits_grad(
            logits,
            labels,
            ctx.temperature,
            grad_logp.float(),
            None if grad_entropy is None else grad_entropy.float(),
            grad,
            ctx.sampling,
            floors,
            transform=ctx.transform,
        )
        return grad, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    sampling: SamplingMask | None = None,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T, V] logits, [B, T] int64 labels -> logp [B, T] (and entropy), differentiable.
    `transform`: a soft cap applied to the logits first (the gradient taken through it)."""
    if logits.requires_grad and torch.is_grad_enabled():
        out = _TorchLogprobs.apply(logits, labels, temperature, return_entropy, sampling, transform)
        return (out[0], out[1]) if return_entropy else (out[0], None)
    return forward_stats(
        logits, labels, temperature, return_entropy, sampling=sampling, transform=transform
    )


def planned_call(inp, cfg, need_entropy):
    """backends.Backend: no call is one fused kernel here (the torch code's blocks)."""
    return None


def terms(logp, entropy, inp, cfg, need_entropy):
    """backends.Backend.terms: `token_terms` on the masked rows."""
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    return token_terms(logp, entropy if need_entropy else None, masked_rows(inp), cfg)


def policy_loss(
    inp: LossInputs, cfg: LossConfig, need_entropy: bool, grad_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms]:
    """Pass 1, the [B, T] terms, and (when `grad_out` is given) pass 2 into `grad_out`."""
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    sampling = cfg.sampling
    floors = _floors_buffer(inp.logits, sampling) if grad_out is not None else None
    full_kl = None
    if inp.ref_logits is not None:
        full_kl = torch.empty(inp.labels.numel(), dtype=torch.float32, device=inp.logits.device)
    temperature = temperature_of(inp, cfg)
    logp, entropy = forward_stats(
        inp.logits,
        inp.labels,
        temperature,
        need_entropy,
        inp.valid,
        sampling,
        floors,
        inp.ref_logits,
        cfg.kl,
        full_kl,
        inp.transform,
    )
    if full_kl is not None:
        full_kl = torch.where(inp.valid, full_kl.view_as(logp), 0.0)
    terms = token_terms(logp, entropy, inp, cfg, full_kl=full_kl)
    if grad_out is not None:
        # beta = 0: the KL is a metric, its gradient term is zero and its pass is skipped.
        with_kl = full_kl is not None and cfg.beta > 0
        write_logits_grad(
            inp.logits,
            inp.labels,
            temperature,
            terms.dlogp,
            terms.dentropy,
            grad_out,
            sampling,
            floors,
            ref_logits=inp.ref_logits if with_kl else None,
            kl_kind=cfg.kl,
            dfull_kl=terms.dfull_kl,
            full_kl=full_kl,
            transform=inp.transform,
        )
    return logp, entropy, terms
