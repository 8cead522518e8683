"""Public entry points: `policy_loss`, `token_logprobs`, `PolicyLoss`; backend dispatch."""

from __future__ import annotations

import torch

import fusedrl.call_plan as call_plan
import fusedrl.output as output
import fusedrl.single_process as single_process

from ._inputs import (
    capping_transform,
    check_sum_pi_squared,
    scaled_temperature,
    temperature_in_config,
)
from .arguments import ModelHead, RolloutInputs
from .backends import BACKENDS
from .config import LossConfig
from .logit_transform import capping_keywords, check_logit_transform
from .output import LossOutput
from .sampling import check_sampling
from .segments import check_packed_rows, require_cu_seqlens


def policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    old_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizer: torch.Tensor | float | None = None,
    inplace: bool = False,
    backend: str = "auto",
    return_entropy: bool = False,
    is_weights: torch.Tensor | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    ref_logits: torch.Tensor | None = None,
    return_sum_pi_squared: bool = False,
    temperature: float | torch.Tensor | None = None,
    prox_logp: torch.Tensor | None = None,
    entropy_coef: torch.Tensor | None = None,
    logit_scale: float | None = None,
    softcap: float | None = None,
    grad_scale: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    cp_group=None,
) -> LossOutput:
    """GRPO-family policy loss from the logits, reading them once per pass and never in fp32 copies.

    One line per argument; docs/losses.md ("Which backend and surface takes which argument")
    says what each backend, tensor parallelism and the LM-head form do with it.

    Args:
        logits: [B, T, V] (strided over B / T is fine; the vocab axis contiguous) or [N, V];
            bf16 / fp16 / fp32.
        labels: [B, T] int64 token ids whose log-prob is taken.
        advantages: [B] (one per sequence) or [B, T].
        mask: [B, T] bool or 0/1 float: the tokens that count.
        old_logp: [B, T] log-probs at rollout time; None means on-policy (logp.detach()).
        ref_logp: [B, T] reference-policy log-probs; required when config.beta > 0.
        rollout_logp: [B, T] inference-engine log-probs; required when config.is_correction is set.
        config: a `LossConfig` (default: PPO-clip, token-mean).
        normalizer: the aggregation's denominator in place of the batch's own (token count for
            token-mean, sequence count for seq-*): the global one under DP x accumulation.
        inplace: write d(loss)/d(logits) into the logits buffer (the logits are destroyed).
        backend: "auto" | "triton" | "cuda" | "torch".
        return_entropy: also return the per-token entropy.
        is_weights: precomputed train / inference IS weights ([B, T], [B, 1] or [B]; verl's
            rollout_is_weights, TRL's importance_sampling_ratio); exclusive with is_correction.
        tp_group: the process group over which the vocabulary is sharded: `logits` is this
            rank's slice (docs/tensor_parallel.md); a DTensor sharded on its last dim needs none.
        vocab_start: the first global token id of this rank's slice (default: the lower ranks').
        vocab_size: the true vocabulary size; columns at global ids >= it are padding.
        ref_logits: the reference policy's logits, shaped like `logits`, for the exact KL
            (config.kl="full" / "full_reverse"; ref_logp is then not passed).
        return_sum_pi_squared: also return sum_v pi_v^2 per token (the Optimal Token Baseline's
            input) as `sum_pi_squared`.
        temperature: a number, or per-token temperatures ([B, T], [B] or 0-dim; finite > 0
            where counted), in place of config.temperature (then left at 1).
        prox_logp: decoupled PPO's [B, T] proximal-policy log-probs (the ratio is taken against
            them, each token weighted by pi_prox / pi_behav; old_logp is the behaviour's).
        entropy_coef: the entropy bonus's coefficient as a one-element device tensor, in place
            of config.entropy_coef (then left at 0): adaptive control without a recompile.
        logit_scale: the model's logits are s x of these (Cohere, Granite); folded into the
            temperature.
        softcap: the model's logits are c tanh(s x / c) of these (Gemma 2/3), capped as each
            row is read.
        grad_scale: the factor the caller will multiply the loss by before backward (a number or
            a one-element device tensor): the gradient is written already times it.
        cu_seqlens: packed sequences: int32 / int64 [S + 1] boundaries of the S sequences whose
            tokens the [N, V] logits concatenate (flash-attention's convention); advantages
            [S] or [N], every per-token argument [N]; as the padded call (fusedrl/packed.py).
        max_seqlen: the longest sequence's length, if known (else read: one host sync).
        cp_group: context parallelism: the packed tokens split over this group's ranks in
            rank order, `logits` and every per-token input this rank's chunk, `cu_seqlens`
            the whole batch's, per-sequence values [S, 1] (fusedrl/context_parallel.py).

    Returns:
        LossOutput(loss: 0-dim fp32 differentiable w.r.t. logits, logp: [B, T] fp32 detached,
        entropy: [B, T] fp32 or None, metrics: dict of 0-dim fp32 tensors; no host sync
        without tp_group).
    """
    if _plannable(
        is_weights,
        tp_group,
        vocab_start,
        vocab_size,
        ref_logits,
        return_sum_pi_squared,
        temperature,
        prox_logp,
        entropy_coef,
        logit_scale,
        softcap,
        cu_seqlens,
        max_seqlen,
        cp_group,
    ):
        out = call_plan.policy_loss(
            call_plan.Call(
                logits,
                labels,
                advantages,
                mask,
                old_logp,
                ref_logp,
                rollout_logp,
                config,
                normalizer,
                backend,
                return_entropy,
                grad_scale,
                inplace,
            )
        )
        if out is not None:  # a call of a kind already decided
            return out
    from .context_parallel import group_argument_checks
    from .tp.dtensor import wants_tensor_parallel

    sharded = wants_tensor_parallel(logits, tp_group, vocab_start, vocab_size)
    # one rank's bad argument: every rank of the group raises
    with group_argument_checks(sharded, logits, tp_group, cp_group):
        config, head = _model_head(config, temperature, softcap, logit_scale)
        _refuse_what_has_no_path(
            config,
            sharded,
            cp_group,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            inplace=inplace,
            ref_logits=ref_logits,
            prox_logp=prox_logp,
            entropy_coef=entropy_coef,
            return_sum_pi_squared=return_sum_pi_squared,
        )
    rollout = RolloutInputs(old_logp, ref_logp, rollout_logp, prox_logp, is_weights)
    call = (labels, advantages, mask, rollout, head, config, normalizer)
    shard = {"tp_group": tp_group, "vocab_start": vocab_start, "vocab_size": vocab_size}
    if cu_seqlens is not None:
        packing = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        options = {"return_entropy": return_entropy, "entropy_coef": entropy_coef}
        options.update(return_sum_pi_squared=return_sum_pi_squared, grad_scale=grad_scale)
        rows = (logits, backend, inplace, ref_logits, shard if sharded else None)
        return _packed_policy_loss(rows, call, packing, cp_group, options)
    if sharded:
        import fusedrl.tp as tp

        return tp.policy_loss(
            logits,
            *call,
            **shard,
            inplace=inplace,
            backend=backend,
            return_entropy=return_entropy,
            grad_scale=grad_scale,
        )
    return single_process.policy_loss(
        logits,
        *call,
        backend=backend,
        inplace=inplace,
        return_entropy=return_entropy,
        ref_logits=ref_logits,
        entropy_coef=entropy_coef,
        return_sum_pi_squared=return_sum_pi_squared,
        grad_scale=grad_scale,
    )


