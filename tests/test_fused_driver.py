"""The fused driver's decisions, tested directly (fusedrl/fused_backend.py): which configs take
the single fused kernel and which the two passes (`needs_two_passes`), and the arguments the
fused op receives (`fused_token_args`, in FUSED_ARGS's order)."""

from __future__ import annotations

import pytest
import torch

from fusedrl import LossConfig
from fusedrl._inputs import prepare_loss_inputs
from fusedrl.fused_backend import FUSED_ARGS, fused_token_args, needs_two_passes

from .conftest import make_batch

ARG_NAMES = [part.split()[-1] for part in FUSED_ARGS.split(", ")]


def _inputs(cfg: LossConfig, *, old: bool = True, entropy_coef=None, is_weights=False):
    data = make_batch(vocab=67, seed=2)
    return prepare_loss_inputs(
        data["logits"], data["labels"], data["advantages"], data["mask"],
        data["old_logp"] if old else None, data["ref_logp"], data["rollout_logp"], cfg, None,
        torch.ones(data["labels"].shape) if is_weights else None, entropy_coef=entropy_coef,
    )  # fmt: skip


@pytest.mark.parametrize(
    "config, old, two_passes",
    [
        (LossConfig.preset("dapo"), True, False),  # token-level: one kernel
        (LossConfig.preset("cispo"), True, False),
        (LossConfig.preset("grpo", beta=0.04, kl="k3"), True, False),  # a KL estimate fits
        (LossConfig.preset("dapo"), False, False),  # on-policy with constant bounds
        (LossConfig.preset("gspo"), True, True),  # a sequence-level ratio
        (LossConfig.preset("gmpo"), True, True),  # a sequence objective
        (LossConfig.preset("dapo", top_entropy_quantile=0.5), True, True),  # a batch quantile
        (LossConfig.preset("dcpo"), False, True),  # bounds from old = logp: after pass 1
        (LossConfig.preset("dcpo"), True, False),
        (LossConfig.preset("dapo", is_correction="token_truncate", is_cap=2.0), False, True),
        (LossConfig.preset("grpo", beta=0.04, kl="k3", kl_bias_correction=True), True, True),
        (LossConfig.preset("dapo", m2po_tau=0.04), True, True),  # a batch statistic of logp
        (LossConfig.preset("dapo", entropy_coef=0.01, entropy_agg="token-mean"), True, True),
        (LossConfig.preset("dapo", entropy_coef=0.01), True, False),  # the kernel's own bonus
    ],
)
def test_which_configs_take_two_passes(config, old, two_passes):
    assert needs_two_passes(_inputs(config, old=old), config) is two_passes


def test_the_fused_op_gets_its_arguments_in_order():
    """FUSED_ARGS's order: per-token tensors, then the scalars, as the config says them."""
    cfg = LossConfig.preset("dapo", dual_clip_c=3.0, entropy_coef=0.01)
    inp = _inputs(cfg, is_weights=True)
    args = dict(zip(ARG_NAMES, fused_token_args(inp, cfg), strict=True))
    assert args["labels"] is inp.labels and args["valid"] is inp.valid
    assert args["old_logp"] is inp.old_logp and args["is_weight"] is inp.is_weights
    assert torch.equal(args["low"], torch.full_like(inp.mask, 1 - cfg.eps_low))
    assert torch.equal(args["high"], torch.full_like(inp.mask, 1 + cfg.eps_high))
    # token-mean: each counted token's weight is its mask over the counted tokens' mask sum
    weights = torch.where(inp.valid, inp.mask, 0.0)
    torch.testing.assert_close(args["agg_weight"], weights / weights.sum())
    assert args["loss"] == "ppo" and args["dual_clip_c"] == 3.0 and args["kl"] is None
    assert args["temperature"] == cfg.temperature and args["entropy_coef"] == 0.01
    assert args["beta"] == 0.0


def test_the_fused_op_gets_dcpo_bounds_per_token_and_a_flushed_subnormal():
    """DCPO's bounds come from old per token; a config number below fp32's normal range reaches
    the kernel as 0 (an fp64 kernel variant otherwise: `kernel_float`)."""
    cfg = LossConfig.preset("dcpo", entropy_coef=1e-310)
    inp = _inputs(cfg)
    args = dict(zip(ARG_NAMES, fused_token_args(inp, cfg), strict=True))
    assert args["loss"] == "dcpo"  # (the kernels read its bounds per token, as PPO's)
    assert not torch.equal(args["low"], args["low"].flatten()[0].expand_as(args["low"]))
    assert args["entropy_coef"] == 0.0
