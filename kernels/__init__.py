"""Triton kernels of fusedrl, installed as `fusedrl.kernels` (DESIGN section 5).

    rows.py         the per-row sweeps every kernel is made of (online lse / entropy, the
                    gradient write, the soft cap, the per-row temperature)
    launch.py       the launch policy of the row kernels: tiles, warps, register cap, programs
    logprobs.py     token log-probs + entropy (the no-grad path, sequence-level pass 1) and the
                    gradient sweep (token_logprobs backward, pass 2)
    token_loss.py   the fused token-level policy loss: one kernel writes logp and the gradient
    split_rows.py   the same loss with each row split over co-resident programs that exchange
                    their slices' sums: one read and one write of the logits (opt-in)
    terms.py        the per-token loss terms both loss kernels evaluate (ratio, clip, KL)
    token_args.py   the loss kernels' arguments by name (TokenLossArgs), one object from the
                    driver to every launcher, and the custom ops' schemas made from it
    sequence_terms.py  a two-pass call's terms on [B, T] log-probs (GSPO's sequence ratio)
    loss_sums.py    the loss kernels' per-program sums of loss and metrics, and their finalize
    two_rows.py     two distributions per token (exact KL, distillation): both rows in one pass
    linear_loss.py  the LM head and the log-softmax fused: logits tiles made on chip
    sampling.py     sampling-mask replay: each row's sampled set by a radix select
    scale.py        the gradient scaled by the upstream one in place, unless that is 1
    device.py       every launch on the device of the tensors it reads
    aot.py          every launch variant compiled ahead of time (no GPU needed): registers,
                    spills, 128-bit loads and the instruction budget read from the SASS
    cuda.py         the CUDA C++ extension's loader (csrc/; imports without triton)

They are launched through `fusedrl.triton_backend` (torch custom ops) and `fusedrl.linear_triton`.
`aot` compiles for sm_80, sm_90, sm_100 and sm_120 with the ptxas Triton ships.

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