def _packed_policy_loss(rows: tuple, call: tuple, packing: dict, cp_group, options: dict):
    """Packed sequences (fusedrl/packed.py) on this process's logits, its slice of them
    (`shard`: tensor parallelism) or its chunk of the tokens (`cp_group`: context
    parallelism, fusedrl/context_parallel.py)."""
    import fusedrl.context_parallel as context_parallel
    import fusedrl.packed as packed

    logits, backend, inplace, ref_logits, shard = rows
    if cp_group is not None:
        options.pop("return_sum_pi_squared")  # (refused above)
        return context_parallel.policy_loss(
            packed.LogitsRows(logits, backend), *call, **packing, cp_group=cp_group, **options
        )
    packed_rows = packed.LogitsRows(logits, backend, inplace, ref_logits)
    if shard is not None:
        packed_rows = packed.ShardRows(logits, backend, inplace, shard, packing["cu_seqlens"])
    return packed.policy_loss(packed_rows, *call, **packing, **options)


def _plannable(
    is_weights,
    tp_group,
    vocab_start,
    vocab_size,
    ref_logits,
    return_sum_pi_squared,
    temperature,
    prox_logp,
    entropy_coef,
    logit_scale,
    softcap,
    cu_seqlens,
    max_seqlen,
    cp_group,
) -> bool:
    """Whether every argument of `policy_loss` outside `call_plan.PLANNED` is at its default:
    such a call's kind may be decided once (tests/test_call_plan.py checks the two lists)."""
    return (
        is_weights is None
        and tp_group is None
        and vocab_start is None
        and vocab_size is None
        and ref_logits is None
        and not return_sum_pi_squared
        and temperature is None
        and prox_logp is None
        and entropy_coef is None
        and logit_scale is None
        and softcap is None
        and cu_seqlens is None
        and max_seqlen is None
        and cp_group is None
    )


