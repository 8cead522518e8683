"""The per-row statistics of a whole vocabulary row from those of its slices.

Each rank reduces its slice of a row z (already divided by the temperature) to three floats:

    lse_r  = log sum_{j in r} exp z_j                  (-inf for a slice of only -inf logits)
    H_r    = the entropy of softmax(z) restricted to the slice
    logp_r = z_label - lse_r                           (used only from the rank owning the label)

The row's lse is the logsumexp of the lse_r, and with w_r = exp(lse_r - lse) (the slice's share
of the probability mass), E[z] = sum_r w_r E_r[z] and E_r[z] = lse_r - H_r, so

    H    = lse - E[z] = sum_r w_r (H_r + (lse - lse_r))
    logp = logp_owner + (lse_owner - lse).

Written as corrections to the slice values rather than as lse - E[z], nothing cancels (lse and
E[z] are both large when the logits are). Every rank merges the same gathered numbers in the same
order, so the results are the same bits on every rank.
"""

from __future__ import annotations

import torch

# Floats per token per rank in the forward all-gather: (lse_r, H_r, logp_r).
PARTIALS = 3


def pack(logp: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """[B, T] slice statistics -> the [B * T, PARTIALS] fp32 rows a rank sends."""
    return torch.stack([lse.reshape(-1), entropy.reshape(-1), logp.reshape(-1)], dim=-1).float()


def merge(
    gathered: torch.Tensor, owners: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[world, N, PARTIALS] gathered partials and the [N] owning rank of each label ->
    (logp, lse, entropy) of the whole rows, [N] fp32.

    Rows with a NaN or +inf logit, or with no logit above -inf on any rank, give NaN (the
    single-process convention); a slice of only -inf logits (lse_r = -inf) holds no mass and
    drops out, its own NaN entropy included.
    """
    lse_r, entropy_r, logp_r = gathered.unbind(-1)
    top = lse_r.amax(0)
    shift = torch.where(torch.isfinite(top), top, 0.0)
    lse = torch.log(torch.exp(lse_r - shift).sum(0)) + shift
    # +inf: a +inf logit somewhere; -inf: no logit above -inf anywhere. Neither row is a
    # distribution, and NaN then flows into logp and the entropy.
    lse = torch.where(torch.isinf(lse), float("nan"), lse)
    empty = lse_r == float("-inf")
    share = torch.exp(lse_r - lse)
    entropy = torch.where(empty, 0.0, share * (entropy_r + (lse - lse_r))).sum(0)
    entropy = torch.where(torch.isnan(lse), lse, entropy)
    owner_lse = lse_r.gather(0, owners[None]).squeeze(0)
    owner_logp = logp_r.gather(0, owners[None]).squeeze(0)
    # An owner slice of only -inf logits: the label's logit is -inf, so is its log-prob (the
    # slice's own logp_r is NaN: it had no mass to normalise by).
    logp = torch.where(owner_lse == float("-inf"), float("-inf"), owner_logp + (owner_lse - lse))
    logp = torch.where(torch.isnan(lse), lse, logp)
    return logp, lse, entropy
