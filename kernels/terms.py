"""The per-token loss terms the loss kernels share: the policy term of each variant, the ratio,
the KL estimators, with the clamps and tie rules of `fusedrl.token_terms` (verl's).

The fused kernel (token_loss.py) evaluates them in registers between its two sweeps of a row; the
sequence-level terms kernel (sequence_terms.py) on [B, T] log-probs after a pass over the logits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .token_args import (  # noqa: F401  (variant_scalars: the launchers import it from here)
    KERNEL_SCALARS,
    LossVariant,
    variant_scalars,
)

# constexpr codes of the variants (csrc/fused_loss.h's LossCode / KlCode have the same values);
# fusedrl.triton_backend maps LossConfig onto them, the kernels branch on the names below.
LOSS_CODES = {"ppo": 0, "dcpo": 0, "cispo": 1, "sapo": 2, "pg": 3}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "abs": 3, "k3": 4, "k1+": 5, "k3+": 5}  # + -> k2 gradient
LOSS_CLIPPED = tl.constexpr(LOSS_CODES["ppo"])  # ppo / dcpo (dcpo's bounds arrive per token)
LOSS_CISPO = tl.constexpr(LOSS_CODES["cispo"])
LOSS_SAPO = tl.constexpr(LOSS_CODES["sapo"])
KL_NONE = tl.constexpr(KL_CODES[None])
KL_K1 = tl.constexpr(KL_CODES["k1"])
KL_K2 = tl.constexpr(KL_CODES["k2"])
KL_ABS = tl.constexpr(KL_CODES["abs"])
KL_K3 = tl.constexpr(KL_CODES["k3"])
# The estimator whose value the kl metric and the loss read (k1+ / k3+: k1's / k3's value): 0
# without ref_logp. The KL code above is the gradient's, 0 when beta is 0.
KL_VALUE_CODES = {None: 0, "k1": 1, "k2": 2, "abs": 3, "k3": 4, "k1+": 1, "k3+": 4}


# A @jit function may read a module global only if it is a tl.constexpr: the interpreter accepts
# plain floats, the compiler raises NameError. These mirror fusedrl.token_terms' clamps (verl's).
LOG_RATIO_CLAMP = tl.constexpr(20.0)
SEQ_LOG_RATIO_MAX = tl.constexpr(10.0)  # GSPO's sequence log-ratio, from above
KL_LOG_CLAMP = tl.constexpr(20.0)
KL_VALUE_CLAMP = tl.constexpr(10.0)

# Where each runtime number of the variant sits in the kernels' `loss_scalars` tuple.
LOW_BOUND_AT = tl.constexpr(KERNEL_SCALARS.index("low_bound"))
HIGH_BOUND_AT = tl.constexpr(KERNEL_SCALARS.index("high_bound"))
DUAL_CLIP_C_AT = tl.constexpr(KERNEL_SCALARS.index("dual_clip_c"))
DELTA_AT = tl.constexpr(KERNEL_SCALARS.index("delta"))
TAU_POS_AT = tl.constexpr(KERNEL_SCALARS.index("tau_pos"))
TAU_NEG_AT = tl.constexpr(KERNEL_SCALARS.index("tau_neg"))
BETA_AT = tl.constexpr(KERNEL_SCALARS.index("beta"))
ENTROPY_COEF_AT = tl.constexpr(KERNEL_SCALARS.index("entropy_coef"))


@triton.jit
def _select_max_grad(a, b, da, db):
    """d max(a, b): the larger branch's derivative, half of each at a tie (torch.maximum)."""
    return tl.where(a > b, da, tl.where(b > a, db, 0.5 * (da + db)))