def _model_head(config, temperature, softcap, logit_scale) -> tuple[object, ModelHead]:
    """(config, model head) with the temperature set one way and the model's head resolved: a
    soft cap as the transform the kernels apply, a bare logit scale folded into the
    temperature. (A bad config or temperature is left as it is, for prepare_loss_inputs to
    name.)"""
    config, temperature = temperature_in_config(config, temperature)
    transform = capping_transform(softcap, logit_scale)
    if logit_scale is not None and transform is None:
        if isinstance(temperature, torch.Tensor):
            temperature = scaled_temperature(temperature, logit_scale)
        elif config is None or isinstance(config, LossConfig):
            cfg = config if config is not None else LossConfig()
            config = cfg.replace(temperature=scaled_temperature(cfg.temperature, logit_scale))
    return config, ModelHead(temperature, transform)


def _refuse_what_has_no_path(config, sharded: bool, cp_group, **arguments) -> None:
    """The arguments of a call whose parallelism (tensor, context) has no path for them yet,
    and a max_seqlen without cu_seqlens, refused by name."""
    require_cu_seqlens(arguments["cu_seqlens"], arguments["max_seqlen"])
    if sharded:
        _refuse_under_tensor_parallelism(
            arguments["prox_logp"],
            arguments["entropy_coef"],
            arguments["return_sum_pi_squared"],
            arguments["ref_logits"],
            config,
        )
    if cp_group is not None:
        _refuse_under_context_parallelism(
            arguments["cu_seqlens"],
            sharded,
            arguments["inplace"],
            arguments["ref_logits"],
            config,
            arguments["return_sum_pi_squared"],
        )


def _refuse_under_context_parallelism(
    cu_seqlens, sharded, inplace, ref_logits, config, return_sum_pi_squared: bool
) -> None:
    if cu_seqlens is None:
        raise ValueError(
            "cp_group takes packed sequences: pass cu_seqlens, the whole batch's boundaries "
            "(each rank's logits its chunk of the tokens, in rank order)"
        )
    full_kl = ref_logits is not None or (isinstance(config, LossConfig) and config.full_kl)
    if sharded or inplace or full_kl:
        raise NotImplementedError(
            "cp_group with tp_group (or DTensor logits), inplace=True or the exact KL "
            "(ref_logits) is not supported yet"
        )
    if return_sum_pi_squared:
        raise NotImplementedError(
            "return_sum_pi_squared with cp_group is not supported by policy_loss yet: take it "
            "from token_logprobs(..., return_sum_pi_squared=True) on each rank's chunk"
        )


