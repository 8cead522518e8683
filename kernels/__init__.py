"""Triton kernels of fusedrl, installed as `fusedrl.kernels` (DESIGN section 5).

- `rows`: the per-row sweeps every kernel is made of (online lse/entropy; gradient write).
- `logprobs`: token log-probs + entropy (no-grad fast path, sequence-level pass 1) and the
  gradient sweep (token_logprobs backward, sequence-level pass 2).
- `token_loss`: the fused token-level policy loss (one kernel writes logp and the gradient).

They are launched through `fusedrl.triton_backend`, which registers them as torch custom ops.
`aot` compiles every launch variant ahead of time for sm_80/sm_90 (no GPU needed).

Supported Triton: OLDEST_TRITON to NEWEST_TRITON, both compiled in CI.
"""

import functools
import warnings

OLDEST_TRITON = (3, 6)
NEWEST_TRITON = (3, 9)


@functools.cache
def check_triton_version() -> None:
    """Raise on a Triton older than supported, warn on a newer one than tested. Not run at import:
    `fusedrl.kernels.cuda` (the CUDA extension's loader) must import without triton."""
    import triton

    version = triton.__version__
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if release < OLDEST_TRITON:
        raise ImportError(
            f"fusedrl.kernels needs triton>={'.'.join(map(str, OLDEST_TRITON))} "
            f"(found {version}); upgrade triton or use backend='torch'"
        )
    if release > NEWEST_TRITON:
        warnings.warn(
            f"triton {version} is newer than the newest version fusedrl's kernels are compiled "
            f"against in CI ({'.'.join(map(str, NEWEST_TRITON))}); check with "
            "`python -m fusedrl.kernels.aot`",
            stacklevel=2,
        )

