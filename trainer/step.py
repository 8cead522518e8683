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
from fusedrl.distill.sampled import teacher_shifted_advantages
from fusedrl.linear import lm_head_of
from fusedrl.logit_transform import model_logit_transform
from fusedrl.packed import reads_logits_once
from fusedrl.tp.dtensor import is_dtensor

from .distributed import max_over_ranks, sum_over_ranks, world_size
from .packing import PackedRows, pack_rows


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
    # host-side count of each sequence's loss tokens (mask's row sums): the LM-head loss makes
    # logits for these rows alone without asking the device how many there are
    loss_tokens: list[int] | None = None
    # host-side prompt lengths (without the left padding): --pack lays the rows end to end
    prompt_lengths: list[int] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice) -> Batch:
        """The sub-batch of these rows, completion columns trimmed to its longest completion."""
        sub = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in sub.items():
            if isinstance(value, torch.Tensor):
                sub[name] = value[index]
        sub["lengths"] = self.lengths[index]
        for name in ("loss_tokens", "prompt_lengths"):
            if sub[name] is not None:
                sub[name] = sub[name][index]
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
        loss_tokens=[len(c) if keep else 0 for c, keep in zip(completions, loss_rows.tolist())],
        prompt_lengths=[len(p) for p in prompts],
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
    """(hidden [B, T, H], weight, bias, tp_group, transform) whose head(hidden), transformed, are
    completion_logits: the body's last hidden states at the positions that predict the
    completion (a strided view), the head's parameters in the hidden states' dtype (as autocast
    would cast them for the matmul), and the model's softcap / logit_scale after its head (keyword
    arguments of the LM-head losses). Under --tp: this rank's rows of the head and the group they
    are split over."""
    head = lm_head_of(model)
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp_min(0)
    width = batch.labels.shape[1]
    with _autocast(batch, autocast_dtype):
        out = model.base_model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
    return _with_head(model, head, out.last_hidden_state[:, -(width + 1) : -1])


def _with_head(model, head, hidden: torch.Tensor) -> tuple:
    """(hidden, weight, bias, tp_group, transform): `completion_hidden`'s, for these hidden
    states (a padded or a packed micro-batch's)."""
    weight, tp_group = _rows(head.weight)
    bias = None if head.bias is None else _rows(head.bias)[0].to(hidden.dtype)
    return hidden, weight.to(hidden.dtype), bias, tp_group, model_logit_transform(model)


def _linear_backend(backend: str) -> str:
    return backend if backend in fusedrl.LINEAR_BACKENDS else "auto"


def loss_normalizer(cfg: LossConfig, mask: torch.Tensor) -> torch.Tensor:
    """This rank's share of the aggregation denominator (fusedrl.reference.aggregate's rule)."""
    if cfg.loss == "gmpo" or cfg.agg == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    if cfg.agg == "token-mean":
        return mask.sum().float()
    return (mask.sum(-1) > 0).sum().float()


