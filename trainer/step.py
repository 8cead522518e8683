"""One policy update: padded batch -> completion logits -> fusedrl.policy_loss -> optimizer steps.

The logits never leave the model's dtype: the completion slice of the model output is a strided
view handed to fusedrl, which reads it once and writes the gradient once (in place: the logits
buffer is dead after the loss). Under data parallelism every rank divides by the same global
normaliser (all-reduced token or sequence count of the minibatch), so the sum of the ranks'
gradients is the gradient of the whole minibatch; FSDP averages over ranks, hence the loss is
scaled by the world size. Under --tp the data-parallel ranks are those of the "dp" mesh dimension
(the "tp" ranks of a row share one batch): the count is summed and the loss scaled over them only.
With the LM head split over "tp", the logits are a DTensor sharded on the vocabulary, or, for the
fused LM head, each rank holds its rows of the head; fusedrl's loss takes either as it is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch

import fusedrl
from fusedrl import LossConfig
from fusedrl.linear import plain_lm_head
from fusedrl.tp.dtensor import is_dtensor

from .distributed import max_over_ranks, sum_over_ranks, world_size


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, P + T] prompts left-padded to P, completions right-padded to T
    attention_mask: torch.Tensor  # [B, P + T]
    labels: torch.Tensor  # [B, T] completion tokens
    mask: torch.Tensor  # [B, T] float: tokens in the loss
    advantages: torch.Tensor  # [B]
    prompt_len: int  # P
    lengths: list[int]  # completion lengths, host-side: slicing never syncs with the device
    rollout_logp: torch.Tensor | None = None  # [B, T] vLLM's processed log-probs
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice) -> Batch:
        """The sub-batch of these rows, completion columns trimmed to its longest completion."""
        sub = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in sub.items():
            if isinstance(value, torch.Tensor):
                sub[name] = value[index]
        sub["lengths"] = self.lengths[index]
        width = max(sub["lengths"], default=1) or 1
        for name in ("labels", "mask", "rollout_logp", "old_logp", "ref_logp"):
            if sub[name] is not None:
                sub[name] = sub[name][:, :width]
        sub["input_ids"] = sub["input_ids"][:, : self.prompt_len + width]
        sub["attention_mask"] = sub["attention_mask"][:, : self.prompt_len + width]
        return Batch(**sub)

    def to(self, device: torch.device) -> Batch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return Batch(**moved)


def collate(
    prompts: list[list[int]],
    completions: list[list[int]],
    advantages: torch.Tensor,
    loss_rows: torch.Tensor,
    rollout_logps: list[list[float]] | None,
    pad_id: int,
) -> Batch:
    """Left-pad prompts and right-pad completions into one [B, P + T] batch."""
    n = len(prompts)
    prompt_len = max(len(p) for p in prompts)
    width = max(1, max(len(c) for c in completions))
    input_ids = torch.full((n, prompt_len + width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, prompt_len + width), dtype=torch.long)
    mask = torch.zeros((n, width))
    rollout = torch.zeros((n, width)) if rollout_logps is not None else None
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        start = prompt_len - len(prompt)
        input_ids[i, start:prompt_len] = torch.tensor(prompt)
        input_ids[i, prompt_len : prompt_len + len(completion)] = torch.tensor(completion)
        attention[i, start : prompt_len + len(completion)] = 1
        mask[i, : len(completion)] = 1.0
        if rollout is not None:
            rollout[i, : len(completion)] = torch.tensor(rollout_logps[i])
    mask = mask * loss_rows.float().unsqueeze(1)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        labels=input_ids[:, prompt_len:].clone(),
        mask=mask,
        advantages=advantages.float(),
        prompt_len=prompt_len,
        lengths=[len(c) for c in completions],
        rollout_logp=rollout,
    )


def _autocast(batch: Batch, autocast_dtype: torch.dtype | None):
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype)


def completion_logits(model, batch: Batch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """[B, T, V] logits that predict the completion tokens: a strided view, never copied (under
    --tp a DTensor sharded on V: each rank holds its slice)."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    width = batch.labels.shape[1]
    with _autocast(batch, autocast_dtype):
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            logits_to_keep=width + 1,
            use_cache=False,
        )
    return out.logits[:, :width]


