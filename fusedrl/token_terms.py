"""Per-token loss terms and their closed-form derivatives: the scalar half of every fused backend.

Once the vocab axis is reduced, a token of any GRPO-family loss is a handful of scalars: logp, the
entropy H, old/ref/rollout log-probs, the advantage A and the token's aggregation weight. This
module computes, on [B, T] tensors and without autograd,

    loss                   the aggregated scalar loss,
    d(loss)/d(logp)        per token,
    d(loss)/d(H)           per token (entropy bonus),

so that a backend only has to turn them into d(loss)/d(logits) = dlogp (onehot - p) + dH dH/dz
on the vocab axis. The Triton and CUDA kernels implement exactly these formulas per row; the torch
backend calls this module directly. Every derivative mirrors autograd on `fusedrl.reference`
(which this module never imports: see "the backends' own semantics" below),
including its conventions at ties (torch.maximum / minimum split the gradient in half; clamp
passes the gradient at its bounds), which the tests check.

The aggregation is folded into one weight per token, agg_w = d(agg)/d(per-token loss), so that the
per-token derivative is agg_w * d(per-token loss)/d(logp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ._inputs import LossInputs, entropy_coef_of, has_entropy_bonus
from .batch_stats import gathered, statistics_group
from .config import SCALAR_LOSSES, LossConfig

# ------------------------------------------------------------------ the backends' own semantics
# What defines the losses besides the formulas below (clamps, ratio bounds, IS weights, masked
# statistics) exists twice on purpose: once in fusedrl.reference, the oracle every backend is
# tested against, and once here, for the backends. Shared code would put a bug on both sides of
# every comparison, where no test could see it. This copy is written from docs/losses.md, not from
# the reference's code; keep the two independent.
LOG_RATIO_CLAMP = 20.0  # |log(pi / pi_old)| before exp (verl), also the IS log-weight
SEQ_LOG_RATIO_MAX = 10.0  # GSPO's sequence log-ratio, from above (verl)
KL_LOG_CLAMP = 20.0  # k3: |ref - logp|
KL_VALUE_CLAMP = 10.0  # k3: |estimate|
VESPO_LOG_W_MIN = math.log(1e-8)  # VESPO's sequence log-weight (and each IS log-weight), below


def _per_inputs(inp: LossInputs, key: tuple, make):
    """make(), once per LossInputs and key. A call's masked means and aggregation weights are
    [B, T] functions of its mask alone; each is one to seven small kernels, and launching them
    again for every metric is what a short row (a 4k-token micro-batch) pays for on the host.
    `dataclasses.replace` (a changed mask) makes a new LossInputs, so nothing stale is reused."""
    memo = inp.derived
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _mean_weights(inp: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The counted tokens' mask weights and their sum (the masked means' denominator)."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.where(inp.valid, inp.mask, 0.0)
        return weights, weights.sum().clamp_min(1e-8)

    return _per_inputs(inp, ("mean_weights",), make)


def masked_mean(x: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    """Mean of x over the counted tokens, each weighted by its (float) mask weight. Divided once,
    at the end: a share of all tokens is then exactly 1."""
    weights, total = _mean_weights(inp)
    if x.dtype == torch.bool:  # a flag is finite everywhere: the zero weights mask it
        return (x * weights).sum() / total
    return (torch.where(inp.valid, x.float(), 0.0) * weights).sum() / total


class Metrics(dict):
    """A call's metrics, whose masked means are taken together when its terms are done
    (`finish`): one stack, one weighted sum and one division for all the means over the same
    mask, where each mean alone is three to five launches, the host's time at a short row.
    `mean(name, x, inp)` reserves the name's place; a plain assignment to the name replaces it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending: dict[str, tuple[torch.Tensor, LossInputs]] = {}

    def mean(self, name: str, x: torch.Tensor, inp: LossInputs) -> None:
        super().__setitem__(name, None)
        self._pending[name] = (x, inp)

    def __setitem__(self, name: str, value) -> None:
        self._pending.pop(name, None)
        super().__setitem__(name, value)

    def finish(self) -> dict[str, torch.Tensor]:
        """The metrics as a plain dict, every reserved mean taken (`masked_mean`'s values)."""
        groups: dict[int, tuple[LossInputs, list[str]]] = {}
        for name, (_, inp) in self._pending.items():
            groups.setdefault(id(inp), (inp, []))[1].append(name)
        for inp, names in groups.values():
            weights, total = _mean_weights(inp)
            parts = [self._pending[name][0] for name in names]
            stacked = torch.stack(
                [x if x.shape == weights.shape else x.expand_as(weights) for x in parts]
            )
            if stacked.dtype not in (torch.bool, torch.float32):
                stacked = stacked.float()
            stacked = torch.where(inp.valid, stacked, 0.0)  # (a flag stack becomes fp32 here)
            means = (stacked * weights).sum((-2, -1)) / total
            for name, value in zip(names, means.unbind()):
                super().__setitem__(name, value)
        self._pending.clear()
        return dict(self)


