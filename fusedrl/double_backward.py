"""The one rule of fusedrl's hand-written backwards under `backward(create_graph=True)`."""

from __future__ import annotations

import torch


def refuse_double_backward(what: str) -> None:
    """RuntimeError under backward(create_graph=True) (grad mode on inside a backward) for a
    gradient computed by hand: its values carry no graph, so a second-order term through them
    would silently be 0."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} does not support double backward (create_graph=True): its gradient is "
            "computed by fusedrl's kernels and carries no graph, so a second-order term would "
            "silently be 0. fusedrl.reference (plain autograd) gives higher-order derivatives"
        )