def _rows(param: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(this rank's rows, their group) of an LM-head parameter split over the vocabulary by --tp
    (a DTensor; to_local() passes the gradient back to it); a plain one as it is, no group."""
    if not is_dtensor(param):
        return param, None
    return param.to_local(), param.device_mesh.get_group()


def completion_hidden(model, batch: Batch, autocast_dtype: torch.dtype | None):
    """(hidden [B, T, H], weight, bias, tp_group) whose head(hidden) are completion_logits: the
    body's last hidden states at the positions that predict the completion (a strided view) and
    the head's parameters in the hidden states' dtype (as autocast would cast them for the
    matmul). Under --tp: this rank's rows of the head and the group they are split over."""
    head = plain_lm_head(model)
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    width = batch.labels.shape[1]
    with _autocast(batch, autocast_dtype):
        out = model.base_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
    hidden = out.last_hidden_state[:, -(width + 1) : -1]
    weight, tp_group = _rows(head.weight)
    bias = None if head.bias is None else _rows(head.bias)[0].to(hidden.dtype)
    return hidden, weight.to(hidden.dtype), bias, tp_group


def _linear_backend(backend: str) -> str:
    return backend if backend in fusedrl.LINEAR_BACKENDS else "auto"


def loss_normalizer(cfg: LossConfig, mask: torch.Tensor) -> torch.Tensor:
    """This rank's share of the aggregation denominator (fusedrl.reference.aggregate's rule)."""
    if cfg.loss == "gmpo" or cfg.agg == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    if cfg.agg == "token-mean":
        return mask.sum().float()
    return (mask.sum(-1) > 0).sum().float()


def micro_batches(n_rows: int, micro_batch_size: int) -> list[slice]:
    """Row slices; every rank runs the same count (FSDP collectives must match), some empty."""
    size = micro_batch_size if micro_batch_size > 0 else max(n_rows, 1)
    count = max_over_ranks(-(-n_rows // size))
    return [slice(i * size, min((i + 1) * size, n_rows)) for i in range(count)]


@torch.no_grad()
def token_logprobs(
    model,
    batch: Batch,
    cfg: LossConfig,
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    backend: str,
    lm_head: bool = False,
) -> torch.Tensor:
    """Log-probs of the completion tokens under `model` with the fused no-grad kernel (from the
    hidden states and the head, without logits, when `lm_head`)."""
    out = torch.zeros(batch.labels.shape, device=batch.labels.device)
    for rows in micro_batches(len(batch), micro_batch_size):
        sub = batch.rows(_nonempty(rows, len(batch)))
        if lm_head:
            hidden, weight, bias, tp_group = completion_hidden(model, sub, autocast_dtype)
            logp, _ = fusedrl.linear_token_logprobs(
                hidden, weight, sub.labels, cfg.temperature, bias=bias,
                backend=_linear_backend(backend), top_k=cfg.top_k, top_p=cfg.top_p,
                min_p=cfg.min_p, tp_group=tp_group,
            )  # fmt: skip
        else:
            logits = completion_logits(model, sub, autocast_dtype)
            logp, _ = fusedrl.token_logprobs(
                logits, sub.labels, cfg.temperature, backend=backend,
                top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
            )  # fmt: skip
        if rows.stop > rows.start:
            out[rows, : logp.shape[1]] = logp
    return out


def _nonempty(rows: slice, n_rows: int) -> slice:
    # A rank with fewer rows still runs the forward (FSDP all-gathers inside it) on one real
    # row; the result is discarded or fully masked.
    return rows if rows.stop > rows.start else slice(max(n_rows - 1, 0), max(n_rows, 1))


def accumulate_gradients(
    model,
    batch: Batch,
    cfg: LossConfig,
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    backend: str,
    normalizer: torch.Tensor | None = None,
    lm_head: bool = False,
    dp_group=None,
    ref_model=None,
) -> dict[str, torch.Tensor]:
    """Backward of the minibatch loss in micro-batches; returns token-weighted metrics.

    `lm_head`: the loss from the body's hidden states and the LM head
    (fusedrl.linear_policy_loss), so that the [B, T, V] logits never exist.
    `ref_model` (config.kl="full" / "full_reverse"): the reference's logits of each micro-batch,
    made without gradient, for the exact KL; the policy's are then made too (logits path).

    `normalizer` defaults to the count of the minibatch all-reduced over `dp_group` (the
    data-parallel ranks; None: every rank), so the gradients summed over micro-batches and ranks
    equal the single-process gradient of the whole minibatch.
    """
    if normalizer is None:
        normalizer = sum_over_ranks(loss_normalizer(cfg, batch.mask), dp_group).clamp_min(1.0)
    scale = float(world_size(dp_group))
    sums: dict[str, torch.Tensor] = {}
    weight_total = torch.zeros((), device=batch.mask.device)
    for rows in micro_batches(len(batch), micro_batch_size):
        empty = rows.stop <= rows.start
        sub = batch.rows(_nonempty(rows, len(batch)))
        if empty:
            sub.mask = torch.zeros_like(sub.mask)
        rows_args = dict(
            old_logp=sub.old_logp, ref_logp=sub.ref_logp, rollout_logp=sub.rollout_logp,
            config=cfg, normalizer=normalizer, return_entropy=True,
        )  # fmt: skip
        if ref_model is not None:
            with torch.no_grad():
                ref_logits = completion_logits(ref_model, sub, autocast_dtype)
            logits = completion_logits(model, sub, autocast_dtype)
            out = fusedrl.policy_loss(
                logits, sub.labels, sub.advantages, sub.mask, inplace=True, backend=backend,
                ref_logits=ref_logits, **rows_args,
            )  # fmt: skip
        elif lm_head:
            hidden, weight, bias, tp_group = completion_hidden(model, sub, autocast_dtype)
            # Under --tp the body is replicated: the loss sums the hidden states' gradient over
            # the group (reduce_input_grad, its default), so every rank backpropagates the whole.
            out = fusedrl.linear_policy_loss(
                hidden, weight, sub.labels, sub.advantages, sub.mask, bias=bias,
                backend=_linear_backend(backend), tp_group=tp_group, **rows_args,
            )  # fmt: skip
        else:
            logits = completion_logits(model, sub, autocast_dtype)
            out = fusedrl.policy_loss(
                logits, sub.labels, sub.advantages, sub.mask, inplace=True, backend=backend,
                **rows_args,
            )  # fmt: skip
        (out.loss * scale).backward()
        weight = sub.mask.sum()
        weight_total = weight_total + weight
        sums["loss"] = sums.get("loss", 0.0) + out.loss.detach()
        for name, value in out.metrics.items():
            sums[name] = sums.get(name, 0.0) + value.detach() * weight
        if sub.rollout_logp is not None and sub.old_logp is None:
            # On-policy, this logp is the rollout policy's: its gap to vLLM's is the sync error.
            # With old_logp given the caller measures the gap once, from old_logp.
            diff = ((out.logp - sub.rollout_logp).abs() * sub.mask).sum()
            sums["logp_diff_vllm"] = sums.get("logp_diff_vllm", 0.0) + diff
    metrics = {k: v / weight_total.clamp_min(1.0) for k, v in sums.items() if k != "loss"}
    metrics["loss"] = sums.get("loss", torch.zeros(()))
    return metrics