def max_over_valid(x: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    """Largest x over counted tokens (x >= 0 here); 0 when there is none."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.where(inp.valid, x.float(), torch.zeros_like(x, dtype=torch.float32)).amax()


def add_token_metrics(
    metrics: Metrics,
    old: torch.Tensor,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    is_weight: torch.Tensor | None,
    inp: LossInputs,
) -> None:
    metrics.mean("ppo_kl", old - logp, inp)
    metrics.mean("logp_mean", logp, inp)
    if entropy is not None:
        metrics.mean("entropy", entropy, inp)
    if is_weight is not None:
        metrics.mean("is_weight_mean", is_weight, inp)
        metrics["is_weight_max"] = max_over_valid(is_weight, inp)


def ratio_bounds(
    old: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """[low, high] of the ratio: the numbers 1 -+ eps, or per token DCPO's bounds from the old
    probability q: 1/2 (1 + sqrt(1 - 4 eps_low / q)) (0 under the root when negative) and
    min(1/2 (1 + sqrt(1 + 4 eps_high / q)), r_max)."""
    if cfg.loss != "dcpo":
        return 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    inv_q = torch.exp(-old)
    low = 0.5 * (1.0 + (1.0 - 4.0 * cfg.eps_low * inv_q).clamp_min(0.0).sqrt())
    high = (0.5 * (1.0 + (1.0 + 4.0 * cfg.eps_high * inv_q).sqrt())).clamp_max(cfg.dcpo_r_max)
    return low, high


def _train_inference_weights(old: torch.Tensor, inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    """pi_old / pi_rollout per token (or its product over the sequence), truncated at is_cap (and
    below at is_cap_low) or zeroed outside [is_cap_low or 1 / is_cap, is_cap]; no gradient."""
    log_w = torch.where(inp.valid, old - inp.rollout_logp, 0.0)
    if cfg.is_correction in ("sequence_truncate", "sequence_mask"):
        log_w = (log_w * inp.mask).sum(dim=-1, keepdim=True).expand(old.shape)
    w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if cfg.is_correction in ("token_truncate", "sequence_truncate"):
        return w.clamp(min=cfg.is_cap_low, max=cfg.is_cap).detach()
    lowest = 1.0 / cfg.is_cap if cfg.is_cap_low is None else cfg.is_cap_low
    kept = (w >= lowest) & (w <= cfg.is_cap)
    return torch.where(kept, w, 0.0).detach()


def resolve_is_weights(old: torch.Tensor, inp: LossInputs, cfg: LossConfig) -> torch.Tensor | None:
    """The call's IS weights: precomputed (`is_weights=`), from rollout_logp, or none. From the
    call's own old log-probs they are made once per LossInputs (the fused op's arguments and the
    metrics both ask); from logp (on-policy, pass 2) each time."""
    if inp.is_weights is not None:
        return inp.is_weights
    if cfg.is_correction is None:
        return None
    if old is not inp.old_logp:
        return _train_inference_weights(old, inp, cfg)
    key = ("is_weights", cfg.is_correction, cfg.is_cap, cfg.is_cap_low)
    return _per_inputs(inp, key, lambda: _train_inference_weights(old, inp, cfg))


def scaled_by(t: torch.Tensor | None, grad_scale) -> torch.Tensor | None:
    """A [B, T] derivative or weight times the call's `grad_scale` (None: as it is): what a pass
    that writes the gradient from it then writes already scaled (`LossInputs.grad_scale`;
    `token_terms` scales its own derivatives)."""
    return t if t is None or grad_scale is None else t * grad_scale


@dataclass
class TokenTerms:
    """The loss, its metrics, and the derivatives a backend's gradient pass reads. Those are of
    the loss times the call's `grad_scale` (`LossInputs.grad_scale`; None: 1), so that every
    pass writes the gradient the caller will backpropagate, with nothing left to scale."""

    loss: torch.Tensor  # 0-dim fp32
    dlogp: torch.Tensor | None  # [B, T] d(loss)/d(logp); 0 on masked tokens (None: not wanted)
    dentropy: torch.Tensor | None  # [B, T] d(loss)/d(H), None when there is no entropy term
    metrics: dict[str, torch.Tensor]
    # [B, T] d(loss)/d(KL_t) of the exact KL (kl="full" / "full_reverse"), else None
    dfull_kl: torch.Tensor | None = None


def _times(derivative: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor | None:
    """A derivative scaled with its value (None when the derivatives are not wanted)."""
    return None if derivative is None else derivative * factor


def _inside(x: torch.Tensor, low, high) -> torch.Tensor:
    """d clamp(x, low, high) / dx: 1 inside the closed interval, 0 outside (torch.clamp's rule)."""
    return ((x >= low) & (x <= high)).float()


def _select_max(
    a: torch.Tensor, b: torch.Tensor, da: torch.Tensor, db: torch.Tensor
) -> torch.Tensor:
    """Derivative of torch.maximum(a, b): the larger one's, half of each at a tie."""
    return torch.where(a > b, da, torch.where(b > a, db, 0.5 * (da + db)))


def aggregation_weights(inp: LossInputs, cfg: LossConfig, kernel=None) -> torch.Tensor:
    """agg_w[b, t] such that agg(X) = sum_bt agg_w * X over valid tokens (verl's agg_loss modes);
    `kernel(mask, agg, normalizer, norm_constant)`: a backend's one-launch form of the same.
    Weights the caller gave (`LossInputs.agg_weights`) are these."""
    if inp.agg_weights is not None:
        return inp.agg_weights
    key = ("aggregation_weights", cfg.agg, cfg.norm_constant)
    if kernel is not None:
        return _per_inputs(
            inp, key, lambda: kernel(inp.mask, cfg.agg, inp.normalizer, cfg.norm_constant)
        )
    return _per_inputs(inp, key, lambda: _aggregation_weights(inp, cfg))


def _aggregation_weights(inp: LossInputs, cfg: LossConfig) -> torch.Tensor:
    mask = torch.where(inp.valid, inp.mask, 0.0)
    if cfg.agg == "token-mean":
        denom = inp.normalizer if inp.normalizer is not None else mask.sum().clamp_min(1e-8)
        return mask / denom
    if cfg.agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        seq_len = mask.sum(-1, keepdim=True)
        nonempty = (seq_len > 0).float()
        n_seq = inp.normalizer if inp.normalizer is not None else nonempty.sum().clamp_min(1)
        if cfg.agg == "seq-mean-token-mean":
            return mask * nonempty / seq_len.clamp_min(1e-8) / n_seq
        return mask * nonempty / n_seq
    n_all = inp.normalizer if inp.normalizer is not None else float(mask.shape[0])
    norm = cfg.norm_constant if cfg.norm_constant is not None else float(mask.shape[-1])
    return mask / n_all / norm


def kl_and_grad(
    logp: torch.Tensor, ref: torch.Tensor, kind: str, grads: bool = True, clamp: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(value, d value / d logp) of the KL estimators of `fusedrl.reference.kl_estimate`; the
    value alone (derivative None) without `grads`. `clamp`: verl's clamps of k3 (else TRL's k3,
    exp(ref - logp) - (ref - logp) - 1 as it is)."""
    delta = logp - ref
    if kind in ("k1+", "k3+"):  # straight-through: value of k1/k3, gradient of k2
        value, _ = kl_and_grad(logp, ref, kind[:-1], grads=False, clamp=clamp)
        return value, delta if grads else None
    if kind == "k1":
        return delta, torch.ones_like(delta) if grads else None
    if kind == "k2":
        return 0.5 * delta.square(), delta if grads else None
    if kind == "abs":
        return delta.abs(), torch.sign(delta) if grads else None
    if not clamp:
        ratio = torch.exp(-delta)
        return ratio + delta - 1.0, (1.0 - ratio) if grads else None
    log_ratio = torch.clamp(-delta, -KL_LOG_CLAMP, KL_LOG_CLAMP)
    raw = log_ratio.exp() - log_ratio - 1.0
    value = torch.clamp(raw, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    if not grads:
        return value, None
    grad = -(log_ratio.exp() - 1.0) * _inside(-delta, -KL_LOG_CLAMP, KL_LOG_CLAMP)
    return value, grad * _inside(raw, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def _ratio(logp, old, inp, cfg, grads: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The importance ratio per token and its derivative in logp (None without `grads`):
    pi / pi_old, or GSPO's sequence ratio s (value s, gradient s * grad logp_t: GSPO-token's
    convention)."""
    raw_log_ratio = logp - old
    log_ratio = torch.clamp(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.ratio_level == "sequence":
        seq_len = inp.mask.sum(-1, keepdim=True).clamp_min(1.0)
        seq_lr = torch.where(inp.valid, log_ratio * inp.mask, 0.0).sum(-1, keepdim=True) / seq_len
        seq_lr = seq_lr.expand_as(logp)
        # value exp(min(seq_lr, 10)); gradient s * grad logp unless the clamp is active.
        ratio = torch.clamp(seq_lr, max=SEQ_LOG_RATIO_MAX).exp()
        return ratio, ratio * (seq_lr <= SEQ_LOG_RATIO_MAX).float() if grads else None
    ratio = log_ratio.exp()
    if not grads:
        return ratio, None
    return ratio, ratio * _inside(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _kl_times_sequence_ratio(logp, old, kl, dkl, agg_w, inp, cfg):
    """(kl s, its derivative through kl alone, dkl s, and the part through s) of the
    bias-corrected KL at the sequence level, as TRL differentiates it: s_i = exp(min(mean_t
    m_t log r_t, 10)) is a function of every token of the sequence, d s_i / d logp_u = s_i m_u
    / |y_i| (0 where a clamp holds), so each token's weighted KL reaches every token of its
    sequence. (The policy term's sequence ratio keeps the per-token convention: its value is
    the same on every token of a sequence, so the two gradients agree there.)"""
    ratio, _ = _ratio(logp, old, inp, cfg, grads=False)
    if dkl is None:
        return kl * ratio, None, None
    raw_log_ratio = logp - old
    m = torch.where(inp.valid, inp.mask, 0.0)
    length = m.sum(-1, keepdim=True).clamp_min(1.0)
    log_ratio = torch.clamp(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_lr = torch.where(inp.valid, log_ratio * m, 0.0).sum(-1, keepdim=True) / length
    ds = ratio * (seq_lr <= SEQ_LOG_RATIO_MAX).float() * (m / length)
    ds = ds * _inside(raw_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weighted_kl = torch.where(inp.valid, kl * agg_w, 0.0).sum(-1, keepdim=True)
    return kl * ratio, dkl * ratio, ds * weighted_kl


def _ratio_terms(logp, old, adv, inp, cfg, metrics, grads: bool = True):
    """Per-token loss and d/dlogp (None without `grads`: the fused kernel applied it already)
    for ppo / dcpo / cispo / sapo (token or GSPO sequence ratio)."""
    ratio, dratio = _ratio(logp, old, inp, cfg, grads)
    low, high = ratio_bounds(old, cfg)
    metrics.mean("clip_low", (ratio < low) & (adv < 0), inp)
    metrics.mean("clip_high", (ratio > high) & (adv > 0), inp)

    if cfg.loss == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0))
        loss = -(4.0 / tau) * gate * adv
        return loss, -4.0 * gate * (1.0 - gate) * dratio * adv if grads else None

    clipped_ratio = torch.clamp(ratio, low, high)
    if cfg.loss == "cispo":
        metrics.mean("clipfrac", ratio != clipped_ratio, inp)
        return -clipped_ratio * adv * logp, -clipped_ratio * adv if grads else None

    if cfg.delta is None:
        loss_unclipped = -adv * ratio
    else:
        loss_unclipped = -adv * torch.clamp(ratio, max=cfg.delta)
    loss_clipped = -adv * clipped_ratio
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    dper_token = None
    if grads:
        if cfg.delta is None:
            d_unclipped = -adv * dratio
        else:
            d_unclipped = -adv * dratio * (ratio <= cfg.delta).float()
        d_clipped = -adv * dratio * _inside(ratio, low, high)
        dper_token = _select_max(loss_unclipped, loss_clipped, d_unclipped, d_clipped)
    metrics.mean("clipfrac", loss_clipped > loss_unclipped, inp)
    if cfg.dual_clip_c is not None:
        loss_dual = -adv * cfg.dual_clip_c
        metrics.mean("dual_clipfrac", (per_token > loss_dual) & (adv < 0), inp)
        if grads:
            # torch.minimum(per_token, constant): keep below, drop above, half at a tie.
            keep = torch.where(
                per_token < loss_dual, 1.0, torch.where(per_token > loss_dual, 0.0, 0.5)
            )
            dper_token = torch.where(adv < 0, dper_token * keep, dper_token)
        per_token = torch.where(adv < 0, torch.minimum(per_token, loss_dual), per_token)
    return per_token, dper_token


def _gmpo_terms(logp, old, adv, w, inp, cfg, metrics):
    """Scalar GMPO loss and d/dlogp (verl "geo_mean")."""
    log_ratio = logp - old
    clipped = torch.clamp(log_ratio, -cfg.eps_low, cfg.eps_high)
    sign = torch.sign(adv)
    a, b = sign * log_ratio, sign * clipped
    log_ratio_min = sign * torch.minimum(a, b)
    # d/dl of sign * min(sign l, sign clip(l)): sign^2 times the selected branch's derivative.
    d_min = torch.where(a < b, 1.0, torch.where(b < a, 0.0, 0.5)) + torch.where(
        b < a, 1.0, torch.where(a < b, 0.0, 0.5)
    ) * _inside(log_ratio, -cfg.eps_low, cfg.eps_high)
    d_min = d_min * sign.square()
    seq_len = inp.mask.sum(-1, keepdim=True).clamp_min(1e-8)
    weighted = torch.where(inp.valid, inp.mask, 0.0)
    seq_ratio = ((log_ratio_min * weighted).sum(-1, keepdim=True) / seq_len).exp()
    seq_adv = (adv * weighted).sum(-1, keepdim=True) / seq_len
    n_seq = inp.normalizer if inp.normalizer is not None else float(logp.shape[0])
    coef = -seq_adv * seq_ratio / n_seq
    if w is not None:
        coef = coef * w[:, :1]
    high = (log_ratio > cfg.eps_high) & (adv > 0)
    low = (log_ratio < -cfg.eps_low) & (adv < 0)
    metrics.mean("clip_high", high, inp)
    metrics.mean("clip_low", low, inp)
    metrics.mean("clipfrac", high | low, inp)
    return coef.sum(), coef * weighted / seq_len * d_min


def _vespo_terms(logp, old, adv, w, inp, cfg, metrics):
    """VESPO: -phi(w_seq) A logp with phi detached; w_seq = the sequence's product of token ratios
    (times its per-token IS weights), phi(w) = exp(lambda + k log w - lambda w), (k, lambda) by
    the sign of A."""
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = torch.where(inp.valid, log_ratio * inp.mask, 0.0).sum(-1, keepdim=True)
    if w is not None:  # an IS weight of 0 (masked by token_mask) counts as log 1e-8
        log_is = torch.clamp(torch.log(w), VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        log_w = log_w + torch.where(inp.valid, log_is, 0.0).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    nonneg = adv >= 0
    k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
    metrics.mean("vespo_phi_mean", phi, inp)
    # A NaN log-prob (a NaN logit) drops the sequence's phi to 0, but its own row's gradient is
    # 0 x NaN, as the oracle's autograd says: a zero dlogp would write that row 0.
    dlogp = torch.where(torch.isnan(logp), logp, -phi * adv)
    return -phi * adv * logp, dlogp


def _ranked_first(keys: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The `count` eligible tokens of smallest key (ties: the first in row-major order), as a
    mask; `count` is a tensor, so that no host sync is needed."""
    flat = torch.where(eligible, keys, math.inf).flatten()
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank.view(keys.shape) < count)


def _covariance(logp, adv, inp, counted, eps: float) -> torch.Tensor:
    """verl's per-token covariance (A - mean A)(logp - mean logp), means over the counted tokens
    (clip_cov divides by count + 1e-8, kl_cov by the count)."""
    count = counted.float().sum()
    denom = count + eps if eps else count.clamp_min(1.0)
    mean_adv = torch.where(counted, adv, 0.0).sum() / denom
    mean_logp = torch.where(counted, logp, 0.0).sum() / denom
    return (adv - mean_adv) * (logp - mean_logp)


def _verl_terms(logp, old, adv, inp, cfg, metrics):
    """Per-token loss and d/dlogp of verl's clip_cov, kl_cov, dppo_tv, dppo_kl and dro."""
    counted = inp.valid & (inp.mask > 0)
    log_ratio = logp - old
    if cfg.loss == "dro":
        penalty = 0.5 * cfg.dro_beta * log_ratio.square()
        return -adv * logp + penalty, -adv + cfg.dro_beta * log_ratio
    if cfg.loss in ("dppo_tv", "dppo_kl"):
        ratio = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weight = torch.clamp(ratio, max=cfg.dppo_ratio_cap)
        prob, old_prob = logp.exp(), old.exp()
        if cfg.loss == "dppo_tv":
            up_ok = prob - old_prob <= cfg.eps_high
            down_ok = prob - old_prob >= -cfg.eps_low
        else:  # KL(Bernoulli(old_prob) || Bernoulli(prob)), verl's 1e-8 in the second term
            kl = old_prob * (old - logp) + (1.0 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            up_ok = (kl <= cfg.eps_high) | (prob <= old_prob)
            down_ok = (kl <= cfg.eps_low) | (prob >= old_prob)
        inside = torch.where(adv > 0, up_ok, down_ok).float()
        metrics.mean("clipfrac", 1.0 - inside, inp)
        metrics.mean("ratio_capped", (ratio > cfg.dppo_ratio_cap).float() * inside, inp)
        per_token, dper_token = -adv * weight * logp * inside, -adv * weight * inside
        if cfg.kl_tau > 0:  # on every counted token, the trust region's outsiders too
            metrics.mean("dppo_kl_term", log_ratio.square(), inp)
            per_token = per_token + cfg.kl_tau * log_ratio.square()
            dper_token = dper_token + 2.0 * cfg.kl_tau * log_ratio
        return per_token, dper_token
    ratio = log_ratio.exp()
    if cfg.loss == "kl_cov":
        cov = _covariance(logp, adv, inp, counted, eps=0.0)
        count = (counted.float().sum() * cfg.kl_cov_ratio).floor().clamp_min(1.0)
        picked = _ranked_first(-cov, counted, count).float()
        metrics.mean("cov_selected", picked, inp)
        per_token = -adv * ratio + picked * cfg.kl_cov_coef * log_ratio.abs()
        return per_token, -adv * ratio + picked * cfg.kl_cov_coef * torch.sign(log_ratio)
    # clip_cov
    low, high = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    d_unclipped, d_clipped = unclipped, unclipped * _inside(ratio, low, high)  # d r = r d logp
    clipped_by_ppo = (clipped > unclipped) & counted
    cov = _covariance(logp, adv, inp, counted, eps=1e-8)
    candidates = counted & ~clipped_by_ppo & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    gen = None
    if cfg.clip_cov_seed is not None:
        gen = torch.Generator(device=logp.device).manual_seed(cfg.clip_cov_seed)
    keys = torch.rand(logp.shape, generator=gen, device=logp.device)
    count = (counted.float().sum() * cfg.clip_cov_ratio).floor().clamp_min(1.0)
    keep = 1.0 - _ranked_first(keys, candidates, count).float()
    metrics.mean("clipfrac", 1.0 - keep, inp)
    metrics.mean("clip_low", (ratio < low) & (adv < 0), inp)
    metrics.mean("clip_high", (ratio > high) & (adv > 0), inp)
    per_token = torch.maximum(unclipped, clipped) * keep
    return per_token, _select_max(unclipped, clipped, d_unclipped, d_clipped) * keep


def _rejection_statistics(old: torch.Tensor, inp: LossInputs) -> dict[str, torch.Tensor]:
    """verl's per-token KL(rollout || old) estimates from log r = old - rollout, clamped at +-20."""
    log_r = torch.where(inp.valid, old - inp.rollout_logp, 0.0)
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"k1": -log_r, "k2": 0.5 * log_r.square(), "k3": torch.expm1(log_r) - log_r}


def with_rejection(
    inp: LossInputs,
    cfg: LossConfig,
    old: torch.Tensor | None = None,
    metrics: Metrics | None = None,
) -> LossInputs:
    """`inp` whose mask drops the tokens / sequences that cfg.rejection rejects (verl's rollout
    rejection sampling); every option is measured on the original mask, and all must keep."""
    rules = cfg.rejection_rules
    if not rules:
        return inp
    old = inp.old_logp if old is None else old
    stats = _rejection_statistics(old, inp)
    counted = inp.valid & (inp.mask > 0)
    weights = torch.where(inp.valid, inp.mask, 0.0)
    keep = torch.ones_like(counted)
    for rule in rules:
        stat = stats[rule.estimator]
        if rule.reduction == "sum":
            stat = (stat * weights).sum(-1, keepdim=True)
        elif rule.reduction == "mean":  # verl's masked mean: / (count + 1e-8)
            stat = (stat * weights).sum(-1, keepdim=True) / (weights.sum(-1, keepdim=True) + 1e-8)
        elif rule.reduction == "max":  # an empty sequence: 0
            stat = torch.where(counted, stat, -math.inf).amax(-1, keepdim=True)
            stat = torch.where(torch.isinf(stat), 0.0, stat)
        ok = stat <= rule.upper  # NaN: rejected
        if rule.lower is not None:
            ok = ok & (stat >= rule.lower)
        ok = ok.expand_as(counted)
        keep = keep & ok
        if metrics is not None:
            metrics.mean(f"rs_{rule.option}_masked", ~ok, inp)
    if metrics is not None:
        metrics.mean("rs_masked", ~keep, inp)
        # over every row, empty ones included (verl's rollout_rs_seq_masked_fraction)
        hit = (~keep & counted).any(-1).float()
        metrics["rs_masked_seqs"] = hit.sum() / max(hit.numel(), 1)
    return replace(inp, mask=inp.mask * keep)


def with_m2po(
    inp: LossInputs, cfg: LossConfig, logp: torch.Tensor, old: torch.Tensor, metrics: Metrics
) -> LossInputs:
    """M2PO: `inp` whose mask drops the counted tokens of largest m2 = (logp - old)^2 until the
    mean m2 of the rest is below cfg.m2po_tau (all but the smallest when no count reaches it).
    The suffix means of m2 sorted downward do not increase, so the count to drop is how many are
    still >= tau: no host sync."""
    counted = inp.valid & (inp.mask > 0)
    m2 = torch.where(counted, (logp - old).square(), 0.0)
    ordered = torch.where(counted, m2, -math.inf).flatten().sort(descending=True).values
    total = counted.sum()
    kept_values = torch.where(torch.isfinite(ordered), ordered, 0.0)
    suffix_sums = kept_values.flip(0).cumsum(0).flip(0)
    suffix_counts = (total - torch.arange(ordered.numel(), device=m2.device)).clamp_min(1)
    above = (suffix_sums / suffix_counts >= cfg.m2po_tau) & torch.isfinite(ordered)
    count = torch.minimum(above.sum(), (total - 1).clamp_min(0))
    dropped = _ranked_first(-m2, counted, count)
    metrics.mean("m2po_masked", dropped, inp)
    return replace(inp, mask=inp.mask * ~dropped)


def masked_quantile(x: torch.Tensor, selected: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x[selected], q) (linear interpolation) without a host sync or its size
    limit: the selected values sort first, the rank is a tensor. +inf when none is selected."""
    values = torch.where(selected, x.float(), math.inf).flatten().sort().values
    count = selected.sum()
    pos = q * (count - 1).clamp_min(0).float()
    lo, hi = pos.floor().long().reshape(1), pos.ceil().long().reshape(1)
    v_lo, v_hi = values.index_select(0, lo), values.index_select(0, hi)
    value = v_lo + (v_hi - v_lo) * (pos - lo.float())
    return torch.where(count > 0, value.reshape(()), math.inf)


def _share_of_sequences(dropped: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    """Share of the non-empty sequences with at least one dropped counted token."""
    counted = inp.valid & (inp.mask > 0)
    nonempty = counted.any(-1)
    hit = (dropped & counted).any(-1) & nonempty
    return hit.float().sum() / nonempty.float().sum().clamp_min(1.0)


def _off_policy_keep(logp, old, adv, inp, cfg, metrics) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: 0 on the negative-advantage tokens of sequences
    whose mean (rollout - current) log-prob gap exceeds cfg.off_policy_mask."""
    sampled = inp.rollout_logp if inp.rollout_logp is not None else old
    gap = torch.nan_to_num(sampled - logp, nan=0.0)
    weights = torch.where(inp.valid, inp.mask, 0.0)
    seq_gap = (torch.where(inp.valid, gap, 0.0) * weights).sum(-1, keepdim=True)
    seq_gap = seq_gap / weights.sum(-1, keepdim=True).clamp_min(1.0)
    keep = (adv >= 0) | (seq_gap <= cfg.off_policy_mask)
    metrics.mean("off_policy_masked", ~keep, inp)
    metrics["off_policy_masked_seqs"] = _share_of_sequences(~keep, inp)
    return keep.float()


def _top_entropy_keep(entropy, inp, cfg, metrics) -> torch.Tensor:
    """1 on the tokens whose entropy is at least the (1 - rho) quantile of the call's counted
    tokens (rho = cfg.top_entropy_quantile; of every rank's, inside
    `fusedrl.batch_statistics_over(group)`), 0 elsewhere."""
    counted = inp.valid & (inp.mask > 0)
    group = statistics_group()
    if group is None:
        threshold = masked_quantile(entropy, counted, 1.0 - cfg.top_entropy_quantile)
    else:  # over every rank's counted tokens (`fusedrl.batch_statistics_over`)
        values = gathered(entropy, counted, group)
        every = torch.ones_like(values, dtype=torch.bool)
        threshold = masked_quantile(values, every, 1.0 - cfg.top_entropy_quantile)
    keep = (entropy >= threshold) & counted
    metrics.mean("entropy_masked", ~keep, inp)
    return keep.float()


def add_mismatch_metrics(
    metrics: Metrics, logp: torch.Tensor, w: torch.Tensor | None, inp: LossInputs
) -> None:
    """Train/inference mismatch from the pass's own log-probs: KL(rollout || trainer) by k1 and
    k3, the chi-square divergence of the token and sequence ratios trainer / rollout (verl's
    rollout_corr metrics), and the IS weights' effective sample size and masked shares."""
    if inp.rollout_logp is not None:
        # fp64, and expm1 rather than exp - 1: chi-square is a small difference of large terms.
        log_rho = torch.where(inp.valid, logp.double() - inp.rollout_logp.double(), 0.0)
        log_rho = torch.nan_to_num(log_rho, nan=0.0)  # tokens the engine could not score
        clamped = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weights = torch.where(inp.valid, inp.mask.double(), 0.0)
        total = weights.sum().clamp_min(1e-8)

        def mean(x: torch.Tensor) -> torch.Tensor:
            return ((x * weights).sum() / total).float()

        metrics["mismatch_kl_k1"] = mean(-log_rho)
        metrics["mismatch_kl_k3"] = mean(torch.expm1(clamped) - clamped)
        metrics["mismatch_chi2_token"] = mean(torch.expm1(2.0 * clamped))
        counted = inp.valid & (inp.mask > 0)
        nonempty = counted.any(-1)
        seq_log_rho = torch.where(counted, log_rho, 0.0).sum(-1)
        seq_chi2 = torch.expm1(2.0 * seq_log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        n_seq = nonempty.double().sum().clamp_min(1.0)
        metrics["mismatch_chi2_seq"] = (torch.where(nonempty, seq_chi2, 0.0).sum() / n_seq).float()
    if w is not None:
        w = w.expand_as(logp).float()
        mean_w = masked_mean(w, inp)
        second = masked_mean((w / mean_w.clamp_min(1e-8)).square(), inp)
        metrics["is_ess"] = torch.where(second > 0, 1.0 / second.clamp_min(1e-30), 0.0)
        metrics.mean("is_masked", w == 0, inp)
        metrics["is_masked_seqs"] = _share_of_sequences(w == 0, inp)


@torch.no_grad()
def token_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    inp: LossInputs,
    cfg: LossConfig,
    agg_weights: torch.Tensor | None = None,
    full_kl: torch.Tensor | None = None,
    grads: bool = True,
) -> TokenTerms:
    """Loss, d(loss)/d(logp) and d(loss)/d(entropy) from per-token scalars ([B, T] fp32).

    `logp` / `entropy` must already be 0 on masked tokens (the backends skip those rows).
    `full_kl`: each token's exact KL over the vocabulary (config.kl="full" / "full_reverse"),
    whose d(loss)/d(KL_t) comes back as `dfull_kl` for the backend's pass over the logits.
    `agg_weights` (computed by the caller over the whole batch, after `with_rejection`) lets a
    token-level loss be evaluated on a slice of its tokens: the LM-head loss does, block by block.
    `grads=False`: the loss and metrics alone (dlogp and dentropy None), for the fused kernel,
    which applied the derivatives itself: each skipped [B, T] op is a launch on the host's time.
    """
    logp = torch.where(inp.valid, logp, 0.0)
    old = inp.old_logp if inp.old_logp is not None else logp
    adv = inp.advantages
    zero = torch.zeros((), device=logp.device)
    metrics = Metrics(clipfrac=zero, clip_low=zero, clip_high=zero, dual_clipfrac=zero)
    sampled = inp  # the mismatch metrics look at every sampled token, rejected ones too
    if agg_weights is None:  # (given weights already leave the rejected tokens out)
        inp = with_rejection(inp, cfg, old, metrics)
    measured = inp  # M2PO's masked tokens leave the loss, not the token metrics
    if cfg.m2po_tau is not None:
        inp = with_m2po(inp, cfg, logp, old, metrics)
    agg_w = aggregation_weights(inp, cfg) if agg_weights is None else agg_weights
    w = resolve_is_weights(old, sampled, cfg)  # on every sampled token, as verl

    loss = zero
    entropy_keep = None
    if cfg.top_entropy_quantile < 1:
        entropy_keep = _top_entropy_keep(entropy, inp, cfg, metrics)
    if cfg.loss == "gmpo":
        loss, dlogp = _gmpo_terms(logp, old, adv, w, inp, cfg, metrics)
        per_token = torch.zeros_like(logp)
        dper_token = torch.zeros_like(logp)
    else:
        if cfg.loss == "pg":
            per_token, dper_token = -adv * logp, -adv
        elif cfg.loss == "vespo":  # the IS weights are inside phi, not a factor
            per_token, dper_token = _vespo_terms(logp, old, adv, w, inp, cfg, metrics)
        elif cfg.loss in SCALAR_LOSSES:
            per_token, dper_token = _verl_terms(logp, old, adv, inp, cfg, metrics)
        else:
            per_token, dper_token = _ratio_terms(logp, old, adv, inp, cfg, metrics, grads)
        if cfg.off_policy_mask is not None:
            keep = _off_policy_keep(logp, old, adv, inp, cfg, metrics)
            per_token, dper_token = per_token * keep, _times(dper_token, keep)
        if entropy_keep is not None:
            per_token, dper_token = per_token * entropy_keep, _times(dper_token, entropy_keep)
        if w is not None and cfg.loss != "vespo":
            per_token, dper_token = per_token * w, _times(dper_token, w)
        dlogp = torch.zeros_like(logp) if grads else None
    dfull_kl = None
    if cfg.full_kl:
        # The exact KL is a function of the whole row, not of logp: its derivative goes to the
        # backend as a per-token weight, d(loss)/d(KL_t) = beta x the token's aggregation weight.
        kl = torch.where(inp.valid, full_kl, 0.0)
        metrics.mean("kl", kl, inp)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
        dfull_kl = torch.where(inp.valid, cfg.beta * agg_w, 0.0)
    elif inp.ref_logp is not None:
        kl, dkl = kl_and_grad(logp, inp.ref_logp, cfg.kl or "k3", grads, cfg.kl_clamp)
        metrics.mean("kl", kl, inp)
        if cfg.beta > 0:
            if cfg.kl_bias_correction and cfg.ratio_level == "sequence":
                kl, dkl, coupled = _kl_times_sequence_ratio(logp, old, kl, dkl, agg_w, inp, cfg)
                if coupled is not None:  # (not weighted by the token's own agg_w: it is whole)
                    dlogp = dlogp + cfg.beta * coupled
            elif cfg.kl_bias_correction:  # d(kl r) = dkl r + kl dr
                ratio, dratio = _ratio(logp, old, inp, cfg, grads)
                kl, dkl = kl * ratio, None if dkl is None else dkl * ratio + kl * dratio
            per_token = per_token + cfg.beta * kl
            dper_token = None if dkl is None else dper_token + cfg.beta * dkl
    dentropy = None
    if has_entropy_bonus(inp, cfg):
        coef = entropy_coef_of(inp, cfg)  # a number, or a 0-dim tensor (adaptive control)
        if cfg.entropy_agg == "token-mean":  # its own mean over the tokens it acts on (TRL)
            acting = torch.where(inp.valid, inp.mask, 0.0)
            acting = acting if entropy_keep is None else acting * entropy_keep
            bonus_w = acting / acting.sum().clamp_min(1.0)
            loss = loss - coef * torch.where(inp.valid, entropy * bonus_w, 0.0).sum()
        else:  # aggregated with the policy term
            bonus = entropy if entropy_keep is None else entropy * entropy_keep
            bonus_w = agg_w if entropy_keep is None else agg_w * entropy_keep
            per_token = per_token - coef * bonus
        dentropy = torch.where(inp.valid, -coef * bonus_w, 0.0) if grads else None

    loss = loss + torch.where(inp.valid, per_token * agg_w, 0.0).sum()
    if grads:
        dlogp = torch.where(inp.valid, dlogp + dper_token * agg_w, 0.0)

    add_token_metrics(metrics, old, logp, entropy, w, measured)
    add_mismatch_metrics(metrics, logp, w, sampled)
    scale = inp.grad_scale  # (`TokenTerms`: the derivatives of the loss the caller scales)
    return TokenTerms(
        loss=loss,
        dlogp=scaled_by(dlogp, scale),
        dentropy=scaled_by(dentropy, scale),
        metrics=metrics.finish(),
        dfull_kl=scaled_by(dfull_kl, scale),
    )