@triton.jit
def token_ratio(logp, old):
    """(ratio pi / pi_old, its d/d(logp), whether the log-ratio is NaN): the log-ratio clamped
    at +-20 before exp (verl), a 0 derivative outside the clamp. The NaN flag is kept apart
    because a GPU's min / max drop a NaN operand."""
    raw_log_ratio = logp - old
    log_ratio = tl.minimum(tl.maximum(raw_log_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    ratio = tl.exp(log_ratio)
    inside_clamp = (raw_log_ratio >= -LOG_RATIO_CLAMP) & (raw_log_ratio <= LOG_RATIO_CLAMP)
    return ratio, tl.where(inside_clamp, ratio, 0.0), raw_log_ratio != raw_log_ratio


@triton.jit
def policy_term(
    logp,
    ratio,
    dratio,
    nan_ratio,
    adv,
    low,
    high,
    loss_scalars,
    LOSS: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    HAS_DELTA: tl.constexpr,
):
    """(per-token policy loss, its d/d(logp), and the clip flags clipfrac, clip_low, clip_high,
    dual_clipfrac) before IS / aggregation weights, given the ratio and its d/d(logp): a token's
    (`token_ratio`) or its sequence's (GSPO: value s, gradient s, the GSPO-token convention).
    Where `nan_ratio` (a NaN log-ratio) the loss is NaN and every flag 0, as torch's
    comparisons of a NaN ratio do (a GPU min / max would drop the NaN and compare a clamped
    value), but CISPO's clipfrac, `ratio != clamp(ratio)`: NaN != NaN, 1."""
    clipped_ratio = tl.minimum(tl.maximum(ratio, low), high)
    below = (ratio < low) & (adv < 0)
    above = (ratio > high) & (adv > 0)
    clipped = ratio != ratio  # False, typed as the flags
    dual_clipped = clipped
    if LOSS == LOSS_CLIPPED:
        if HAS_DELTA:
            delta = loss_scalars[DELTA_AT]
            loss_unclipped = -adv * tl.minimum(ratio, delta)
            d_unclipped = tl.where(ratio <= delta, -adv * dratio, 0.0)
        else:
            loss_unclipped = -adv * ratio
            d_unclipped = -adv * dratio
        loss_clipped = -adv * clipped_ratio
        d_clipped = tl.where((ratio >= low) & (ratio <= high), -adv * dratio, 0.0)
        d = _select_max_grad(loss_unclipped, loss_clipped, d_unclipped, d_clipped)
        value = tl.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
        if DUAL_CLIP:
            loss_dual = -adv * loss_scalars[DUAL_CLIP_C_AT]
            keep = tl.where(value < loss_dual, 1.0, tl.where(value > loss_dual, 0.0, 0.5))
            d = tl.where(adv < 0, d * keep, d)
            dual_clipped = (value > loss_dual) & (adv < 0)
            value = tl.where(adv < 0, tl.minimum(value, loss_dual), value)
    elif LOSS == LOSS_CISPO:  # -sg(clip(r)) A logp
        d = -clipped_ratio * adv
        value = d * logp
        # torch's clamp keeps a NaN ratio, which then differs from itself: clipped. Here the
        # log-ratio clamp (`token_ratio`) has dropped the NaN: the flag comes from nan_ratio.
        clipped = (ratio != clipped_ratio) | nan_ratio
    elif LOSS == LOSS_SAPO:  # -(4/tau) sigmoid(tau (r - 1)) A
        tau = tl.where(adv > 0, loss_scalars[TAU_POS_AT], loss_scalars[TAU_NEG_AT])
        gate = tl.sigmoid(tau * (ratio - 1.0))
        d = -4.0 * gate * (1.0 - gate) * dratio * adv
        value = -(4.0 / tau) * gate * adv
    else:  # pg: -A logp, no ratio
        d = -adv
        value = d * logp
        below = clipped
        above = clipped
    value = tl.where(nan_ratio, float("nan"), value)
    if LOSS != LOSS_CISPO:
        clipped = clipped & ~nan_ratio
    return (
        value,
        d,
        clipped,
        below & ~nan_ratio,
        above & ~nan_ratio,
        dual_clipped & ~nan_ratio,
    )


@triton.jit
def kl_dlogp(logp, ref, KL: tl.constexpr):
    """d KL-estimate / d logp (verl's clamps; k1+/k3+ use k2's gradient)."""
    delta = logp - ref
    if KL == KL_K1:
        d = 1.0
    elif KL == KL_K2:
        d = delta
    elif KL == KL_ABS:
        d = tl.where(delta > 0, 1.0, tl.where(delta < 0, -1.0, 0.0))
    elif KL == KL_K3:
        log_ratio = tl.minimum(tl.maximum(-delta, -KL_LOG_CLAMP), KL_LOG_CLAMP)
        raw = tl.exp(log_ratio) - log_ratio - 1.0
        inside = (delta >= -KL_LOG_CLAMP) & (delta <= KL_LOG_CLAMP)
        inside = inside & (raw >= -KL_VALUE_CLAMP) & (raw <= KL_VALUE_CLAMP)
        d = tl.where(inside, 1.0 - tl.exp(log_ratio), 0.0)
    else:  # k1+ / k3+: the value of k1 / k3, the gradient of k2
        d = delta
    return d


@triton.jit
def kl_value(logp, ref, KL_VALUE: tl.constexpr):
    """The KL estimate's value (verl's clamps; fusedrl.token_terms.kl_and_grad); NaN where
    logp - ref is NaN, which the clamps of a GPU would drop."""
    delta = logp - ref
    if KL_VALUE == KL_K1:
        value = delta
    elif KL_VALUE == KL_K2:
        value = 0.5 * delta * delta
    elif KL_VALUE == KL_ABS:
        value = tl.abs(delta)
    else:  # k3
        log_ratio = tl.minimum(tl.maximum(-delta, -KL_LOG_CLAMP), KL_LOG_CLAMP)
        raw = tl.exp(log_ratio) - log_ratio - 1.0
        value = tl.minimum(tl.maximum(raw, -KL_VALUE_CLAMP), KL_VALUE_CLAMP)
    return tl.where(delta != delta, float("nan"), value)


def variant_constexprs(
    variant: LossVariant, has_ref: bool, has_is: bool, has_bounds: bool, coef_tensor: bool
) -> dict:
    """The loss kernels' constexpr switches of a variant: the loss and KL codes (the KL's
    gradient only when beta > 0; its value whenever ref_logp is given, for the metric), the
    clip options, IS weights, per-token bounds (DCPO), the entropy bonus and where its
    coefficient comes from (a device scalar always applies)."""
    v = variant
    return dict(
        LOSS=LOSS_CODES[v.loss],
        DUAL_CLIP=v.dual_clip_c is not None,
        HAS_DELTA=v.delta is not None,
        KL=KL_CODES[v.kl] if v.beta > 0 else 0,
        KL_VALUE=KL_VALUE_CODES[v.kl or "k3"] if has_ref else 0,
        HAS_IS=has_is,
        HAS_BOUNDS=has_bounds,
        ENTROPY_BONUS=v.entropy_coef != 0.0 or coef_tensor,
        ENTROPY_COEF_FROM_PTR=coef_tensor,
    )
