"""The policy loss from the hidden states and the LM head, without the [tokens x vocab] logits.

`linear_policy_loss(hidden, weight, ...)` equals `policy_loss(hidden @ weight.T + bias, ...)` for
every preset and option, but the logits never exist as a whole: the backends make them a tile
(Triton, on chip) or a block of rows (torch) at a time, and the gradients of hidden, weight and
bias are computed in the forward call (backward only scales them, as in `policy_loss`).
"""

from __future__ import annotations

import torch

import fusedrl.linear_single_process as linear_single_process
import fusedrl.output as output

from ._inputs import (
    check_skip_masked_rows,
    check_sum_pi_squared,
    temperature_in_config,
)
from .arguments import ModelHead, RolloutInputs
from .config import LossConfig
from .logit_transform import check_logit_transform, model_logit_transform
from .output import LossOutput
from .sampling import check_sampling
from .segments import require_cu_seqlens


def _check_linear_loss_arguments(
    config,
    ref_weight,
    ref_hidden,
    ref_bias,
    softcap,
    logit_scale,
    skip_masked_rows,
    live_rows,
    return_sum_pi_squared: bool,
    prox_logp,
    entropy_coef,
    sharded: bool,
):
    """linear_policy_loss's checks of its arguments alone: (the logits' transform, the skip)."""
    full_kl = config is not None and config.full_kl
    if not full_kl and (ref_weight is not None or ref_hidden is not None or ref_bias is not None):
        raise ValueError(
            "ref_weight / ref_hidden / ref_bias are read only by config.kl='full' or "
            "'full_reverse' (the exact KL to the reference head): set the KL, or pass ref_logp "
            "for a per-token estimator"
        )
    if full_kl and ref_weight is None:
        raise ValueError(
            f"ref_weight (the reference policy's LM head, [V, H]) is required when "
            f"config.kl={config.kl!r}"
        )
    transform = check_logit_transform(softcap, logit_scale)
    skip_masked_rows = check_skip_masked_rows(skip_masked_rows, live_rows)
    if return_sum_pi_squared:
        check_sum_pi_squared(config is not None and config.sampling is not None)
    if return_sum_pi_squared and sharded:
        raise NotImplementedError(
            "return_sum_pi_squared under tensor parallelism is not supported by "
            "linear_policy_loss yet: take it from linear_token_logprobs(..., "
            "return_sum_pi_squared=True, tp_group=...)"
        )
    if (prox_logp is not None or entropy_coef is not None) and sharded:
        raise NotImplementedError(
            "prox_logp (decoupled PPO) and a tensor entropy_coef under tensor parallelism are "
            "not supported yet"
        )
    if full_kl and sharded:
        raise NotImplementedError(
            f"config.kl={config.kl!r} (the exact KL to the reference head) under tensor "
            "parallelism is not supported yet: use a per-token KL estimator with ref_logp"
        )
    return transform, skip_masked_rows


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    return_entropy: bool = False,
    is_weights: torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_input_grad: bool = True,
    ref_weight: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float | None = None,
    temperature: float | torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    entropy_coef: torch.Tensor | None = None,
    return_sum_pi_squared: bool = False,
    skip_masked_rows: bool = False,
    live_rows: int | None = None,
    grad_scale: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    cp_group=None,
) -> LossOutput:
    """`fusedrl.policy_loss` of the logits `hidden @ weight.T + bias`, which are never stored.

    One line per argument; docs/losses.md ("Which backend and surface takes which argument",
    "The loss from the hidden states") has the details.

    Args:
        hidden: [B, T, H] (strided over B / T is fine: hidden[:, P-1:-1] of the model body) or
            [N, H]; bf16 / fp16 / fp32.
        weight: [V, H], the LM head (model.lm_head.weight); the dtype and device of `hidden`.
        labels, advantages, mask, old_logp, ref_logp, rollout_logp, config, normalizer,
        return_entropy, is_weights, temperature, prox_logp, entropy_coef,
        return_sum_pi_squared, grad_scale, cu_seqlens, max_seqlen, cp_group: as in
            `fusedrl.policy_loss`
            (the gradients of hidden, weight and bias are written times grad_scale; packed
            sequences take [N, H] hidden states).
        bias: [V] or None.
        backend: "auto" (Triton on CUDA, torch elsewhere) | "triton" | "torch".
        tp_group, vocab_start, vocab_size: a vocab-sharded head: `weight` / `bias` are this
            rank's rows, `hidden` and the labels replicated (docs/tensor_parallel.md).
        reduce_input_grad: with tp_group, all-reduce the gradient of `hidden` in backward;
            False leaves each rank its part (Megatron's column-parallel convention).
        ref_weight, ref_hidden, ref_bias: the reference model's head (and hidden states,
            default `hidden`) for the exact KL (config.kl="full" / "full_reverse"); no gradient.
        softcap, logit_scale: the model's transform of its head's output (Gemma 2/3, Cohere;
            `model_logit_transform(model)` reads them), applied to each chunk of logits.
        skip_masked_rows: make logits only for the rows whose mask is nonzero (one host wait
            for their count, unless `live_rows` gives it); every output as without it.
        live_rows: the number of rows whose mask is nonzero, known on the host; implies
            skip_masked_rows (a wrong count is a device-side assert).

    Returns:
        LossOutput, its loss differentiable w.r.t. hidden, weight and bias (each that requires
        grad); logp / entropy [B, T] fp32 detached; metrics as in `policy_loss`.
    """
    from .context_parallel import group_argument_checks

    sharded = tp_group is not None or vocab_start is not None or vocab_size is not None
    # one rank's bad argument: every rank of the group raises
    with group_argument_checks(sharded, hidden, tp_group, cp_group):
        config, temperature = temperature_in_config(config, temperature)
        transform, skip_masked_rows = _check_linear_loss_arguments(
            config,
            ref_weight,
            ref_hidden,
            ref_bias,
            softcap,
            logit_scale,
            skip_masked_rows,
            live_rows,
            return_sum_pi_squared,
            prox_logp,
            entropy_coef,
            sharded,
        )
        require_cu_seqlens(cu_seqlens, max_seqlen)
        if cp_group is not None:
            _refuse_under_context_parallelism(cu_seqlens, sharded, config, return_sum_pi_squared)
    rollout = RolloutInputs(old_logp, ref_logp, rollout_logp, prox_logp, is_weights)
    head = ModelHead(temperature, transform)
    call = (labels, advantages, mask, rollout, head, config, normalizer)
    rows = {"skip_masked_rows": skip_masked_rows, "live_rows": live_rows}
    shard = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_size": vocab_size}
    shard["reduce_input_grad"] = reduce_input_grad
    if cu_seqlens is not None:
        reference = {"ref_weight": ref_weight, "ref_hidden": ref_hidden, "ref_bias": ref_bias}
        head_rows = (hidden, weight, bias, backend, rows, reference, shard if sharded else None)
        packing = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        options = {"return_entropy": return_entropy, "entropy_coef": entropy_coef}
        options.update(return_sum_pi_squared=return_sum_pi_squared, grad_scale=grad_scale)
        return _packed_linear_loss(head_rows, call, packing, cp_group, options)
    if sharded:
        from .tp import linear as tp_linear

        return tp_linear.linear_policy_loss(
            hidden,
            weight,
            *call,
            bias=bias,
            backend=backend,
            return_entropy=return_entropy,
            **shard,
            **rows,
            grad_scale=grad_scale,
        )
    return linear_single_process.linear_policy_loss(
        hidden,
        weight,
        *call,
        bias=bias,
        backend=backend,
        return_entropy=return_entropy,
        ref_weight=ref_weight,
        ref_hidden=ref_hidden,
        ref_bias=ref_bias,
        entropy_coef=entropy_coef,
        **rows,
        return_sum_pi_squared=return_sum_pi_squared,
        grad_scale=grad_scale,
    )


