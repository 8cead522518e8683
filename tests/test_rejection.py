"""verl's rollout rejection sampling (LossConfig.rejection / rejection_threshold) in the core.

Agreement with the reference for every backend is in test_backends / test_linear
(REJECTION_OPTIONS); parity with verl's own compute_rollout_rejection_mask in
test_verl_integration. Here: every option acts on the test data, rejected tokens leave the loss
and its denominators, on-policy calls, an all-rejected batch, the metrics, and bad input.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS, make_batch, run_loss
from .test_backends import REJECTION_OPTIONS


def _impl(backend):
    def call(*args, **kwargs):
        return fusedrl.policy_loss(*args, backend=backend, **kwargs)

    return call


@pytest.mark.parametrize("name", sorted(REJECTION_OPTIONS))
def test_every_option_rejects_some_tokens_not_all(name):
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    cfg = REJECTION_OPTIONS[name]
    out, _ = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    for rule in cfg.rejection_rules:
        assert 0 < out.metrics[f"rs_{rule.option}_masked"] < 1, rule.option
    assert 0 < out.metrics["rs_masked"] < 1 and 0 < out.metrics["rs_masked_seqs"] <= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(REJECTION_OPTIONS))
def test_on_policy_measures_the_current_log_probs(name, backend):
    """Without old_logp the statistic is log(pi / pi_rollout) of this call (verl's bypass mode):
    the fused backends take two passes."""
    data = make_batch(batch=4, time=9, vocab=523, seed=5, per_token_adv=True)
    data["old_logp"] = None
    # The rollout's log-probs near this call's own (the batch's are near old's, ~0.4 away: every
    # token would be rejected and the loss and its gradient compared at 0).
    with torch.no_grad():
        labels = torch.where(data["mask"], data["labels"], 0)
        current, _ = reference.token_logprobs(data["logits"], labels)
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(6))
    data["rollout_logp"] = current + 0.2 * noise
    cfg = REJECTION_OPTIONS[name]
    ours, grad = run_loss(_impl(backend), data, cfg, return_entropy=True)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    assert float(ref.metrics["rs_masked"]) < 1 and ref_grad.abs().sum() > 0, ref.metrics
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    assert set(ours.metrics) == set(ref.metrics)
    for key in ref.metrics:
        torch.testing.assert_close(ours.metrics[key], ref.metrics[key], atol=1e-5, rtol=1e-5)


def test_rejected_tokens_leave_the_loss_and_its_denominator():
    """The loss with rejection equals the loss without it on the mask verl would return."""
    data = make_batch(batch=4, time=9, vocab=523, seed=6, per_token_adv=True)
    cfg = LossConfig(rejection="token_k1", rejection_threshold="0.75_1.3")
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    log_r = data["old_logp"] - data["rollout_logp"]
    kept = (
        data["mask"]
        & (-log_r >= torch.log(torch.tensor(0.75)))
        & (-log_r <= torch.log(torch.tensor(1.3)))
    )
    assert 0 < kept.sum() < data["mask"].sum()
    by_mask, mask_grad = run_loss(
        fusedrl.policy_loss, dict(data, mask=kept), LossConfig(), backend="torch"
    )
    torch.testing.assert_close(ours.loss, by_mask.loss)
    torch.testing.assert_close(grad, mask_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_everything_rejected_is_zero_not_nan(backend):
    data = make_batch(batch=3, time=7, vocab=211, seed=7)
    cfg = LossConfig.preset("grpo", rejection="seq_max_k3", rejection_threshold=1e-9)
    out, grad = run_loss(_impl(backend), data, cfg)
    assert out.loss == 0 and (grad == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert out.metrics["rs_masked"] == 1


def test_an_empty_batch_has_finite_metrics():
    data = make_batch(batch=0, time=5, vocab=97, seed=8)
    cfg = LossConfig(rejection="token_k1,seq_max_k2", rejection_threshold="2,0.1")
    out, _ = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    assert out.loss == 0 and all(torch.isfinite(v) for v in out.metrics.values())


def test_bad_input_names_the_argument():
    data = make_batch(seed=9)
    cfg = LossConfig(rejection="token_k1", rejection_threshold=2.0)
    with pytest.raises(ValueError, match="rollout_logp is required when config.rejection"):
        run_loss(fusedrl.policy_loss, dict(data, rollout_logp=None), cfg)
    flat = {
        k: (v[0] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v) for k, v in data.items()
    }
    flat["advantages"] = data["advantages"][0].expand(data["labels"].shape[1])
    seq = LossConfig(rejection="seq_mean_k1", rejection_threshold=2.0)
    with pytest.raises(ValueError, match="carry no sequence boundaries"):
        run_loss(fusedrl.policy_loss, flat, seq)
    run_loss(fusedrl.policy_loss, flat, cfg)  # token options need no sequences
    for kwargs, message in [
        (dict(rejection="token_k1"), "needs rejection_threshold"),
        (dict(rejection="seq_max_k1", rejection_threshold=2.0), "is not one of"),
        (dict(rejection="token_k2", rejection_threshold="0.1_0.2"), "one upper bound"),
        (dict(rejection="token_k1", rejection_threshold="2_0.5"), "lower bound exceeds"),
        (dict(rejection="token_k1,token_k2", rejection_threshold="1,2,3"), "one per option"),
        (dict(rejection_threshold=2.0), "rejection is None"),
        (dict(rejection="token_k1", rejection_threshold="-1"), "must be finite and > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            LossConfig(**kwargs)
