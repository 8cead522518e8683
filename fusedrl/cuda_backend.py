"""`backend="cuda"`: the CUDA C++ extension (csrc/), driven exactly like the Triton backend.

The ops are loaded (or JIT-built) on first use by `fusedrl.kernels.cuda.load()`.
"""

from __future__ import annotations

from . import fused_backend

# backends.Backend: the extension's kernels sum no pi^2 (one more read at half the temperature)
SUMS_PI_SQUARED_IN_PASS = False
READS_RAW_ROWS = False  # backends.Backend
_OPS = None


def _ops():
    # A plain global after the first call, so torch.compile sees a constant, not a loader.
    global _OPS
    if _OPS is None:
        from fusedrl.kernels import cuda

        _OPS = cuda.load()
    return _OPS


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
