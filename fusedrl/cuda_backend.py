"""`backend="cuda"`: the CUDA C++ extension (csrc/), driven exactly like the Triton backend.

The ops are loaded (or JIT-built) on first use by `fusedrl.kernels.cuda.load()`; `fused_ops`
makes the driver's `FusedOps` of them (with the Triton ops csrc/ has no counterpart of).
"""

from __future__ import annotations

import importlib.util

import fusedrl.fused_backend as fused_backend

# backends.Backend: the extension's kernels sum no pi^2 (one more read at half the temperature)
SUMS_PI_SQUARED_IN_PASS = False
READS_RAW_ROWS = False  # backends.Backend
_OPS = None


def _ops():
    # A plain global after the first call, so torch.compile sees a constant, not a loader.
    global _OPS
    if _OPS is None:
        from fusedrl.kernels import cuda

        ops = cuda.load()
        _OPS = fused_ops(
            ops.cuda_logprobs_fwd.default,
            ops.cuda_logits_grad.default,
            ops.cuda_fused_token_loss.default,
            ops.cuda_fused_token_loss_inplace.default,
        )
    return _OPS


def fused_ops(logprobs_fwd, logits_grad, fused_token_loss, fused_token_loss_inplace):
    """The extension's four ops (csrc/bindings.cpp's signatures) as the driver's `FusedOps`:
    the fused pair through `kernels.cuda.by_name`, and the Triton ops csrc/ has no counterpart
    of beside them."""
    from fusedrl.kernels.cuda import by_name

    return fused_backend.FusedOps(
        logprobs_fwd,
        logits_grad,
        *by_name(fused_token_loss, fused_token_loss_inplace),
        _from_triton("sampled_set"),
        two_rows=_from_triton("TWO_ROWS"),
        **triton_terms(),
    )


def triton_terms() -> dict:
    """The Triton ops on [B, T] scalars that csrc/ has no counterpart of, as `FusedOps` fields:
    the two-pass terms kernel, the sums' finalize and the aggregation weights (a two-pass call
    is then the extension's two passes and three small launches, not torch's [B, T] terms);
    none where triton is not installed. The extension's fused op keeps no sums
    (`FusedOps.fused_sums` False): its token-level calls take `token_terms`."""
    if importlib.util.find_spec("triton") is None:
        return {}
    import fusedrl.triton_backend as triton_backend

    triton = triton_backend.OPS
    return {
        "token_loss_sums": triton.token_loss_sums,
        "sum_slots": triton.sum_slots,
        "aggregation_weights": triton.aggregation_weights,
        "sequence_terms": triton.sequence_terms,
    }


def _from_triton(name: str):
    """A Triton op that csrc/ has no counterpart of (the sampled-set select, `sampled_set`; the
    two-row kernels of the exact KL and distillation, `TWO_ROWS`): used where triton is
    installed; else None (the select falls back to fusedrl.sampling's torch one, the exact KL and
    distillation are refused with a message)."""
    if importlib.util.find_spec("triton") is None:
        return None
    import fusedrl.triton_backend as triton_backend

    return getattr(triton_backend, name)


def policy_loss(inp, cfg, need_entropy, grad_out):
    return fused_backend.policy_loss(_ops(), inp, cfg, need_entropy, grad_out)


def planned_call(inp, cfg, need_entropy):
    return fused_backend.planned_call(_ops(), inp, cfg, need_entropy)


def terms(logp, entropy, inp, cfg, need_entropy):
    return fused_backend.terms(_ops(), logp, entropy, inp, cfg, need_entropy)


def token_logprobs(logits, labels, temperature, return_entropy, sampling=None, transform=None):
    return fused_backend.token_logprobs(
        _ops(), logits, labels, temperature, return_entropy, sampling, transform
    )
