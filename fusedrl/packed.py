"""Packed sequences: `policy_loss(..., cu_seqlens=)` on padding-free [N, V] logits.

Padding-free batches (verl's `use_remove_padding=True`, TRL's padding-free option, prime-rl's
and OpenRLHF's packed micro-batches) hand the loss the concatenated tokens of S sequences and
their boundaries, `cu_seqlens` (int32 / int64 [S + 1], flash-attention's convention: sequence s
is rows cu_seqlens[s] to cu_seqlens[s + 1]). The result equals the padded call on the same
sequences, for every objective and option (tests/test_packed.py):

- A loss whose every term is a token's own (token-level ratios and rejection, no rollout
  log-probs or IS weights, whose metrics count sequences) is the plain [N, V] call, the fused
  kernel's one read and one write; where its aggregation is a sequence mean (GRPO, Dr. GRPO),
  each token's aggregation weight is computed per sequence first and handed to that call.
- Every other loss reads the logits once for the log-probs and entropy (the backend's log-prob
  pass, differentiable), takes its per-sequence terms on the [S, T_max] padded layout of those
  per-token scalars (a few floats a token; the logits are never padded or copied), and hands
  d(loss)/d(logp) and d(loss)/d(entropy) back to the log-prob pass's backward, which reads the
  logits once more and writes the gradient: 2R + 1W, as the padded two-pass losses.

T_max (the longest sequence) sizes the padded layout, where one is made: `max_seqlen=` gives
it, as flash-attention's varlen functions take it; without it, it is read from `cu_seqlens`
(one host sync on a GPU). The boundaries' own helpers (checks, the padded layout, the
per-sequence weights) are fusedrl/segments.py's, which distillation shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import torch

import fusedrl.backends as backends
import fusedrl.linear_single_process as linear_single_process
import fusedrl.output as output
import fusedrl.single_process as single_process

from ._autograd import attach_grads, wanted_grads
from ._inputs import LossInputs, check_config, check_sum_pi_squared, masked_rows, needs_entropy
from .arguments import ModelHead, RolloutInputs, checked_inputs
from .config import LossConfig
from .logit_transform import capping_keywords
from .output import LossOutput
from .segments import (
    Segments,
    check_cu_seqlens,
    layout_length,
    replace_agg,
    rollout_mismatch,
    segment_weights,
    sum_norm_normalizer,
)
from .tp import linear as tp_linear
from .tp import loss as tp_loss
from .tp.dtensor import local_value, unwrap_logits
from .tp.header import argument_checks, loss_inputs_replicated


def sees_no_boundaries(cfg: LossConfig, rollout_logp, is_weights) -> bool:
    """Whether every term and metric of the loss is a token's own, so that the packed call is
    the plain [N, V] call: token-mean, token-level ratio and rejection (`needs_sequences`), and
    no rollout log-probs or IS weights (their mismatch metrics count sequences)."""
    return not cfg.needs_sequences and rollout_logp is None and is_weights is None


def reads_rollout_for_metrics_only(cfg: LossConfig, rollout_logp, is_weights) -> bool:
    """Whether `rollout_logp` enters the call's metrics alone (no IS correction, rejection,
    trust region or off-policy mask reads it, no IS weights given): the loss is then the call's
    without it, and its mismatch metrics, which count sequences, come from the log-probs."""
    return (
        rollout_logp is not None
        and is_weights is None
        and cfg.is_correction is None
        and not cfg.rejection_rules
        and cfg.off_policy_mask is None
    )


def weighs_sequences_only(cfg: LossConfig, rollout_logp, is_weights) -> bool:
    """Whether the boundaries enter the loss through its aggregation weights alone (a
    sequence-mean of token-level ratios, GRPO's and Dr. GRPO's): the plain [N, V] call then
    takes each token's weight, computed per sequence, and stays one read and one write."""
    return sees_no_boundaries(replace_agg(cfg), rollout_logp, is_weights)