def micro_batches(
    n_rows: int, micro_batch_size: int, row_tokens: list[int] | None = None, max_tokens=None
) -> list[slice]:
    """Row slices; every rank runs the same count (FSDP collectives must match), some empty.
    With `max_tokens` (packed rows): consecutive rows while their `row_tokens` fit the budget
    (a longer row alone), in place of `micro_batch_size` rows."""
    if max_tokens is None:
        size = micro_batch_size if micro_batch_size > 0 else max(n_rows, 1)
        slices = [slice(i * size, min((i + 1) * size, n_rows)) for i in range(-(-n_rows // size))]
    else:
        slices = _by_token_budget(row_tokens, max_tokens)
    count = max_over_ranks(len(slices))
    return slices + [slice(n_rows, n_rows)] * (count - len(slices))


def _by_token_budget(row_tokens: list[int], max_tokens: int) -> list[slice]:
    slices, start, used = [], 0, 0
    for row, tokens in enumerate(row_tokens):
        if row > start and used + tokens > max_tokens:
            slices.append(slice(start, row))
            start, used = row, 0
        used += tokens
    if start < len(row_tokens):
        slices.append(slice(start, len(row_tokens)))
    return slices


def packed_row_tokens(batch: Batch) -> list[int]:
    """The tokens each row puts into a packed micro-batch (prompt and completion; none for a
    sequence without a loss token, which packing leaves out: trainer/packing.py)."""
    prompts = batch.prompt_lengths or [batch.prompt_len] * len(batch)
    live = batch.loss_tokens or [1] * len(batch)
    return [p + n if keep else 0 for p, n, keep in zip(prompts, batch.lengths, live)]


@torch.no_grad()
def token_logprobs(
    model,
    batch: Batch,
    cfg: LossConfig,
    micro_batch_size: int,
    autocast_dtype: torch.dtype | None,
    backend: str,
    lm_head: bool = False,
    pack: bool = False,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Log-probs of the completion tokens under `model` with the fused no-grad kernel (from the
    hidden states and the head, without logits, when `lm_head`; each micro-batch as one
    padding-free row when `pack`, where a sequence with no loss token is left out: 0 there;
    `max_tokens`: packed micro-batches by that token budget)."""
    out = torch.zeros(batch.labels.shape, device=batch.labels.device)
    for rows in _micro_batches(batch, micro_batch_size, max_tokens):
        sub = batch.rows(_nonempty(rows, len(batch)))
        packed = _packed(model, sub, autocast_dtype) if pack else None
        labels = sub.labels if packed is None else packed.tokens(sub.labels)
        outputs = _outputs(model, sub, autocast_dtype, lm_head, packed)
        if lm_head:
            hidden, weight, bias, tp_group, transform = outputs
            logp, _ = fusedrl.linear_token_logprobs(
                hidden,
                weight,
                labels,
                cfg.temperature,
                bias=bias,
                backend=_linear_backend(backend),
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                min_p=cfg.min_p,
                tp_group=tp_group,
                **transform,
            )
        else:
            logp, _ = fusedrl.token_logprobs(
                outputs,
                labels,
                cfg.temperature,
                backend=backend,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                min_p=cfg.min_p,
            )
        if packed is not None:
            logp = packed.padded(logp)
        if rows.stop > rows.start:
            out[rows, : logp.shape[1]] = logp
    return out


def _micro_batches(batch: Batch, micro_batch_size: int, max_tokens: int | None) -> list[slice]:
    row_tokens = None if max_tokens is None else packed_row_tokens(batch)
    return micro_batches(len(batch), micro_batch_size, row_tokens, max_tokens)


def _nonempty(rows: slice, n_rows: int) -> slice:
    # A rank with fewer rows still runs the forward (FSDP all-gathers inside it) on one real
    # row; the result is discarded or fully masked.
    return rows if rows.stop > rows.start else slice(max(n_rows - 1, 0), max(n_rows, 1))


@dataclass(frozen=True)
class Distill:
    """The teacher term of on-policy distillation (--distill-*; fusedrl.distill_loss)."""

    kind: str  # one of fusedrl.DISTILL_KINDS
    coef: float  # weight of the divergence; sampled_reverse_kl: of its advantage shift
    beta: float  # jsd's teacher share of the mixture

    def config(self, cfg: LossConfig) -> LossConfig:
        """The divergence's aggregation: the policy loss's."""
        return LossConfig(agg=cfg.agg, norm_constant=cfg.norm_constant)


def _outputs(model, sub: Batch, autocast_dtype, lm_head: bool, packed: PackedRows | None = None):
    """The completion's logits, or with `lm_head` (hidden, weight, bias, tp_group, transform);
    `packed`: of `sub` packed (`packed_outputs`)."""
    if packed is not None:
        return packed_outputs(model, sub, packed, autocast_dtype, lm_head)
    if lm_head:
        return completion_hidden(model, sub, autocast_dtype)
    return completion_logits(model, sub, autocast_dtype)


def packed_outputs(model, sub: Batch, packed: PackedRows, autocast_dtype, lm_head: bool):
    """`_outputs` of a packed micro-batch (trainer/packing.py): logits [M, V] of the positions
    that predict completion tokens, made for those alone, or with `lm_head` the hidden states
    [M, H] there and the head's parameters, as `completion_hidden` gives them."""
    inputs = dict(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=packed.attention_mask,
        use_cache=False,
    )
    with _autocast(sub, autocast_dtype):
        if not lm_head:
            return model(**inputs, logits_to_keep=packed.keep).logits[0]
        hidden = model.base_model(**inputs).last_hidden_state[0, packed.keep]
    return _with_head(model, lm_head_of(model), hidden)


# The per-token arguments of the loss that a packed micro-batch hands over as its [M] rows.
PER_TOKEN_ARGS = ("old_logp", "ref_logp", "rollout_logp", "prox_logp")


def _micro_batch_loss(
    model,
    sub: Batch,
    cfg: LossConfig,
    autocast_dtype,
    backend: str,
    lm_head: bool,
    rows_args: dict,
    ref_model,
    teacher,
    distill: Distill | None,
    distill_normalizer,
    packed: PackedRows | None = None,
) -> tuple[torch.Tensor, fusedrl.LossOutput]:
    """(the loss to backpropagate, the policy loss's output) of one micro-batch: the policy
    loss, with the exact KL to `ref_model` and the teacher term of `distill` when given;
    `packed` (--pack): the micro-batch as one padding-free row, every per-token tensor as its
    [M] loss rows and the sequences' boundaries (`cu_seqlens`) in place of the padding."""
    if packed is None:
        labels, mask, advantages = sub.labels, sub.mask, sub.advantages
        layout = {}
        # In place: the logits are dead after the loss (every other read is done by then).
        inplace = True
    else:
        labels, mask = packed.tokens(sub.labels), packed.tokens(sub.mask)
        advantages = packed.per_sequence(sub.advantages)
        layout = dict(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen)
        rows_args = {
            k: packed.tokens(v) if k in PER_TOKEN_ARGS else v for k, v in rows_args.items()
        }
        # (in place where the packed loss reads the logits once: token-level ratios)
        inplace = reads_logits_once(cfg, rows_args.get("rollout_logp"), None)
    policy = _outputs(model, sub, autocast_dtype, lm_head, packed)
    with torch.no_grad():
        ref = (
            None if ref_model is None else _outputs(ref_model, sub, autocast_dtype, lm_head, packed)
        )
        taught = (
            None if teacher is None else _outputs(teacher, sub, autocast_dtype, lm_head, packed)
        )
    linear_backend = _linear_backend(backend)
    if lm_head:
        hidden, weight, bias, tp_group, transform = policy
        head_args = dict(transform)  # the reference is the policy's kind of model
        if ref is not None:
            head_args.update(ref_hidden=ref[0], ref_weight=ref[1], ref_bias=ref[2])

        # Padding and filtered rows make no logits (the reference's and the teacher's heads
        # neither; under --tp no rank's slice): the host knows how many rows are live. (A
        # packed row holds none of them.)
        skip = {}
        if sub.loss_tokens is not None and packed is None:
            skip["live_rows"] = sum(sub.loss_tokens)
        head_args.update(skip)

        # Under --tp the body is replicated: the loss sums the hidden states' gradient over the
        # group (reduce_input_grad, its default), so every rank backpropagates the whole.

        def policy_loss(advantages):
            return fusedrl.linear_policy_loss(
                hidden,
                weight,
                labels,
                advantages,
                mask,
                bias=bias,
                backend=linear_backend,
                tp_group=tp_group,
                **head_args,
                **rows_args,
                **layout,
            )
    else:
        logits = policy
        ref_args = {} if ref is None else {"ref_logits": ref}

        def policy_loss(advantages):
            return fusedrl.policy_loss(
                logits,
                labels,
                advantages,
                mask,
                inplace=inplace,
                backend=backend,
                **ref_args,
                **rows_args,
                **layout,
            )

    if distill is None:
        out = policy_loss(advantages)
        return out.loss, out
    if distill.kind == "sampled_reverse_kl":
        with torch.no_grad():

            def logprobs(outputs, filters):
                if lm_head:
                    return fusedrl.linear_token_logprobs(
                        outputs[0].detach(),
                        outputs[1].detach(),
                        labels,
                        cfg.temperature,
                        bias=None if outputs[2] is None else outputs[2].detach(),
                        backend=linear_backend,
                        **outputs[4],
                        **filters,
                    )[0]
                return fusedrl.token_logprobs(
                    outputs.detach(), labels, cfg.temperature, backend=backend, **filters
                )[0]

            # The sampler's log-probs are the engine's (over its sampled sets, as old_logp is
            # when the batch is reused); the teacher's are its own, over the whole vocabulary.
            filters = dict(top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
            old = sub.old_logp if packed is None else packed.tokens(sub.old_logp)
            sampler = old if old is not None else logprobs(policy, filters)
            per_token = advantages if packed is None else packed.tokens(_per_token(sub))
            shifted, gap = teacher_shifted_advantages(
                per_token, sampler, logprobs(taught, {}), mask, distill.coef
            )
        out = policy_loss(shifted)
        out.metrics["distill"] = (gap * mask).sum() / mask.sum().clamp_min(1.0)
        return out.loss, out
    dcfg = distill.config(cfg)
    common = dict(
        kind=distill.kind,
        beta=distill.beta,
        temperature=cfg.temperature,
        config=dcfg,
        normalizer=distill_normalizer,
        **layout,
    )
    # The term's upstream gradient: the coefficient times the policy loss's factor.
    term_scale = distill.coef * rows_args.get("grad_scale", 1.0)
    if term_scale not in (0.0, 1.0):
        common["grad_scale"] = term_scale
    # The divergence first: its gradient is written in this call, so the policy loss may then
    # take the logits' buffer for its own.
    if lm_head:
        term = fusedrl.linear_distill_loss(
            hidden,
            weight,
            taught[0],
            taught[1],
            labels,
            mask,
            student_bias=bias,
            teacher_bias=taught[2],
            backend=linear_backend,
            student_transform=transform,
            teacher_transform=taught[4],
            **skip,
            **common,
        )
    else:
        # csrc has no two-row kernel: "cuda" runs Triton's (config.py checks it is installed)
        term = fusedrl.distill_loss(
            logits,
            taught,
            labels,
            mask,
            backend="triton" if backend == "cuda" else backend,
            **common,
        )
    out = policy_loss(advantages)
    out.metrics["distill"] = term.metrics["distill"]
    return out.loss + distill.coef * term.loss, out


def _per_token(sub: Batch) -> torch.Tensor:
    """The [B] advantages over the [B, T] layout (a packed call takes them per token)."""
    return sub.advantages[:, None].expand(sub.mask.shape)


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
    teacher=None,
    distill: Distill | None = None,
    decoupled: bool = False,
    entropy_coef: torch.Tensor | None = None,
    pack: bool = False,
    max_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """Backward of the minibatch loss in micro-batches; returns token-weighted metrics.

    `lm_head`: the loss from the body's hidden states and the LM head
    (fusedrl.linear_policy_loss), so that the [B, T, V] logits never exist.
    `ref_model` (config.kl="full" / "full_reverse"): the reference's logits (or hidden states
    and head) of each micro-batch, made without gradient, for the exact KL.
    `teacher` and `distill`: on-policy distillation, the teacher's made the same way.
    `decoupled`: decoupled PPO: batch.old_logp (recomputed before the update) is the proximal
    policy, batch.rollout_logp (the engine's) the behaviour one (fusedrl's prox_logp=).
    `entropy_coef`: the entropy bonus's coefficient as a device scalar (adaptive entropy
    control), in place of cfg.entropy_coef.
    `pack`: each micro-batch as one padding-free row (trainer/packing.py); `max_tokens`: the
    packed micro-batches by that token budget in place of `micro_batch_size` rows.

    `normalizer` defaults to the count of the minibatch all-reduced over `dp_group` (the
    data-parallel ranks; None: every rank), so the gradients summed over micro-batches and ranks
    equal the single-process gradient of the whole minibatch.
    """
    if normalizer is None:
        normalizer = sum_over_ranks(loss_normalizer(cfg, batch.mask), dp_group).clamp_min(1.0)
    distill_normalizer = None
    if distill is not None and distill.kind != "sampled_reverse_kl":
        distill_count = loss_normalizer(distill.config(cfg), batch.mask)
        distill_normalizer = sum_over_ranks(distill_count, dp_group).clamp_min(1.0)
    scale = float(world_size(dp_group))
    sums: dict[str, torch.Tensor] = {}
    weight_total = torch.zeros((), device=batch.mask.device)
    for rows in _micro_batches(batch, micro_batch_size, max_tokens):
        empty = rows.stop <= rows.start
        sub = batch.rows(_nonempty(rows, len(batch)))
        if empty:
            sub.mask = torch.zeros_like(sub.mask)
            sub.loss_tokens = [0] * len(sub)
        rows_args = dict(
            old_logp=sub.old_logp,
            ref_logp=sub.ref_logp,
            rollout_logp=sub.rollout_logp,
            config=cfg,
            normalizer=normalizer,
            return_entropy=True,
        )
        if entropy_coef is not None:
            rows_args["entropy_coef"] = entropy_coef
        if scale != 1.0:  # the gradient written times it: backward then rescales nothing
            rows_args["grad_scale"] = scale
        if decoupled:  # the recomputed log-probs are the proximal policy, vLLM's the behaviour
            # (rollout_logp stays: the rejection and trust-region rules measure prox against it)
            rows_args.update(old_logp=sub.rollout_logp, prox_logp=sub.old_logp)
        packed = _packed(model, sub, autocast_dtype) if pack else None
        loss, out = _micro_batch_loss(
            model,
            sub,
            cfg,
            autocast_dtype,
            backend,
            lm_head,
            rows_args,
            ref_model,
            teacher,
            distill,
            distill_normalizer,
            packed,
        )
        (loss * scale).backward()
        weight = sub.mask.sum()
        weight_total = weight_total + weight
        sums["loss"] = sums.get("loss", 0.0) + loss.detach()
        for name, value in out.metrics.items():
            sums[name] = sums.get(name, 0.0) + value.detach() * weight
        if sub.rollout_logp is not None and sub.old_logp is None:
            # On-policy, this logp is the rollout policy's: its gap to the engine's (vLLM's or
            # transformers') is the sync error.
            # With old_logp given the caller measures the gap once, from old_logp.
            logp = out.logp if packed is None else packed.padded(out.logp)
            diff = ((logp - sub.rollout_logp).abs() * sub.mask).sum()
            sums["logp_diff_rollout"] = sums.get("logp_diff_rollout", 0.0) + diff
    metrics = {k: v / weight_total.clamp_min(1.0) for k, v in sums.items() if k != "loss"}
    metrics["loss"] = sums.get("loss", torch.zeros(()))
    return metrics


def _packed(model, sub: Batch, autocast_dtype) -> PackedRows:
    """`sub` packed for `model`: its attention implementation decides how the sequences are
    kept apart, its compute dtype the additive mask's."""
    dtype = autocast_dtype or next(model.parameters()).dtype
    return pack_rows(sub, model.config._attn_implementation, dtype)
