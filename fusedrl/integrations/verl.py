"""Drop-in for verl (tested against verl 0.9.1): registry policy losses and fused log-probs/entropy.

Three independent pieces, switched on from a verl config (see docs/integrations.md):

1. Policy losses in verl's registry. Importing this module registers, with verl's own
   `register_policy_loss`, one fused loss per verl mode that fusedrl reproduces exactly:

       fusedrl_vanilla  fusedrl_gspo  fusedrl_sapo  fusedrl_gpg  fusedrl_cispo  fusedrl_geo_mean
       fusedrl_clip_cov  fusedrl_kl_cov  fusedrl_dppo_tv  fusedrl_dppo_kl  fusedrl_dro

   (clip_cov draws its tokens with keys from torch's default generator where verl permutes the
   candidates with torch.randperm: the same distribution, not the same draw, and no host sync.)

   Each has verl's signature `(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
   config, rollout_is_weights)`, reads the same config keys, honours `config.global_batch_info`
   like `agg_loss`, and returns `(pg_loss, metrics)` with verl's metric names. verl hands a policy
   loss log-probs, not logits, so what runs here is fusedrl's scalar half (`token_terms`): loss,
   closed-form d(loss)/d(log_prob) and metrics on [B, T] tensors, attached to `log_prob` by one
   autograd node. That is the same formula code the fused kernels use, but on [B, T] tensors the
   memory saved is small; the saving on the logits is in piece 2.

2. The log-prob / entropy-from-logits path. `patch_actor()` replaces verl's
   `logprobs_from_logits`, `entropy_from_logits` and `entropy_from_logits_with_chunking` (in
   `verl.utils.torch_functional` and in every verl module that imported them by name) with
   `fusedrl.token_logprobs`: no fp32 copy and no softmax of [N, V] is kept for backward; the
   gradient is written per block of rows. Set `FUSEDRL_VERL_PATCH_ACTOR=1` to patch on import.

3. verl's Megatron (tensor-parallel) helpers on vocab-sharded logits:
   `vocab_parallel_log_probs_from_logits`, `vocab_parallel_entropy`,
   `vocab_parallel_entropy_with_chunking` (verl.utils.megatron.tensor_parallel), both at once
   (`vocab_parallel_log_probs_and_entropy`), and the fused-kernel `linear_cross_entropy`, with
   verl's arguments, by fusedrl's tensor-parallel path (docs/tensor_parallel.md). `patch_megatron()`
   installs them; `FUSEDRL_VERL_PATCH_MEGATRON=1` patches on import.

Put the module on verl's import path of every worker with
`actor_rollout_ref.model.external_lib=fusedrl.integrations.verl` (or the environment variable
`VERL_USE_EXTERNAL_MODULES=fusedrl.integrations.verl`).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import verl
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

import fusedrl
from fusedrl import LossConfig
from fusedrl._inputs import LossInputs, check_normalizer
from fusedrl.config import open_if_unbounded
from fusedrl.double_backward import refuse_double_backward
from fusedrl.token_terms import token_terms

# The fused modes follow this version's core_algos (earlier verl forced seq-mean-token-mean in gspo
# and divided seq-mean-token-sum-norm by loss_scale_factor only).
TESTED_VERL_VERSION = "0.9.1"
if getattr(verl, "__version__", None) != TESTED_VERL_VERSION:
    warnings.warn(
        f"fusedrl.integrations.verl is tested with verl {TESTED_VERL_VERSION}, found "
        f"{getattr(verl, '__version__', 'unknown')}: check the loss modes you use against "
        "tests/test_verl_integration.py",
        stacklevel=2,
    )

# verl modes reproduced exactly (verl name -> fusedrl registry name).
LOSS_MODES = {
    "vanilla": "fusedrl_vanilla",
    "gspo": "fusedrl_gspo",
    "sapo": "fusedrl_sapo",
    "gpg": "fusedrl_gpg",
    "cispo": "fusedrl_cispo",
    "geo_mean": "fusedrl_geo_mean",
    "clip_cov": "fusedrl_clip_cov",
    "kl_cov": "fusedrl_kl_cov",
    "dppo_tv": "fusedrl_dppo_tv",
    "dppo_kl": "fusedrl_dppo_kl",
    "dro": "fusedrl_dro",
}
# verl modes with no fused counterpart, and why (the error message says it).
UNSUPPORTED_LOSS_MODES = {
    "bypass_mode": "verl's trainer forces its own 'bypass_mode' loss; use the fused modes with "
    "the trainer's rollout_is_weights (decoupled mode) instead",
}
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# verl clamps log(pi / pi_old) at +-20 in vanilla / sapo / cispo, but not in gspo / geo_mean; its
# ppo_kl metric follows the mode's own log-ratio.
_CLAMPED_PPO_KL = {
    "vanilla": True,
    "sapo": True,
    "cispo": True,
    "gspo": False,
    "geo_mean": False,
    "clip_cov": False,
    "kl_cov": False,
    "dppo_tv": True,
    "dppo_kl": True,
    "dro": False,
}
# The metric names each mode returns (verl 0.9.1): gpg none, kl_cov / dro ppo_kl only.
_METRIC_KEYS = {
    "gpg": (),
    "kl_cov": ("actor/ppo_kl",),
    "dro": ("actor/ppo_kl",),
    "clip_cov": ("actor/pg_clipfrac", "actor/ppo_kl"),
}
_ALL_METRIC_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
_LOG_RATIO_CLAMP = 20.0
# fusedrl backend of the log-prob / entropy drop-ins ("auto": Triton on CUDA, torch elsewhere).
BACKEND = os.environ.get("FUSEDRL_VERL_BACKEND", "auto")


def _get(config: Any, key: str, default: Any = None) -> Any:
    """A key of verl's ActorConfig dataclass or of a (legacy) DictConfig / dict."""
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def _clip_bounds(config: Any) -> tuple[float, float]:
    clip_ratio = _get(config, "clip_ratio", 0.2)
    low = _get(config, "clip_ratio_low")
    high = _get(config, "clip_ratio_high")
    return float(clip_ratio if low is None else low), float(clip_ratio if high is None else high)


