"""The driver shared by the fused backends (Triton and the CUDA extension).

Each backend provides the same four ops (`FusedOps`); this module decides how to use them:

- token-level variants with a gradient: one fused kernel (one read of each row, the gradient
  written in the same program, into the logits when in place);
- sequence-level variants (GSPO, GMPO, sequence IS) and on-policy configs whose per-token inputs
  depend on old = logp: pass 1 (logp / lse / entropy), the [B, T] terms, pass 2;
- the loss value and the metrics: the kernels' own per-program sums where they cover the
  config (`kernel_sums_cover`, `sequence_kernel_covers`), added up by one launch; otherwise
  `token_terms` on [B, T] scalars in torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from fusedrl.kernels.token_args import KERNEL_SCALARS, LossVariant, TokenLossArgs

from ._inputs import (
    LossInputs,
    check_labels_counted,
    has_entropy_bonus,
    masked_rows,
    needs_entropy,
    temperature_of,
)
from .config import PPO_CLIPPED, SCALAR_LOSSES, LossConfig
from .double_backward import refuse_double_backward
from .logit_transform import LogitTransform
from .output import MetricSlots
from .row_blocks import row_blocks, rows_temperature
from .sampling import SamplingMask, mask_to_sampled_set
from .token_terms import (
    Metrics,
    TokenTerms,
    add_mismatch_metrics,
    aggregation_weights,
    max_over_valid,
    ratio_bounds,
    resolve_is_weights,
    scaled_by,
    token_terms,
    with_rejection,
)


@dataclass(frozen=True)
class TwoRowOps:
    """The two-row ops (kernels/two_rows.py): a student's (policy's) row beside a teacher's
    (reference's). forward: (student, teacher, labels, valid?, temperature, kind, beta) ->
    (logp, lse_s, lse_q, D, sum s g, entropy); grad: (student, teacher, lse_s, lse_q, D,
    sum s g, weight, temperature, kind, beta, out, labels?, entropy?, dlogp?, dentropy?)."""

    forward: Callable
    grad: Callable


@dataclass(frozen=True)
class FusedOps:
    """The four ops of a fused backend (signatures of the fusedrl:: op schemas)."""

    logprobs_fwd: Callable  # (logits, labels, valid?, temperature) -> (logp, lse, entropy)
    logits_grad: Callable  # (logits, labels, lse, entropy, dlogp, dentropy?, temperature, out)
    # (logits, grad, args: TokenLossArgs) -> (logp, entropy[, each program's sums]): the fused
    # loss, the gradient written into `grad`; the in-place one (logits, args) into the logits.
    fused_token_loss: Callable
    fused_token_loss_inplace: Callable
    # (logits, labels, out, temperature, top_k, top_p, min_p): out = logits masked to the sampled
    # sets, found on chip (kernels/sampling.py); None: torch.topk / sort a block at a time.
    sampled_set: Callable | None = None
    # (logits, labels, temperature, top_k, top_p, min_p) -> [B, T] fp32: each row's sampled-set
    # floor, found on chip, which the log-prob, gradient and fused-loss ops then read with
    # `floors=`: no masked copy of the logits. None: those ops cannot (the CUDA extension's),
    # and `sampled_set` writes the copy they read.
    sampled_floors: Callable | None = None
    # The two-row ops, for the exact KL to the reference (kl="full" / "full_reverse") and
    # distillation; None: the backend has none.
    two_rows: TwoRowOps | None = None
    # (logits, labels, temperature, row_temps?) -> `logprobs_fwd`'s three of every row and
    # sum_v pi_v^2 from the same read; None: the backend takes it from a second read at half the
    # temperature (output.sum_pi_squared_of).
    logprobs_squares: Callable | None = None
    # Whether the log-prob and fused-loss ops fill a `sum_sq=` buffer ([B, T] fp32) with
    # sum_v pi_v^2 per row from their own read (`policy_loss_squares`).
    loss_squares: bool = False
    # (partials) -> (loss, means): adds up the kernels' per-program sums into the loss and the
    # metrics' means, in the order `sum_slots` names; None: the loss and the metrics come from
    # `token_terms` on [B, T] tensors.
    token_loss_sums: Callable | None = None
    sum_slots: tuple[str, ...] = ()
    # Whether the fused-loss ops sum too: they then take `mask=` and the ratio bounds as
    # numbers (`low_bound=`, `high_bound=`; per-token tensors only for DCPO) and return a third
    # output, each program's sums over its rows, for `token_loss_sums` (Triton's do; the CUDA
    # extension's keep no sums, and its backend takes Triton's sums for the two-pass terms).
    fused_sums: bool = False
    # (mask, agg, normalizer, norm_constant) -> the [B, T] aggregation weights in one launch
    # (token_terms.aggregation_weights's formulas); None: torch's few small kernels.
    aggregation_weights: Callable | None = None
    # (logp, entropy?, valid, mask, advantages, old, ref?, is_weight?, agg_weight, low?, high?,
    # sequence_ratio, loss, ...) -> (dlogp, dentropy, partials): a two-pass call's terms on
    # [B, T] log-probs, one program per sequence (kernels/sequence_terms.py), whose sums
    # `token_loss_sums` adds up; None: `token_terms` in torch.
    sequence_terms: Callable | None = None


def _empty_rows_like(labels: torch.Tensor) -> torch.Tensor:
    return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)


def temperature_keywords(
    temperature,
    rows: slice | None = None,
    transform: LogitTransform | None = None,
    floors: torch.Tensor | None = None,
) -> tuple[float, dict]:
    """(the ops' float temperature, their `row_temps=` keyword) of a float or of per-token
    temperatures ([B, T] tensor; `rows`: the flat rows of a chunk, taken as [1, n]). With a
    soft cap (`transform`: y = c tanh(s x / c)) the ops read tanh(a x), a = s / c, at the
    temperature T / c (y / T = tanh(a x) / (T / c)): their `cap=` keyword is a. `floors`:
    sampled-set floors ([B, T], `FusedOps.sampled_floors`), the row ops' `floors=` keyword."""
    keywords = {} if floors is None else {"floors": floors}
    if transform is not None and transform.softcap is not None:
        keywords["cap"] = transform.scale / transform.softcap
        temperature = temperature / transform.softcap
    if not isinstance(temperature, torch.Tensor):
        return temperature, keywords
    if rows is not None:
        temperature = temperature.reshape(1, -1)[:, rows]
    return 1.0, {"row_temps": temperature, **keywords}


class _FusedLogprobs(torch.autograd.Function):
    """`source` (None: the logits) is what the kernels read: the logits masked to a sampled
    set; its gradient is the logits' (0 outside the set). `floors`: the sampled sets as each
    row's floor instead, read from the logits themselves (`FusedOps.sampled_floors`).
    `squares`: a last output, sum_v pi_v^2 per row (no gradient), from the same read
    (`ops.logprobs_squares`). `transform`: a soft cap the kernels apply (or None)."""

    @staticmethod
    def forward(
        ctx, ops, logits, labels, temperature, return_entropy, source, squares, transform, floors
    ):
        source = logits if source is None else source
        scalar, rows = temperature_keywords(temperature, transform=transform, floors=floors)
        if squares:
            logp, lse, entropy, *sum_sq = ops.logprobs_squares(source, labels, scalar, **rows)
        else:
            logp, lse, entropy, *sum_sq = ops.logprobs_fwd(source, labels, None, scalar, **rows)
        ctx.save_for_backward(source, labels, lse, entropy)
        ctx.temperature, ctx.rows = scalar, rows
        ctx.ops, ctx.return_entropy = ops, return_entropy
        ctx.mark_non_differentiable(*sum_sq)
        return (logp, entropy, *sum_sq) if return_entropy else (logp, *sum_sq)

    @staticmethod
    def backward(ctx, grad_logp, *grads):
        refuse_double_backward("fusedrl.token_logprobs")
        grad_entropy = grads[0] if ctx.return_entropy else None  # (then the squares' None)
        logits, labels, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        ctx.ops.logits_grad(
            logits,
            labels,
            lse,
            entropy,
            grad_logp,
            grad_entropy,
            ctx.temperature,
            grad,
            **ctx.rows,
        )
        return None, grad, None, None, None, None, None, None, None


# ------------------------------------------------------------------ sampling-mask replay
# The kernels replay a sampled set by reading logits that hold -inf outside it, written once:
# into the gradient buffer, which the kernels then overwrite in place, or into a block-sized
# buffer when there is no gradient. The backend's `sampled_set` kernel finds each row's set on
# chip (a radix select, kernels/sampling.py) as it writes; without one, `fusedrl.sampling` finds
# it with torch.topk / sort, a block of rows at a time.
def _write_sampled_set(ops, logits, labels, temperature, sampling, out, transform=None) -> None:
    """out = logits with -inf outside each row's sampled set (out may be logits); `temperature`
    a float or per-token ([B, T], as `labels`). Under a soft cap (`transform`) the sets are the
    capped logits' (min_p and top_p weigh them), found by the torch route: the select kernel
    reads the logits as they are."""
    capped = transform is not None and transform.softcap is not None
    if ops.sampled_set is not None and not capped:
        scalar, rows = temperature_keywords(temperature)
        ops.sampled_set(
            logits, labels, out, scalar, sampling.top_k, sampling.top_p, sampling.min_p, **rows
        )
        return
    flat_labels = labels.reshape(-1)
    for start, (block, out_block) in row_blocks(logits, out):
        stop = start + block.shape[0]
        rows_t = rows_temperature(temperature, start, stop)
        if not capped:
            out_block.copy_(mask_to_sampled_set(block, flat_labels[start:stop], rows_t, sampling))
            continue
        # The raw logits outside the capped rows' sets (and banned ones) become -inf: the
        # kernels keep a -inf banned under the cap.
        kept = mask_to_sampled_set(transform.rows(block), flat_labels[start:stop], rows_t, sampling)
        out_block.copy_(block.masked_fill(kept == float("-inf"), float("-inf")))


def sampled_floors(ops, logits, labels, temperature, sampling, transform=None):
    """[B, T] fp32: each row's sampled-set floor, where the backend's row ops read the sets
    through floors (`FusedOps.sampled_floors`); None where they read a masked copy instead (no
    such op, or a soft cap: its sets are the capped logits', found by the torch route)."""
    if ops.sampled_floors is None or (transform is not None and transform.softcap is not None):
        return None
    scalar, rows = temperature_keywords(temperature)
    return ops.sampled_floors(
        logits, labels, scalar, sampling.top_k, sampling.top_p, sampling.min_p, **rows
    )


# Rows of a masked copy without a gradient, with the select kernel: 256 MiB of bf16, enough rows
# (883 at V = 151936) to fill the GPU; the torch route keeps its fp32 block size.
SAMPLED_CHUNK_ELEMENTS = 1 << 27


def _sampled_stats(ops, logits, labels, valid, temperature, sampling, transform=None):
    """logp, lse, entropy [B, T] over the sampled sets, a masked block of rows at a time;
    `temperature` a float or per-token ([B, T]); `transform`: a soft cap or None."""
    batch, time, _ = logits.shape
    flat = [t.reshape(-1) for t in (labels, valid if valid is not None else labels)]
    out = [
        torch.empty(batch * time, dtype=torch.float32, device=logits.device)
        for _stat in ("logp", "lse", "entropy")
    ]
    masked = None
    elements = SAMPLED_CHUNK_ELEMENTS if ops.sampled_set is not None else None
    for start, (block,) in row_blocks(logits, elements=elements):
        stop = start + block.shape[0]
        rows_labels = flat[0][start:stop][None]
        if masked is None or masked.shape[1] < block.shape[0]:
            masked = torch.empty((1, *block.shape), dtype=block.dtype, device=block.device)
        rows_masked = masked[:, : block.shape[0]]
        rows_t = rows_temperature(temperature, start, stop)
        rows_t = rows_t.reshape(1, -1) if isinstance(rows_t, torch.Tensor) else rows_t
        _write_sampled_set(ops, block[None], rows_labels, rows_t, sampling, rows_masked, transform)
        rows_valid = None if valid is None else flat[1][start:stop][None]
        scalar, row_temps = temperature_keywords(rows_t, transform=transform)
        stats = ops.logprobs_fwd(rows_masked, rows_labels, rows_valid, scalar, **row_temps)
        for whole, part in zip(out, stats):
            whole[start:stop] = part[0]
    return tuple(t.view(batch, time) for t in out)


def token_logprobs_squares(
    ops: FusedOps,
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`token_logprobs` (no sampling filters) and sum_v pi_v^2 per token ([B, T], no gradient),
    from one read of the logits."""
    if logits.requires_grad and torch.is_grad_enabled():
        out = _FusedLogprobs.apply(
            ops, logits, labels, temperature, return_entropy, None, True, transform, None
        )
        return (out[0], out[1], out[2]) if return_entropy else (out[0], None, out[1])
    scalar, rows = temperature_keywords(temperature, transform=transform)
    logp, _, entropy, sum_sq = ops.logprobs_squares(logits, labels, scalar, **rows)
    return logp, entropy if return_entropy else None, sum_sq


def token_logprobs(
    ops: FusedOps,
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    sampling: SamplingMask | None = None,
    transform: LogitTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    sampling = sampling if sampling is not None and sampling.active else None
    floors = None
    if sampling is not None:
        floors = sampled_floors(ops, logits.detach(), labels, temperature, sampling, transform)
    if logits.requires_grad and torch.is_grad_enabled():
        source = None
        if sampling is not None and floors is None:  # one masked copy, kept for backward
            source = torch.empty_like(logits)
            _write_sampled_set(
                ops, logits.detach(), labels, temperature, sampling, source, transform
            )
        out = _FusedLogprobs.apply(
            ops, logits, labels, temperature, return_entropy, source, False, transform, floors
        )
        return (out[0], out[1]) if return_entropy else (out[0], None)
    if sampling is not None and floors is None:
        logp, _, entropy = _sampled_stats(
            ops, logits, labels, None, temperature, sampling, transform
        )
    else:
        scalar, rows = temperature_keywords(temperature, transform=transform, floors=floors)
        logp, _, entropy = ops.logprobs_fwd(logits, labels, None, scalar, **rows)
    return logp, entropy if return_entropy else None


FP32_TINY = torch.finfo(torch.float32).tiny


def kernel_float(value: float | None) -> float | None:
    """A config number as the fused kernel's fp32 scalar. Triton types a Python float below
    fp32's normal range as fp64: another variant of the kernel, whose bf16 stores the interpreter
    writes as 0 (a hypothesis example, entropy_coef=2.2e-308, found it: a zero gradient). An fp32
    kernel would flush such a value to 0 anyway, so it is flushed here."""
    if value is None or abs(value) >= FP32_TINY:
        return value
    return 0.0


def fused_token_args(
    inp: LossInputs,
    cfg: LossConfig,
    sums: bool = False,
    weights_kernel: Callable | None = None,
    sum_sq: torch.Tensor | None = None,
) -> TokenLossArgs:
    """The fused op's arguments of a call (kernels/token_args.py). The aggregation weight, IS
    weight and bounds do not depend on the logits, so they are computed here for the whole
    batch (a chunk of rows takes `TokenLossArgs.rows`). `sums`: the op's own sums are the
    loss and the metrics (`FusedOps.fused_sums`): it reads the mask weights, takes constant
    ratio bounds as numbers (tensors for DCPO alone) and grad_scale, and weighs the mask itself
    where it can (`mask_aggregation`); else (the CUDA extension's op keeps no sums) the bounds
    are tensors and the aggregation weights carry grad_scale. `weights_kernel`: the backend's
    aggregation weights op (`FusedOps.aggregation_weights`), or None. `sum_sq`: a [B, T] fp32
    buffer for sum_v pi_v^2 per row."""
    old = inp.old_logp
    # IS weights, DCPO bounds and rejection need old; on-policy (old = logp) such configs take
    # two passes. Rejected tokens get an aggregation weight of 0 (they leave the denominators).
    is_weight = resolve_is_weights(old, inp, cfg)  # on every sampled token, as verl
    inp = with_rejection(inp, cfg)
    denominator = mask_aggregation(inp, cfg) if sums else None
    agg = None  # (weighed from the mask in the kernel)
    if denominator is None:
        agg = aggregation_weights(inp, cfg, weights_kernel)
        agg = agg if sums else scaled_by(agg, inp.grad_scale)  # (an op without grad_scale)
    loss = cfg.loss
    low = high = None
    low_bound = high_bound = 0.0
    if loss == "dcpo" or (not sums and (loss in PPO_CLIPPED or loss == "cispo")):  # per token
        like = old if old is not None else torch.zeros_like(inp.mask)
        low, high = (
            b if isinstance(b, torch.Tensor) else torch.full_like(like, b)
            for b in ratio_bounds(like, cfg)
        )
    elif sums:
        low_bound, high_bound = ratio_bounds(old, cfg)
    temperature, rows = temperature_keywords(temperature_of(inp, cfg), transform=inp.transform)
    scale = inp.grad_scale if sums else None
    variant = loss_variant(
        cfg, temperature, rows.get("cap"), low_bound, high_bound, denominator is not None
    )
    return TokenLossArgs(
        inp.labels,
        inp.valid,
        inp.advantages,
        variant,
        agg,
        inp.mask if sums else None,
        old,
        inp.ref_logp,
        is_weight,
        low,
        high,
        rows.get("row_temps"),
        inp.entropy_coef,
        scale if isinstance(scale, torch.Tensor) else None,
        sum_sq,
        1.0 if scale is None or isinstance(scale, torch.Tensor) else scale,
        denominator or 0.0,
        inp.sampled_floors,
    )


def loss_variant(
    cfg: LossConfig,
    temperature: float,
    cap: float | None,
    low_bound: float,
    high_bound: float,
    agg_from_mask: bool,
) -> LossVariant:
    """The kernels' variant of a config (kernels/token_args.py), its numbers as fp32 scalars.
    Kept per config object and call numbers in eager calls (a dict lookup: building it is a few
    microseconds of a host-bound call; the entry holds the config, so its id is not reused
    meanwhile). A traced call builds it: a dict that changes between calls would be a guard."""
    if torch.compiler.is_compiling():
        return _variant_of(cfg, temperature, cap, low_bound, high_bound, agg_from_mask)
    key = (id(cfg), temperature, cap, low_bound, high_bound, agg_from_mask)
    known = _VARIANTS.get(key)
    if known is not None and known[0] is cfg:
        return known[1]
    variant = _variant_of(cfg, temperature, cap, low_bound, high_bound, agg_from_mask)
    if len(_VARIANTS) >= MAX_VARIANTS:  # a config per step must not leak
        _VARIANTS.clear()
    _VARIANTS[key] = (cfg, variant)
    return variant


MAX_VARIANTS = 256
_VARIANTS: dict[tuple, tuple[LossConfig, LossVariant]] = {}


# The kernels' numbers that the config holds under another name. Every other one of
# KERNEL_SCALARS but the call's ratio bounds is the config's field of the same name: a new
# number of the loss needs no line here.
_CONFIG_NAMES = {"tau_pos": "sapo_tau_pos", "tau_neg": "sapo_tau_neg"}
_CALL_NUMBERS = ("low_bound", "high_bound")


def _variant_of(cfg, temperature, cap, low_bound, high_bound, agg_from_mask) -> LossVariant:
    numbers = {
        name: kernel_float(getattr(cfg, _CONFIG_NAMES.get(name, name)))
        for name in KERNEL_SCALARS
        if name not in _CALL_NUMBERS
    }
    return LossVariant(
        loss="ppo" if cfg.loss in PPO_CLIPPED else cfg.loss,  # the kernels' name for PPO
        temperature=temperature,
        cap=cap,
        kl=cfg.kl,
        low_bound=low_bound,
        high_bound=high_bound,
        agg_from_mask=agg_from_mask,
        **numbers,
    )


def mask_aggregation(inp: LossInputs, cfg: LossConfig) -> float | None:
    """Where each token's aggregation weight is its mask weight over one number, that number,
    for the fused kernel to weigh the mask itself (AGG_FROM_MASK: no weights launch before it):
    token-mean's normalizer, or 0.0 for the kernel to count the mask; seq-mean-token-sum-norm's
    N x C (token_terms.aggregation_weights's formulas). None where a weight needs a sequence's
    count (seq-mean-*), a device normalizer, rejection's mask, or the caller gave the weights."""
    if (
        cfg.rejection_rules
        or isinstance(inp.normalizer, torch.Tensor)
        or inp.agg_weights is not None
    ):
        return None
    if cfg.agg == "token-mean":
        return 0.0 if inp.normalizer is None else float(inp.normalizer)
    if cfg.agg == "seq-mean-token-sum-norm":
        batch, time = inp.labels.shape
        sequences = float(batch) if inp.normalizer is None else float(inp.normalizer)
        return sequences * (float(time) if cfg.norm_constant is None else cfg.norm_constant)
    return None


def _fused_token_level(
    ops: FusedOps,
    inp: LossInputs,
    cfg: LossConfig,
    grad_out: torch.Tensor,
    sum_sq: torch.Tensor | None = None,
):
    """One kernel: logp, entropy and the gradient (and sum_v pi_v^2 into `sum_sq`); with an op
    that sums the loss and metrics (`FusedOps.fused_sums`), each program's sums too."""
    args = fused_token_args(inp, cfg, ops.fused_sums, ops.aggregation_weights, sum_sq)
    if grad_out is inp.logits:
        return ops.fused_token_loss_inplace(inp.logits, args)
    return ops.fused_token_loss(inp.logits, grad_out, args)


def kernel_sums_cover(inp: LossInputs, cfg: LossConfig) -> bool:
    """Whether the fused kernel's own sums give the loss and its metrics (on the fused path):
    not where a batch statistic decides a mask (rejection, the off-policy mask), which
    `token_terms` computes on [B, T] tensors with its own metrics."""
    return not cfg.rejection_rules and cfg.off_policy_mask is None


def sequence_kernel_covers(inp: LossInputs, cfg: LossConfig) -> bool:
    """Whether the two-pass call's terms come from `FusedOps.sequence_terms`: the variants the
    fused kernel knows (token or sequence ratio), with no batch statistic deciding a mask or a
    weight (`kernel_sums_cover`, the top-entropy tokens, M2PO), no ratio-weighted KL and no
    entropy bonus of its own aggregation."""
    return (
        kernel_sums_cover(inp, cfg)
        and cfg.loss in KERNEL_LOSSES
        and cfg.top_entropy_quantile == 1
        and cfg.m2po_tau is None
        and not (cfg.kl_bias_correction and cfg.beta > 0)
        and not _unclamped_kl(cfg)
        and not (cfg.entropy_agg is not None and has_entropy_bonus(inp, cfg))
    )


def _unclamped_kl(cfg: LossConfig) -> bool:
    """TRL's k3 without verl's clamps (`kl_clamp=False`), which the kernels' KL terms hold."""
    return not cfg.kl_clamp and cfg.beta > 0 and (cfg.kl or "k3") in ("k3", "k3+")


KERNEL_LOSSES = (*PPO_CLIPPED, "dcpo", "cispo", "sapo", "pg")  # the kernels' LOSS codes


def _kernel_terms(
    ops: FusedOps,
    logp: torch.Tensor,
    entropy: torch.Tensor,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
) -> TokenTerms:
    """`token_terms` of pass 1's logp and entropy by the backend's kernel (`sequence_terms`)
    and `token_loss_sums`: two launches where torch takes some seventy."""
    old = inp.old_logp if inp.old_logp is not None else logp  # on-policy: ratio 1
    # The kernel's own rule (a coefficient below fp32's range is 0 to it: `kernel_float`), so
    # that a dentropy is handed on exactly when the kernel wrote one.
    bonus = inp.entropy_coef is not None or kernel_float(cfg.entropy_coef) != 0.0
    low, high = ratio_bounds(old, cfg)
    per_token = isinstance(low, torch.Tensor)  # DCPO's bounds
    args = TokenLossArgs(
        inp.labels,
        inp.valid,
        inp.advantages,
        loss_variant(cfg, 1.0, None, *((0.0, 0.0) if per_token else (low, high)), False),
        aggregation_weights(inp, cfg, ops.aggregation_weights),
        inp.mask,
        old,
        inp.ref_logp,
        resolve_is_weights(old, inp, cfg),
        low if per_token else None,
        high if per_token else None,
        entropy_coef_tensor=inp.entropy_coef,
    )
    dlogp, dentropy, partials = ops.sequence_terms(
        logp,
        entropy if need_entropy or bonus else None,
        args,
        sequence_ratio=cfg.ratio_level == "sequence",
        vocab=inp.logits.shape[-1],
    )
    terms = _summed_terms(ops, partials, logp, inp, cfg, need_entropy, args.is_weight)
    # (`TokenTerms`: the derivatives of the loss the caller scales, as token_terms gives them)
    dentropy = dentropy if bonus else None
    return replace(
        terms, dlogp=scaled_by(dlogp, inp.grad_scale), dentropy=scaled_by(dentropy, inp.grad_scale)
    )


def terms(
    ops: FusedOps,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
) -> TokenTerms:
    """backends.Backend.terms: the terms kernel where it covers the call (two launches), else
    `token_terms` on the masked rows."""
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    if ops.sequence_terms is not None and sequence_kernel_covers(inp, cfg):
        return _kernel_terms(ops, logp, entropy, inp, cfg, need_entropy)
    return token_terms(logp, entropy if need_entropy else None, masked_rows(inp), cfg)


def _summed_terms(
    ops: FusedOps,
    partials: torch.Tensor,
    logp: torch.Tensor,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
    weights: torch.Tensor | None,
    views_when_read: bool = False,
) -> TokenTerms:
    """The loss and the metrics from a kernel's sums: one launch, each metric a view of its
    means (the names of `token_terms`'s metrics for the same call). The IS weights' and the
    train / inference mismatch metrics, which count sequences, are taken from logp on the host
    where the call has them. `weights`: the IS weights the kernel used (None: none).
    `views_when_read`: the metrics as `MetricSlots`, for a `LossOutputOfSums` to make when
    read (the planned call's)."""
    loss, means = ops.token_loss_sums(partials)
    count, slots, labels_slot = _metric_slots(ops.sum_slots, inp.ref_logp is not None, need_entropy)
    check_labels_counted(means[labels_slot], inp)
    extra = {}
    if weights is not None or inp.rollout_logp is not None:
        pending = Metrics()
        if weights is not None:
            pending.mean("is_weight_mean", weights, inp)
            pending["is_weight_max"] = max_over_valid(weights, inp)
        add_mismatch_metrics(pending, logp, weights, inp)
        extra = pending.finish()
    metrics = MetricSlots(means, count, slots, extra)
    return TokenTerms(
        loss=loss,
        dlogp=None,
        dentropy=None,
        metrics=metrics if views_when_read else metrics.views(),
    )


@functools.cache
def _metric_slots(
    sum_slots: tuple[str, ...], with_kl: bool, with_entropy: bool
) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """(how many leading slots hold the call's metrics, each metric's name and slot, the labels'
    flag's slot): the metrics `token_terms` reports for the same call, the KL's where the call
    has ref_logp, the entropy's where it wants the entropy."""
    names = ["clipfrac", "clip_low", "clip_high", "dual_clipfrac"]
    names += ["kl"] if with_kl else []
    names += ["ppo_kl", "logp_mean"] + (["entropy"] if with_entropy else [])
    slots = tuple((name, sum_slots.index(name)) for name in names)
    return 1 + max(slot for _, slot in slots), slots, sum_slots.index("labels_ok")


def _terms_source(ops: FusedOps, inp: LossInputs, cfg: LossConfig, fused: bool) -> str:
    """Where a call's loss, metrics and d(loss)/d(logp) come from, decided once: "fused" (the
    fused kernel's own sums; `fused`: the call takes that kernel), "kernel" (the terms kernel
    on a pass's logp, `FusedOps.sequence_terms`: the two-pass path, and the fused path of an op
    that keeps no sums), or "torch" (`token_terms` on [B, T] tensors)."""
    if fused and ops.fused_sums and kernel_sums_cover(inp, cfg):
        return "fused"
    if ops.sequence_terms is not None and sequence_kernel_covers(inp, cfg):
        return "kernel"
    return "torch"


def fused_sums_call(
    ops: FusedOps,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
    grad_out: torch.Tensor,
    sum_sq: torch.Tensor | None = None,
    views_when_read: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms]:
    """The call as the fused kernel whose own sums are the loss and the metrics (`_terms_source`
    "fused"): the fused kernel and `token_loss_sums`, two launches (three where the aggregation
    weights need a sequence's count: their kernel first). `views_when_read`: as
    `_summed_terms`'s."""
    logp, entropy, partials = _fused_token_level(ops, inp, cfg, grad_out, sum_sq)
    weights = resolve_is_weights(inp.old_logp, inp, cfg)  # (made once per inputs: the kernel's)
    terms = _summed_terms(ops, partials, logp, inp, cfg, need_entropy, weights, views_when_read)
    return logp, entropy if need_entropy else None, terms


def planned_call(ops: FusedOps, inp: LossInputs, cfg: LossConfig, need_entropy: bool):
    """`fused_sums_call` bound to this call's config, where `policy_loss` would take it for a
    call of this kind with a gradient (`call_plan` decides it once per kind); None where it takes
    more (two passes, torch's terms, the exact KL, sampled sets)."""
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    if cfg.full_kl or cfg.sampling is not None or needs_two_passes(inp, cfg):
        return None
    if _terms_source(ops, inp, cfg, fused=True) != "fused":
        return None
    return functools.partial(
        fused_sums_call, ops, cfg=cfg, need_entropy=need_entropy, views_when_read=True
    )


def needs_two_passes(inp: LossInputs, cfg: LossConfig) -> bool:
    if cfg.is_sequence_level or cfg.loss in SCALAR_LOSSES:  # the kernels know neither
        return True
    if cfg.entropy_agg is not None and has_entropy_bonus(inp, cfg):
        return True  # the kernel weighs d(loss)/d(entropy) with the policy's aggregation weight
    if cfg.kl_bias_correction and cfg.beta > 0:  # the fused kernel has no ratio-weighted KL
        return True
    if _unclamped_kl(cfg):  # nor an unclamped k3
        return True
    if cfg.m2po_tau is not None:  # a batch-wide statistic of logp: known after pass 1
        return True
    # On-policy with bounds that depend on old (dcpo) or an IS weight: old = logp is only known
    # after pass 1. (Token-level ppo/cispo bounds are constants and need no old.)
    return inp.old_logp is None and (
        cfg.loss == "dcpo" or cfg.is_correction is not None or bool(cfg.rejection_rules)
    )


_KL_KERNEL_KIND = {"full": "kl", "full_reverse": "kl_rev"}


def _with_exact_kl(
    ops: FusedOps,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
    grad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms]:
    """The exact KL to the reference: pass 1 reads the policy's and the reference's rows once
    (logp, entropy, lse of both, KL_t), the [B, T] terms, pass 2 reads both once and writes the
    whole gradient (the policy's terms and beta x dKL_t): 2R + 1W of [N, V] in all."""
    if ops.two_rows is None:
        raise ValueError(
            f"config.kl={cfg.kl!r} (the exact KL from ref_logits) has no kernel in this backend "
            "(the CUDA extension takes Triton's two-row kernels, and triton is not installed): "
            "use backend='torch', or install triton"
        )
    kind = _KL_KERNEL_KIND[cfg.kl]
    # The two-row ops of every backend take per-token temperatures and a soft cap.
    scalar, rows = temperature_keywords(temperature_of(inp, cfg), transform=inp.transform)
    logp, lse, ref_lse, kl, aux, entropy = ops.two_rows.forward(
        inp.logits, inp.ref_logits, inp.labels, inp.valid, scalar, kind, 0.0, **rows
    )
    terms = token_terms(logp, entropy if need_entropy else None, inp, cfg, full_kl=kl)
    if grad_out is not None:
        ops.two_rows.grad(
            inp.logits,
            inp.ref_logits,
            lse,
            ref_lse,
            kl,
            aux,
            terms.dfull_kl,
            scalar,
            kind,
            0.0,
            grad_out,
            inp.labels,
            entropy,
            terms.dlogp,
            terms.dentropy,
            **rows,
        )
    return logp, entropy if need_entropy else None, terms


def policy_loss_squares(
    ops: FusedOps,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
    grad_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms, torch.Tensor]:
    """`policy_loss` and sum_v pi_v^2 per token ([B, T] fp32, 0 on masked rows) from the same
    read of the logits: the fused kernel's sweep 1, or pass 1 of the two-pass path. Not for the
    exact KL (its two-row kernels keep no squares) or sampled sets."""
    if cfg.full_kl or cfg.sampling is not None or not ops.loss_squares:
        raise ValueError("policy_loss_squares: no read of this config sums pi^2")
    sum_sq = torch.empty(inp.labels.shape, dtype=torch.float32, device=inp.logits.device)
    return (*policy_loss(ops, inp, cfg, need_entropy, grad_out, sum_sq), sum_sq)


@torch.no_grad()
def policy_loss(
    ops: FusedOps,
    inp: LossInputs,
    cfg: LossConfig,
    need_entropy: bool,
    grad_out: torch.Tensor | None,
    sum_sq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms]:
    """Token-level with a gradient: the fused kernel. Otherwise pass 1, terms, pass 2. `sum_sq`:
    a [B, T] buffer for sum_v pi_v^2 (`policy_loss_squares`)."""
    need_entropy = need_entropy or needs_entropy(inp, cfg)
    fused = grad_out is not None and not needs_two_passes(inp, cfg)
    source = _terms_source(ops, inp, cfg, fused)
    sampling = cfg.sampling
    floors = None
    if sampling is not None:
        temperature = temperature_of(inp, cfg)
        floors = sampled_floors(ops, inp.logits, inp.labels, temperature, sampling, inp.transform)
    # The kernels read counted tokens only; torch's terms multiply by the mask, and the exact
    # KL's terms and a masked copy's search take every row (`LossInputs.rows_masked`).
    if source == "torch" or cfg.full_kl or (sampling is not None and floors is None):
        inp = masked_rows(inp)
    if cfg.full_kl:
        return _with_exact_kl(ops, inp, cfg, need_entropy, grad_out)
    if floors is not None:
        # The kernels read the sets through the floors: no masked copy, no other change.
        inp = replace(inp, sampled_floors=floors)
    elif sampling is not None:
        if grad_out is None:
            logp, _, entropy = _sampled_stats(
                ops, inp.logits, inp.labels, inp.valid, temperature, sampling, inp.transform
            )
            terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
            return logp, entropy if need_entropy else None, terms
        # The masked logits go where the gradient will be written; the kernels then run in place.
        _write_sampled_set(
            ops, inp.logits, inp.labels, temperature, sampling, grad_out, inp.transform
        )
        inp = replace(inp, logits=grad_out)
    if fused and source == "fused":
        return fused_sums_call(ops, inp, cfg, need_entropy, grad_out, sum_sq)
    if fused:
        logp, entropy = _fused_token_level(ops, inp, cfg, grad_out, sum_sq)[:2]
        if source == "kernel":
            # A fused op that keeps no sums (the CUDA extension's): the loss and the metrics
            # from the terms kernel on its logp (two launches; its derivatives go unused).
            terms = _kernel_terms(ops, logp, entropy, inp, cfg, need_entropy)
            terms = replace(terms, dlogp=None, dentropy=None)
        else:
            terms = token_terms(logp, entropy if need_entropy else None, inp, cfg, grads=False)
        return logp, entropy if need_entropy else None, terms
    scalar, rows = temperature_keywords(
        temperature_of(inp, cfg), transform=inp.transform, floors=inp.sampled_floors
    )
    if sum_sq is None:
        logp, lse, entropy = ops.logprobs_fwd(inp.logits, inp.labels, inp.valid, scalar, **rows)
    else:  # one read still; the [B, T] copy is 1 / V of it
        logp, lse, entropy, squares = ops.logprobs_squares(
            inp.logits, inp.labels, scalar, **rows, valid=inp.valid
        )
        sum_sq.copy_(squares)
    if source == "kernel":
        terms = _kernel_terms(ops, logp, entropy, inp, cfg, need_entropy)
    else:
        terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
    if grad_out is not None:
        ops.logits_grad(
            inp.logits,
            inp.labels,
            lse,
            entropy,
            terms.dlogp,
            terms.dentropy,
            scalar,
            grad_out,
            **rows,
        )
    return logp, entropy if need_entropy else None, terms
