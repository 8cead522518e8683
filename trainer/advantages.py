"""A step's advantages, one per sequence, from the statistics of the whole step.

The data-parallel ranks each roll out a slice of the step's prompts; the estimators whose
statistics reach beyond one group (the batch std of lite_ppo, reinforce_pp and
reinforce_pp_baseline; dcpo_sas's per-prompt history) must see all of them, as one process
would. Every rank gathers the step's rewards and prompt keys (a few floats per sequence),
computes the estimator over them alike (SAS's history thus stays the same on every rank, and
rank 0's checkpoint holds all of it), and keeps its own rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

import fusedrl.advantages as adv

from .distributed import DistEnv, gather_in_dp_group


def step_advantages(
    name: str,
    rewards: torch.Tensor,
    prompt_keys: Sequence[Hashable],
    group_size: int,
    env: DistEnv,
    sas: adv.SmoothAdvantageStandardizer | None = None,
) -> torch.Tensor:
    """This rank's advantages ([B] for its `rewards`, groups contiguous, one key a group) by the
    estimator `name` (a function of `fusedrl.advantages`, or "dcpo_sas" with `sas`) over the
    rewards of every data-parallel rank."""
    parts = gather_in_dp_group((rewards.cpu(), list(prompt_keys)), env)
    every = torch.cat([part for part, _ in parts])
    if name == "dcpo_sas":
        out = sas(every, group_size, [key for _, keys in parts for key in keys])
    elif name == "reinforce_pp":  # batch whitening: no groups
        out = adv.reinforce_pp(every)
    else:
        out = getattr(adv, name)(every, group_size)
    start = sum(len(part) for part, _ in parts[: env.dp_rank])
    return out[start : start + len(rewards)].to(rewards.device)
