"""Padding-free micro-batches (--pack): a padded [B, P + T] micro-batch as one packed row.

Each sequence's real tokens (its prompt without the left padding, its completion without the
right padding) are laid end to end in one [1, N] row, with position ids that restart at every
sequence, so the model computes no padding. Attention must not cross sequences: with flash
attention (`attn_implementation="flash_attention_2"` / "_3") transformers reads the boundaries
from the restarting position ids; with sdpa or eager (transformers 5.19 does not isolate packed
sequences from position ids there) the row gets a block-diagonal causal mask [1, 1, N, N]: bool
under sdpa (1 byte an element), additive under eager (which adds it to the scores). N^2
elements either way, so long packed micro-batches want flash attention. The model makes
logits (or, for the fused LM head, the loss takes hidden states) only at the M positions that
predict a completion token (`logits_to_keep` as indices), and the loss reads them as packed
[M, V] rows with `cu_seqlens` at the sequences' boundaries (fusedrl's packed sequences).
A sequence with no loss token (filtered: overlong, a zero-variance group's) is left out of the
row altogether: it adds nothing to the loss, its gradient or its metrics, and the overlong ones
are the longest the batch has (one is kept where none has a loss token: the forward still runs).

Everything is sized from the batch's host-side lengths: packing asks the device nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3")


@dataclass(frozen=True)
class PackedRows:
    """One micro-batch packed: the model's inputs and where its loss rows sit."""

    input_ids: torch.Tensor  # [1, N] every sequence's real tokens, end to end
    position_ids: torch.Tensor  # [1, N] restarting at 0 at every sequence
    attention_mask: torch.Tensor | None  # [1, 1, N, N] bool (sdpa) / additive, None (flash)
    keep: torch.Tensor  # [M] the row positions that predict a completion token
    sequences: torch.Tensor  # [S] the batch rows packed (those with a loss token)
    cu_seqlens: torch.Tensor  # [S + 1] int32: the sequences' boundaries among the M loss rows
    max_seqlen: int  # the longest completion
    completion: torch.Tensor  # [B, T] bool: the packed sequences' completion positions, row-major

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """A [B] per-sequence tensor (the advantages) as the packed sequences' [S]."""
        return values[self.sequences]

    def tokens(self, padded: torch.Tensor | None) -> torch.Tensor | None:
        """A [B, T] per-token tensor of the padded layout as the packed [M] rows."""
        return None if padded is None else padded[self.completion]

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed [M] rows back in the padded [B, T] layout (0 at the padding)."""
        out = packed.new_zeros(self.completion.shape)
        out[self.completion] = packed
        return out


def pack_rows(batch, attn_implementation: str | None, mask_dtype: torch.dtype) -> PackedRows:
    """`batch` (a trainer Batch) packed; `attn_implementation`: the model's, which decides how
    the sequences are kept apart; `mask_dtype`: the additive mask's (the model's compute dtype)."""
    device = batch.input_ids.device
    width = batch.labels.shape[1]
    prompt_len = batch.prompt_len
    prompts = batch.prompt_lengths
    if prompts is None:  # (a Batch made without them: one read of its attention mask)
        prompts = batch.attention_mask[:, :prompt_len].sum(1).tolist()
    live = [
        row
        for row in range(len(batch.lengths))
        if batch.loss_tokens is None or batch.loss_tokens[row] > 0
    ] or [0]
    prompts = [prompts[row] for row in live]
    completions = [batch.lengths[row] for row in live]
    pieces, positions, keep, starts, lengths = [], [], [], [0], []
    offset = 0
    for row, prompt, completion in zip(live, prompts, completions):
        pieces.append(batch.input_ids[row, prompt_len - prompt : prompt_len + completion])
        lengths.append(prompt + completion)
        positions.append(torch.arange(lengths[-1]))
        # the position before each completion token predicts it
        keep.append(torch.arange(offset + prompt - 1, offset + prompt - 1 + completion))
        starts.append(starts[-1] + completion)
        offset += lengths[-1]
    packed_lengths = torch.zeros(len(batch.lengths), dtype=torch.long)
    packed_lengths[live] = torch.tensor(completions)
    completion_mask = torch.arange(width)[None, :] < packed_lengths[:, None]
    return PackedRows(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None].to(device),
        attention_mask=_attention_mask(
            torch.tensor(lengths), attn_implementation, mask_dtype, device
        ),
        keep=torch.cat(keep).to(device),
        sequences=torch.tensor(live, device=device),
        cu_seqlens=torch.tensor(starts, dtype=torch.int32, device=device),
        max_seqlen=max(completions, default=0),
        completion=completion_mask.to(device),
    )


def _attention_mask(lengths, attn_implementation, mask_dtype, device) -> torch.Tensor | None:
    """How `attn_implementation` keeps the packed sequences apart (see the module docstring)."""
    if attn_implementation in FLASH_ATTENTION:
        return None
    dtype = torch.bool if attn_implementation == "sdpa" else mask_dtype  # (eager adds it)
    return _block_causal(lengths, dtype, device)


def _block_causal(lengths: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, N, N] mask of where a token may attend (earlier or itself, same sequence): True
    there for a bool `dtype`, else additive (0 there, the dtype's lowest value elsewhere:
    transformers' convention for a 4-D float mask)."""
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    index = torch.arange(sequence.numel(), device=device)
    allowed = (sequence[:, None] == sequence[None, :]) & (index[None, :] <= index[:, None])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]
