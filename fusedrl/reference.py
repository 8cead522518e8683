"""The oracle: GRPO-family policy losses in plain, eager PyTorch (fp32, autograd).

Every other backend is tested against this file, so it is written to be read, not to be fast: it
materialises fp32 copies of the logits and lets autograd derive every gradient. The formulas follow
verl's `core_algos.py` conventions (ratio log clamp at +-20, k3 clamps, empty sequences excluded
from seq-mean); docs/losses.md states them per variant.

It is independent of what it judges: it imports no backend, kernel or `token_terms`, and nothing
but tests imports it. Its clamps, ratio bounds, IS weights and masked statistics have a second,
separately written copy in `fusedrl.token_terms`, on purpose (see there). Only argument
validation (`fusedrl._inputs`) and the config are shared.

Masked tokens never reach the loss or its gradient: their logits are replaced by zeros before the
softmax (so a NaN in a padded row cannot leak) and their labels by 0.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._inputs import (
    LossInputs,
    check_labels,
    check_logits,
    check_sum_pi_squared,
    check_temperature,
    prepare_loss_inputs,
    temperature_in_config,
)
from .config import LossConfig, parse_rejection
from .output import LossOutput

LOG_RATIO_CLAMP = 20.0  # verl: clamp log(pi/pi_old) before exp for stability
SEQ_LOG_RATIO_MAX = 10.0  # verl gspo: clamp the sequence log-ratio from above
KL_LOG_CLAMP = 20.0  # verl k3: clamp ref - logp
KL_VALUE_CLAMP = 10.0  # verl k3: clamp the estimate


def _vllm_sampling_set(scaled, labels, top_k, top_p, min_p) -> torch.Tensor:
    """The tokens vLLM's V1 sampler keeps, on temperature-scaled logits [..., V], in its order:
    min_p on the probabilities, then top_k (ties kept), then top_p on the renormalised rest
    (ascending cumulative sum <= 1 - p dropped, the largest kept); the sampled label always."""
    keep = torch.ones_like(scaled, dtype=torch.bool)
    z = scaled.detach()
    if min_p is not None and min_p > 0:
        probs = torch.softmax(z, -1)
        keep &= probs >= probs.amax(-1, keepdim=True) * min_p
    if top_k is not None and 0 < top_k < z.shape[-1]:  # vLLM: top_k 0 and -1 are off
        kth = torch.topk(z.masked_fill(~keep, float("-inf")), top_k, -1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None and top_p < 1:
        masked = z.masked_fill(~keep, float("-inf"))
        ordered, order = torch.sort(masked, -1)  # ascending
        cumulative = torch.softmax(ordered, -1).cumsum(-1)
        dropped = cumulative <= 1 - top_p
        dropped[..., -1] = False
        keep &= ~torch.zeros_like(dropped).scatter(-1, order, dropped)
    label_slot = torch.zeros_like(keep).scatter(-1, labels.long().clamp_min(0).unsqueeze(-1), True)
    return keep | label_slot


def _log_softmax_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    sampling: tuple = (None, None, None),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # fp64 stays fp64 so the oracle itself can be gradchecked; everything else computes in fp32.
    scaled = (logits.double() if logits.dtype == torch.float64 else logits.float()) / temperature
    if any(v is not None for v in sampling):
        kept = _vllm_sampling_set(scaled, labels, *sampling)
        scaled = scaled.masked_fill(~kept, float("-inf"))
    log_probs = torch.log_softmax(scaled, dim=-1)
    logp = log_probs.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    # A +inf logit makes the row's distribution undefined: say so with NaN rather than a -inf
    # logp that the ratio clamp would quietly turn into a finite loss.
    corrupt = scaled.amax(-1) == float("inf")
    logp = torch.where(corrupt, float("nan"), logp)
    entropy = None
    if return_entropy:
        probs = log_probs.exp()
        # -inf logits (banned tokens) have p = 0 and contribute 0, not 0 * -inf = NaN.
        entropy = -(probs * torch.where(probs > 0, log_probs, 0.0)).sum(-1)
        entropy = torch.where(corrupt, float("nan"), entropy)
    return logp, entropy


def _model_logits(
    logits: torch.Tensor, logit_scale: float | None, softcap: float | None
) -> torch.Tensor:
    """The logits the model outputs from these, in fp32 (fp64 stays fp64): s x, or under a soft
    cap c tanh(s x / c), where a banned logit (-inf, or -finfo.max of the logits' dtype, as
    masks write it) stays -inf (a banned token is not given probability by the cap)."""
    scale = 1.0 if logit_scale is None else logit_scale
    work = (logits.double() if logits.dtype == torch.float64 else logits.float()) * scale
    if softcap is None:
        return work
    # NaN (padding) goes around the tanh: its backward would turn a zero gradient into NaN
    nan = torch.isnan(work)
    capped = softcap * torch.tanh(torch.where(nan, 0.0, work) / softcap)
    capped = torch.where(nan, float("nan"), capped)
    return torch.where(logits <= -torch.finfo(logits.dtype).max, float("-inf"), capped)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature)[labels] in fp32, optionally the entropy; differentiable.
    With top_k / top_p / min_p, over the set vLLM's sampler kept (the rest at -inf). A tensor
    `temperature` holds one per token (or one per sequence, [B]). `logit_scale`: the logits are
    s x, scaled here first; `softcap`: they are c tanh(s x / c) (`_model_logits`).

    `backend` is accepted (and ignored) so the reference is a drop-in for `fusedrl.token_logprobs`.
    """
    if logit_scale is not None or softcap is not None:
        logits = _model_logits(logits, logit_scale, softcap)
    logits = check_logits(logits)
    labels = check_labels(labels, logits, None)
    if isinstance(temperature, torch.Tensor):
        per_token = temperature.float()
        if per_token.dim() == 1 and labels.dim() == 2:  # one per sequence
            per_token = per_token[:, None]
        temperature = per_token.expand(labels.shape).unsqueeze(-1)
    else:
        temperature = check_temperature(temperature)
    return _log_softmax_stats(logits, labels, temperature, return_entropy, (top_k, top_p, min_p))