def _refuse_under_tensor_parallelism(
    prox_logp, entropy_coef, return_sum_pi_squared: bool, ref_logits, config
) -> None:
    if prox_logp is not None or entropy_coef is not None:
        raise NotImplementedError(
            "prox_logp (decoupled PPO) and a tensor entropy_coef under tensor parallelism are "
            "not supported yet"
        )
    if return_sum_pi_squared:
        raise NotImplementedError(
            "return_sum_pi_squared under tensor parallelism is not supported by policy_loss "
            "yet: take it from token_logprobs(..., return_sum_pi_squared=True, tp_group=...)"
        )
    if ref_logits is not None or (isinstance(config, LossConfig) and config.full_kl):
        raise NotImplementedError(
            "config.kl='full' / 'full_reverse' (ref_logits) under tensor parallelism is not "
            "supported yet: gather the vocabulary or use a per-token KL estimator"
        )


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    tp_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    return_sum_pi_squared: bool = False,
    logit_scale: float | None = None,
    softcap: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """log_softmax(logits / temperature) at `labels` in fp32 (and the entropy), differentiable.

    Under `torch.no_grad()` this is the fast path for old / reference log-probs: no gradient state
    is kept. logits [B, T, V] or [N, V]; labels of the same leading shape. `top_k` / `top_p` /
    `min_p`: vLLM's sampling filters of the rollouts; logp and the entropy are then taken over
    the set the engine sampled from (its processed log-probs; `fusedrl.sampling`).

    `tp_group`, `vocab_start`, `vocab_size`: vocab-sharded logits, as in `policy_loss`
    (docs/tensor_parallel.md); the gradient is this rank's slice, its backward communicates
    nothing.

    `temperature` may be a tensor of per-token temperatures ([B, T], or [B] one per sequence;
    [N] for [N, V] logits), as in `policy_loss` (with top_k / top_p / min_p each row's sampled
    set is its temperature's).

    `return_sum_pi_squared`: a third output, sum_v pi_v^2 per token ([B, T] fp32, no gradient;
    the Optimal Token Baseline's input); under tensor parallelism too, not with sampling filters.

    `logit_scale`, `softcap`: the model's transform of these logits, as in `policy_loss`.
    `cu_seqlens`, `max_seqlen`: packed sequences, as in `policy_loss`: checked, and nothing
    else changes (each row's log-prob is its own).
    docs/losses.md ("Which backend and surface takes which argument") has what each backend
    does with these.
    """
    from .tp.dtensor import wants_tensor_parallel
    from .tp.header import argument_checks

    sharded = wants_tensor_parallel(logits, tp_group, vocab_start, vocab_size)
    with argument_checks(sharded, logits, tp_group):  # one rank's bad argument: all raise
        temperature = check_packed_rows(cu_seqlens, logits, max_seqlen, temperature)
        transform = capping_transform(softcap, logit_scale)
        if transform is None:
            temperature = scaled_temperature(temperature, logit_scale)
        # a recursive call's own softcap / logit_scale (the latter folded above without a cap)
        capping = capping_keywords(transform)
        in_kernel = (
            return_sum_pi_squared
            and not sharded
            and isinstance(logits, torch.Tensor)
            and single_process.sums_squares_in_kernel(backend, logits.device)
        )
        if return_sum_pi_squared and not in_kernel:
            check_sum_pi_squared(check_sampling(top_k, top_p, min_p).active)
    if return_sum_pi_squared and not in_kernel:
        with torch.no_grad():
            sharp, _ = token_logprobs(
                logits.detach(),
                labels,
                temperature / 2,
                backend=backend,
                tp_group=tp_group,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
                **capping,
            )
        logp, entropy = token_logprobs(
            logits,
            labels,
            temperature,
            return_entropy,
            backend,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            **capping,
        )
        return logp, entropy, output.sum_pi_squared_of(logp.detach(), sharp)
    if sharded:
        import fusedrl.tp as tp

        return tp.token_logprobs(
            logits,
            labels,
            temperature,
            return_entropy,
            backend,
            top_k,
            top_p,
            min_p,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            transform=transform,
            cu_seqlens=cu_seqlens,
        )
    return single_process.token_logprobs(
        logits,
        labels,
        temperature,
        return_entropy,
        backend,
        top_k,
        top_p,
        min_p,
        transform=transform,
        return_sum_pi_squared=return_sum_pi_squared,
    )


class PolicyLoss(torch.nn.Module):
    """nn.Module wrapper of `policy_loss` with a fixed config and backend (and the model's soft
    cap / logit scale, for raw logits of such a head)."""

    def __init__(
        self,
        config: LossConfig | str | None = None,
        backend: str = "auto",
        inplace: bool = False,
        softcap: float | None = None,
        logit_scale: float | None = None,
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if isinstance(config, str):
            config = LossConfig.preset(config)
        self.config = config if config is not None else LossConfig()
        self.backend = backend
        self.inplace = inplace
        check_logit_transform(softcap, logit_scale)  # named at construction
        self.softcap, self.logit_scale = softcap, logit_scale

    def forward(
        self,
        logits,
        labels,
        advantages,
        mask,
        old_logp=None,
        ref_logp=None,
        rollout_logp=None,
        normalizer=None,
        return_entropy=False,
        is_weights=None,
        ref_logits=None,
        *,
        temperature=None,
        prox_logp=None,
        entropy_coef=None,
        return_sum_pi_squared=False,
        tp_group=None,
        vocab_start=None,
        vocab_size=None,
        grad_scale=None,
        cu_seqlens=None,
        max_seqlen=None,
        cp_group=None,
    ) -> LossOutput:
        """`policy_loss` with this module's config, backend, inplace and head settings; every
        other keyword as there."""
        return policy_loss(
            logits,
            labels,
            advantages,
            mask,
            old_logp=old_logp,
            ref_logp=ref_logp,
            rollout_logp=rollout_logp,
            config=self.config,
            normalizer=normalizer,
            inplace=self.inplace,
            backend=self.backend,
            return_entropy=return_entropy,
            is_weights=is_weights,
            ref_logits=ref_logits,
            temperature=temperature,
            prox_logp=prox_logp,
            entropy_coef=entropy_coef,
            return_sum_pi_squared=return_sum_pi_squared,
            tp_group=tp_group,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
            softcap=self.softcap,
            logit_scale=self.logit_scale,
            grad_scale=grad_scale,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cp_group=cp_group,
        )

    def extra_repr(self) -> str:
        extra = "".join(
            f", {name}={value}"
            for name, value in (("softcap", self.softcap), ("logit_scale", self.logit_scale))
            if value is not None
        )
        return f"config={self.config}, backend={self.backend!r}, inplace={self.inplace}{extra}"
