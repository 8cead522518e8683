"""Where a rank's logits columns sit in the vocabulary, and the labels as that rank sees them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabShard:
    """The vocab layout of a tensor-parallel group, the same on every rank (from the header).

    Rank r holds global token ids [starts[r], starts[r] + sizes[r]); ids >= vocab_size are
    padding (Megatron pads the vocabulary to a multiple of the TP size): they exist as columns
    but are no tokens, so they count nowhere and get a zero gradient.
    """

    rank: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    vocab_size: int

    @property
    def world(self) -> int:
        return len(self.starts)

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def width(self) -> int:
        """This rank's columns that are tokens (its slice without the padding)."""
        return self.width_of(self.rank)

    def width_of(self, rank: int) -> int:
        return max(0, min(self.sizes[rank], self.vocab_size - self.starts[rank]))

    @property
    def widest(self) -> int:
        """The most token columns any rank holds (what sizes row blocks alike on every rank)."""
        return max(self.width_of(r) for r in range(self.world))

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """The token columns of this rank's slice: a view, never a copy (the kernels take any
        row stride)."""
        return logits[..., : self.width]

    def local_labels(self, labels: torch.Tensor, missing: int) -> torch.Tensor:
        """Global ids -> column indices in this rank's slice; `missing` where another rank owns
        the label."""
        local = labels - self.start
        owned = (local >= 0) & (local < self.width)
        return torch.where(owned, local, missing)

    def owners(self, labels: torch.Tensor) -> torch.Tensor:
        """The rank that holds each global id (ids are in [0, vocab_size): checked before)."""
        # A rank of only padding starts at or past vocab_size, beyond every label: it owns none.
        order = sorted(range(self.world), key=self.starts.__getitem__)
        bounds = torch.tensor([self.starts[r] for r in order], device=labels.device)
        slot = torch.searchsorted(bounds, labels, right=True) - 1
        return torch.tensor(order, device=labels.device)[slot]