def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """sum_v pi_v^2 per row, pi = softmax(logits / temperature), from the probabilities (fp64
    for fp64 input, else fp32); no gradient."""
    logits = check_logits(logits)
    with torch.no_grad():
        work = logits.double() if logits.dtype == torch.float64 else logits.float()
        probs = torch.softmax(work / check_temperature(temperature), dim=-1)
        return (probs * probs).sum(-1)


# ---------------------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    num = torch.where(inp.valid, x.float() * inp.mask, 0.0).sum()
    return num / inp.mask.sum().clamp_min(1e-8)


def _masked_max(x: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    if x.numel() == 0:
        return x.new_zeros(())
    return torch.where(inp.valid, x.float(), 0.0).max()


def add_token_metrics(
    metrics: dict,
    old: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    w: torch.Tensor | None,
    inp: LossInputs,
) -> None:
    """The metrics that are plain masked statistics of per-token values (no loss math)."""
    metrics["ppo_kl"] = masked_mean(old - logp, inp)
    metrics["logp_mean"] = masked_mean(logp, inp)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, inp)
    if w is not None:
        metrics["is_weight_mean"] = masked_mean(w, inp)
        metrics["is_weight_max"] = _masked_max(w, inp)


def aggregate(per_token: torch.Tensor, inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """verl's agg_loss; `normalizer` replaces the token count or the sequence count."""
    weighted = torch.where(inp.valid, per_token * inp.mask, 0.0)
    seq_len = inp.mask.sum(-1)
    nonempty = seq_len > 0
    if cfg.agg == "token-mean":
        denom = inp.normalizer if inp.normalizer is not None else inp.mask.sum().clamp_min(1e-8)
        return weighted.sum() / denom
    n_seq = inp.normalizer if inp.normalizer is not None else nonempty.sum().clamp_min(1)
    if cfg.agg == "seq-mean-token-mean":
        per_seq = weighted.sum(-1) / seq_len.clamp_min(1e-8)
        return torch.where(nonempty, per_seq, 0.0).sum() / n_seq
    if cfg.agg == "seq-mean-token-sum":
        return torch.where(nonempty, weighted.sum(-1), 0.0).sum() / n_seq
    # seq-mean-token-sum-norm (Dr.GRPO): a constant denominator, all sequences counted.
    # B = 0 or T = 0: an empty sum over a count of at least 1, so the loss is 0, not 0 / 0.
    batch, time = per_token.shape
    n_all = inp.normalizer if inp.normalizer is not None else float(max(batch, 1))
    norm = cfg.norm_constant if cfg.norm_constant is not None else float(max(time, 1))
    return weighted.sum() / n_all / norm


def kl_estimate(
    logp: torch.Tensor, ref: torch.Tensor, kind: str, clamp: bool = True
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators (Schulman's k1/k2/k3, verl's clamps and '+' forms;
    `clamp=False`: k3 as TRL writes it, pi_ref / pi - log(pi_ref / pi) - 1 with no clamp)."""
    delta = logp - ref
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta.square()
    if kind == "abs":
        return delta.abs()
    if clamp:
        k3_log = torch.clamp(-delta, -KL_LOG_CLAMP, KL_LOG_CLAMP)
        k3 = torch.clamp(k3_log.exp() - k3_log - 1.0, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    else:
        k3 = torch.exp(ref - logp) - (ref - logp) - 1.0
    if kind == "k3":
        return k3
    # Straight-through: the value of k1 / k3, the gradient of k2 (unbiased KL gradient).
    forward = delta if kind == "k1+" else k3
    k2 = 0.5 * delta.square()
    return k2 - k2.detach() + forward.detach()


def exact_kl(
    logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float, kind: str
) -> torch.Tensor:
    """KL(pi || pi_ref) ("full") or KL(pi_ref || pi) ("full_reverse") summed over the vocabulary
    per token, both distributions softmax(logits / temperature); differentiable in `logits`."""
    if kind == "full":
        return vocab_kl(logits, ref_logits, temperature)
    return vocab_kl(ref_logits, logits, temperature)


class _Unbounded(torch.autograd.Function):
    """+inf per row of `logits` [..., V], whose derivative is not defined: NaN in every element
    of a row that the loss weighs (a zero upstream gradient stays zero)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        ctx.shape = logits.shape
        return torch.full(logits.shape[:-1], float("inf"), dtype=logits.dtype, device=logits.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(grad[..., None] != 0, float("nan"), 0.0).expand(ctx.shape)


def _nan_inputs_term(logp, old, adv, w, inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """The rule for a NaN in an input that a counted token's loss term computes with (its old
    or ref log-prob, its advantage, its IS weight): the term is NaN, and so is the token's
    gradient row, on every backend; where the input enters a value its sequence shares (the
    old log-probs of a sequence-level ratio, and its own log-prob there: a NaN logit; GMPO's
    per-sequence objective, its advantages too), every counted token's row of that sequence. A
    sequence IS weight carries its NaN to each of its tokens' `w`. Not NaN: a mask decided on a
    NaN (is_correction's "_mask" modes) drops the token (no comparison with NaN holds), and
    VESPO's phi of a NaN sequence ratio is 0 (TRL's nan_to_num), so its old log-probs drop the
    sequence. Autograd through clamp / min / where would drop the NaN from the gradient; this
    term (0 elsewhere, with a zero gradient) keeps it."""
    old_nan = torch.isnan(old) if cfg.loss != "vespo" else torch.zeros_like(inp.valid)
    unread = old_nan | torch.isnan(adv)
    if w is not None:
        unread = unread | torch.isnan(w)
    if cfg.beta > 0 and inp.ref_logp is not None:
        unread = unread | torch.isnan(inp.ref_logp)
    if cfg.ratio_level == "sequence" or cfg.loss == "gmpo":
        # a NaN log-prob (a NaN or +inf logit) enters the sequence's ratio as its old one does
        logp_nan = torch.isnan(logp.detach()) if cfg.loss != "vespo" else False
        shared = old_nan | logp_nan | (torch.isnan(adv) if cfg.loss == "gmpo" else False)
        unread = unread | (shared & inp.valid).any(-1, keepdim=True)
    unread = unread & inp.valid
    return torch.where(unread, logp, 0.0) * torch.where(unread, float("nan"), 0.0)


def vocab_kl(first: torch.Tensor, second: torch.Tensor, temperature) -> torch.Tensor:
    """KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)) per row, P = softmax(first / T), Q =
    softmax(second / T), differentiable in either.

    A banned token (a -inf logit, or -finfo.max of the logits' dtype, as masks write it) has
    probability 0; any other logit has probability > 0, however small it rounds. So: 0 log 0 = 0
    where P bans v, and the KL is +inf where P can emit a token that Q bans. There the
    derivative in P's logits is not defined (NaN, `_Unbounded`); the derivative in Q's logits
    is the finite d/dz (-sum_v P(v) log Q(v)) = (Q - P) / T, exact, kept."""
    upcast = torch.float64 if first.dtype == torch.float64 else torch.float32
    p_bans = first <= -torch.finfo(first.dtype).max
    q_bans = second <= -torch.finfo(second.dtype).max
    log_p = torch.log_softmax(first.to(upcast) / temperature, dim=-1)
    log_q = torch.log_softmax(second.to(upcast) / temperature, dim=-1)
    finite = _kl_terms(log_p, log_q, ~p_bans & ~q_bans)
    infinite = (~p_bans & q_bans).any(-1)
    if not bool(infinite.any()):
        return finite
    # Where infinite: +inf, NaN in P's logits, and in Q's the gradient of the cross-entropy
    # terms -P(v) log Q(v) of every token P emits, those Q bans included (+inf there).
    cross = _kl_terms(log_p, log_q, ~p_bans & (log_p.exp() > 0))
    return torch.where(infinite, cross + _Unbounded.apply(first), finite)


def _kl_terms(log_p: torch.Tensor, log_q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """sum_v P(v) (log P(v) - log Q(v)) over the tokens `keep`; the others' -inf log-probs are
    replaced before the product, so that their zero gradient is not 0 x inf = NaN."""
    safe_p = torch.where(keep, log_p, 0.0)
    return torch.where(keep, safe_p.exp() * (safe_p - log_q), 0.0).sum(-1)


def is_weights(old: torch.Tensor, inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """Train/inference importance weight exp(old - rollout), truncated or masked, detached."""
    log_w = torch.where(inp.valid, old - inp.rollout_logp, 0.0)
    if cfg.is_correction.startswith("sequence"):
        log_w = (log_w * inp.mask).sum(-1, keepdim=True).expand_as(old)
    w = torch.clamp(log_w, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if cfg.is_correction.endswith("truncate"):
        w = torch.clamp(w, min=cfg.is_cap_low, max=cfg.is_cap)
    else:
        low = cfg.is_cap_low if cfg.is_cap_low is not None else 1.0 / cfg.is_cap
        # outside the bounds: 0 (a NaN weight too: no comparison with it holds)
        w = torch.where((w >= low) & (w <= cfg.is_cap), w, 0.0)
    return w.detach()


def resolve_is_weights(old: torch.Tensor, inp: LossInputs, cfg: LossConfig):
    """The IS weights of the call: precomputed (`is_weights=`), from `rollout_logp`, or None."""
    if inp.is_weights is not None:
        return inp.is_weights
    return is_weights(old, inp, cfg) if cfg.is_correction is not None else None


def ratio_bounds(old: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.loss == "dcpo":
        q = old.exp()
        low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * cfg.eps_low / q, min=0.0))
        high = torch.clamp(0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * cfg.eps_high / q), max=cfg.dcpo_r_max)
        return low, high
    return torch.full_like(old, 1.0 - cfg.eps_low), torch.full_like(old, 1.0 + cfg.eps_high)


def _gmpo(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    w: torch.Tensor | None,
    inp: LossInputs,
    cfg: LossConfig,
    metrics: dict,
) -> torch.Tensor:
    """GMPO (verl "geo_mean"): geometric mean of sign-aware clipped token ratios per sequence."""
    log_ratio = logp - old
    clipped = torch.clamp(log_ratio, -cfg.eps_low, cfg.eps_high)
    sign = torch.sign(adv)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_len = inp.mask.sum(-1).clamp_min(1e-8)
    seq_log_ratio = torch.where(inp.valid, log_ratio_min * inp.mask, 0.0).sum(-1) / seq_len
    seq_adv = torch.where(inp.valid, adv * inp.mask, 0.0).sum(-1) / seq_len
    per_seq = -seq_adv * seq_log_ratio.exp()
    if w is not None:
        per_seq = per_seq * w[:, 0]
    n_seq = inp.normalizer if inp.normalizer is not None else float(max(per_seq.shape[0], 1))
    high = (log_ratio > cfg.eps_high) & (adv > 0)
    low = (log_ratio < -cfg.eps_low) & (adv < 0)
    metrics["clip_high"] = masked_mean(high, inp)
    metrics["clip_low"] = masked_mean(low, inp)
    metrics["clipfrac"] = masked_mean(high | low, inp)
    return per_seq.sum() / n_seq


def _ratio(logp: torch.Tensor, old: torch.Tensor, inp: LossInputs, cfg: LossConfig):
    """pi / pi_old per token, or GSPO's sequence ratio (value s_i = exp(mean_t log-ratio),
    gradient s_i * grad logp_t per token)."""
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.ratio_level == "sequence":
        seq_len = inp.mask.sum(-1, keepdim=True).clamp_min(1.0)
        seq_log_ratio = torch.where(inp.valid, log_ratio * inp.mask, 0.0).sum(-1, keepdim=True)
        seq_log_ratio = (seq_log_ratio / seq_len).detach()
        log_ratio = torch.clamp(logp - logp.detach() + seq_log_ratio, max=SEQ_LOG_RATIO_MAX)
    return log_ratio.exp()


def _whole_sequence_ratio(logp: torch.Tensor, old: torch.Tensor, inp: LossInputs):
    """GSPO's sequence ratio s_i = exp(min(mean_t log-ratio, 10)) as a function of every token
    of the sequence ([B, 1]; TRL's coef_1 at importance_sampling_level="sequence", which its
    bias-corrected KL is multiplied by and differentiated through)."""
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_len = inp.mask.sum(-1, keepdim=True).clamp_min(1.0)
    seq_log_ratio = torch.where(inp.valid, log_ratio * inp.mask, 0.0).sum(-1, keepdim=True)
    return torch.clamp(seq_log_ratio / seq_len, max=SEQ_LOG_RATIO_MAX).exp()


def _vespo(logp, old, adv, w, inp, cfg, metrics) -> torch.Tensor:
    """VESPO (TRL's get_gamma_weights): -phi A logp, phi = e^lam w^k e^(-lam w) of the sequence
    ratio w (log w clamped to [log 1e-8, 20], per-token IS weights multiplied in), no gradient."""
    floor = math.log(1e-8)
    with torch.no_grad():
        token_log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_w = torch.where(inp.valid, token_log_ratio * inp.mask, 0.0).sum(-1, keepdim=True)
        if w is not None:
            log_is = torch.clamp(w.log(), floor, LOG_RATIO_CLAMP)
            log_w = log_w + torch.where(inp.valid, log_is, 0.0).sum(-1, keepdim=True)
        log_w = torch.clamp(log_w, floor, LOG_RATIO_CLAMP)
        positive = adv >= 0
        k = torch.where(positive, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(positive, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        phi = (math.e**lam) * log_w.exp() ** k * torch.exp(-lam * log_w.exp())
        phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
    metrics["vespo_phi_mean"] = masked_mean(phi.expand_as(logp), inp)
    return -phi * adv * logp


def _off_policy_mask(logp, old, adv, inp, cfg, metrics) -> torch.Tensor:
    """DeepSeek-V3.2: keep a token if A >= 0 or its sequence's mean (sampler - policy) log-prob
    gap is at most the threshold; the sampler is rollout_logp when given, else old."""
    sampler = inp.rollout_logp if inp.rollout_logp is not None else old
    gap = (sampler - logp.detach()).nan_to_num(nan=0.0)
    w = torch.where(inp.valid, inp.mask, 0.0)
    mean_gap = (torch.where(inp.valid, gap, 0.0) * w).sum(-1, keepdim=True)
    mean_gap = mean_gap / w.sum(-1, keepdim=True).clamp_min(1.0)
    keep = (adv >= 0) | (mean_gap <= cfg.off_policy_mask)
    _masked_share(metrics, "off_policy_masked", ~keep, inp)
    return keep.float()


def _top_entropy_mask(entropy, inp, cfg, metrics) -> torch.Tensor:
    """TRL's get_high_entropy_mask: entropy >= the (1 - rho) quantile of the counted tokens."""
    counted = inp.valid & (inp.mask > 0)
    values = entropy.detach()[counted].float()
    if values.numel() == 0:
        keep = torch.zeros_like(counted)
    else:
        keep = (entropy.detach() >= torch.quantile(values, 1 - cfg.top_entropy_quantile)) & counted
    metrics["entropy_masked"] = masked_mean((~keep).float(), inp)
    return keep.float()


def _masked_share(metrics: dict, name: str, dropped: torch.Tensor, inp: LossInputs) -> None:
    """Share of counted tokens dropped, and of non-empty sequences with a token dropped."""
    metrics[name] = masked_mean(dropped.float(), inp)
    counted = inp.valid & (inp.mask > 0)
    seqs = [(row_drop & row).any() for row_drop, row in zip(dropped, counted) if row.any()]
    share = torch.stack(seqs).float().mean() if seqs else torch.zeros(())
    metrics[name + "_seqs"] = share.to(inp.mask.device)


def _mismatch_metrics(metrics: dict, logp, w, inp: LossInputs) -> None:
    """KL(rollout || trainer) (k1, k3), chi-square of the trainer / rollout ratios per token and
    per sequence (verl's rollout_corr formulas, with the pass's own log-probs as the trainer's),
    and the effective sample size and masked shares of the IS weights."""
    if inp.rollout_logp is not None:
        counted = inp.valid & (inp.mask > 0)
        # float64 and expm1: the chi-square is a small difference of terms near 1.
        gap = torch.where(counted, logp.double() - inp.rollout_logp.double(), 0.0).nan_to_num()
        x = torch.clamp(gap, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        m = torch.where(counted, inp.mask.double(), 0.0)

        def mean(v):
            return ((v * m).sum() / m.sum().clamp_min(1e-8)).float()

        metrics["mismatch_kl_k1"] = mean(-gap)
        metrics["mismatch_kl_k3"] = mean(x.exp() - x - 1)
        metrics["mismatch_chi2_token"] = mean(torch.expm1(2 * x))
        per_seq = [
            torch.expm1(2 * torch.clamp(row_gap.sum(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            for row_gap, row in zip(gap, counted)
            if row.any()
        ]
        chi2_seq = torch.stack(per_seq).mean() if per_seq else torch.zeros(())
        metrics["mismatch_chi2_seq"] = chi2_seq.float().to(logp.device)
    if w is not None:
        w = w.expand_as(logp).float()
        normalised = w / masked_mean(w, inp).clamp_min(1e-8)
        second_moment = masked_mean(normalised * normalised, inp)
        ess = 1 / second_moment if second_moment > 0 else torch.zeros(())
        metrics["is_ess"] = ess.float().to(logp.device)
        _masked_share(metrics, "is_masked", w == 0, inp)


def _clipped_objective(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    inp: LossInputs,
    cfg: LossConfig,
    metrics: dict,
) -> torch.Tensor:
    """Per-token loss of the ratio variants (ppo, dcpo, cispo, sapo; token or sequence ratio)."""
    ratio = _ratio(logp, old, inp, cfg)
    low, high = ratio_bounds(old, cfg)

    metrics["clip_low"] = masked_mean((ratio < low) & (adv < 0), inp)
    metrics["clip_high"] = masked_mean((ratio > high) & (adv > 0), inp)
    if cfg.loss == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        metrics["clipfrac"] = torch.zeros((), device=logp.device)
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    # torch.clamp, as verl and TRL write it: at a ratio exactly on a bound the gradient passes
    # (min(max(r, lo), hi) would pass half of it).
    clipped_ratio = torch.clamp(ratio, low, high)
    if cfg.loss == "cispo":
        metrics["clipfrac"] = masked_mean(ratio != clipped_ratio, inp)
        return -clipped_ratio.detach() * adv * logp

    unclipped_ratio = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    loss_unclipped = -adv * unclipped_ratio
    loss_clipped = -adv * clipped_ratio
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    metrics["clipfrac"] = masked_mean(loss_clipped > loss_unclipped, inp)
    if cfg.dual_clip_c is not None:
        loss_dual = -adv * cfg.dual_clip_c
        metrics["dual_clipfrac"] = masked_mean((per_token > loss_dual) & (adv < 0), inp)
        per_token = torch.where(adv < 0, torch.minimum(per_token, loss_dual), per_token)
    return per_token


def _rejection_sampling(old, inp: LossInputs, cfg: LossConfig, metrics: dict) -> LossInputs:
    """verl's rollout rejection sampling: each option's statistic of KL(rollout || old), per
    token or per sequence on the original mask; a token stays when every option keeps it."""
    response = torch.where(inp.valid, inp.mask, 0.0)
    log_r = torch.clamp(torch.where(inp.valid, old - inp.rollout_logp, 0.0), -20.0, 20.0)
    per_token = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1.0 - log_r}
    kept = torch.ones(response.shape, dtype=torch.bool, device=response.device)
    rules = () if cfg.rejection is None else parse_rejection(cfg.rejection, cfg.rejection_threshold)
    for rule in rules:
        values = per_token[rule.estimator]
        if rule.reduction == "token":
            statistic = values
        else:
            total = (values * response).sum(-1)
            if rule.reduction == "mean":
                total = total / (response.sum(-1) + 1e-8)
            elif rule.reduction == "max":
                filled = values.masked_fill(response == 0, float("-inf")).max(-1).values
                total = torch.where(filled == float("-inf"), torch.zeros_like(filled), filled)
            statistic = total[:, None].expand(response.shape)
        option_keeps = statistic <= rule.upper
        if rule.lower is not None:
            option_keeps = option_keeps & (statistic >= rule.lower)
        metrics[f"rs_{rule.option}_masked"] = masked_mean(~option_keeps, inp)
        kept = kept & option_keeps
    if cfg.trust_region_delta is not None:
        # arXiv 2512.23075: a sequence whose log(pi_old / pi_rollout) leaves [-delta, delta] on
        # some token (max) or on average (mean) is dropped whole
        counted = response > 0
        outside = log_r.abs() > cfg.trust_region_delta
        if cfg.trust_region_mode == "max":
            bad = (outside & counted).any(-1)
        else:
            mean_log_r = (log_r * response).sum(-1) / (response.sum(-1) + 1e-8)
            bad = mean_log_r.abs() > cfg.trust_region_delta
        option_keeps = ~bad[:, None].expand(response.shape)
        name = "tr_max_k2" if cfg.trust_region_mode == "max" else "tr_mean_k1"  # verl's spelling
        metrics[f"rs_{name}_masked"] = masked_mean(~option_keeps, inp)
        kept = kept & option_keeps
    metrics["rs_masked"] = masked_mean(~kept, inp)
    rows_hit = ((~kept) & (response > 0)).any(-1)
    metrics["rs_masked_seqs"] = rows_hit.float().sum() / max(rows_hit.numel(), 1)
    return dataclasses.replace(inp, mask=inp.mask * kept.float())


def _m2po(logp, old, inp: LossInputs, cfg: LossConfig, metrics: dict) -> LossInputs:
    """M2PO (AReaL's m2_threshold): drop the counted tokens of largest (logp - old)^2, one at a
    time, while the mean over the tokens left is >= tau (keeping at least one)."""
    counted = (inp.valid & (inp.mask > 0)).flatten()
    m2 = ((logp - old) ** 2).flatten()
    order = sorted((i for i in range(m2.numel()) if counted[i]), key=lambda i: (-float(m2[i]), i))
    dropped = torch.zeros_like(counted)
    remaining = list(order)
    while len(remaining) > 1 and sum(float(m2[i]) for i in remaining) / len(remaining) >= (
        cfg.m2po_tau
    ):
        dropped[remaining.pop(0)] = True
    dropped = dropped.view(inp.mask.shape)
    metrics["m2po_masked"] = masked_mean(dropped.float(), inp)
    return dataclasses.replace(inp, mask=inp.mask * (~dropped).float())


def _select_flat(mask: torch.Tensor, scores: torch.Tensor, count: int) -> torch.Tensor:
    """A mask of the `count` tokens of `mask` with the largest scores (ties: row-major order)."""
    where = torch.nonzero(mask.flatten()).flatten()
    chosen = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if where.numel() == 0:
        return chosen.view(mask.shape)
    order = torch.argsort(-scores.flatten()[where], stable=True)[:count]
    chosen[where[order]] = True
    return chosen.view(mask.shape)


def _verl_objective(logp, old, adv, inp, cfg, metrics) -> torch.Tensor:
    """Per-token loss of verl's clip_cov, kl_cov, dppo_tv, dppo_kl and dro (verl 0.9.1
    core_algos.py), differentiated by autograd."""
    counted = inp.valid & (inp.mask > 0)
    n_counted = int(counted.sum())
    log_ratio = logp - old
    if cfg.loss == "dro":
        return -(logp * adv - 0.5 * cfg.dro_beta * log_ratio**2)
    if cfg.loss in ("dppo_tv", "dppo_kl"):
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        truncated = torch.clamp(ratio, max=cfg.dppo_ratio_cap).detach()
        p, p_old = torch.exp(logp), torch.exp(old)
        if cfg.loss == "dppo_tv":
            positive_ok = (p - p_old) <= cfg.eps_high
            negative_ok = (p - p_old) >= -cfg.eps_low
        else:
            binary_kl = p_old * (old - logp) + (1 - p_old) * torch.log(
                (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
            )
            positive_ok = (binary_kl <= cfg.eps_high) | (p <= p_old)
            negative_ok = (binary_kl <= cfg.eps_low) | (p >= p_old)
        valid = torch.where(adv > 0, positive_ok, negative_ok).detach().float()
        metrics["clipfrac"] = masked_mean(1.0 - valid, inp)
        metrics["ratio_capped"] = masked_mean((ratio > cfg.dppo_ratio_cap).float() * valid, inp)
        loss = -adv * truncated * logp * valid
        if cfg.kl_tau > 0:  # prime-rl's kl_tau (log r)^2, kept tokens or not
            metrics["dppo_kl_term"] = masked_mean(log_ratio.detach() ** 2, inp)
            loss = loss + cfg.kl_tau * log_ratio**2
        return loss
    ratio = torch.exp(log_ratio)
    adv_c = torch.where(counted, adv, 0.0)
    logp_c = torch.where(counted, logp.detach(), 0.0)
    if cfg.loss == "kl_cov":
        mean_adv = adv_c.sum() / max(n_counted, 1)
        mean_logp = logp_c.sum() / max(n_counted, 1)
        cov = (adv - mean_adv) * (logp.detach() - mean_logp)
        k = max(1, int(n_counted * cfg.kl_cov_ratio))
        chosen = _select_flat(counted, cov, k)
        metrics["cov_selected"] = masked_mean(chosen, inp)
        penalty = cfg.kl_cov_coef * torch.abs(log_ratio)
        return torch.where(chosen, -adv * ratio + penalty, -adv * ratio)
    # clip_cov: verl's masked means divide by count + 1e-8
    mean_adv = adv_c.sum() / (n_counted + 1e-8)
    mean_logp = logp_c.sum() / (n_counted + 1e-8)
    cov = (adv - mean_adv) * (logp.detach() - mean_logp)
    loss_1 = -adv * ratio
    loss_2 = -adv * torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    clipped_by_ppo = (loss_2 > loss_1) & counted
    candidates = counted & ~clipped_by_ppo & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    generator = None
    if cfg.clip_cov_seed is not None:
        generator = torch.Generator(device=logp.device).manual_seed(cfg.clip_cov_seed)
    keys = torch.rand(logp.shape, generator=generator, device=logp.device)
    n_zeroed = max(int(cfg.clip_cov_ratio * n_counted), 1)
    zeroed = _select_flat(candidates, -keys, n_zeroed)  # the smallest keys
    metrics["clipfrac"] = masked_mean(zeroed, inp)
    metrics["clip_low"] = masked_mean((ratio < 1 - cfg.eps_low) & (adv < 0), inp)
    metrics["clip_high"] = masked_mean((ratio > 1 + cfg.eps_high) & (adv > 0), inp)
    return torch.maximum(loss_1, loss_2) * (~zeroed).float()


def policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    inplace: bool = False,
    backend: str | None = None,
    return_entropy: bool = False,
    is_weights: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
    temperature: float | torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    entropy_coef: torch.Tensor | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    grad_scale: float | torch.Tensor | None = None,
    return_sum_pi_squared: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> LossOutput:
    """The GRPO-family policy loss of DESIGN section 4, eager and in fp32.

    `cu_seqlens`: packed [N, V] logits of S sequences: the padded call on the sequences cut
    out of them (`max_seqlen` unused), its per-token outputs packed again.

    `inplace` and `backend` exist for signature parity with `fusedrl.policy_loss`; ignored.
    `grad_scale` is checked and has no other effect: fusedrl writes its gradient times it and
    divides it out of the upstream gradient, so its gradients are autograd's, as here.
    `temperature`: a number in place of config.temperature, or per-token temperatures, each
    token's logits divided by its own. `return_sum_pi_squared`: sum_v pi_v^2 per counted token
    from the probabilities at that temperature (0 elsewhere).
    `prox_logp`: decoupled PPO (AReaL's ppo_actor_loss_fn): the ratio against pi_prox, each
    token's loss times pi_prox / pi_behav (old_logp: the behaviour policy; its log clamped at
    +-20 before the exp, as verl clamps log-ratios), dropped above config.decoupled_is_cap.
    `entropy_coef`: the bonus's coefficient as a tensor, in place of config.entropy_coef.
    `logit_scale`: the model's logits are s x (Cohere's logit_scale): x scaled here, the
    reference's logits too. `softcap`: they are c tanh(s x / c) (Gemma 2/3), the reference's
    too (`_model_logits`).
    """
    if cu_seqlens is not None:  # (before the model's transform: the padded call applies it)
        tensors = dict(labels=labels, advantages=advantages, mask=mask, old_logp=old_logp)
        tensors.update(ref_logp=ref_logp, rollout_logp=rollout_logp, is_weights=is_weights)
        tensors.update(temperature=temperature, prox_logp=prox_logp, ref_logits=ref_logits)
        rest = dict(config=config, normalizer=normalizer, return_entropy=return_entropy)
        rest.update(entropy_coef=entropy_coef, grad_scale=grad_scale)
        rest.update(logit_scale=logit_scale, softcap=softcap)
        rest.update(return_sum_pi_squared=return_sum_pi_squared)
        return _packed(logits, cu_seqlens, tensors, rest)
    if logit_scale is not None or softcap is not None:
        logits = _model_logits(logits, logit_scale, softcap)
        if ref_logits is not None:
            ref_logits = _model_logits(ref_logits, logit_scale, softcap)
    cfg, temperature = temperature_in_config(config, temperature)
    cfg = cfg if cfg is not None else LossConfig()
    if prox_logp is not None and old_logp is not None:
        # log(pi_prox / pi_behav) clamped at +-20 before the exp, as verl clamps its log-ratios
        log_w = (prox_logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        behaviour = torch.exp(log_w)
        if cfg.decoupled_is_cap is not None:
            behaviour = torch.where(behaviour <= cfg.decoupled_is_cap, behaviour, 0.0)
        is_weights = behaviour if is_weights is None else is_weights * behaviour
        old_logp, prox_logp = prox_logp, None
    elif prox_logp is not None:
        raise ValueError("prox_logp needs old_logp (the behaviour policy's log-probs)")
    inp = prepare_loss_inputs(
        logits,
        labels,
        advantages,
        mask,
        old_logp,
        ref_logp,
        rollout_logp,
        cfg,
        normalizer,
        is_weights,
        ref_logits=ref_logits,
        temperature=temperature,
        entropy_coef=entropy_coef,
        grad_scale=grad_scale,
    )
    bonus_coef = cfg.entropy_coef if entropy_coef is None else entropy_coef.float().reshape(())
    has_bonus = entropy_coef is not None or cfg.entropy_coef != 0.0
    need_entropy = return_entropy or has_bonus or cfg.top_entropy_quantile < 1
    safe_logits = torch.where(inp.valid.unsqueeze(-1), inp.logits, 0.0)
    divisor = cfg.temperature if inp.row_temps is None else inp.row_temps.unsqueeze(-1)
    logp, entropy = _log_softmax_stats(
        safe_logits, inp.labels, divisor, need_entropy, (cfg.top_k, cfg.top_p, cfg.min_p)
    )
    old = inp.old_logp if inp.old_logp is not None else logp.detach()
    adv = inp.advantages
    zero = torch.zeros((), device=logp.device)
    metrics: dict[str, torch.Tensor] = {
        "clipfrac": zero,
        "clip_low": zero,
        "clip_high": zero,
        "dual_clipfrac": zero,
    }

    w = resolve_is_weights(old, inp, cfg)  # rejection leaves the IS weights alone (verl)
    sampled = inp
    if cfg.rejection is not None or cfg.trust_region_delta is not None:
        inp = _rejection_sampling(old, inp, cfg, metrics)
    measured = inp  # M2PO's dropped tokens stay in the token metrics
    if cfg.m2po_tau is not None:
        inp = _m2po(logp.detach(), old, inp, cfg, metrics)
    top_entropy = None
    if cfg.top_entropy_quantile < 1:
        top_entropy = _top_entropy_mask(entropy, inp, cfg, metrics)
    if cfg.loss == "gmpo":
        loss = _gmpo(logp, old, adv, w, inp, cfg, metrics)
        per_token = torch.zeros_like(logp)
    else:
        if cfg.loss == "pg":
            per_token = -adv * logp
        elif cfg.loss == "vespo":
            per_token = _vespo(logp, old, adv, w, inp, cfg, metrics)
        elif cfg.loss in ("clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"):
            per_token = _verl_objective(logp, old, adv, inp, cfg, metrics)
        else:
            per_token = _clipped_objective(logp, old, adv, inp, cfg, metrics)
        if cfg.off_policy_mask is not None:
            per_token = per_token * _off_policy_mask(logp, old, adv, inp, cfg, metrics)
        if top_entropy is not None:
            per_token = per_token * top_entropy
        if w is not None and cfg.loss != "vespo":  # VESPO has its IS weights inside phi
            per_token = per_token * w
        loss = zero
    if cfg.kl in ("full", "full_reverse"):
        safe_ref = torch.where(inp.valid.unsqueeze(-1), inp.ref_logits, 0.0)
        kl = exact_kl(safe_logits, safe_ref, divisor, cfg.kl)
        kl = torch.where(inp.valid, kl, 0.0)
        metrics["kl"] = masked_mean(kl.detach(), inp)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    elif inp.ref_logp is not None:
        kl = kl_estimate(logp, inp.ref_logp, cfg.kl or "k3", cfg.kl_clamp)
        metrics["kl"] = masked_mean(kl.detach(), inp)
        if cfg.beta > 0:
            if cfg.kl_bias_correction and cfg.ratio_level == "sequence":
                kl = kl * _whole_sequence_ratio(logp, old, inp)
            elif cfg.kl_bias_correction:  # KL(pi || ref) under samples of pi_old: times r
                kl = kl * _ratio(logp, old, inp, cfg)
            per_token = per_token + cfg.beta * kl
    per_token = per_token + _nan_inputs_term(logp, old, adv, w, inp, cfg)
    if has_bonus:
        bonus = entropy if top_entropy is None else entropy * top_entropy
        if cfg.entropy_agg == "token-mean":
            # TRL's bonus: sum(H m) / max(sum(m), 1) over the tokens it acts on, m = mask x the
            # top-entropy selection, whatever agg and the normalizer say
            acting = torch.where(inp.valid, inp.mask, 0.0)
            acting = acting if top_entropy is None else acting * top_entropy
            own_mean = torch.where(acting > 0, entropy * acting, 0.0).sum()
            loss = loss - bonus_coef * own_mean / acting.sum().clamp_min(1.0)
        else:
            per_token = per_token - bonus_coef * bonus
    loss = loss + aggregate(per_token, inp, cfg)

    add_token_metrics(
        metrics, old, logp.detach(), None if entropy is None else entropy.detach(), w, measured
    )
    _mismatch_metrics(metrics, logp.detach(), w, sampled)

    unflat = (lambda t: t[0]) if inp.flat_input else (lambda t: t)
    logp_out = unflat(torch.where(inp.valid, logp.detach(), 0.0))
    ent_out = None if entropy is None else unflat(torch.where(inp.valid, entropy.detach(), 0.0))
    squares = None
    if return_sum_pi_squared:
        check_sum_pi_squared(cfg.sampling is not None)
        with torch.no_grad():
            wide = torch.float64 if safe_logits.dtype == torch.float64 else torch.float32
            probs = torch.softmax(safe_logits.to(wide) / divisor, dim=-1)
            squares = unflat(torch.where(inp.valid, (probs * probs).sum(-1), 0.0))
    return LossOutput(
        loss=loss,
        logp=logp_out,
        entropy=ent_out,
        metrics={k: v.detach() for k, v in metrics.items()},
        sum_pi_squared=squares,
    )


def _packed(logits, cu_seqlens, tensors: dict, rest: dict):
    """`policy_loss` of packed sequences as the padded call: each sequence cut out of the [N, V]
    logits and its per-token inputs ([N]) and padded to the longest (mask False there); a
    per-sequence input ([S], [S, 1]) as it is."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    spans = list(zip(bounds[:-1], bounds[1:]))
    tokens = logits.shape[0]
    longest = max((b - a for a, b in spans), default=0)

    def padded(x, fill=0):
        if not isinstance(x, torch.Tensor) or not (x.dim() >= 1 and x.shape[0] == tokens):
            return x  # None, a number, or one per sequence
        tail = x.shape[1:]
        rows = [torch.cat([x[a:b], x.new_full((longest - b + a, *tail), fill)]) for a, b in spans]
        return torch.stack(rows) if rows else x.new_zeros((0, longest, *tail))

    def packed(x):
        if x is None or not spans:
            return None if x is None else x.new_zeros(0)
        return torch.cat([x[s, : b - a] for s, (a, b) in enumerate(spans)])

    fills = {"mask": False if tensors["mask"].dtype == torch.bool else 0, "is_weights": 1.0}
    fills["temperature"] = 1.0
    arguments = {name: padded(value, fills.get(name, 0)) for name, value in tensors.items()}
    out = policy_loss(padded(logits), **arguments, **rest)
    return dataclasses.replace(
        out,
        logp=packed(out.logp),
        entropy=packed(out.entropy),
        sum_pi_squared=packed(out.sum_pi_squared),
    )


# --------------------------------------------------------------------------------- distillation
def distill_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    """Per-token divergence of `fusedrl.distill_loss`, from the probabilities themselves: KL(s || q)
    (reverse_kl), KL(q || s) (forward_kl), or beta KL(q || m) + (1 - beta) KL(s || m) with the
    mixture m = beta q + (1 - beta) s (jsd; beta 0 and 1 are forward_kl and reverse_kl, as in
    TRL's generalized_jsd_loss)."""
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    if kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "reverse_kl":
        return vocab_kl(student_logits, teacher_logits, temperature)
    if kind == "forward_kl":
        return vocab_kl(teacher_logits, student_logits, temperature)
    upcast = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    s = torch.softmax(student_logits.to(upcast) / temperature, dim=-1)
    q = torch.softmax(teacher_logits.to(upcast) / temperature, dim=-1)

    def kl(p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:  # sum_v p log(p / r), 0 log 0 = 0
        # The logs read 1 where p = 0 (a banned token), so that their derivatives there are
        # finite: the unselected branch's gradient is 0, and 0 * inf would be NaN.
        held = p > 0
        p_log, r_log = torch.log(torch.where(held, p, 1.0)), torch.log(torch.where(held, r, 1.0))
        return torch.where(held, p * (p_log - r_log), 0.0).sum(-1)

    m = beta * q + (1.0 - beta) * s
    return beta * kl(q, m) + (1.0 - beta) * kl(s, m)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    inplace: bool = False,
    backend: str | None = None,
    advantages: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> LossOutput:
    """`fusedrl.distill_loss` in plain autograd; `inplace` / `backend` are ignored. `softcap`,
    `logit_scale`: both models' logits are c tanh(s x / c) (or s x) of these (`_model_logits`)."""
    if logit_scale is not None or softcap is not None:
        student_logits = _model_logits(student_logits, logit_scale, softcap)
        teacher_logits = _model_logits(teacher_logits, logit_scale, softcap)
    cfg = config if config is not None else LossConfig()
    if kind == "sampled_reverse_kl":
        return _sampled_reverse_kl(
            student_logits,
            teacher_logits,
            labels,
            mask,
            beta,
            temperature,
            cfg,
            normalizer,
            advantages,
            old_logp,
        )
    advantages = torch.zeros(student_logits.shape[:-1], device=student_logits.device)
    inp = prepare_loss_inputs(
        student_logits, labels, advantages, mask, None, None, None, cfg, normalizer
    )
    teacher = teacher_logits.detach()
    teacher = teacher.unsqueeze(0) if inp.flat_input else teacher
    keep = inp.valid.unsqueeze(-1)
    safe_student = torch.where(keep, inp.logits, 0.0)
    safe_teacher = torch.where(keep, teacher, 0.0)
    if isinstance(temperature, torch.Tensor):  # one per token (or per sequence, [B])
        per_token = temperature.float()
        if inp.flat_input:
            per_token = per_token.reshape(1, -1)
        elif per_token.dim() == 1:
            per_token = per_token[:, None]
        temperature = torch.where(inp.valid, per_token.expand(inp.labels.shape), 1.0)
        temperature = temperature.unsqueeze(-1)
    divergence = distill_divergence(safe_student, safe_teacher, kind, beta, temperature)
    divergence = torch.where(inp.valid, divergence, 0.0)
    loss = aggregate(divergence, inp, cfg)
    logp, _ = _log_softmax_stats(safe_student, inp.labels, temperature, False)
    logp = torch.where(inp.valid, logp.detach(), 0.0)
    metric = masked_mean(divergence.detach(), inp)
    unflat = (lambda t: t[0]) if inp.flat_input else (lambda t: t)
    return LossOutput(loss=loss, logp=unflat(logp), entropy=None, metrics={"distill": metric})


def _sampled_reverse_kl(
    student_logits,
    teacher_logits,
    labels,
    mask,
    beta,
    temperature,
    cfg,
    normalizer,
    advantages,
    old_logp,
) -> LossOutput:
    """kind="sampled_reverse_kl": the policy loss of `cfg` with advantages
    A_t - beta (log pi_old(y_t) - log pi_teacher(y_t)) (pi_old: old_logp, else the student)."""
    valid = mask != 0
    safe = torch.where(valid, labels, 0)
    per_token = {}
    if isinstance(temperature, torch.Tensor):  # each token's own; masked ones may hold anything
        if temperature.dim() == 1 and valid.dim() == 2:
            temperature = temperature[:, None]
        temperature = torch.where(valid, temperature.float().expand(valid.shape), 1.0)
        per_token = {"temperature": temperature}
    else:
        cfg = dataclasses.replace(cfg, temperature=temperature)
    with torch.no_grad():
        teacher_logp, _ = token_logprobs(teacher_logits.detach(), safe, temperature)
        sampler = old_logp
        if sampler is None:  # over the sampled sets, as the engine's log-probs are
            sampler, _ = token_logprobs(
                student_logits.detach(),
                safe,
                temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                min_p=cfg.min_p,
            )
        gap = torch.where(valid, sampler.float() - teacher_logp, 0.0)
    if advantages is None:
        advantages = torch.zeros_like(gap)
    elif advantages.dim() == 1 and gap.dim() == 2:
        advantages = advantages.float()[:, None].expand_as(gap)
    out = policy_loss(
        student_logits,
        labels,
        advantages - beta * gap,
        mask,
        old_logp=old_logp,
        config=cfg,
        normalizer=normalizer,
        **per_token,
    )
    weights = torch.where(valid, mask.float(), 0.0)
    out.metrics["distill"] = (gap * weights).sum() / weights.sum().clamp_min(1e-8)
    return out