def _check_loss_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r} is not supported by fusedrl's verl integration; "
            f"supported: {LOSS_AGG_MODES}"
        )


def _agg(loss_agg_mode: str) -> str:
    # token-sum is a token-mean whose denominator is 1 / dp_size (see verl_normalizer).
    return "token-mean" if loss_agg_mode == "token-sum" else loss_agg_mode


def loss_config_from_verl(
    config: Any,
    loss_mode: str | None = None,
    loss_agg_mode: str | None = None,
    global_batch_info: dict | None = None,
) -> LossConfig:
    """The LossConfig that reproduces verl's policy loss `loss_mode` for this actor config.

    `config` is verl's `actor_rollout_ref.actor` (ActorConfig or DictConfig). `loss_mode` defaults
    to `config.policy_loss.loss_mode` (a `fusedrl_` prefix is accepted), `loss_agg_mode` to
    `config.loss_agg_mode`. `loss_scale_factor` is read from `global_batch_info` when given (as
    verl's `agg_loss` receives it), else from the config. The per-call denominator comes from
    `verl_normalizer`.
    """
    if loss_mode is None:
        loss_mode = _get(_get(config, "policy_loss"), "loss_mode", "vanilla")
    mode = loss_mode.removeprefix("fusedrl_")
    if mode in UNSUPPORTED_LOSS_MODES:
        raise ValueError(
            f"verl policy_loss.loss_mode={loss_mode!r} is not supported by fusedrl: "
            f"{UNSUPPORTED_LOSS_MODES[mode]}; supported: {tuple(LOSS_MODES)}"
        )
    if mode not in LOSS_MODES:
        raise ValueError(
            f"verl policy_loss.loss_mode={loss_mode!r} is not supported by fusedrl; "
            f"supported: {tuple(LOSS_MODES)}"
        )
    if loss_agg_mode is None:
        loss_agg_mode = _get(config, "loss_agg_mode", "token-mean")
    _check_loss_agg_mode(loss_agg_mode)
    norm_constant = None
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if global_batch_info is not None:
            norm_constant = global_batch_info.get("loss_scale_factor")
        else:
            norm_constant = _get(config, "loss_scale_factor")
    eps_low, eps_high = _clip_bounds(config)
    if mode in ("vanilla", "gspo", "cispo"):
        # verl's lower bound 1 - clip_ratio_low <= 0 never binds a ratio (its CISPO recipe
        # sets clip_ratio_low=10): the open bound, as TRL's cispo.
        eps_low = open_if_unbounded(eps_low)
    try:
        if mode == "vanilla":
            # verl's vanilla always dual-clips (clip_ratio_c, default 3.0).
            return LossConfig(
                loss="ppo",
                eps_low=eps_low,
                eps_high=eps_high,
                dual_clip_c=float(_get(config, "clip_ratio_c", 3.0)),
                agg=_agg(loss_agg_mode),
                norm_constant=norm_constant,
            )
        if mode == "gspo":
            return LossConfig(
                loss="ppo",
                ratio_level="sequence",
                eps_low=eps_low,
                eps_high=eps_high,
                agg=_agg(loss_agg_mode),
                norm_constant=norm_constant,
            )
        if mode == "sapo":
            # verl's sapo aggregates per sequence whatever loss_agg_mode says.
            return LossConfig(
                loss="sapo",
                sapo_tau_pos=float(_get(config, "tau_pos", 1.0)),
                sapo_tau_neg=float(_get(config, "tau_neg", 1.05)),
                agg="seq-mean-token-mean",
            )
        if mode == "gpg":
            return LossConfig(loss="pg", agg=_agg(loss_agg_mode), norm_constant=norm_constant)
        if mode == "cispo":
            return LossConfig(
                loss="cispo",
                eps_low=eps_low,
                eps_high=eps_high,
                agg=_agg(loss_agg_mode),
                norm_constant=norm_constant,
            )
        if mode == "geo_mean":  # a mean over all rows, loss_agg_mode is not used
            return LossConfig(loss="gmpo", eps_low=eps_low, eps_high=eps_high)
        agg = _agg(loss_agg_mode)
        return _scalar_loss_config(mode, config, eps_low, eps_high, agg, norm_constant)
    except ValueError as err:
        raise ValueError(
            f"verl actor config (loss_mode={loss_mode!r}, clip_ratio_low={eps_low}, "
            f"clip_ratio_high={eps_high}) is not supported by fusedrl: {err}"
        ) from err


