"""Decoupled PPO (AReaL; asynchronous RL): `policy_loss(..., prox_logp=)` takes the ratio and its
clip against the proximal policy and weights each token by pi_prox / pi_behav (old_logp being the
behaviour policy's), 0 above `LossConfig.decoupled_is_cap`.

Every backend against the oracle on token-level (the fused kernel: prox in old's place, the
behaviour weight as an IS weight) and sequence-level losses, the LM-head form; AReaL's
`ppo_actor_loss_fn` written out here; prox_logp == old_logp is the plain loss bit for bit; the
misuse errors."""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import (
    BACKENDS,
    LOGITS_BACKENDS,
    make_batch,
    run_loss,
)


def _data(seed=0):
    """old_logp is the behaviour policy (the sampler, some steps stale); prox_logp the policy
    the trainer recomputed before the update, between it and the current one."""
    data = make_batch(vocab=131, seed=seed, per_token_adv=True)
    with torch.no_grad():
        now = torch.log_softmax(data["logits"].float(), -1).gather(-1, data["labels"][..., None])
    gen = torch.Generator().manual_seed(seed + 1)
    prox = now[..., 0] + 0.1 * torch.randn(data["labels"].shape, generator=gen)
    data["old_logp"] = prox + 0.6 * torch.randn(prox.shape, generator=gen)  # stale sampler
    data["prox_logp"] = prox
    del data["ref_logp"]
    return data


CASES = {
    "dapo-capped": LossConfig.preset("dapo", decoupled_is_cap=1.5),  # fused, some dropped
    "gspo": LossConfig.preset("gspo", decoupled_is_cap=2.0),  # two passes
    "cispo": LossConfig.preset("cispo"),  # no cap
}


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_backend_equals_the_oracle(case, backend):
    data, cfg = _data(seed=len(case)), CASES[case]
    ours, grad = run_loss(fusedrl.policy_loss, data, config=cfg, backend=backend)
    want, want_grad = run_loss(reference.policy_loss, data, config=cfg)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ours.metrics["is_weight_mean"], want.metrics["is_weight_mean"])
    # the weight acted: another loss than the plain one on the same old_logp
    plain, _ = run_loss(fusedrl.policy_loss, dict(data, prox_logp=None), config=cfg)
    assert (plain.loss - ours.loss).abs() > 1e-4
    if cfg.decoupled_is_cap is not None and case != "gspo":
        assert 0 < ours.metrics["is_masked"] < 1  # the cap dropped some tokens


@pytest.mark.parametrize("cap", [None, 1.5])
def test_equals_areals_actor_loss(cap):
    """AReaL's ppo_actor_loss_fn (token level, clip 0.2 / 0.28, no dual clip): the ratio against
    prox, max(-A r, -A clip(r)) times exp(prox - old) (0 above the cap), summed over the loss mask
    and divided by its count: fusedrl's dapo-shaped config with token-mean."""
    data = _data(seed=9)
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, decoupled_is_cap=cap)
    ours, grad = run_loss(fusedrl.policy_loss, data, config=cfg, backend="torch")
    logits = data["logits"].clone().requires_grad_(True)
    logp, _ = reference.token_logprobs(logits, data["labels"])
    mask, adv = data["mask"], data["advantages"]
    ratio = torch.where(mask, torch.exp(logp - data["prox_logp"]), 0.0)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    weight = torch.exp(data["prox_logp"] - data["old_logp"])
    if cap is not None:
        weight = torch.where(weight <= cap, weight, 0.0)
    areal = torch.where(mask, pg * weight, 0.0).sum() / mask.sum()
    (areal_grad,) = torch.autograd.grad(areal, logits)
    torch.testing.assert_close(ours.loss, areal, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, areal_grad, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_prox_equal_to_old_is_the_plain_loss(backend):
    data = _data(seed=3)
    cfg = LossConfig.preset("dapo")
    same = dict(data, prox_logp=data["old_logp"])
    ours, grad = run_loss(fusedrl.policy_loss, same, config=cfg, backend=backend)
    plain, plain_grad = run_loss(
        fusedrl.policy_loss, dict(data, prox_logp=None), config=cfg, backend=backend
    )
    torch.testing.assert_close(ours.loss, plain.loss, atol=0, rtol=0)
    torch.testing.assert_close(grad, plain_grad, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lm_head_form(backend):
    data = _data(seed=5)
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    rows = {k: v for k, v in data.items() if k != "logits"}
    cfg = LossConfig.preset("dapo", decoupled_is_cap=1.5)
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    ours = fusedrl.linear_policy_loss(*leaves, **rows, config=cfg, backend=backend)
    grads = torch.autograd.grad(ours.loss, leaves)
    oracle = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    want = reference.policy_loss(oracle[0] @ oracle[1].T, **rows, config=cfg)
    for got, expected in zip(grads, torch.autograd.grad(want.loss, oracle)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_misuse_is_named():
    data = _data(seed=1)
    with pytest.raises(ValueError, match="prox_logp .* needs old_logp"):
        fusedrl.policy_loss(**dict(data, old_logp=None))
    with pytest.raises(ValueError, match="is_correction='token_truncate' both weight"):
        fusedrl.policy_loss(
            **dict(data, rollout_logp=data["old_logp"]),
            config=LossConfig(is_correction="token_truncate"),
        )
    with pytest.raises(ValueError, match="loss='gmpo' weights whole sequences"):
        fusedrl.policy_loss(**data, config=LossConfig.preset("gmpo"))
    with pytest.raises(ValueError, match="decoupled_is_cap must be > 1"):
        LossConfig(decoupled_is_cap=0.5)
    with pytest.raises(ValueError, match=r"prox_logp shape"):
        fusedrl.policy_loss(**dict(data, prox_logp=data["prox_logp"][:, :3]))
    with pytest.raises(NotImplementedError, match="prox_logp .* tensor parallelism"):
        fusedrl.policy_loss(**data, vocab_start=0)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_the_behaviour_log_weight_is_clamped_alike_in_the_oracle(backend):
    """log(pi_prox / pi_behav) beyond +-20 (a token the sampler gave e^-25 of the proximal
    policy's probability, and one the other way round): clamped at +-20 before the exp, in the
    library and in the oracle alike."""
    data = _data(seed=4)
    valid = data["mask"].nonzero()
    high, low = tuple(valid[0].tolist()), tuple(valid[-1].tolist())
    data["old_logp"][high] = data["prox_logp"][high] - 25.0
    data["old_logp"][low] = data["prox_logp"][low] + 25.0
    cfg = LossConfig.preset("dapo")
    ours, grad = run_loss(fusedrl.policy_loss, data, config=cfg, backend=backend)
    want, want_grad = run_loss(reference.policy_loss, data, config=cfg)
    torch.testing.assert_close(ours.loss, want.loss, atol=0, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-3, rtol=1e-5)
    clamped = dict(data, old_logp=data["old_logp"].clone())
    clamped["old_logp"][high] = data["prox_logp"][high] - 20.0
    clamped["old_logp"][low] = data["prox_logp"][low] + 20.0
    at_the_clamp, _ = run_loss(reference.policy_loss, clamped, config=cfg)
    torch.testing.assert_close(want.loss, at_the_clamp.loss, atol=0, rtol=1e-6)
