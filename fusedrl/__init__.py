"""fusedrl: fused GRPO-family policy losses that read the logits once.

import fusedrl
cfg = fusedrl.LossConfig.preset("dapo")
out = fusedrl.policy_loss(logits, labels, advantages, mask, old_logp=old, config=cfg)
out.loss.backward()
"""

import fusedrl.advantages as advantages
import fusedrl.reference as reference

from .api import PolicyLoss, policy_loss, token_logprobs
from .backends import BACKENDS, LINEAR_BACKENDS
from .batch_stats import batch_statistics_over
from .config import PRESETS, LossConfig
from .distill import DISTILL_KINDS, distill_loss
from .distill.linear import linear_distill_loss
from .linear import linear_policy_loss, linear_token_logprobs
from .output import LossOutput

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DISTILL_KINDS",
    "LINEAR_BACKENDS",
    "PRESETS",
    "LossConfig",
    "LossOutput",
    "PolicyLoss",
    "advantages",
    "batch_statistics_over",
    "distill_loss",
    "linear_distill_loss",
    "linear_policy_loss",
    "linear_token_logprobs",
    "policy_loss",
    "reference",
    "token_logprobs",
]