def reads_logits_once(cfg: LossConfig, rollout_logp, is_weights) -> bool:
    """Whether a packed call is the plain [N, V] call (one read and one write; `inplace=True`
    taken): the boundaries enter through the aggregation weights and the mismatch metrics
    alone."""
    metrics_only = reads_rollout_for_metrics_only(cfg, rollout_logp, is_weights)
    return weighs_sequences_only(cfg, None if metrics_only else rollout_logp, is_weights)


class LogitsRows(NamedTuple):
    """The rows of a packed call as [N, V] logits (`fusedrl.policy_loss`)."""

    logits: torch.Tensor
    backend: str
    # the gradient into the logits' buffer: token-level ratios only (`policy_loss`)
    inplace: bool = False
    # the reference's packed logits of the exact KL (kl="full" / "full_reverse"): a token's own
    # term, so token-level ratios only, as `inplace`
    ref_logits: torch.Tensor | None = None

    @property
    def source(self) -> torch.Tensor:  # (what `cu_seqlens` is checked against)
        return self.logits

    @property
    def vocab(self) -> int:
        return self.logits.shape[-1]

    def wants_grad(self) -> bool:
        return self.logits.requires_grad

    def checks(self):
        return contextlib.nullcontext()

    @staticmethod
    def checked_labels(labels):  # (the padded call's checks take them as they are)
        return labels

    def plain(self, *call, **options) -> LossOutput:
        """The call without boundaries (single_process.policy_loss)."""
        return single_process.policy_loss(
            self.logits,
            *call,
            backend=self.backend,
            inplace=self.inplace,
            ref_logits=self.ref_logits,
            **options,
        )

    def logprobs(self, labels, temperature, return_entropy, transform, inp=None, **sampling):
        return single_process.token_logprobs(
            self.logits,
            labels,
            temperature,
            return_entropy,
            self.backend,
            **sampling,
            transform=transform,
        )


class HeadRows(NamedTuple):
    """The rows of a packed call as [N, H] hidden states and an LM head
    (`fusedrl.linear_policy_loss`): the logits are never made."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    backend: str
    skip_masked_rows: bool
    live_rows: int | None
    # the reference's head of the exact KL (kl="full" / "full_reverse"; `ref_hidden` packed as
    # `hidden`, default `hidden`): a token's own term, so token-level ratios only
    ref_weight: torch.Tensor | None = None
    ref_hidden: torch.Tensor | None = None
    ref_bias: torch.Tensor | None = None

    @property
    def source(self) -> torch.Tensor:
        return self.hidden

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def wants_grad(self) -> bool:
        return any(wanted_grads(self.hidden, self.weight, self.bias))

    def checks(self):
        return contextlib.nullcontext()

    @staticmethod
    def checked_labels(labels):  # (the padded call's checks take them as they are)
        return labels

    def plain(self, *call, **options) -> LossOutput:
        """The call without boundaries (linear_single_process.linear_policy_loss)."""
        return linear_single_process.linear_policy_loss(
            self.hidden,
            self.weight,
            *call,
            bias=self.bias,
            backend=self.backend,
            skip_masked_rows=self.skip_masked_rows,
            live_rows=self.live_rows,
            ref_weight=self.ref_weight,
            ref_hidden=self.ref_hidden,
            ref_bias=self.ref_bias,
            **options,
        )

    def logprobs(self, labels, temperature, return_entropy, transform, inp=None, **sampling):
        return linear_single_process.linear_token_logprobs(
            self.hidden,
            self.weight,
            labels,
            temperature,
            return_entropy,
            self.bias,
            self.backend,
            **sampling,
            transform=transform,
        )


def _compared(inp, cu_seqlens):
    """What the log-prob pass's header compares across the ranks beside its labels: the loss's
    own inputs on the padded layout (`inp`; None: the pass alone)."""
    return None if inp is None else loss_inputs_replicated(inp, cu_seqlens)


class ShardRows(NamedTuple):
    """The rows of a packed call as this rank's [N, V_r] slice of vocab-sharded logits
    (`fusedrl.policy_loss(..., tp_group=)`): the plain call and the log-prob pass are tensor
    parallelism's, whose header compares `cu_seqlens` across the ranks."""

    logits: torch.Tensor  # a DTensor sharded on its last dim, or this rank's slice
    backend: str
    inplace: bool
    shard: dict  # tp_group, vocab_start, vocab_size
    cu_seqlens: torch.Tensor

    @property
    def source(self) -> torch.Tensor:  # this rank's slice
        return unwrap_logits(self.logits, self.shard["tp_group"])[0]

    @property
    def vocab(self) -> int:
        return self.source.shape[-1]

    def wants_grad(self) -> bool:
        return self.logits.requires_grad

    def checks(self):
        return argument_checks(True, self.logits, self.shard["tp_group"])

    @staticmethod
    def checked_labels(labels):
        # global token ids: their range is the log-prob pass's header's to check, against the
        # global vocabulary (this rank's V_r is not it)
        return torch.zeros_like(labels) if isinstance(labels, torch.Tensor) else labels

    def plain(self, *call, **options) -> LossOutput:
        """The call without boundaries (tp.loss.policy_loss)."""
        return tp_loss.policy_loss(
            self.logits,
            *call,
            **self.shard,
            inplace=self.inplace,
            backend=self.backend,
            cu_seqlens=self.cu_seqlens,
            **options,
        )

    def logprobs(self, labels, temperature, return_entropy, transform, inp=None, **sampling):
        return tp_loss.token_logprobs(
            self.logits,
            labels,
            temperature,
            return_entropy,
            self.backend,
            **sampling,
            **self.shard,
            transform=transform,
            cu_seqlens=self.cu_seqlens,
            compared=_compared(inp, self.cu_seqlens),
        )


