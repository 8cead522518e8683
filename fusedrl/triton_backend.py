"""`backend="triton"`: the kernels of `fusedrl.kernels`, registered as torch custom ops.

The ops have fake implementations so that `torch.compile` traces through them; under
`TRITON_INTERPRET=1` they also run on CPU tensors. How they are used (fused single kernel vs two
passes) is `fusedrl.fused_backend`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch

import fusedrl.fused_backend as fused_backend
from fusedrl.kernels.token_args import LossVariant, TokenLossArgs, op_schema

from .fused_backend import FusedOps


@functools.cache
def _kernels() -> SimpleNamespace:
    """The kernel modules by name, imported once and lazily (importing triton is slow and fails
    on machines without it)."""
    from fusedrl.kernels import (
        check_triton_version,
        logprobs,
        loss_sums,
        sampling,
        sequence_terms,
        split_rows,
        token_loss,
    )

    check_triton_version()
    return SimpleNamespace(
        logprobs=logprobs,
        token_loss=token_loss,
        split_rows=split_rows,
        loss_sums=loss_sums,
        sequence_terms=sequence_terms,
        sampling=sampling,
    )


# ------------------------------------------------------------------------------ custom ops
def _custom_op(name: str, mutates_args: tuple[str, ...]):
    """torch.library.custom_op("fusedrl::<name>") whose Python body stays at hand as
    `op.eager_body`, for `_eager_or_traced`."""

    def register(body: Callable) -> Callable:
        op = torch.library.custom_op(f"fusedrl::{name}", mutates_args=mutates_args)(body)
        op.eager_body = body
        return op

    return register


def _eager_or_traced(op: Callable, body: Callable | None = None) -> Callable:
    """`op` while torch.compile traces (its fake gives the shapes), its body when run eagerly:
    there the custom-op layers around the body (an autograd wrapper, a redispatch, a dynamo
    guard) cost several microseconds a call and do nothing for the driver, which calls the ops
    under no_grad with plain tensors; at a 4k-token micro-batch they are the host's time."""
    body = op.eager_body if body is None else body

    @functools.wraps(body)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return body(*args, **kwargs)

    return call


