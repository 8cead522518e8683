"""`backend="triton"`: the fused kernels of `fusedrl.kernels`, registered as torch custom ops.

Token-level variants run one fused kernel (one read of each row, gradient written in the same
program). Sequence-level variants (GSPO, GMPO, sequence IS) need a per-sequence reduction of logp
before any gradient is known: pass 1 (logp/lse/entropy), the [B, T] math of `token_terms`, pass 2
(gradient). The loss value and the metrics always come from `token_terms` on [B, T] scalars.

The kernels are wrapped with `torch.library.custom_op` (with fake implementations) so that
`torch.compile` traces through them; under `TRITON_INTERPRET=1` they also run on CPU tensors.
"""

from __future__ import annotations

import torch

from ._inputs import LossInputs
from .config import LossConfig
from .reference import is_weights, ratio_bounds
from .token_terms import TokenTerms, aggregation_weights, token_terms


def _kernels():
    # Imported lazily: importing triton is slow and fails on machines without it.
    from fusedrl.kernels import logprobs, token_loss

    return logprobs, token_loss


def _empty_rows_like(labels: torch.Tensor) -> torch.Tensor:
    return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)


# ------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("fusedrl::logprobs_fwd", mutates_args=())
def logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor | None, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs, _ = _kernels()
    return logprobs.logprobs_forward(logits, labels, valid, temperature)


@logprobs_fwd.register_fake
def _(logits, labels, valid, temperature):
    return _empty_rows_like(labels), _empty_rows_like(labels), _empty_rows_like(labels)


@torch.library.custom_op("fusedrl::logits_grad", mutates_args=("out",))
def logits_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    dlogp: torch.Tensor,
    dentropy: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> None:
    logprobs, _ = _kernels()
    logprobs.logits_backward(logits, labels, lse, entropy, dlogp, dentropy, temperature, out)


@logits_grad.register_fake
def _(logits, labels, lse, entropy, dlogp, dentropy, temperature, out):
    return None


# The fused kernel has many per-token inputs and variant scalars; one schema string serves the
# out-of-place op (writes `grad`) and the in-place one (writes the gradient into `logits`).
_FUSED_ARGS = (
    "Tensor labels, Tensor valid, Tensor advantages, Tensor? old_logp, Tensor? ref_logp, "
    "Tensor? is_weight, Tensor agg_weight, Tensor? low, Tensor? high, float temperature, "
    "str loss, float? dual_clip_c, float? delta, float tau_pos, float tau_neg, str? kl, "
    "float beta, float entropy_coef"
)
torch.library.define(
    "fusedrl::fused_token_loss",
    f"(Tensor logits, Tensor(a!) grad, {_FUSED_ARGS}) -> (Tensor, Tensor)",
)
torch.library.define(
    "fusedrl::fused_token_loss_inplace", f"(Tensor(a!) logits, {_FUSED_ARGS}) -> (Tensor, Tensor)"
)


@torch.library.impl("fusedrl::fused_token_loss", "default")
def _fused_token_loss(logits, grad, *args):
    return _kernels()[1].fused_token_loss(logits, grad, *args)


@torch.library.impl("fusedrl::fused_token_loss_inplace", "default")
def _fused_token_loss_inplace(logits, *args):
    return _kernels()[1].fused_token_loss(logits, logits, *args)


@torch.library.register_fake("fusedrl::fused_token_loss")
def _(logits, grad, labels, *args):
    return _empty_rows_like(labels), _empty_rows_like(labels)


@torch.library.register_fake("fusedrl::fused_token_loss_inplace")
def _(logits, labels, *args):
    return _empty_rows_like(labels), _empty_rows_like(labels)


fused_token_loss = torch.ops.fusedrl.fused_token_loss.default
fused_token_loss_inplace = torch.ops.fusedrl.fused_token_loss_inplace.default


# ------------------------------------------------------------------------------ backends
class _LogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, return_entropy):
        logp, lse, entropy = logprobs_fwd(logits, labels, None, temperature)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        return (logp, entropy) if return_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, labels, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        logits_grad(logits, labels, lse, entropy, grad_logp, grad_entropy, ctx.temperature, grad)
        return grad, None, None, None


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if logits.requires_grad and torch.is_grad_enabled():
        out = _LogprobsFn.apply(logits, labels, temperature, return_entropy)
        return (out[0], out[1]) if return_entropy else (out[0], None)
    logp, _, entropy = logprobs_fwd(logits, labels, None, temperature)
    return logp, entropy if return_entropy else None


def _fused_token_level(inp: LossInputs, cfg: LossConfig, grad_out: torch.Tensor):
    """One kernel: logp, entropy and the gradient; the aggregation weight and IS weight, which
    do not depend on the logits, are [B, T] inputs."""
    old = inp.old_logp
    # IS weights and DCPO bounds need old; on-policy (old = logp) such configs take two passes.
    is_weight = is_weights(old, inp, cfg) if cfg.is_correction is not None else None
    low = high = None
    if cfg.loss in ("ppo", "cispo", "dcpo"):
        low, high = ratio_bounds(old if old is not None else torch.zeros_like(inp.mask), cfg)
    args = (
        inp.labels,
        inp.valid,
        inp.advantages,
        old,
        inp.ref_logp,
        is_weight,
        aggregation_weights(inp, cfg),
        low,
        high,
        cfg.temperature,
        cfg.loss,
        cfg.dual_clip_c,
        cfg.delta,
        cfg.sapo_tau_pos,
        cfg.sapo_tau_neg,
        cfg.kl,
        cfg.beta,
        cfg.entropy_coef,
    )
    if grad_out is inp.logits:
        return fused_token_loss_inplace(inp.logits, *args)
    return fused_token_loss(inp.logits, grad_out, *args)


def _needs_two_passes(inp: LossInputs, cfg: LossConfig) -> bool:
    if cfg.is_sequence_level:
        return True
    # On-policy with bounds that depend on old (dcpo) or an IS weight: old = logp is only known
    # after pass 1. (Token-level ppo/cispo bounds are constants and need no old.)
    return inp.old_logp is None and (cfg.loss == "dcpo" or cfg.is_correction is not None)


@torch.no_grad()
def policy_loss(
    inp: LossInputs, cfg: LossConfig, need_entropy: bool, grad_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, TokenTerms]:
    """Token-level with a gradient: the fused kernel. Otherwise pass 1, terms, pass 2."""
    need_entropy = need_entropy or cfg.entropy_coef != 0.0
    if grad_out is not None and not _needs_two_passes(inp, cfg):
        logp, entropy = _fused_token_level(inp, cfg, grad_out)
        entropy = entropy if need_entropy else None
        return logp, entropy, token_terms(logp, entropy, inp, cfg)
    logp, lse, entropy = logprobs_fwd(inp.logits, inp.labels, inp.valid, cfg.temperature)
    terms = token_terms(logp, entropy if need_entropy else None, inp, cfg)
    if grad_out is not None:
        logits_grad(
            inp.logits,
            inp.labels,
            lse,
            entropy,
            terms.dlogp,
            terms.dentropy,
            cfg.temperature,
            grad_out,
        )
    return logp, entropy if need_entropy else None, terms