class ShardHeadRows(NamedTuple):
    """The rows of a packed call as [N, H] hidden states and this rank's rows of a
    vocab-sharded LM head (`fusedrl.linear_policy_loss(..., tp_group=)`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    backend: str
    shard: dict  # tp_group, vocab_start, vocab_size, reduce_input_grad
    skip_masked_rows: bool
    live_rows: int | None
    cu_seqlens: torch.Tensor

    @property
    def source(self) -> torch.Tensor:
        return self.hidden

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def wants_grad(self) -> bool:
        return any(wanted_grads(self.hidden, self.weight, self.bias))

    def checks(self):
        return argument_checks(True, self.hidden, self.shard["tp_group"])

    checked_labels = staticmethod(ShardRows.checked_labels)

    def plain(self, *call, **options) -> LossOutput:
        """The call without boundaries (tp.linear.linear_policy_loss)."""
        return tp_linear.linear_policy_loss(
            self.hidden,
            self.weight,
            *call,
            bias=self.bias,
            backend=self.backend,
            **self.shard,
            skip_masked_rows=self.skip_masked_rows,
            live_rows=self.live_rows,
            cu_seqlens=self.cu_seqlens,
            **options,
        )

    def logprobs(self, labels, temperature, return_entropy, transform, inp=None, **sampling):
        return tp_linear.linear_token_logprobs(
            self.hidden,
            self.weight,
            labels,
            temperature,
            return_entropy,
            self.bias,
            self.backend,
            **sampling,
            **self.shard,
            **capping_keywords(transform),
            cu_seqlens=self.cu_seqlens,
            compared=_compared(inp, self.cu_seqlens),
        )


def policy_loss(
    rows: LogitsRows | HeadRows | ShardRows | ShardHeadRows,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig | None,
    normalizer,
    *,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    return_entropy: bool,
    entropy_coef: torch.Tensor | None,
    return_sum_pi_squared: bool,
    grad_scale,
) -> LossOutput:
    """`fusedrl.policy_loss` / `linear_policy_loss` of packed sequences (the module docstring
    says how) on the call's `rows`, its rollout inputs and model head as objects."""
    cfg = config if config is not None else LossConfig()
    options = {"return_entropy": return_entropy, "grad_scale": grad_scale}
    if entropy_coef is not None:  # (the tensor-parallel forms take neither)
        options["entropy_coef"] = entropy_coef
    if return_sum_pi_squared:
        options["return_sum_pi_squared"] = True
    labels, advantages, mask, normalizer = map(local_value, (labels, advantages, mask, normalizer))
    rollout = rollout.map(lambda _, value: local_value(value))
    head = head.map_temperature(local_value)
    with rows.checks():  # under tensor parallelism, one rank's bad argument: every rank raises
        check_config(cfg)
        segments = Segments(
            check_cu_seqlens(local_value(cu_seqlens), rows.source, max_seqlen),
            rows.source.shape[0],
            layout_length(cfg, max_seqlen),
        )
        if isinstance(advantages, torch.Tensor):
            advantages = segments.per_token(advantages, "advantages")
        if isinstance(head.temperature, torch.Tensor) and head.temperature.dim() > 0:
            head = head.map_temperature(lambda t: segments.per_token(t, "temperature"))
        segments.check_per_token({"labels": labels, "mask": mask, **rollout.per_token()})
        segments.check_unambiguous(rollout.is_weights, "is_weights")
        normalizer = sum_norm_normalizer(segments, cfg, normalizer)
        call = (labels, advantages, mask, rollout, head, cfg, normalizer)
        once = reads_logits_once(cfg, rollout.rollout_logp, rollout.is_weights)
        if once:
            weights = segment_weights(segments, rows.source, rows.vocab, mask, cfg, normalizer)
        else:
            _refuse_whole_sequence_options(rows, cfg)
            inp = padded_inputs(rows, segments, *call, options)
    if once:
        return _plain_call(rows, segments, *call, options, weights)
    return _two_passes(rows, segments, labels, head, cfg, options, inp)


