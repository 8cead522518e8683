"""Tensor parallelism: the fused loss on vocab-sharded logits, with one collective per forward.

Under tensor parallelism the LM head is split over the vocabulary: rank r holds logits
[B, T, V_r] for the global token ids [start_r, start_r + V_r). `fusedrl.policy_loss(...,
tp_group=group)` and `fusedrl.token_logprobs(..., tp_group=group)` take that slice and the global
labels; outputs are the same on every rank, gradients are each rank's slice. (This package's
`policy_loss` / `linear_policy_loss` are the family those entry points call: they take the
rollout inputs and model head as fusedrl/arguments.py's objects.)

    shard.py   the vocab layout (starts, sizes, padding) and labels as a rank sees them
    header.py  the per-call header: what ranks must agree on, checked alike on every rank
    comm.py    the collectives (all-gather, all-reduce) and the group's rank / size
    ops.py     the two row ops of each backend on a slice (statistics, gradient)
    merge.py   whole-row logp / lse / entropy from the ranks' slice statistics
    rows.py    the forward sweep + the one all-gather, and the backward sweep (no collective)
    sampling.py  sampling-mask replay: each row's sampled set by radix selects over the group
    loss.py    policy_loss / token_logprobs
    linear.py  linear_policy_loss / linear_token_logprobs (the LM head's rows [V_r, H])
    dtensor.py DTensor logits sharded on the vocab: the local shard and the mesh's group

Cost per call (docs/tensor_parallel.md): the header (one all-gather of 24 int64 per rank), then
one all-gather of 3 fp32 per token per rank in the forward; none in the backward (the LM-head
forms: one all-reduce of the [N, H] input gradient). Sampling-mask replay adds its selects'
all-reduces (at most 256 fp32 per token each; 4 per filter).
"""

import fusedrl.tp.sampling as sampling

from .header import TensorParallelInputError
from .linear import linear_policy_loss, linear_token_logprobs
from .loss import policy_loss, token_logprobs
from .merge import PARTIALS
from .shard import VocabShard

__all__ = [
    "PARTIALS",
    "TensorParallelInputError",
    "VocabShard",
    "linear_policy_loss",
    "linear_token_logprobs",
    "policy_loss",
    "sampling",
    "token_logprobs",
]
