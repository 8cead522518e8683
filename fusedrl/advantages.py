"""Outcome-level advantage estimators and rollout-side tricks for GRPO-family RL.

All estimators take per-sequence scalar rewards and return one advantage per sequence; the
loss broadcasts it over the completion's tokens.

Conventions
-----------
* ``rewards`` is a 1-D floating tensor ``[B]`` with ``B = num_prompts * group_size`` and the
  groups stored **contiguously**: rows ``g*G .. g*G+G-1`` are the ``G`` completions of prompt
  ``g`` (the order vLLM's ``SamplingParams(n=G)`` returns them in).
* Standard deviations are the unbiased (Bessel-corrected) std, as torch, verl and TRL use.
* A group (or batch) whose rewards are all identical gets advantage exactly ``0`` (never NaN),
  including ``group_size == 1``.
* A non-finite reward is unscorable (TRL writes NaN for a completion no reward function
  scored): it takes no part in any mean, std or min / max, and its advantage is ``0``, as TRL's
  ``nanmean`` / ``nanstd`` and ``nan_to_num`` give. A NaN never spreads to its group or batch.
* Results are ``float32`` on the input's device. The math is computed in float32 (float64 if
  the input is float64) and is free of host synchronisation (no ``.item()``), so the tensor
  estimators run unchanged on GPU tensors. The exceptions are documented host-side helpers:
  :class:`SmoothAdvantageStandardizer` and :func:`dupo_fill`.

This module depends only on torch and the standard library.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = [
    "SmoothAdvantageStandardizer",
    "dr_grpo",
    "dupo_fill",
    "dynamic_sampling_filter",
    "expand_group_indices",
    "expand_group_mask",
    "grpo",
    "lite_ppo",
    "overlong_filter",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "soft_overlong_punishment",
]

DEFAULT_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_eps(eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    return float(eps)


def _check_rewards(rewards: Any) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got dtype {rewards.dtype}")
    return rewards


def _check_grouped(rewards: Any, group_size: Any) -> tuple[torch.Tensor, int]:
    rewards = _check_rewards(rewards)
    group_size = _check_int(group_size, "group_size", 1)
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards length {rewards.shape[0]} is not divisible by group_size {group_size} "
            "(rewards must hold num_prompts * group_size contiguous completions)"
        )
    return rewards, group_size


def _work(rewards: torch.Tensor) -> torch.Tensor:
    """Upcast to the compute dtype: float64 stays float64, everything else becomes float32."""
    if rewards.dtype == torch.float64:
        return rewards
    return rewards.to(torch.float32)


def _out(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


# --------------------------------------------------------------------------------------------
# shared sync-free building blocks
# --------------------------------------------------------------------------------------------


def _scored_stats(x: torch.Tensor, dim: int | None = None):
    """``(scored, mean, std, const)`` of the scored (finite) entries of ``x`` along ``dim`` (None:
    all of it), kept dims: the mean and the unbiased std over them (std 0 where fewer than two are
    scored), and ``const`` where they are all equal (or none / one is scored).

    A non-finite reward is "unscorable" (TRL writes NaN for a completion that no reward function
    scored): it takes no part in any statistic and its advantage is 0, as TRL's nanmean / nanstd
    and ``nan_to_num`` give; a NaN must not turn its whole group, or batch, into NaN.
    """
    scored = torch.isfinite(x)
    dims = () if dim is None else (dim,)
    keep = dim is not None
    count = scored.sum(dims, keepdim=keep).to(x.dtype)
    mean = torch.where(scored, x, 0.0).sum(dims, keepdim=keep) / count.clamp_min(1.0)
    deviation = torch.where(scored, x - mean, 0.0)
    var = (deviation * deviation).sum(dims, keepdim=keep) / (count - 1.0).clamp_min(1.0)
    lo = torch.where(scored, x, math.inf).amin(dims, keepdim=keep)
    hi = torch.where(scored, x, -math.inf).amax(dims, keepdim=keep)
    return scored, mean, var.sqrt(), hi <= lo


def _group_centered(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """``(r - mean_g, std_g, scored)`` as ``[num_groups, G]`` / ``[num_groups, 1]`` / ``[num_groups,
    G]``, over each group's scored rewards.

    Groups whose scored rewards are all identical are centred to exactly 0 (the float mean of
    identical values can round away from them), and so is every unscorable reward.
    """
    x = _work(rewards).view(-1, group_size)
    scored, mean, std, const = _scored_stats(x, dim=1)
    centered = torch.where(const | ~scored, 0.0, x - mean)
    return centered, std, scored


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch whitening ``(x - mean) / (std + eps)`` of a 1-D tensor over its finite entries; 0 at
    the others, and everywhere if the finite values are all equal."""
    if x.numel() == 0:
        return x.clone()
    scored, mean, std, const = _scored_stats(x)
    out = (x - mean) / (std + eps)
    return torch.where(const | ~scored, 0.0, out)