def _plain_call(
    rows, segments, labels, advantages, mask, rollout, head, cfg, normalizer, options, weights
) -> LossOutput:
    """The packed call as the plain [N, V] call (`reads_logits_once`), each token's aggregation
    weight (`weights`) computed per sequence; the mismatch metrics, if the engine's log-probs
    enter them alone, from the call's log-probs."""
    # (no IS weights here, and the engine's log-probs, if any, are for the metrics alone)
    plain_rollout = dataclasses.replace(rollout, rollout_logp=None)
    out = rows.plain(
        labels,
        advantages,
        mask,
        plain_rollout,
        head,
        replace_agg(cfg),
        normalizer,
        **options,
        agg_weights=weights,
    )
    if rollout.rollout_logp is not None:
        extra = rollout_mismatch(
            segments, rows.source, rows.vocab, mask, rollout.rollout_logp, out.logp
        )
        out.metrics.update(extra)
    return out


def _refuse_whole_sequence_options(rows, cfg: LossConfig) -> None:
    if getattr(rows, "inplace", False):
        raise NotImplementedError(
            "inplace=True with cu_seqlens takes token-level ratios with a token or sequence "
            "mean (dapo, grpo, dr_grpo, ...); this call's ratios or corrections need whole "
            "sequences, whose gradient comes from a log-prob pass's backward: pass inplace=False"
        )
    if cfg.full_kl or getattr(rows, "ref_logits", None) is not None:
        raise NotImplementedError(
            "config.kl='full' / 'full_reverse' (ref_logits / ref_weight) with cu_seqlens takes "
            "token-level "
            "ratios with a token or sequence mean (dapo, grpo, dr_grpo, ...); this call's "
            "ratios or corrections need whole sequences: use a per-token KL estimator"
        )