def _packed_linear_loss(head_rows: tuple, call: tuple, packing: dict, cp_group, options: dict):
    """Packed sequences (fusedrl/packed.py) from this process's hidden states and head, its
    rows of a vocab-sharded head (`shard`), or its chunk of the tokens (`cp_group`: context
    parallelism, fusedrl/context_parallel.py)."""
    import fusedrl.context_parallel as context_parallel
    import fusedrl.packed as packed

    hidden, weight, bias, backend, rows, reference, shard = head_rows
    own_rows = packed.HeadRows(hidden, weight, bias, backend, **rows, **reference)
    if cp_group is not None:
        options.pop("return_sum_pi_squared")  # (refused above)
        packing["cp_group"] = cp_group
        return context_parallel.policy_loss(own_rows, *call, **packing, **options)
    if shard is not None:
        own_rows = packed.ShardHeadRows(
            hidden, weight, bias, backend, shard, **rows, cu_seqlens=packing["cu_seqlens"]
        )
    return packed.policy_loss(own_rows, *call, **packing, **options)


def _refuse_under_context_parallelism(cu_seqlens, sharded, config, return_sum_pi_squared):
    if cu_seqlens is None:
        raise ValueError(
            "cp_group takes packed sequences: pass cu_seqlens, the whole batch's boundaries "
            "(each rank's hidden states its chunk of the tokens, in rank order)"
        )
    full_kl = isinstance(config, LossConfig) and config.full_kl
    if sharded or full_kl or return_sum_pi_squared:
        raise NotImplementedError(
            "cp_group with tp_group, the exact KL (ref_weight) or return_sum_pi_squared is not "
            "supported by linear_policy_loss yet"
        )


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_input_grad: bool = True,
    softcap: float | None = None,
    logit_scale: float | None = None,
    return_sum_pi_squared: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """log_softmax((hidden @ weight.T + bias) / temperature) at `labels`, fp32, and the entropy.

    Differentiable w.r.t. hidden, weight and bias (backward recomputes the logits tile by tile);
    under `torch.no_grad()` it is the memory-light path for old / reference log-probs.
    `top_k` / `top_p` / `min_p`: over the set vLLM sampled from, as in `fusedrl.token_logprobs`.
    `tp_group`, `vocab_start`, `vocab_size`, `reduce_input_grad`: a vocab-sharded LM head, as in
    `linear_policy_loss`. `softcap`, `logit_scale`: the model's transform of its head's output,
    as in `linear_policy_loss`. `temperature` may be per-token, as in `fusedrl.token_logprobs`.
    `return_sum_pi_squared`: a third output, sum_v pi_v^2 per token: with the Triton "gemm"
    design from the same sweep (the row kernels sum the squares), else from one more no-grad
    sweep at half the temperature, as in `fusedrl.token_logprobs`. `cu_seqlens`, `max_seqlen`:
    packed sequences, checked as in `fusedrl.token_logprobs`.
    """
    from .segments import check_packed_rows
    from .tp.header import argument_checks

    sharded = tp_group is not None or vocab_start is not None or vocab_size is not None
    with argument_checks(sharded, hidden, tp_group):  # one rank's bad argument: all raise
        temperature = check_packed_rows(cu_seqlens, hidden, max_seqlen, temperature)
        in_sweep = (
            return_sum_pi_squared
            and not sharded
            and isinstance(hidden, torch.Tensor)
            and linear_single_process.sums_squares_in_sweep(backend, hidden.device)
        )
        if return_sum_pi_squared and not in_sweep:
            check_sum_pi_squared(check_sampling(top_k, top_p, min_p).active)
        transform = check_logit_transform(softcap, logit_scale)
    if return_sum_pi_squared and not in_sweep:
        common = dict(
            bias=bias,
            backend=backend,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            softcap=softcap,
            logit_scale=logit_scale,
        )
        with torch.no_grad():
            sharp, _ = linear_token_logprobs(
                hidden.detach(),
                weight.detach(),
                labels,
                temperature / 2,
                **{**common, "bias": None if bias is None else bias.detach()},
            )
        logp, entropy = linear_token_logprobs(
            hidden,
            weight,
            labels,
            temperature,
            return_entropy,
            reduce_input_grad=reduce_input_grad,
            **common,
        )
        return logp, entropy, output.sum_pi_squared_of(logp.detach(), sharp)
    if sharded:
        from .tp import linear as tp_linear

        return tp_linear.linear_token_logprobs(
            hidden,
            weight,
            labels,
            temperature,
            return_entropy,
            bias,
            backend,
            top_k,
            top_p,
            min_p,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            reduce_input_grad=reduce_input_grad,
            softcap=softcap,
            logit_scale=logit_scale,
            cu_seqlens=cu_seqlens,
        )
    return linear_single_process.linear_token_logprobs(
        hidden,
        weight,
        labels,
        temperature,
        return_entropy,
        bias,
        backend,
        top_k,
        top_p,
        min_p,
        transform=transform,
        return_sum_pi_squared=return_sum_pi_squared,
    )


def lm_head_of(model) -> torch.nn.Linear | None:
    """The model's LM head when its logits are transform(head(body(x))): a plain nn.Linear, a
    body at `model.base_model`, and after the head at most the scale and soft cap that
    `model_logit_transform(model)` reads from its config (pass them to the LM-head losses as
    softcap= / logit_scale=). Else None."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    body = getattr(model, "base_model", None)
    if type(head) is not torch.nn.Linear or body is None or body is model:
        return None
    return head


def plain_lm_head(model) -> torch.nn.Linear | None:
    """`lm_head_of(model)` when its logits are exactly head(body(x)): no logit scaling or
    soft-capping after the head. Else None."""
    head = lm_head_of(model)
    if head is None or any(value is not None for value in model_logit_transform(model).values()):
        return None
    return head