@_custom_op("logprobs_fwd", mutates_args=())
def logprobs_fwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    temperature: float,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
    floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cap` (every row op): a soft cap's a = s / c, the rows read as tanh(a x) at the
    temperature T / c (`fused_backend.temperature_keywords`). `floors` (every row op): each
    row's sampled-set floor (`sampled_floors`), the rows read over their sets."""
    return _kernels().logprobs.logprobs_forward(
        logits, labels, valid, temperature, row_temps, cap=cap, floors=floors
    )


@logprobs_fwd.register_fake
def _(logits, labels, valid, temperature, row_temps=None, cap=None, floors=None):
    return tuple(fused_backend._empty_rows_like(labels) for _ in range(3))


# sum_v pi_v^2 comes back as a fourth output, not into a buffer the op mutates: torch 2.11's
# functionalization fails on a mutated optional argument left None (IndexError under
# torch.compile, seen on an H200 in tests/test_gpu.py's gspo case).
@_custom_op("logprobs_squares_fwd", mutates_args=())
def logprobs_squares_fwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
    valid: torch.Tensor | None = None,
    floors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logprobs_fwd` and sum_v pi_v^2 per row, from the same read of the logits; `valid`:
    the rows to read (None: every row, as the log-prob calls, which have no mask)."""
    sum_sq = fused_backend._empty_rows_like(labels)
    stats = _kernels().logprobs.logprobs_forward(
        logits, labels, valid, temperature, row_temps, cap=cap, sum_sq=sum_sq, floors=floors
    )
    return (*stats, sum_sq)


@logprobs_squares_fwd.register_fake
def _(logits, labels, temperature, row_temps=None, cap=None, valid=None, floors=None):
    return tuple(fused_backend._empty_rows_like(labels) for _ in range(4))


@_custom_op("logits_grad", mutates_args=("out",))
def logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
    floors: torch.Tensor | None = None,
) -> None:
    _kernels().logprobs.logits_backward(
        logits, labels, lse, entropy, dlogp, dentropy, temperature, out, row_temps, cap, floors
    )


@logits_grad.register_fake
def _(
    logits,
    labels,
    lse,
    entropy,
    dlogp,
    dentropy,
    temperature,
    out,
    row_temps=None,
    cap=None,
    floors=None,
):
    return None


@_custom_op("sampled_set", mutates_args=("out",))
def sampled_set(
    logits: torch.Tensor,
    labels: torch.Tensor,
    out: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    row_temps: torch.Tensor | None = None,
) -> None:
    _kernels().sampling.write_sampled_set(
        logits, labels, out, temperature, top_k, top_p, min_p, row_temps
    )


@_custom_op("sampled_floors", mutates_args=())
def sampled_floors(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    row_temps: torch.Tensor | None = None,
) -> torch.Tensor:
    return _kernels().sampling.sampled_floors(
        logits, labels, temperature, top_k, top_p, min_p, row_temps
    )


@sampled_floors.register_fake
def _(logits, labels, temperature, top_k, top_p, min_p, row_temps=None):
    return fused_backend._empty_rows_like(labels)


# The fused loss (and its in-place twin, which writes the gradient into the logits). An op cannot
# take a TokenLossArgs, so its schema is the object's fields by keyword (`op_schema`), the call
# passes `args.keywords()` and the body rebuilds the object (the dispatcher leaves out keywords at
# their defaults: `from_keywords` fills them in): the fields are listed once, in
# kernels/token_args.py. The fakes take the same keywords.
_ARGS_SCHEMA = op_schema()
_FUSED_OUTPUTS = "(Tensor, Tensor, Tensor)"  # logp, entropy, the programs' sums
torch.library.define(
    "fusedrl::fused_token_loss",
    f"(Tensor logits, Tensor(a!) grad, *, {_ARGS_SCHEMA}) -> {_FUSED_OUTPUTS}",
)
torch.library.define(
    "fusedrl::fused_token_loss_inplace",
    f"(Tensor(a!) logits, *, {_ARGS_SCHEMA}) -> {_FUSED_OUTPUTS}",
)


@torch.library.impl("fusedrl::fused_token_loss", "default")
def _fused_token_loss(logits, grad, **arguments):
    args = TokenLossArgs.from_keywords(arguments)
    return _kernels().split_rows.fused_token_loss(logits, grad, args)


@torch.library.impl("fusedrl::fused_token_loss_inplace", "default")
def _fused_token_loss_inplace(logits, **arguments):
    args = TokenLossArgs.from_keywords(arguments)
    return _kernels().split_rows.fused_token_loss(logits, logits, args)


def _fused_outputs_like(logits, labels):
    """logp, entropy ([B, T] fp32) and the programs' sums ([programs, SUM_WIDTH] fp32)."""
    token_loss = _kernels().token_loss
    partials = torch.empty(
        token_loss.sum_programs(logits), _kernels().loss_sums.SUM_WIDTH.value, device=logits.device
    )
    return fused_backend._empty_rows_like(labels), fused_backend._empty_rows_like(labels), partials


@torch.library.register_fake("fusedrl::fused_token_loss")
def _(logits, grad, **arguments):
    return _fused_outputs_like(logits, TokenLossArgs.from_keywords(arguments).labels)


@torch.library.register_fake("fusedrl::fused_token_loss_inplace")
def _(logits, **arguments):
    return _fused_outputs_like(logits, TokenLossArgs.from_keywords(arguments).labels)


def _fused_token_loss_inplace_eager(logits, args):
    return _kernels().split_rows.fused_token_loss(logits, logits, args)


def _taking_args(op: Callable, body: Callable, fields: tuple[str, ...] | None = None) -> Callable:
    """A `FusedOps` entry whose last positional argument is a TokenLossArgs: eagerly `body`
    (the launcher, which takes the object), under torch.compile `op` with its fields (those of
    its schema, `fields`; None: all) by keyword."""

    @functools.wraps(body)
    def call(*leading, **named):
        if torch.compiler.is_compiling():
            *tensors, args = leading
            return op(*tensors, **args.keywords(fields), **named)
        return body(*leading, **named)

    return call


