"""The single-process loss on whole-vocabulary logits: what `fusedrl.policy_loss` and
`fusedrl.token_logprobs` run once their arguments are settled (the model's transform resolved,
tensor parallelism dispatched), and what a tensor-parallel group of one runs.

Below the entry points (api.py), beside the families (tp/, distill/): it uses only what lies
below it (the inputs, the backends, the autograd layer).
"""

from __future__ import annotations

import torch

import fusedrl.backends as backends
import fusedrl.output as output

from ._autograd import with_known_grad
from ._inputs import (
    check_labels,
    check_logits,
    check_sum_pi_squared,
    check_temperature_arg,
    masked_rows,
    temperature_of,
)
from .arguments import ModelHead, RolloutInputs, checked_inputs
from .config import LossConfig
from .logit_transform import LogitTransform
from .output import LossOutput
from .sampling import check_sampling


def sums_squares_in_kernel(backend: str, device: torch.device) -> bool:
    """Whether the backend's log-prob kernel sums pi^2 in its own read (Triton)."""
    return backends.resolve(backend, device).SUMS_PI_SQUARED_IN_PASS


def policy_loss(
    logits,
    labels,
    advantages,
    mask,
    rollout: RolloutInputs,
    head: ModelHead,
    config: LossConfig | None = None,
    normalizer=None,
    *,
    backend: str = "auto",
    inplace: bool = False,
    return_entropy: bool = False,
    ref_logits=None,
    entropy_coef=None,
    return_sum_pi_squared: bool = False,
    grad_scale=None,
    agg_weights=None,
) -> LossOutput:
    """`fusedrl.policy_loss` on one process, its rollout inputs and model head as objects
    (fusedrl/arguments.py); `agg_weights`: per-token aggregation weights in place of the
    mask's (packed sequences)."""
    cfg = config if config is not None else LossConfig()
    inp = checked_inputs(
        logits,
        labels,
        advantages,
        mask,
        rollout,
        head,
        cfg,
        normalizer,
        ref_logits=ref_logits,
        entropy_coef=entropy_coef,
        mask_rows=False,
        grad_scale=grad_scale,
        agg_weights=agg_weights,
    )
    impl = backends.resolve(backend, inp.logits.device)
    if not impl.READS_RAW_ROWS:
        inp = masked_rows(inp)
    sharp = None
    # Triton sums pi^2 in the loss's own read of the logits (the exact KL's two-row kernels
    # do not); elsewhere one more read at half the temperature, before the loss, which may
    # overwrite the logits.
    in_loss = impl.SUMS_PI_SQUARED_IN_PASS and not cfg.full_kl
    if return_sum_pi_squared:
        check_sum_pi_squared(cfg.sampling is not None)
    if return_sum_pi_squared and not in_loss:
        with torch.no_grad():
            sharp, _ = impl.token_logprobs(
                inp.logits.detach(),
                inp.labels,
                temperature_of(inp, cfg) / 2,
                False,
                **transform_keyword(head.transform),
            )

    def compute(grad):
        if return_sum_pi_squared and in_loss:
            logp, entropy, terms, sum_sq = impl.policy_loss_squares(inp, cfg, return_entropy, grad)
            return terms.loss, (logp, entropy, terms, sum_sq)
        logp, entropy, terms = impl.policy_loss(inp, cfg, return_entropy, grad)
        return terms.loss, (logp, entropy, terms, None)

    loss, (logp, entropy, terms, sum_sq) = with_known_grad(
        logits, inp.logits, inplace, inp.flat_input, compute, inp.grad_scale
    )
    sum_pi_squared = None
    if sharp is not None:
        sum_pi_squared = torch.where(inp.valid, output.sum_pi_squared_of(logp, sharp), 0.0)
    elif sum_sq is not None:
        sum_pi_squared = torch.where(inp.valid, sum_sq, 0.0)
    if inp.flat_input:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
        sum_pi_squared = None if sum_pi_squared is None else sum_pi_squared[0]
    return LossOutput(
        loss=loss,
        logp=logp,
        entropy=entropy,
        metrics=terms.metrics,
        sum_pi_squared=sum_pi_squared,
    )


def token_logprobs(
    logits,
    labels,
    temperature=1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    top_k=None,
    top_p=None,
    min_p=None,
    *,
    transform: LogitTransform | None = None,
    return_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`fusedrl.token_logprobs` on one process; `return_sum_pi_squared` only where the kernel
    sums the squares itself (`sums_squares_in_kernel`)."""
    logits = check_logits(logits)
    labels = check_labels(labels, logits, None)
    sampling = check_sampling(top_k, top_p, min_p)
    flat = logits.dim() == 2
    temperature = check_temperature_arg(temperature, tuple(labels.shape), logits.device, flat)
    impl = backends.resolve(backend, logits.device)
    logits3 = logits.unsqueeze(0) if flat else logits
    labels2 = labels.unsqueeze(0) if flat else labels
    if return_sum_pi_squared:
        check_sum_pi_squared(sampling.active)
        logp, entropy, sum_sq = impl.token_logprobs_squares(
            logits3, labels2, temperature, return_entropy, **transform_keyword(transform)
        )
        if flat:
            return logp[0], None if entropy is None else entropy[0], sum_sq[0]
        return logp, entropy, sum_sq
    extra = {"sampling": sampling} if sampling.active else {}
    extra.update(transform_keyword(transform))
    logp, entropy = impl.token_logprobs(logits3, labels2, temperature, return_entropy, **extra)
    if flat:
        logp = logp[0]
        entropy = None if entropy is None else entropy[0]
    return logp, entropy


def transform_keyword(transform: LogitTransform | None) -> dict:
    return {} if transform is None else {"transform": transform}
