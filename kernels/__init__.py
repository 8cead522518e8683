"""Triton kernels of fusedrl, installed as `fusedrl.kernels` (DESIGN section 5).

- `rows`: the per-row sweeps every kernel is made of (online lse/entropy; gradient write).
- `logprobs`: token log-probs + entropy (no-grad fast path, sequence-level pass 1) and the
  gradient sweep (token_logprobs backward, sequence-level pass 2).
- `token_loss`: the fused token-level policy loss (one kernel writes logp and the gradient).

They are launched through `fusedrl.triton_backend`, which registers them as torch custom ops.
"""
