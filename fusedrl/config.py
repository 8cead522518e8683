"""`LossConfig`: every knob of the GRPO-family policy loss, validated once at construction.

The semantics of each field are in docs/losses.md and DESIGN section 4; this module only holds the
values, their defaults, the presets and the checks. Every backend reads the same frozen object, so a
config that constructs is a config every backend accepts.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from .sampling import SamplingMask, check_sampling

LOSSES = (
    "ppo",
    "cispo",
    "sapo",
    "gmpo",
    "dcpo",
    "pg",
    "luspo",
    "vespo",
    "clip_cov",
    "kl_cov",
    "dppo_tv",
    "dppo_kl",
    "dro",
)
# verl's losses that only the [B, T] scalar code computes (`token_terms`): the fused kernels take
# them in two passes (clip_cov / kl_cov need statistics over the whole call first).
SCALAR_LOSSES = ("clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro")
# The PPO clipped objective (LUSPO differs from PPO only in its defaults: a sequence ratio and a
# per-sequence token sum).
PPO_CLIPPED = ("ppo", "luspo")
# An eps_low that leaves the lower ratio bound open (TRL's cispo; verl's clip_ratio_low >= 1,
# a bound 1 - clip_ratio_low <= 0): 1 - eps_low = 1e-12 lies below every ratio the losses form
# (|log ratio| is clamped at 20: ratio >= 2e-9), so it never binds.
OPEN_LOWER_BOUND = 1.0 - 1e-12

# Losses that take a sequence ratio (ratio_level="sequence"): GSPO's clipped objective, and
# CISPO's / SAPO's weights of it (TRL's importance_sampling_level="sequence" for them).
SEQUENCE_RATIO_LOSSES = (*PPO_CLIPPED, "cispo", "sapo")
RATIO_LEVELS = ("token", "sequence")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# The entropy bonus's own aggregations (LossConfig.entropy_agg); None: the policy's `agg`
ENTROPY_AGGS = (None, "token-mean")
# Per-token estimators of KL(pi || pi_ref) from the sampled token's log-probs (`ref_logp=`).
KL_ESTIMATORS = ("k1", "k2", "abs", "k3", "k1+", "k3+")
# The exact KL over the whole vocabulary per token, from the reference policy's logits
# (`ref_logits=`): KL(pi || pi_ref) ("full") or KL(pi_ref || pi) ("full_reverse").
FULL_KLS = ("full", "full_reverse")
KLS = KL_ESTIMATORS + FULL_KLS
TRUST_REGION_MODES = ("max", "mean")
IS_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# verl's rollout rejection sampling (rollout_corr_helper.py): estimator of KL(rollout || train)
# per token (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, r = pi_train / pi_rollout),
# taken per token or aggregated per sequence (sum / mean / max).
REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def open_if_unbounded(eps_low: float) -> float:
    """`eps_low`, or OPEN_LOWER_BOUND where the lower bound 1 - eps_low <= 0 could never bind a
    ratio (the drop-ins' mapping of TRL's epsilon and verl's clip_ratio_low >= 1)."""
    return eps_low if eps_low < 1.0 else OPEN_LOWER_BOUND


@dataclass(frozen=True)
class RejectionRule:
    """One rejection option: keep a token (or its whole sequence) while lower <= statistic <=
    upper. k1 bounds are logs of verl's ratio bounds; k2 / k3 have an upper bound only."""

    option: str
    lower: float | None
    upper: float

    @property
    def estimator(self) -> str:
        return self.option[-2:]

    @property
    def reduction(self) -> str:
        """ "token", or the per-sequence reduction "sum" / "mean" / "max"."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]


def parse_rejection(options: str, threshold: Any) -> tuple[RejectionRule, ...]:
    """verl's `rollout_rs` / `rollout_rs_threshold`: comma-chained options (duplicates dropped,
    first kept), thresholds one per option by position or one for all; a k1 threshold is a ratio
    range "lower_upper" or t for [1 / t, t], a k2 / k3 threshold one upper bound."""
    names = []
    for name in (part.strip() for part in options.split(",")):
        if name and name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"LossConfig.rejection={options!r} names no option")
    for name in names:
        _check_choice("rejection", name, REJECTION_OPTIONS)
    if threshold is None:
        raise ValueError(f"LossConfig.rejection={options!r} needs rejection_threshold")
    if isinstance(threshold, bool) or not isinstance(threshold, (str, int, float)):
        raise ValueError(
            f"LossConfig.rejection_threshold must be a number or a string, got {threshold!r}"
        )
    specs = [threshold] if not isinstance(threshold, str) else threshold.split(",")
    specs = [str(spec).strip() for spec in specs if str(spec).strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"LossConfig.rejection_threshold={threshold!r} gives {len(specs)} thresholds for "
            f"{len(names)} options {names}: give one, or one per option"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    rules = []
    for name, spec in zip(names, specs):
        where = f"LossConfig.rejection_threshold {spec!r} of {name!r}"
        try:
            if name.endswith("k1"):
                low_s, _, up_s = spec.partition("_") if "_" in spec else ("", "", spec)
                upper = float(up_s)
                lower = float(low_s) if low_s else (1.0 / upper if upper > 0 else 0.0)
            elif "_" in spec:
                raise ValueError(f"{where}: a k2 / k3 option takes one upper bound, not a range")
            else:
                lower, upper = None, float(spec)
        except (ValueError, ZeroDivisionError) as err:
            if str(err).startswith(where):
                raise
            raise ValueError(f"{where} is not a number or a 'lower_upper' range") from err
        if not math.isfinite(upper) or upper <= 0 or (lower is not None and not lower > 0):
            raise ValueError(f"{where}: bounds must be finite and > 0")
        if lower is not None and lower > upper:
            raise ValueError(f"{where}: the lower bound exceeds the upper one")
        if lower is not None:  # k1 compares log-ratios
            lower, upper = math.log(lower), math.log(upper)
        rules.append(RejectionRule(name, lower, upper))
    return tuple(rules)


# Clip ranges when the caller does not give them: GSPO's sequence ratio is a geometric mean, so
# its paper's range is ~1000x narrower; GMPO clips log-ratios (wider range, its paper's 0.4);
# DCPO's paper uses 0.16 / 0.2 as the base of its probability-dependent bounds.
_DEFAULT_EPS = {"sequence": (3e-4, 4e-4), "gmpo": (0.4, 0.4), "dcpo": (0.16, 0.2)}
_PPO_EPS = (0.2, 0.2)


def _default_eps(loss: str, ratio_level: str) -> tuple[float, float]:
    if ratio_level == "sequence" and loss in PPO_CLIPPED:  # GSPO's bounds of its clipped ratio
        return _DEFAULT_EPS["sequence"]
    return _DEFAULT_EPS.get(loss, _PPO_EPS)


def _check_choice(field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"LossConfig.{field}={value!r} is not one of {choices}")


def _check_positive(field: str, value: Any, *, above: float = 0.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"LossConfig.{field} must be a finite number, got {value!r}")
    if value <= above:
        raise ValueError(f"LossConfig.{field} must be > {above:g}, got {value!r}")


_NUMERIC_FIELDS = (
    "eps_low",
    "eps_high",
    "dual_clip_c",
    "delta",
    "sapo_tau_pos",
    "sapo_tau_neg",
    "dcpo_r_max",
    "norm_constant",
    "beta",
    "entropy_coef",
    "temperature",
    "is_cap",
    "is_cap_low",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "off_policy_mask",
    "top_entropy_quantile",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "kl_cov_coef",
    "dppo_ratio_cap",
    "kl_tau",
    "decoupled_is_cap",
    "dro_beta",
    "top_p",
    "min_p",
    "trust_region_delta",
    "m2po_tau",
)


@dataclass(frozen=True)
class LossConfig:
    """The GRPO-family policy loss, as a few scalars per token.

    ``eps_low`` / ``eps_high`` left as ``None`` take the default of the chosen variant: 0.2 / 0.2
    (PPO, GRPO, CISPO, SAPO, ...), 3e-4 / 4e-4 for GSPO's clipped sequence ratio (ppo or luspo
    at ``ratio_level="sequence"``), 0.4 / 0.4 for GMPO (a log-ratio range) and 0.16 / 0.2 for
    DCPO. After construction they always hold numbers.
    ``is_cap_low=None`` means ``1 / is_cap`` for the mask modes (verl's default) and no lower
    bound for the truncate modes. ``ratio_level`` / ``agg`` left as ``None`` take ``"token"`` /
    ``"token-mean"``, except for LUSPO: ``"sequence"`` / ``"seq-mean-token-sum"``.
    """

    loss: str = "ppo"
    ratio_level: str | None = None
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip_c: float | None = None
    delta: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dcpo_r_max: float = 10.0
    agg: str | None = None
    norm_constant: float | None = None
    kl: str | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    # The entropy bonus's aggregation: None, the policy's `agg` (verl); "token-mean", its own
    # mean over the tokens it acts on, whatever `agg` and the normalizer (TRL's entropy bonus)
    entropy_agg: str | None = None
    temperature: float = 1.0
    is_correction: str | None = None
    is_cap: float = 2.0
    is_cap_low: float | None = None
    # VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio w, with
    # (k, lambda) by the sign of the advantage (TRL's defaults).
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # The KL term times the ratio pi / pi_old (DeepSeek-V3.2; TRL's use_bias_correction_kl).
    kl_bias_correction: bool = False
    # verl's clamps of k3 (and k3+'s value): |ref - logp| <= 20 before the exp, the estimate
    # within +-10, no gradient past them. TRL's k3 has none (False): the KL term's terms then
    # come from the torch code after a log-prob pass (two reads of the logits, not one).
    kl_clamp: bool = True
    # DeepSeek-V3.2's off-policy sequence mask: a sequence whose mean KL(rollout || policy) exceeds
    # this drops its negative-advantage tokens from the policy term (TRL's
    # off_policy_mask_threshold). None: off.
    off_policy_mask: float | None = None
    # Only the tokens in the top `top_entropy_quantile` share of entropy (over the call's valid
    # tokens) train the policy term and the entropy bonus (TRL's top_entropy_quantile). 1: all;
    # 0: the highest-entropy token.
    top_entropy_quantile: float = 1.0
    # verl's Clip-Cov: of the unclipped tokens whose centred covariance (A - mean A)(logp - mean
    # logp) lies in (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio x tokens)) drawn at random
    # get no gradient. clip_cov_seed: the draw's generator seed (None: torch's default generator).
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    clip_cov_seed: int | None = None
    # verl's KL-Cov: the max(1, int(kl_cov_ratio x tokens)) tokens of largest covariance get
    # kl_cov_coef x |logp - old| (verl's ppo_kl_coef) added to -A r.
    kl_cov_ratio: float = 0.0002
    kl_cov_coef: float = 0.1
    # DPPO: eps_low / eps_high are the trust region's thresholds (probability difference for
    # dppo_tv, binary KL for dppo_kl); the detached ratio is capped at dppo_ratio_cap (verl's
    # clip_ratio_c).
    dppo_ratio_cap: float = 3.0
    # prime-rl's DPPO + KL (its default loss, after Kimi K2.5): kl_tau (log pi - log pi_old)^2
    # added on every counted token of loss="dppo_tv" / "dppo_kl", those outside the trust region
    # too (prime-rl's kl_tau; pi_old: the sampler). 0: off.
    kl_tau: float = 0.0
    # Decoupled PPO (AReaL): with policy_loss(prox_logp=), tokens whose behaviour weight
    # pi_prox / pi_behav exceeds this get weight 0 (AReaL's behav_imp_weight_cap). None: no cap.
    decoupled_is_cap: float | None = None
    # DRO: -A logp + dro_beta / 2 (logp - old)^2; required (> 0) for loss="dro".
    dro_beta: float | None = None
    # verl's rollout rejection sampling: tokens / sequences whose KL(rollout || old) estimate
    # leaves the threshold leave the loss, denominators included (verl's rollout_rs and
    # rollout_rs_threshold strings, e.g. "token_k1,seq_max_k3" and "0.5_2.0,0.1"). Needs
    # rollout_logp; measured against old_logp (the current log-probs when there is none).
    rejection: str | None = None
    rejection_threshold: str | float | None = None
    # Trust-region sequence masking (arXiv 2512.23075): a sequence leaves the loss, denominators
    # included, when its per-token log-ratio log(pi_old / pi_rollout) leaves [-delta, delta]
    # anywhere (mode "max") or on average (mode "mean"); verl's rollout_rs seq_max_k2 /
    # seq_mean_k1 with those bounds. Needs rollout_logp. None: off.
    trust_region_delta: float | None = None
    trust_region_mode: str = "max"
    # M2PO (second-moment trust region; AReaL's m2_threshold): the tokens of largest
    # (log pi - log pi_old)^2 leave the loss, denominators included, until the mean over the rest
    # is below m2po_tau (a batch-wide statistic: two passes). None: off.
    m2po_tau: float | None = None
    # Sampling-mask replay: vLLM's top_k / top_p / min_p of the rollouts, so that logp and the
    # entropy are taken over the set the engine sampled from (its processed log-probs). None: off.
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        self._to_plain_numbers()
        self._resolve_choices()
        self._resolve_clip_bounds()
        self._check_variant_options()
        self._check_caps()
        self._check_coefficients()
        self._check_corrections()
        self._check_scalar_losses()
        self._check_kl_and_rollout_options()
        self._check_norm_constant()

    def _to_plain_numbers(self) -> None:
        # numpy / torch scalars (np.float32(0.2), say) are numbers too: keep plain floats.
        for field in _NUMERIC_FIELDS:
            value = getattr(self, field)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                object.__setattr__(self, field, float(value))
        for field in ("top_k", "clip_cov_seed"):  # numpy / torch integers: plain ints
            value = getattr(self, field)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                object.__setattr__(self, field, int(value))

    def _resolve_choices(self) -> None:
        """The loss, its defaults for ratio_level and agg, and every named choice."""
        _check_choice("loss", self.loss, LOSSES)
        if self.ratio_level is None:
            object.__setattr__(self, "ratio_level", "sequence" if self.loss == "luspo" else "token")
        if self.agg is None:
            agg = "seq-mean-token-sum" if self.loss == "luspo" else "token-mean"
            object.__setattr__(self, "agg", agg)
        _check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _check_choice("agg", self.agg, AGGS)
        if self.kl is not None:
            _check_choice("kl", self.kl, KLS)
        if self.is_correction is not None:
            _check_choice("is_correction", self.is_correction, IS_CORRECTIONS)

    def _resolve_clip_bounds(self) -> None:
        """eps_low / eps_high: the loss's defaults where unset, checked."""
        default_low, default_high = _default_eps(self.loss, self.ratio_level)
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", default_low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", default_high)
        _check_positive("eps_low", self.eps_low)
        if self.loss == "cispo":
            # CISPO bounds a weight, not a trust region: a cap below 1 (TRL's cispo with
            # epsilon_high <= 1, its default when unset) scales every ratio above it down to it.
            _check_positive("eps_high", self.eps_high, above=-self.eps_low)
        else:
            _check_positive("eps_high", self.eps_high)
        if self.loss in (*PPO_CLIPPED, "cispo") and self.eps_low >= 1:
            raise ValueError(
                f"LossConfig.eps_low={self.eps_low!r} must be < 1 for loss={self.loss!r}: "
                "the lower ratio bound 1 - eps_low would not be positive"
            )

    def _check_caps(self) -> None:
        """The positive scalars, and the IS weights' bounds."""
        _check_positive("sapo_tau_pos", self.sapo_tau_pos)
        _check_positive("sapo_tau_neg", self.sapo_tau_neg)
        _check_positive("dcpo_r_max", self.dcpo_r_max, above=1.0)
        _check_positive("temperature", self.temperature)
        _check_positive("is_cap", self.is_cap)
        if self.is_cap_low is not None:
            _check_positive("is_cap_low", self.is_cap_low)
            if self.is_cap_low >= self.is_cap:
                raise ValueError(
                    f"LossConfig.is_cap_low={self.is_cap_low!r} must be < is_cap={self.is_cap!r}"
                )
            if self.is_correction is None:
                raise ValueError("LossConfig.is_cap_low is set but is_correction is None")
        elif self.is_correction in ("token_mask", "sequence_mask") and self.is_cap <= 1:
            raise ValueError(
                f"LossConfig.is_correction={self.is_correction!r} keeps weights in "
                f"[1 / is_cap, is_cap] by default, which is empty for is_cap={self.is_cap!r} <= 1 "
                "(every weight would be 0): use is_cap > 1 or set is_cap_low"
            )

    def _check_coefficients(self) -> None:
        """beta (with its KL estimator), the entropy bonus's coefficient and aggregation."""
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise ValueError(f"LossConfig.beta must be a number, got {self.beta!r}")
        if not math.isfinite(self.beta) or self.beta < 0:
            raise ValueError(f"LossConfig.beta must be finite and >= 0, got {self.beta!r}")
        if self.beta > 0 and self.kl is None:
            raise ValueError(
                f"LossConfig.beta={self.beta!r} > 0 needs a KL estimator: set kl to one of {KLS}"
            )
        if isinstance(self.entropy_coef, bool) or not isinstance(self.entropy_coef, (int, float)):
            raise ValueError(f"LossConfig.entropy_coef must be a number, got {self.entropy_coef!r}")
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"LossConfig.entropy_coef must be finite, got {self.entropy_coef!r}")
        if self.entropy_agg not in ENTROPY_AGGS:
            raise ValueError(
                f"LossConfig.entropy_agg must be one of {ENTROPY_AGGS}, got {self.entropy_agg!r}"
            )

    def _check_kl_and_rollout_options(self) -> None:
        """The sampling filters, the exact KL's exclusions, M2PO, trust-region masking,
        rejection sampling."""
        check_sampling(self.top_k, self.top_p, self.min_p, where="LossConfig")
        if self.full_kl and self.kl_bias_correction:
            raise ValueError(
                f"LossConfig.kl_bias_correction corrects a KL estimated from samples of pi_old; "
                f"kl={self.kl!r} is exact over the vocabulary and needs no correction"
            )
        if self.full_kl and check_sampling(self.top_k, self.top_p, self.min_p).active:
            raise ValueError(
                f"LossConfig.kl={self.kl!r} (over the whole vocabulary) with top_k / top_p / "
                "min_p (a sampled set) is not supported yet: use a per-token estimator (k1, k3, "
                "...) with the sampling filters"
            )
        if self.m2po_tau is not None:
            _check_positive("m2po_tau", self.m2po_tau)
        _check_choice("trust_region_mode", self.trust_region_mode, TRUST_REGION_MODES)
        if self.trust_region_delta is not None:
            _check_positive("trust_region_delta", self.trust_region_delta)
            if self.trust_region_delta >= 20.0:
                raise ValueError(
                    f"LossConfig.trust_region_delta={self.trust_region_delta!r} must be < 20 (the "
                    "log-ratios are clamped at +-20)"
                )
        if self.rejection is not None:
            if not isinstance(self.rejection, str):
                raise ValueError(f"LossConfig.rejection must be a string, got {self.rejection!r}")
            parse_rejection(self.rejection, self.rejection_threshold)
        elif self.rejection_threshold is not None:
            raise ValueError("LossConfig.rejection_threshold is set but rejection is None")

    def _check_norm_constant(self) -> None:
        if self.norm_constant is not None:
            if self.agg != "seq-mean-token-sum-norm":
                raise ValueError(
                    f"LossConfig.norm_constant is only used by agg='seq-mean-token-sum-norm', "
                    f"got agg={self.agg!r}"
                )
            _check_positive("norm_constant", self.norm_constant)

    def _check_corrections(self) -> None:
        for field in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _check_positive(field, getattr(self, field))
        for flag in ("kl_bias_correction", "kl_clamp"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"LossConfig.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.off_policy_mask is not None:
            _check_positive("off_policy_mask", self.off_policy_mask, above=-math.inf)
            if self.off_policy_mask < 0:
                raise ValueError(
                    f"LossConfig.off_policy_mask must be >= 0 (a KL threshold), "
                    f"got {self.off_policy_mask!r}"
                )
            if self.loss == "gmpo":
                raise ValueError(
                    "LossConfig.off_policy_mask masks tokens of the policy term, but loss='gmpo' "
                    "has one term per sequence"
                )
        q = self.top_entropy_quantile
        _check_positive("top_entropy_quantile", q, above=-math.inf)
        if not 0 <= q <= 1:  # 0: only the highest-entropy token(s) train (TRL's range)
            raise ValueError(f"LossConfig.top_entropy_quantile must be in [0, 1], got {q!r}")
        if q < 1 and self.loss == "gmpo":
            raise ValueError(
                "LossConfig.top_entropy_quantile masks tokens of the policy term, but loss='gmpo' "
                "has one term per sequence"
            )
        if self.loss == "vespo" and (self.is_correction or "").startswith("sequence"):
            raise ValueError(
                f"LossConfig.is_correction={self.is_correction!r}: loss='vespo' folds per-token "
                "IS weights into its sequence weight; use 'token_truncate' or 'token_mask'"
            )

    def _check_scalar_losses(self) -> None:
        for field in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, field)
            _check_positive(field, value)
            if value > 1:
                raise ValueError(f"LossConfig.{field} must be in (0, 1], got {value!r}")
        for field in ("clip_cov_lb", "clip_cov_ub", "kl_cov_coef"):
            _check_positive(field, getattr(self, field), above=-math.inf)
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"LossConfig.clip_cov_lb={self.clip_cov_lb!r} must be < "
                f"clip_cov_ub={self.clip_cov_ub!r}"
            )
        if self.clip_cov_seed is not None and (
            isinstance(self.clip_cov_seed, bool) or not isinstance(self.clip_cov_seed, int)
        ):
            raise ValueError(
                f"LossConfig.clip_cov_seed must be an int or None, got {self.clip_cov_seed!r}"
            )
        _check_positive("dppo_ratio_cap", self.dppo_ratio_cap)
        if self.decoupled_is_cap is not None:
            _check_positive("decoupled_is_cap", self.decoupled_is_cap, above=1.0)
        if self.kl_tau != 0.0:
            _check_positive("kl_tau", self.kl_tau)
            if self.loss not in ("dppo_tv", "dppo_kl"):
                raise ValueError(
                    f"LossConfig.kl_tau={self.kl_tau!r} is DPPO's trust-region KL term "
                    f"(loss='dppo_tv' / 'dppo_kl'), got loss={self.loss!r}: for a KL to the "
                    "reference use kl / beta"
                )
        if self.dro_beta is not None:
            _check_positive("dro_beta", self.dro_beta)
            if self.loss != "dro":  # read by DRO alone: another loss would ignore it
                raise ValueError(
                    f"LossConfig.dro_beta={self.dro_beta!r} is DRO's penalty (loss='dro'), got "
                    f"loss={self.loss!r}"
                )
        elif self.loss == "dro":
            raise ValueError("LossConfig.dro_beta must be set (> 0) for loss='dro'")
        if self.loss in SCALAR_LOSSES and (
            self.ratio_level == "sequence" or (self.is_correction or "").startswith("sequence")
        ):
            raise ValueError(
                f"loss={self.loss!r} is a token-level loss (verl's); it takes no sequence "
                "ratio or sequence IS correction"
            )

    def _check_variant_options(self) -> None:
        """Reject combinations that have no meaning rather than silently ignoring a knob."""
        if self.ratio_level == "sequence" and self.loss not in SEQUENCE_RATIO_LOSSES:
            raise ValueError(
                f"LossConfig.ratio_level='sequence' takes a sequence ratio into the loss's "
                f"weight and needs loss in {SEQUENCE_RATIO_LOSSES}, got loss={self.loss!r}"
                + (
                    " (GMPO is sequence-level by construction: use ratio_level='token')"
                    if self.loss == "gmpo"
                    else ""
                )
            )
        if self.dual_clip_c is not None:
            if self.loss not in PPO_CLIPPED:
                raise ValueError(
                    f"LossConfig.dual_clip_c applies to loss='ppo' / 'luspo' only, "
                    f"got loss={self.loss!r}"
                )
            _check_positive("dual_clip_c", self.dual_clip_c, above=1.0)
        if self.delta is not None:
            if self.loss not in PPO_CLIPPED:
                raise ValueError(
                    f"LossConfig.delta applies to loss='ppo' / 'luspo' only, got {self.loss!r}"
                )
            _check_positive("delta", self.delta, above=1.0)
            if self.delta <= 1 + self.eps_high and self.ratio_level == "token":
                raise ValueError(
                    f"LossConfig.delta={self.delta!r} must be > 1 + eps_high = "
                    f"{1 + self.eps_high!r}:"
                    " otherwise it clips below the PPO upper bound"
                )
        if self.loss == "gmpo" and (self.is_correction or "").startswith("token"):
            raise ValueError(
                f"LossConfig.is_correction={self.is_correction!r} is per token, but loss='gmpo' "
                "weights whole sequences: use 'sequence_truncate' or 'sequence_mask'"
            )

    # ------------------------------------------------------------------ helpers
    def replace(self, **changes: Any) -> LossConfig:
        """A copy with `changes` applied (validated again). eps keep their current values."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"LossConfig.replace: unknown field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_sequence_level(self) -> bool:
        """True when the loss of a token depends on other tokens of its sequence (or, for
        top_entropy_quantile, of the batch): the fused kernels then need a reduction between a
        logp pass and a gradient pass."""
        return (
            self.ratio_level == "sequence"
            or self.loss in ("gmpo", "vespo")
            or (self.is_correction or "").startswith("sequence")
            or self.off_policy_mask is not None
            or self.top_entropy_quantile < 1
        )

    @property
    def sampling(self) -> SamplingMask | None:
        """The sampling filters to replay, or None when none is active."""
        mask = check_sampling(self.top_k, self.top_p, self.min_p)
        return mask if mask.active else None

    @property
    def rejection_rules(self) -> tuple[RejectionRule, ...]:
        """The parsed `rejection` options and the trust-region sequence mask (empty when off):
        |log r| <= delta on every token is k2 = (log r)^2 / 2 <= delta^2 / 2 at the sequence's
        max; on average, the mean k1 = -log r within [-delta, delta]."""
        rules = ()
        if self.rejection is not None:
            rules = parse_rejection(self.rejection, self.rejection_threshold)
        delta = self.trust_region_delta
        if delta is not None:
            if self.trust_region_mode == "max":
                rules = (*rules, RejectionRule("tr_max_k2", None, 0.5 * delta * delta))
            else:
                rules = (*rules, RejectionRule("tr_mean_k1", -delta, delta))
        return rules

    @property
    def needs_sequences(self) -> bool:
        """The loss needs the [B, T] layout (sequence boundaries)."""
        return (
            self.agg != "token-mean"
            or self.is_sequence_level
            or any(rule.reduction != "token" for rule in self.rejection_rules)
        )

    @property
    def full_kl(self) -> bool:
        """The KL term is exact over the vocabulary: it reads the reference's logits."""
        return self.kl in FULL_KLS

    @property
    def needs_entropy(self) -> bool:
        """The loss reads the entropy (bonus, or the top-entropy token selection)."""
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1

    @property
    def uses_old_logp(self) -> bool:
        """pg is on-policy REINFORCE: it never looks at a ratio."""
        return self.loss != "pg"

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossConfig:
        """A named, documented configuration (see docs/losses.md), optionally with overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {tuple(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # PPO-clip with a token-mean (the verl default actor loss).
    "ppo": dict(loss="ppo", eps_low=0.2, eps_high=0.2, agg="token-mean"),
    # DeepSeekMath GRPO: token ratio, symmetric clip, per-sequence token mean, k3 KL to the ref.
    "grpo": dict(
        loss="ppo", eps_low=0.2, eps_high=0.2, agg="seq-mean-token-mean", kl="k3", beta=0.04
    ),
    # DAPO: clip-higher (0.28), token-level loss, no KL.
    "dapo": dict(loss="ppo", eps_low=0.2, eps_high=0.28, agg="token-mean", beta=0.0),
    # Dr.GRPO: no length normalisation; the trainer sets norm_constant to max completion length.
    "dr_grpo": dict(loss="ppo", eps_low=0.2, eps_high=0.2, agg="seq-mean-token-sum-norm"),
    # LitePPO: plain PPO-clip + token-mean; its difference lives in the advantage (group mean,
    # batch std: fusedrl.advantages.lite_ppo).
    "lite_ppo": dict(loss="ppo", eps_low=0.2, eps_high=0.2, agg="token-mean"),
    # GSPO: sequence-level (geometric mean) ratio, narrow clip, per-sequence token mean.
    "gspo": dict(
        loss="ppo", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"
    ),
    # GSPO-token: the same loss; advantages may be given per token ([B, T]).
    "gspo_token": dict(
        loss="ppo", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-mean"
    ),
    # CISPO (MiniMax-M1): clipped, stop-gradient IS weight times the REINFORCE term; token-mean.
    "cispo": dict(loss="cispo", eps_low=0.2, eps_high=0.28, agg="token-mean"),
    # SAPO: soft sigmoid gate instead of a hard clip; verl aggregates it per sequence.
    "sapo": dict(loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, agg="seq-mean-token-mean"),
    # GMPO: geometric mean of clipped token ratios per sequence (verl "geo_mean").
    "gmpo": dict(loss="gmpo", eps_low=0.4, eps_high=0.4),
    # DCPO: probability-dependent clip bounds, token-mean.
    "dcpo": dict(loss="dcpo", eps_low=0.16, eps_high=0.2, dcpo_r_max=10.0, agg="token-mean"),
    # REINFORCE / GPG: -A logp, on-policy.
    "pg": dict(loss="pg", agg="token-mean"),
    # LUSPO: GSPO's clipped sequence ratio, each sequence's token losses summed (not averaged), so
    # long sequences are not down-weighted; mean over sequences.
    "luspo": dict(
        loss="luspo", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-sum"
    ),
    # VESPO: REINFORCE weighted by a gamma function of the sequence ratio (no hard clip);
    # token-mean (TRL aggregates it as dapo).
    "vespo": dict(loss="vespo", agg="token-mean"),
}