def _policy_loss_field(config: Any, key: str, fallback: float) -> float:
    """config.policy_loss.<key>, with verl's in-function fallback when it is None."""
    value = _get(_get(config, "policy_loss"), key)
    return float(fallback if value is None else value)


def _scalar_loss_config(mode, config, eps_low, eps_high, agg, norm_constant) -> LossConfig:
    """clip_cov / kl_cov / dppo_tv / dppo_kl / dro with verl's config keys and fallbacks."""
    common = dict(loss=mode, agg=agg, norm_constant=norm_constant)
    if mode == "clip_cov":
        return LossConfig(
            **common,
            eps_low=eps_low,
            eps_high=eps_high,
            clip_cov_ratio=_policy_loss_field(config, "clip_cov_ratio", 0.0002),
            clip_cov_lb=_policy_loss_field(config, "clip_cov_lb", 1.0),
            clip_cov_ub=_policy_loss_field(config, "clip_cov_ub", 5.0),
        )
    if mode == "kl_cov":
        return LossConfig(
            **common,
            kl_cov_ratio=_policy_loss_field(config, "kl_cov_ratio", 0.0002),
            kl_cov_coef=_policy_loss_field(config, "ppo_kl_coef", 1.0),
        )
    if mode == "dro":
        beta = _get(_get(config, "policy_loss"), "dro_beta")
        if beta is None or beta <= 0:
            raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
        return LossConfig(**common, dro_beta=float(beta))
    # dppo_tv / dppo_kl: clip_ratio(_low / _high) are the trust region's thresholds; verl reads
    # clip_ratio_c with a fallback of 20 (ActorConfig's default is 3).
    return LossConfig(
        **common,
        eps_low=eps_low,
        eps_high=eps_high,
        dppo_ratio_cap=float(_get(config, "clip_ratio_c", 20.0)),
    )