@_custom_op("aggregation_weights", mutates_args=())
def _aggregation_weights_op(
    mask: torch.Tensor,
    agg: str,
    normalizer_tensor: torch.Tensor | None,
    normalizer: float | None,
    norm_constant: float | None,
) -> torch.Tensor:
    given = normalizer_tensor if normalizer_tensor is not None else normalizer
    return _kernels().loss_sums.aggregation_weights(mask, agg, given, norm_constant)


@_aggregation_weights_op.register_fake
def _(mask, agg, normalizer_tensor, normalizer, norm_constant):
    # fp32 whatever the mask's dtype (a bool mask is read as it is)
    return torch.empty(mask.shape, dtype=torch.float32, device=mask.device)


def aggregation_weights(mask, agg, normalizer, norm_constant) -> torch.Tensor:
    """The aggregation weights in one launch; `normalizer` a number, a device scalar or None."""
    if not torch.compiler.is_compiling():  # (`_eager_or_traced`: the launcher itself)
        return _kernels().loss_sums.aggregation_weights(mask, agg, normalizer, norm_constant)
    tensor = normalizer if isinstance(normalizer, torch.Tensor) else None
    number = None if tensor is not None else normalizer
    return _aggregation_weights_op(mask, agg, tensor, number, norm_constant)