# --------------------------------------------------------------------------------------------
# outcome advantage estimators
# --------------------------------------------------------------------------------------------


def grpo(rewards: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """GRPO group-normalised advantage.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` with ``mean_g`` / ``std_g`` (unbiased) taken over the
    ``G`` completions of the prompt. Follows DeepSeekMath's GRPO (Shao et al. 2024,
    arXiv 2402.03300), verl's ``compute_grpo_outcome_advantage`` and TRL's
    ``scale_rewards="group"``.

    Differences from peers: a group of identical rewards, including ``group_size == 1``, gives
    exactly 0 (verl uses mean 0 / std 1 for a singleton group, i.e. ``A = r``); TRL uses
    ``eps = 1e-4``, verl and this function ``1e-6``.

    Args:
        rewards: ``[B]`` floating tensor, groups contiguous.
        group_size: completions per prompt ``G``; ``B % G == 0``.
        eps: added to the std.

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    eps = _check_eps(eps)
    centered, std, _ = _group_centered(rewards, group_size)
    adv = centered / (std + eps)
    adv = torch.where(centered == 0, 0.0, adv)  # 0, not 0/0, when eps == 0
    return _out(adv.reshape(-1))


def dr_grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO advantage: group mean baseline, no std scaling.

    ``A_i = r_i - mean_g``. Follows "Understanding R1-Zero-Like Training: A Critical
    Perspective" (Liu et al. 2025, arXiv 2503.20783) and verl's GRPO estimator with
    ``norm_adv_by_std_in_grpo=False`` (TRL ``scale_rewards="none"``). Groups of identical rewards
    (and ``group_size == 1``) give exactly 0.

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    centered, _, _ = _group_centered(rewards, group_size)
    return _out(centered.reshape(-1))


def lite_ppo(rewards: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """LitePPO advantage: group mean baseline, batch-level std.

    ``A_i = (r_i - mean_g) / (std_B + eps)`` where ``std_B`` is the unbiased std of *all* ``B``
    rewards in the batch. Follows "Tricks or Traps? A Deep Dive into RL for LLM Reasoning"
    (Liu et al. 2025, arXiv 2508.08221) and TRL's ``scale_rewards="batch"`` (TRL's ``eps`` is
    ``1e-4``: pass it to get TRL's numbers where the batch std is that small).

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    eps = _check_eps(eps)
    centered, _, _ = _group_centered(rewards, group_size)
    _, _, std, _ = _scored_stats(_work(rewards))
    adv = centered / (std + eps)
    adv = torch.where(centered == 0, 0.0, adv)  # 0, not 0/0, when eps == 0
    return _out(adv.reshape(-1))


def reinforce_pp(rewards: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """REINFORCE++ outcome advantage: global batch whitening.

    ``A_i = (r_i - mean_B) / (std_B + eps)`` over all ``B`` sequences of the batch (no grouping).
    REINFORCE++ (Hu 2025, arXiv 2501.03262) for outcome rewards with ``gamma = 1``, whitened over
    sequences. verl's ``compute_reinforce_plus_plus_outcome_advantage`` gives other numbers, even
    when every response has the same length: it whitens over *tokens* (each sequence weighs its
    length, and Bessel's correction counts tokens: ``n / (n - 1)`` over all ``B * T`` of them) and
    scales by ``rsqrt(var + 1e-8)`` where this function divides by ``std + eps`` (at ``B = 8``,
    ``T = 100``, 0/1 rewards: verl +-0.9994, this +-0.9354). A batch of identical rewards gives
    exactly 0.

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards = _check_rewards(rewards)
    eps = _check_eps(eps)
    return _out(_whiten(_work(rewards), eps))


def reinforce_pp_baseline(
    rewards: torch.Tensor, group_size: int, eps: float = DEFAULT_EPS
) -> torch.Tensor:
    """REINFORCE++-baseline: group mean baseline, then global batch whitening.

    ``x_i = r_i - mean_g``; ``A_i = (x_i - mean_B(x)) / (std_B(x) + eps)``: REINFORCE++
    (Hu 2025, arXiv 2501.03262), whitened over sequences. verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` differs as :func:`reinforce_pp`
    says (it whitens over tokens, with ``rsqrt(var + 1e-8)``), and for ``group_size == 1`` it
    whitens the raw rewards where this function gives 0 (no baseline from other samples). If
    every ``x_i`` is equal (e.g. all groups constant) the result is exactly 0.

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    eps = _check_eps(eps)
    centered, _, scored = _group_centered(rewards, group_size)
    return _out(_whiten(torch.where(scored, centered, math.nan).reshape(-1), eps))


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (REINFORCE leave-one-out) advantage.

    ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g)`` within each group; 0 for
    ``group_size == 1`` (no other sample to form a baseline; verl's
    ``compute_rloo_outcome_advantage`` gives ``A = r`` there, and equals this otherwise). Follows
    "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
    LLMs" (Ahmadian et al. 2024, arXiv 2402.14740). With unscorable rewards in a group, ``G`` is
    the number of scored ones.

    Returns:
        ``[B]`` float32 advantages.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    centered, _, scored = _group_centered(rewards, group_size)
    # n / (n - 1) over the group's n scored rewards (0 where n <= 1: centered is 0 there)
    n = scored.sum(1, keepdim=True).to(centered.dtype)
    return _out((centered * (n / (n - 1.0).clamp_min(1.0))).reshape(-1))


# --------------------------------------------------------------------------------------------
# DCPO smooth advantage standardization
# --------------------------------------------------------------------------------------------

# per-prompt running statistics: [visits, count, mean, m2 (the sum of squared deviations from the
# mean), min, max]. Mean and m2 merge exactly (Chan et al.'s pairwise update); a running sum of
# squares would cancel catastrophically for rewards with a large offset and a small spread
# (1e8 + {0, 1}: sum**2 / count against sumsq in float64 leaves nothing of the variance).
_VISITS, _COUNT, _MEAN, _M2, _MIN, _MAX = range(6)


def _group_stats(values: list[float]) -> list[float]:
    """One visit's statistics of a group's scored rewards (at least one)."""
    mean = math.fsum(values) / len(values)
    m2 = math.fsum((v - mean) ** 2 for v in values)
    return [1.0, float(len(values)), mean, m2, min(values), max(values)]


def _merged(old: list[float], new: list[float]) -> list[float]:
    count = old[_COUNT] + new[_COUNT]
    delta = new[_MEAN] - old[_MEAN]
    return [
        old[_VISITS] + 1.0,
        count,
        old[_MEAN] + delta * new[_COUNT] / count,
        old[_M2] + new[_M2] + delta * delta * old[_COUNT] * new[_COUNT] / count,
        min(old[_MIN], new[_MIN]),
        max(old[_MAX], new[_MAX]),
    ]


def _stats_adv(values: torch.Tensor, stats: list[float], eps: float) -> torch.Tensor:
    """``(values - mu) / (sigma + eps)`` from (count, mean, m2, min, max); 0 if all equal."""
    count, mean, m2 = stats[_COUNT], stats[_MEAN], stats[_M2]
    if stats[_MIN] == stats[_MAX]:
        return torch.zeros_like(values)
    var = m2 / (count - 1) if count > 1 else 0.0
    return (values - mean) / (math.sqrt(var) + eps)


class SmoothAdvantageStandardizer:
    """DCPO smooth advantage standardization (SAS).

    From "DCPO: Dynamic Clipping Policy Optimization" (arXiv 2509.02333). For a prompt seen for
    the ``i``-th time (``i = 1, 2, ...``) with this step's group rewards ``R``:

    * ``A_new   = (R - mu_new)   / (sigma_new   + eps)``  (stats of this step's group),
    * ``A_total = (R - mu_total) / (sigma_total + eps)``  (stats of every reward of this prompt
      seen so far, this step included),
    * ``SA_new   = (i-1)/i * A_new + 1/i * A_total``,
    * ``SA_total = 1/i * A_new + (i-1)/i * A_total``,
    * advantage = whichever of ``SA_new`` / ``SA_total`` has the smaller absolute value, per
      element (``SA_total`` on ties).

    So a group whose rewards are all equal (``A_new = 0``) still contributes, with a small weight,
    through the prompt's history. On the first visit ``A_new == A_total`` and the result equals
    the GRPO advantage. Stds are unbiased; a set of identical rewards gives exactly 0.
    Unscorable (non-finite) rewards are left out of the statistics and get 0, as in the tensor
    estimators; a group with none scored is not a visit.

    Running statistics are kept per prompt key as visit count, reward count, mean, sum of squared
    deviations, min and max (Python floats, i.e. float64, merged exactly: no cancellation for
    rewards of a large offset), so memory is ``O(#prompts)``. Use :meth:`state_dict` /
    :meth:`load_state_dict` to checkpoint them.

    Host-side: each call copies the rewards to the CPU (one device sync) and loops over prompts
    in Python. If the same key appears more than once in one call, its groups are processed in
    order, each counting as one more visit.
    """

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        self.eps = _check_eps(eps)
        self._stats: dict[Hashable, list[float]] = {}

    def __len__(self) -> int:
        return len(self._stats)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._stats

    def num_visits(self, key: Hashable) -> int:
        """How many groups of ``key`` have been seen (0 if never)."""
        stats = self._stats.get(key)
        return 0 if stats is None else int(stats[_VISITS])

    def reset(self) -> None:
        """Forget all per-prompt statistics."""
        self._stats.clear()

    def __call__(
        self, rewards: torch.Tensor, group_size: int, prompt_keys: Sequence[Hashable]
    ) -> torch.Tensor:
        """Update the running statistics with this batch and return its SAS advantages.

        Args:
            rewards: ``[B]`` floating tensor, groups contiguous.
            group_size: completions per prompt ``G``.
            prompt_keys: ``num_prompts = B // G`` hashable keys, one per group, in group order.

        Returns:
            ``[B]`` float32 advantages on ``rewards.device``.
        """
        rewards, group_size = _check_grouped(rewards, group_size)
        num_prompts = rewards.shape[0] // group_size
        if isinstance(prompt_keys, (str, bytes)) or not isinstance(prompt_keys, Sequence):
            raise TypeError("prompt_keys must be a sequence (e.g. list) of hashable keys")
        if len(prompt_keys) != num_prompts:
            raise ValueError(
                f"prompt_keys has {len(prompt_keys)} entries but rewards holds {num_prompts} "
                f"groups of group_size {group_size}"
            )
        for key in prompt_keys:
            try:
                hash(key)
            except TypeError:
                raise TypeError(f"prompt_keys entries must be hashable, got {key!r}") from None

        groups = rewards.detach().to(device="cpu", dtype=torch.float64).view(-1, group_size)
        out = torch.zeros_like(groups)
        for g, key in enumerate(prompt_keys):
            r = groups[g]
            scored = torch.isfinite(r)
            vals = r[scored].tolist()
            if not vals:  # nothing to learn from, and nothing learned
                continue
            new = _group_stats(vals)
            old = self._stats.get(key)
            total = list(new) if old is None else _merged(old, new)
            self._stats[key] = total
            i = total[_VISITS]
            r = torch.where(scored, r, 0.0)
            a_new = _stats_adv(r, new, self.eps)
            a_total = _stats_adv(r, total, self.eps)
            sa_new = (i - 1.0) / i * a_new + a_total / i
            sa_total = a_new / i + (i - 1.0) / i * a_total
            out[g] = torch.where(
                scored, torch.where(sa_new.abs() < sa_total.abs(), sa_new, sa_total), 0.0
            )
        return out.reshape(-1).to(device=rewards.device, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (tensors, a list of keys and eps; ``torch.save``-friendly)."""
        keys = list(self._stats)
        table = torch.tensor([self._stats[k] for k in keys], dtype=torch.float64)
        table = table.reshape(len(keys), 6)
        return {
            "eps": self.eps,
            "keys": keys,
            "visits": table[:, _VISITS].to(torch.int64),
            "count": table[:, _COUNT].to(torch.int64),
            "mean": table[:, _MEAN].clone(),
            "m2": table[:, _M2].clone(),
            "min": table[:, _MIN].clone(),
            "max": table[:, _MAX].clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state produced by :meth:`state_dict` (replaces the current state); also
        the ``sum`` / ``sumsq`` columns of a state saved before 2026-11-30."""
        if "mean" not in state and {"sum", "sumsq", "count"} <= set(state):
            count = torch.as_tensor(state["count"], dtype=torch.float64).clamp_min(1.0)
            total = torch.as_tensor(state["sum"], dtype=torch.float64)
            squares = torch.as_tensor(state["sumsq"], dtype=torch.float64)
            m2 = (squares - total * total / count).clamp_min(0.0)
            state = {**state, "mean": total / count, "m2": m2}
        names = ("visits", "count", "mean", "m2", "min", "max")
        missing = [n for n in ("eps", "keys", *names) if n not in state]
        if missing:
            raise ValueError(f"state is missing entries {missing}")
        keys = list(state["keys"])
        cols = [torch.as_tensor(state[n], dtype=torch.float64).reshape(-1) for n in names]
        if any(c.numel() != len(keys) for c in cols):
            raise ValueError("state columns must have one entry per key")
        eps = _check_eps(state["eps"])
        rows = torch.stack(cols, dim=1).tolist() if keys else []
        self.eps = eps
        self._stats = {k: row for k, row in zip(keys, rows)}


# --------------------------------------------------------------------------------------------
# DAPO / DUPO rollout-side tricks
# --------------------------------------------------------------------------------------------


def soft_overlong_punishment(
    lengths: torch.Tensor, max_length: int, cache_length: int
) -> torch.Tensor:
    """DAPO soft overlong punishment (length-aware reward shaping).

    From DAPO (Yu et al. 2025, arXiv 2503.14476), with ``L_max = max_length`` and
    ``L_cache = cache_length``::

        R_length(L) = 0                               if L <= L_max - L_cache
                    = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                    = -1                              if L > L_max

    i.e. a linear ramp from 0 to -1 across the last ``L_cache`` tokens. ``cache_length == 0``
    means no soft zone (0 up to ``L_max``, -1 beyond). The result is meant to be added to the
    task reward.

    Args:
        lengths: ``[B]`` int or float tensor of completion lengths.
        max_length: ``L_max`` (int >= 1).
        cache_length: ``L_cache`` in ``[0, max_length]``.

    Returns:
        float32 penalties in ``[-1, 0]``, same shape as ``lengths``.
    """
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths must be a torch.Tensor, got {type(lengths).__name__}")
    if lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(f"lengths must be an int or float tensor, got dtype {lengths.dtype}")
    max_length = _check_int(max_length, "max_length", 1)
    cache_length = _check_int(cache_length, "cache_length", 0)
    if cache_length > max_length:
        raise ValueError(
            f"cache_length must be in [0, max_length={max_length}], got {cache_length}"
        )
    x = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    start = float(max_length - cache_length)
    ramp = (start - x) / float(max(cache_length, 1))
    out = torch.where(x <= start, torch.zeros_like(x), ramp)
    out = torch.where(x > float(max_length), torch.full_like(x, -1.0), out)
    return out.to(torch.float32)


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: drop truncated completions from the loss.

    Returns a copy of the ``[B, T]`` loss ``mask`` with the rows of truncated completions set to
    zero (``False`` for a bool mask); dtype and device are preserved. Follows DAPO
    (arXiv 2503.14476), "Overlong Filtering".

    Args:
        mask: ``[B, T]`` token mask (any dtype).
        truncated: ``[B]`` bool, True where the completion hit the length limit unfinished.
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("mask must be a 2-D [B, T] tensor")
    if not isinstance(truncated, torch.Tensor) or truncated.dtype != torch.bool:
        raise ValueError("truncated must be a bool tensor [B]")
    if truncated.dim() != 1 or truncated.shape[0] != mask.shape[0]:
        raise ValueError(
            f"truncated must have shape [{mask.shape[0]}] to match mask, "
            f"got {tuple(truncated.shape)}"
        )
    return mask.masked_fill(truncated.to(mask.device).unsqueeze(1), 0)


def dynamic_sampling_filter(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal.

    Returns a bool ``[num_groups]`` keep-flag, True where the group's scored (finite) rewards are
    not all equal (``max != min``; for 0/1 rewards, ``0 < #correct < G``). Groups with identical
    rewards have zero GRPO advantage and are filtered out (DAPO, arXiv 2503.14476, "Dynamic
    Sampling"); unscorable (non-finite) rewards count for nothing, as in the estimators. Sync-free;
    use :func:`expand_group_mask` for a per-sequence ``[B]`` mask.
    """
    rewards, group_size = _check_grouped(rewards, group_size)
    _, _, _, const = _scored_stats(_work(rewards).view(-1, group_size), dim=1)
    return ~const.view(-1)


def expand_group_mask(group_keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """Expand a ``[num_groups]`` bool flag to a per-sequence ``[num_groups * group_size]`` mask."""
    if not isinstance(group_keep, torch.Tensor) or group_keep.dtype != torch.bool:
        raise ValueError("group_keep must be a bool tensor [num_groups]")
    if group_keep.dim() != 1:
        raise ValueError(f"group_keep must be 1-D, got shape {tuple(group_keep.shape)}")
    group_size = _check_int(group_size, "group_size", 1)
    return group_keep.repeat_interleave(group_size)


def dupo_fill(
    group_keep: torch.Tensor,
    target_num_groups: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """DUPO duplicate-fill: group indices for a fixed-size batch built from the kept groups.

    DUPO ("Duplicating Sampling Policy Optimization", WebSailor, Li et al. 2025, arXiv 2507.02592)
    removes groups whose rewards have zero std, like DAPO's dynamic sampling, but instead of
    sampling more prompts it fills the freed slots by duplicating other kept groups of the same
    batch, so the batch size stays fixed.

    Returns a LongTensor of ``target_num_groups`` indices into the groups: every kept group once,
    in order, followed by duplicates of kept groups. Duplicates are spread evenly: with ``n`` kept
    groups and a deficit ``d = q * n + r``, every kept group is repeated ``q`` more times and
    ``r`` distinct kept groups, drawn uniformly at random with ``generator``, once more. If more
    than ``target_num_groups`` groups are kept, the first ``target_num_groups`` kept are returned.

    Host-side: the number of kept groups is data-dependent, so this synchronises with the device
    (``nonzero``). The result lives on ``group_keep.device``; turn it into row indices of the
    ``[B]`` batch with :func:`expand_group_indices`.

    Raises:
        ValueError: if no group is kept (the caller must resample the batch).
    """
    if not isinstance(group_keep, torch.Tensor) or group_keep.dtype != torch.bool:
        raise ValueError("group_keep must be a bool tensor [num_groups]")
    if group_keep.dim() != 1:
        raise ValueError(f"group_keep must be 1-D, got shape {tuple(group_keep.shape)}")
    target_num_groups = _check_int(target_num_groups, "target_num_groups", 1)
    kept = torch.nonzero(group_keep.detach().cpu()).reshape(-1)
    n = kept.numel()
    if n == 0:
        raise ValueError(
            "dupo_fill: no group was kept (every group has identical rewards); "
            "there is nothing to duplicate, resample the batch"
        )
    if n >= target_num_groups:
        idx = kept[:target_num_groups]
    else:
        q, r = divmod(target_num_groups - n, n)
        parts = [kept] * (1 + q)
        if r:
            gen_device = generator.device if generator is not None else torch.device("cpu")
            perm = torch.randperm(n, generator=generator, device=gen_device).cpu()
            parts.append(kept[perm[:r]])
        idx = torch.cat(parts)
    return idx.to(device=group_keep.device, dtype=torch.int64)


def expand_group_indices(group_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices ``[len(group_idx) * G]`` of the sequences of the given groups, in order.

    ``group_idx[k] = g`` expands to rows ``g*G .. g*G+G-1`` (groups are contiguous), e.g. to
    gather a :func:`dupo_fill` batch: ``rewards[expand_group_indices(idx, G)]``.
    """
    if not isinstance(group_idx, torch.Tensor) or group_idx.dtype != torch.int64:
        raise ValueError("group_idx must be an int64 (Long) tensor [K]")
    if group_idx.dim() != 1:
        raise ValueError(f"group_idx must be 1-D, got shape {tuple(group_idx.shape)}")
    group_size = _check_int(group_size, "group_size", 1)
    offsets = torch.arange(group_size, device=group_idx.device, dtype=torch.int64)
    return (group_idx.unsqueeze(1) * group_size + offsets).reshape(-1)