def verl_normalizer(
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_batch_info: dict | None = None,
) -> torch.Tensor | float | None:
    """fusedrl's `normalizer` for verl's `agg_loss(..., **global_batch_info)`.

    verl divides by `batch_num_tokens` (token-mean) or `global_batch_size` (seq-* modes) and
    multiplies by `dp_size`; fusedrl divides by normalizer = count / dp_size. Without global counts
    verl falls back to the local token count / number of non-empty sequences, which is fusedrl's
    default except for seq-mean-token-sum-norm (fusedrl: all rows), so that one is passed here.
    """
    _check_loss_agg_mode(loss_agg_mode)
    info = global_batch_info or {}
    dp_size = info.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return 1.0 / float(dp_size)
    key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    count = info.get(key)
    if count is None:
        if dp_size > 1:
            raise ValueError(f"verl global_batch_info[{key!r}] is required when dp_size > 1")
        if loss_agg_mode == "seq-mean-token-sum-norm":
            return ((response_mask != 0).sum(-1) > 0).sum().float().clamp_min(1.0)
        return None
    if isinstance(count, torch.Tensor):
        return count.to(device=response_mask.device, dtype=torch.float32) / dp_size
    return float(count) / dp_size


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl_F.masked_mean: sum over the mask / (count + 1e-8)."""
    return torch.where(mask, values, 0.0).sum() / (mask.sum() + 1e-8)


class _LossFromLogp(torch.autograd.Function):
    """A loss whose d(loss)/d(log_prob) was computed with it (fusedrl.token_terms)."""

    @staticmethod
    def forward(ctx, log_prob, loss, dlogp):
        ctx.save_for_backward(dlogp)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_double_backward("fusedrl's verl policy loss")
        (dlogp,) = ctx.saved_tensors
        return dlogp * grad_loss.to(dlogp.dtype), None, None


def _geo_mean_is_weights(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl geo_mean: token IS weights -> one weight per sequence, their geometric mean."""
    weights = weights.detach().float()
    length = mask.sum(-1)
    log_w = torch.where(mask, torch.log(weights + 1e-10), 0.0).sum(-1)
    return torch.exp(log_w / (length + 1e-8))