def padded_inputs(
    rows, segments, labels, advantages, mask, rollout, head, cfg, normalizer, options
) -> LossInputs:
    """The checked, masked inputs of a loss whose terms need whole sequences, on the padded
    [S, T_max] layout of the per-token scalars (the logits a stand-in: never padded)."""
    if options.get("return_sum_pi_squared"):  # (the plain call checks its own)
        check_sum_pi_squared(cfg.sampling is not None)
    padded_head = head  # (per-token temperatures padded: the checks are the padded call's)
    if isinstance(head.temperature, torch.Tensor) and head.temperature.dim() > 0:
        padded_head = head.map_temperature(lambda t: segments.pad(t, 1.0))
    padded_rollout = rollout.map(
        lambda name, value: (
            segments.padded_per_sequence_or_token(value, 1.0)
            if name == "is_weights"
            else segments.pad(value)
        )
    )
    return masked_rows(
        checked_inputs(
            segments.stand_in(rows.source, rows.vocab),
            segments.pad(rows.checked_labels(labels)),
            segments.padded_per_sequence_or_token(advantages),
            segments.pad(mask, False if mask.dtype == torch.bool else 0),
            padded_rollout,
            padded_head,
            cfg,
            normalizer,
            entropy_coef=options.get("entropy_coef"),
            mask_rows=False,
            grad_scale=options["grad_scale"],
        )
    )


def terms_with_grads(rows, segments, values, own, inp, cfg, mine: slice | None = None):
    """(the terms, the loss with its gradient attached) of a loss whose terms need whole
    sequences: the backend's own terms (Triton's terms kernel where it covers the loss: two
    launches where torch takes some seventy) on the padded layout of `values` (the log-probs
    and entropy [N], 0 where not counted), and d(loss)/d(logp), d(loss)/d(entropy) handed to
    the log-prob pass's outputs `own` (their tokens `mine` of the N: context parallelism's
    chunk; None: all)."""
    logp, entropy = values
    terms = backends.resolve(rows.backend, logp.device).terms(
        segments.pad(logp),
        None if entropy is None else segments.pad(entropy),
        inp,
        cfg,
        entropy is not None,
    )
    mine = slice(None) if mine is None else mine
    pairs = [(own[0], segments.unpad(terms.dlogp)[mine])]
    if own[1] is not None and terms.dentropy is not None:
        pairs.append((own[1], segments.unpad(terms.dentropy)[mine]))
    loss = terms.loss
    if rows.wants_grad() and torch.is_grad_enabled():
        inputs, grads = tuple(x for x, _ in pairs), tuple(g for _, g in pairs)
        loss = attach_grads(loss, inputs, grads, inp.grad_scale)
    return terms, loss


def _two_passes(rows, segments, labels, head, cfg, options, inp) -> LossOutput:
    """A loss whose terms need whole sequences: the log-prob pass, the terms on the padded
    layout of its per-token scalars (`inp`), the gradient through the pass's backward
    (2R + 1W)."""
    return_entropy = options["return_entropy"]
    temperature = head.temperature
    counted = segments.unpad(inp.valid.float()) != 0
    safe_labels = torch.where(counted, labels, 0)
    sampling = {"top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p}
    rows_temperature = cfg.temperature  # (a masked token's may be anything: 1 there)
    if temperature is not None:
        rows_temperature = torch.where(counted, temperature.float(), 1.0)
    entropy_wanted = return_entropy or needs_entropy(inp, cfg)
    logp, entropy = rows.logprobs(
        safe_labels, rows_temperature, entropy_wanted, head.transform, inp, **sampling
    )
    # (the log-prob pass reads every row: a masked one's NaN padding must not reach the terms)
    logp_values = torch.where(counted, logp.detach(), 0.0)
    entropy_values = None if entropy is None else torch.where(counted, entropy.detach(), 0.0)
    terms, loss = terms_with_grads(
        rows, segments, (logp_values, entropy_values), (logp, entropy), inp, cfg
    )
    squares = None
    if options.get("return_sum_pi_squared"):  # from the log-probs at T and T / 2
        with torch.no_grad():
            sharp, _ = rows.logprobs(safe_labels, rows_temperature / 2, False, head.transform)
        squares = torch.where(counted, output.sum_pi_squared_of(logp.detach(), sharp), 0.0)
    return LossOutput(
        loss=loss,
        logp=torch.where(counted, logp.detach(), 0.0),
        entropy=None if not return_entropy else torch.where(counted, entropy.detach(), 0.0),
        metrics=terms.metrics,
        sum_pi_squared=squares,
    )