@_custom_op("token_loss_sums", mutates_args=())
def token_loss_sums(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused loss's per-program sums added up: (the 0-dim loss, the [SUM_WIDTH] means)."""
    return _kernels().loss_sums.token_loss_sums(partials)


@token_loss_sums.register_fake
def _(partials):
    width = _kernels().loss_sums.SUM_WIDTH.value
    return partials.new_empty(()), partials.new_empty(width)


# The fields the terms kernel reads (kernels/sequence_terms.py): all but the rows' (temperature,
# cap, per-token temperatures), the gradient's (grad_scale), the mask-weighed aggregation and
# the sum of p^2 buffer (whose alias annotation would mark the op as mutating, for
# torch.compile to functionalise). A new number of the variant joins by itself.
_NOT_SEQUENCE_FIELDS = {
    "variant",
    "row_temps",
    "grad_scale_tensor",
    "sum_sq",
    "grad_scale",
    "agg_denominator",
    "temperature",
    "cap",
    "agg_from_mask",
}
SEQUENCE_FIELDS = tuple(
    name
    for name in (*TokenLossArgs._fields, *LossVariant._fields)
    if name not in _NOT_SEQUENCE_FIELDS
)
torch.library.define(
    "fusedrl::sequence_terms",
    f"(Tensor logp, Tensor? entropy, *, {op_schema(SEQUENCE_FIELDS)}, bool sequence_ratio, "
    "int vocab) -> (Tensor, Tensor, Tensor)",
)


@torch.library.impl("fusedrl::sequence_terms", "default")
def _sequence_terms(logp, entropy, *, sequence_ratio, vocab, **arguments):
    """A two-pass call's terms on [B, T] log-probs (kernels/sequence_terms.py): (dlogp,
    dentropy or [0] without a bonus, one row of sums per sequence for `token_loss_sums`)."""
    return _kernels().sequence_terms.sequence_terms(
        logp,
        entropy,
        TokenLossArgs.from_keywords(arguments),
        sequence_ratio=sequence_ratio,
        vocab=vocab,
    )


@torch.library.register_fake("fusedrl::sequence_terms")
def _(logp, entropy, *, sequence_ratio, vocab, **arguments):
    # (the dispatcher leaves out keywords at their defaults: the object fills them in)
    args = TokenLossArgs.from_keywords(arguments)
    bonus = args.variant.entropy_coef != 0.0 or args.entropy_coef_tensor is not None
    width = _kernels().loss_sums.SUM_WIDTH.value
    dentropy = torch.empty_like(logp) if bonus else logp.new_empty(0)
    return torch.empty_like(logp), dentropy, logp.new_empty(logp.shape[0], width)


fused_token_loss = torch.ops.fusedrl.fused_token_loss.default
fused_token_loss_inplace = torch.ops.fusedrl.fused_token_loss_inplace.default
sequence_terms = torch.ops.fusedrl.sequence_terms.default


# Two distributions per token (kernels/two_rows.py): the exact KL and distillation.
def _two_rows_kernels():
    from fusedrl.kernels import check_triton_version, two_rows

    check_triton_version()
    return two_rows


@_custom_op("two_rows_fwd", mutates_args=())
def two_rows_fwd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor | None,
    temperature: float,
    kind: str,
    beta: float,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _two_rows_kernels().two_rows_forward(
        student, teacher, labels, valid, temperature, kind, beta, row_temps, cap
    )


@two_rows_fwd.register_fake
def _(student, teacher, labels, valid, temperature, kind, beta, row_temps=None, cap=None):
    return tuple(fused_backend._empty_rows_like(labels) for _ in range(6))


@_custom_op("two_rows_grad", mutates_args=("out",))
def two_rows_grad(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse_s: torch.Tensor,
    lse_q: torch.Tensor,
    value: torch.Tensor,
    aux: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    kind: str,
    beta: float,
    out: torch.Tensor,
    labels: torch.Tensor | None,
    entropy: torch.Tensor | None,
    dlogp: torch.Tensor | None,
    dentropy: torch.Tensor | None,
    row_temps: torch.Tensor | None = None,
    cap: float | None = None,
) -> None:
    _two_rows_kernels().two_rows_backward(
        student,
        teacher,
        lse_s,
        lse_q,
        value,
        aux,
        weight,
        temperature,
        kind,
        beta,
        out,
        labels,
        entropy,
        dlogp,
        dentropy,
        row_temps,
        cap,
    )


@two_rows_grad.register_fake
def _(student, teacher, lse_s, lse_q, value, aux, weight, temperature, kind, beta, out, *rest):
    return None


TWO_ROWS = fused_backend.TwoRowOps(_eager_or_traced(two_rows_fwd), _eager_or_traced(two_rows_grad))


# ------------------------------------------------------------------------------ backends
SUMS_PI_SQUARED_IN_PASS = True  # backends.Backend: the fused kernel's sweep 1, or pass 1
READS_RAW_ROWS = True  # backends.Backend: fused_backend masks the rows where torch needs them
OPS = FusedOps(
    _eager_or_traced(logprobs_fwd),
    _eager_or_traced(logits_grad),
    # (eagerly, the launchers themselves: a call's frames are a 4k-token micro-batch's time)
    _taking_args(fused_token_loss, _kernels().split_rows.fused_token_loss),
    _taking_args(fused_token_loss_inplace, _fused_token_loss_inplace_eager),
    _eager_or_traced(sampled_set),
    _eager_or_traced(sampled_floors),
    TWO_ROWS,
    logprobs_squares=_eager_or_traced(logprobs_squares_fwd),
    loss_squares=True,
    token_loss_sums=_eager_or_traced(token_loss_sums, _kernels().loss_sums.token_loss_sums),
    sum_slots=_kernels().loss_sums.SUM_SLOTS,
    fused_sums=True,
    aggregation_weights=aggregation_weights,
    sequence_terms=_taking_args(
        sequence_terms, _kernels().sequence_terms.sequence_terms, SEQUENCE_FIELDS
    ),
)
policy_loss = functools.partial(fused_backend.policy_loss, OPS)
token_logprobs = functools.partial(fused_backend.token_logprobs, OPS)
token_logprobs_squares = functools.partial(fused_backend.token_logprobs_squares, OPS)
policy_loss_squares = functools.partial(fused_backend.policy_loss_squares, OPS)
terms = functools.partial(fused_backend.terms, OPS)
# A planned call runs eagerly only (`call_plan` plans no traced call): its ops are the launchers
# themselves, without the check for tracing that each of OPS makes (a planned dapo call's host
# time is some 60 us, a third of it frames like these).
EAGER_OPS = dataclasses.replace(
    OPS,
    fused_token_loss=_kernels().split_rows.fused_token_loss,
    fused_token_loss_inplace=_fused_token_loss_inplace_eager,
    token_loss_sums=_kernels().loss_sums.token_loss_sums,
    aggregation_weights=_kernels().loss_sums.aggregation_weights,
)
planned_call = functools.partial(fused_backend.planned_call, EAGER_OPS)