def fused_policy_loss(
    loss_mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's policy loss `loss_mode` computed by fusedrl (the body of the registered losses)."""
    if config is None:
        raise ValueError("fusedrl's verl policy losses need the actor config (config=None)")
    mode = loss_mode.removeprefix("fusedrl_")
    batch_info = _get(config, "global_batch_info") or {}
    cfg = loss_config_from_verl(config, mode, loss_agg_mode, batch_info)
    mask = response_mask.bool()
    if mode == "geo_mean":
        normalizer = None
    else:
        agg_mode = "seq-mean-token-mean" if mode == "sapo" else loss_agg_mode
        normalizer = verl_normalizer(response_mask, agg_mode, batch_info)

    def where_valid(t: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, t.detach().float(), 0.0)

    is_weights = None
    if rollout_is_weights is not None:
        if mode == "geo_mean":
            # One weight per sequence, read from the first column: not masked, so that a row
            # whose first token is padding keeps its weight.
            seq_w = _geo_mean_is_weights(rollout_is_weights, mask)
            is_weights = seq_w[:, None].expand(mask.shape)
        else:
            is_weights = where_valid(rollout_is_weights)

    logp = where_valid(log_prob)
    old = where_valid(old_log_prob)
    inp = LossInputs(
        logits=None,  # token_terms never looks at the vocab axis
        labels=None,
        advantages=where_valid(advantages),
        mask=mask.float(),
        valid=mask,
        old_logp=old,
        ref_logp=None,
        rollout_logp=None,
        is_weights=is_weights,
        normalizer=check_normalizer(normalizer, log_prob.device),
        flat_input=False,
    )
    terms = token_terms(logp, None, inp, cfg)
    pg_loss = _LossFromLogp.apply(log_prob, terms.loss, terms.dlogp.to(log_prob.dtype))
    return pg_loss, policy_metrics(mode, cfg, logp, old, inp.advantages, mask, terms.metrics)


def policy_metrics(
    mode: str,
    cfg: LossConfig,
    logp: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    metrics: dict[str, torch.Tensor],
) -> dict[str, float]:
    """verl's metrics of policy loss `mode` ([B, R] tensors, 0 off the bool `mask`; `metrics`:
    fusedrl's of the same call), as verl's loss returns them: host floats by verl's names."""
    keys = _METRIC_KEYS.get(mode, _ALL_METRIC_KEYS)
    if not keys:
        return {}
    log_ratio = logp - old
    if _CLAMPED_PPO_KL[mode]:
        log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # kl_cov reports the mean |log ratio| as its ppo_kl.
    ppo_kl = _masked_mean(log_ratio.abs() if mode == "kl_cov" else -log_ratio, mask)
    zero = torch.zeros((), device=logp.device)
    if mode == "geo_mean":
        # verl counts any clipped log-ratio by the sign of the advantage (fusedrl's clip_low /
        # clip_high also look at the direction of the clip).
        clipped = log_ratio != log_ratio.clamp(-cfg.eps_low, cfg.eps_high)
        clipfrac = _masked_mean((clipped & (advantages > 0)).float(), mask)
        clipfrac_lower = _masked_mean((clipped & (advantages < 0)).float(), mask)
    else:
        clipfrac = zero if mode == "sapo" else metrics["clipfrac"]
        clipfrac_lower = metrics["dual_clipfrac"] if mode == "vanilla" else zero
        if mode in ("dppo_tv", "dppo_kl"):  # verl: valid tokens whose ratio passed the cap
            clipfrac_lower = metrics["ratio_capped"]
    found = {
        "actor/pg_clipfrac": clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": clipfrac_lower,
    }
    # verl reports host floats (one sync per metric), and so does its logging downstream.
    return {k: float(found[k]) for k in keys}


def _make_loss(mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    def policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return fused_policy_loss(
            mode,
            old_log_prob,
            log_prob,
            advantages,
            response_mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
        )

    policy_loss.__name__ = f"compute_policy_loss_{LOSS_MODES[mode]}"
    policy_loss.__doc__ = f"verl's {mode!r} policy loss, computed by fusedrl (verl's signature)."
    return policy_loss


POLICY_LOSSES = {name: _make_loss(mode) for mode, name in LOSS_MODES.items()}


def register(replace_builtin: bool = False) -> dict[str, Callable]:
    """Register the fused losses in verl's registry under `fusedrl_<mode>` (idempotent).

    With `replace_builtin=True` they also replace verl's own `vanilla`, `gspo`, ... so that an
    unchanged config runs fusedrl. Returns {registered name: function}.
    """
    registered = {}
    for mode, name in LOSS_MODES.items():
        names = (name, mode) if replace_builtin else (name,)
        for key in names:
            core_algos.register_policy_loss(key)(POLICY_LOSSES[name])
            registered[key] = POLICY_LOSSES[name]
    return registered


# ------------------------------------------------------------------ log-probs / entropy from logits
def _as_rows(logits: torch.Tensor) -> torch.Tensor:
    # fusedrl takes [B, T, V] or [N, V]; anything else is flattened to rows (a view when it can).
    return logits if logits.dim() in (2, 3) else logits.reshape(-1, logits.shape[-1])


# torch.compiler.disable: verl wraps the entropy function in torch.compile by default; the fusedrl
# call is already one fused pass, so tracing it would only add compile time.
@torch.compiler.disable
def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy in one pass (fp32, differentiable), for call sites you control."""
    rows = _as_rows(logits)
    logp, entropy = fusedrl.token_logprobs(
        rows, labels.reshape(rows.shape[:-1]), return_entropy=True, backend=backend or BACKEND
    )
    return logp.view(labels.shape), entropy.view(labels.shape)


@torch.compiler.disable
def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
) -> torch.Tensor:
    """verl_F.logprobs_from_logits, fused: fp32 log-probs, gradient written without fp32 copies.

    `inplace_backward` is accepted for verl's signature; fusedrl's backward writes the gradient
    block by block into a new logits-sized buffer (the logits themselves are left intact, which
    the entropy computation on the same logits needs).
    """
    rows = _as_rows(logits)
    logp, _ = fusedrl.token_logprobs(rows, labels.reshape(rows.shape[:-1]), backend=BACKEND)
    return logp.view(labels.shape)


@torch.compiler.disable
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl_F.entropy_from_logits, fused: fp32 entropy, no softmax of [N, V] kept for backward."""
    rows = _as_rows(logits)
    # Any label will do: only the entropy is used; 0 is a valid index for every row.
    labels = torch.zeros(rows.shape[:-1], dtype=torch.long, device=rows.device)
    _, entropy = fusedrl.token_logprobs(rows, labels, return_entropy=True, backend=BACKEND)
    return entropy.view(logits.shape[:-1])


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl_F.entropy_from_logits_with_chunking, fused (fusedrl already walks rows in blocks)."""
    return entropy_from_logits(logits)


_ORIGINALS: dict[str, Callable] = {}
_DROP_INS = {
    "logprobs_from_logits": logprobs_from_logits,
    "entropy_from_logits": entropy_from_logits,
    "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking,
}


def _rebind(swaps: list[tuple[Callable, Callable]]) -> list[str]:
    """In `verl` and every loaded `verl.*` module, rebind each attribute that is `old` to `new`
    (for each (old, new) of `swaps`). Returns the attributes rebound."""
    by_id = {id(old): (old, new) for old, new in swaps}
    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for attr, value in list(vars(module).items()):
            pair = by_id.get(id(value))
            if pair is not None and value is pair[0]:
                setattr(module, attr, pair[1])
                rebound.append(f"{mod_name}.{attr}")
    return sorted(rebound)


def patch_actor() -> list[str]:
    """Route verl's log-prob / entropy-from-logits path through fusedrl (idempotent).

    Patches `verl.utils.torch_functional` and every imported `verl.*` module that bound the
    originals by name (`from verl.utils.torch_functional import logprobs_from_logits`); modules
    imported later pick the drop-ins up from `torch_functional`. Call it in each worker before the
    engine is built (FSDPEngine binds its entropy function at construction), which importing this
    module through `external_lib` with FUSEDRL_VERL_PATCH_ACTOR=1 does. Returns what was patched.
    """
    for name in _DROP_INS:
        _ORIGINALS.setdefault(name, getattr(verl_F, name))
    return _rebind([(_ORIGINALS[name], _DROP_INS[name]) for name in _DROP_INS])


def unpatch_actor() -> None:
    """Undo `patch_actor` (for tests and A/B runs in one process)."""
    _rebind([(_DROP_INS[name], _ORIGINALS[name]) for name in _DROP_INS if name in _ORIGINALS])


# --------------------------------------------- verl's Megatron helpers: vocab-sharded logits (TP)
# verl's Megatron engine (verl/workers/engine/megatron/transformer_impl.py) computes log-probs and
# entropy from the LM head's vocab-parallel output with the helpers of
# verl/utils/megatron/tensor_parallel.py, over megatron's tensor-parallel group: Megatron's
# vocab_parallel_cross_entropy (3 all-reduces per call) and its own entropy (3 more). The
# drop-ins below take the same arguments and run fusedrl's tensor-parallel path instead: one
# all-gather of a few floats per token in the forward, none in the backward (docs/
# tensor_parallel.md). `group=None` is megatron's tensor-parallel group, as in verl.
MEGATRON_HELPERS = "verl.utils.megatron.tensor_parallel"
FUSED_KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"


def megatron_tp_group():
    """megatron's tensor-parallel group: what verl's Megatron helpers all-reduce over."""
    try:
        from megatron.core import parallel_state
    except ImportError as err:
        raise ValueError(
            "fusedrl's verl Megatron helpers need the tensor-parallel process group: pass "
            "group=... (megatron.core is not importable, so megatron's "
            "parallel_state.get_tensor_model_parallel_group() cannot supply it)"
        ) from err
    return parallel_state.get_tensor_model_parallel_group()


def _vocab_parallel(logits, labels, group, vocab_size, entropy: bool):
    """fusedrl.token_logprobs on this rank's vocab slice; (logp, entropy) of labels' shape."""
    group = megatron_tp_group() if group is None else group
    rows = _as_rows(logits)
    shape = logits.shape[:-1]
    if labels is None:  # entropy only: any id will do, 0 is in every vocabulary
        labels = torch.zeros(shape, dtype=torch.long, device=logits.device)
    logp, ent = fusedrl.token_logprobs(
        rows,
        labels.reshape(rows.shape[:-1]),
        return_entropy=entropy,
        backend=BACKEND,
        tp_group=group,
        vocab_size=vocab_size,
    )
    return logp.view(labels.shape), None if ent is None else ent.view(shape)


@torch.compiler.disable
def vocab_parallel_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """verl's `vocab_parallel_log_probs_from_logits(logits, labels)`, fused.

    logits: this rank's vocab slice `[..., V / tp]` (rank r holds global ids from r * V / tp, or
    from the sum of the lower ranks' widths when the slices are uneven); labels: global token ids
    of shape `logits.shape[:-1]`, the same on every rank. Returns the fp32 log-probs, labels'
    shape, the same on every rank (Megatron's `-vocab_parallel_cross_entropy`); the gradient is
    this rank's slice, in the logits' dtype. Unlike Megatron's, the logits are left intact.

    `group`: the tensor-parallel process group (default: megatron's, as verl). `vocab_size`:
    the true vocabulary, when the slices hold padding columns that must not count (Megatron's
    own helper counts them; the default, the sum of the slices, does the same).
    """
    return _vocab_parallel(logits, labels, group, vocab_size, entropy=False)[0]


@torch.compiler.disable
def vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor, *, group=None, vocab_size: int | None = None
) -> torch.Tensor:
    """verl's `vocab_parallel_entropy(vocab_parallel_logits)`, fused: the entropy of the whole
    rows, shape `logits.shape[:-1]`, fp32 (verl's has the logits' dtype), the same on every
    rank; the gradient is this rank's slice. `group`, `vocab_size`: as in
    `vocab_parallel_log_probs_from_logits`."""
    return _vocab_parallel(vocab_parallel_logits, None, group, vocab_size, entropy=True)[1]


def vocab_parallel_entropy_with_chunking(
    vocab_parallel_logits: torch.Tensor,
    chunk_size: int = 2048,
    *,
    group=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """verl's `vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size)`, fused
    (fusedrl already walks the rows in blocks; `chunk_size` is accepted and not needed)."""
    return vocab_parallel_entropy(vocab_parallel_logits, group=group, vocab_size=vocab_size)


@torch.compiler.disable
def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, group=None, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy of vocab-sharded logits from one pass and one collective: what
    verl's Megatron engine gets from `vocab_parallel_entropy` and then
    `vocab_parallel_log_probs_from_logits` on a copy of the logits (6 all-reduces). Arguments and
    results as those two."""
    return _vocab_parallel(logits, labels, group, vocab_size, entropy=True)


def _linear_backend(sharded: bool) -> str:
    # The LM-head form has no "cuda" backend. "auto" runs the Triton gemm design on CUDA tensors
    # (with a process group too) and the torch blocks elsewhere, such as a CPU gloo group.
    if BACKEND == "cuda" or (sharded and BACKEND == "triton"):
        return "auto"
    return BACKEND


@torch.compiler.disable
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
    *,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's fused-kernel `linear_cross_entropy(hidden, weight, labels, temperature, reduction,
    dist_process_group)` (verl/utils/kernel/linear_cross_entropy.py, the Megatron engine's
    `use_fused_kernels=True` path), by `fusedrl.linear_token_logprobs`.

    hidden `[..., H]` (replicated over the group), weight this rank's rows `[V / tp, H]`, labels
    global ids of hidden's leading shape. Returns (log-probs, entropy), fp32, flattened to
    `[N]`; with reduction "sum" / "mean" the log-probs are summed / averaged to a scalar (the
    entropy stays per token), as verl's. `dist_process_group=None` is a whole head on one rank.
    The gradient of `hidden` is this rank's part, not summed over the group (as verl's kernel:
    the caller's Megatron region reduces it); `weight`'s is this rank's rows.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"Invalid reduction: {reduction!r}: expected 'none', 'sum' or 'mean'")
    rows = hidden.reshape(-1, hidden.shape[-1])
    sharded = dist_process_group is not None
    logp, entropy = fusedrl.linear_token_logprobs(
        rows,
        weight,
        labels.reshape(-1),
        float(temperature),
        True,
        backend=_linear_backend(sharded),
        tp_group=dist_process_group,
        vocab_size=vocab_size,
        reduce_input_grad=False,
    )
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


_MEGATRON_DROP_INS = {
    "vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
    "vocab_parallel_entropy": vocab_parallel_entropy,
    "vocab_parallel_entropy_with_chunking": vocab_parallel_entropy_with_chunking,
}
_MEGATRON_ORIGINALS: dict[str, Callable] = {}


def _megatron_swaps(fused_kernels: bool) -> list[tuple[str, str, Callable]]:
    """(module, name, drop-in) of what patch_megatron replaces."""
    swaps = [(MEGATRON_HELPERS, name, fn) for name, fn in _MEGATRON_DROP_INS.items()]
    if fused_kernels:
        swaps.append((FUSED_KERNEL_MODULE, "linear_cross_entropy", linear_cross_entropy))
    return swaps


def patch_megatron(fused_kernels: bool = False) -> list[str]:
    """Route verl's Megatron log-prob / entropy helpers through fusedrl's tensor-parallel path
    (idempotent): `vocab_parallel_log_probs_from_logits`, `vocab_parallel_entropy` and
    `vocab_parallel_entropy_with_chunking` of verl.utils.megatron.tensor_parallel, in that module
    and in every loaded `verl.*` module that bound them by name (the Megatron engine does). With
    `fused_kernels=True`, also verl's `linear_cross_entropy` (the `use_fused_kernels=True` path).
    Needs megatron (verl's module imports it). Returns what was patched.
    """
    import importlib

    swaps = _megatron_swaps(fused_kernels)
    for module_name in {module for module, _, _ in swaps}:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ImportError(
                f"patch_megatron: verl's {module_name} does not import ({err}); it needs "
                "megatron-core, which verl's Megatron backend installs"
            ) from err
        for mod, name, drop_in in swaps:
            current = getattr(module, name) if mod == module_name else drop_in
            if current is not drop_in:  # (taken again from a module imported afresh)
                _MEGATRON_ORIGINALS[name] = current
    return _rebind([(_MEGATRON_ORIGINALS[name], fn) for _, name, fn in swaps])


def unpatch_megatron() -> None:
    """Undo `patch_megatron`."""
    swaps = _megatron_swaps(fused_kernels=True)
    originals = _MEGATRON_ORIGINALS
    _rebind([(fn, originals[name]) for _, name, fn in swaps if name in originals])


register()
if os.environ.get("FUSEDRL_VERL_PATCH_ACTOR", "0") == "1":
    patch_actor()
if os.environ.get("FUSEDRL_VERL_PATCH_MEGATRON", "0") == "1":
    patch_megatron()
