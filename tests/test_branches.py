"""Every option of the loss, on data where it provably acts, for each backend against the oracle.

Random data leaves whole branches idle (no token beyond a dual-clip cap, no |log-ratio| above 20,
symmetric eps), and a test whose branch never runs cannot fail. Each case here builds its data so
that the branch runs, asserts that it did (a metric or the data itself), then compares loss,
gradient, logp and metrics with `fusedrl.reference`.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import LOGITS_BACKENDS, make_batch, needs_interpreter, run_loss


def _data(seed=0, batch=4, time=6, vocab=131, per_token_adv=True, empty_rows=()):
    data = make_batch(
        batch=batch,
        time=time,
        vocab=vocab,
        seed=seed,
        per_token_adv=per_token_adv,
        empty_rows=empty_rows,
    )
    data["mask"][:, :3] = True  # every sequence has at least 3 counted tokens
    with torch.no_grad():
        logp, _ = reference.token_logprobs(data["logits"], data["labels"])
    return data, logp


def _compare(data, cfg, backend, **kwargs):
    ours, grad = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend=backend, **k), data, cfg, **kwargs
    )
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, **kwargs)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-5, rtol=1e-5)
    assert set(ours.metrics) == set(ref.metrics)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-5, rtol=1e-5, msg=key)
    return ref


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_dual_clip_caps_negative_advantages(backend):
    data, logp = _data(seed=1)
    data["advantages"] = -data["advantages"].abs()  # all A < 0
    data["old_logp"] = logp - torch.tensor([2.0, 0.0, 0.05, -0.3, 1.5, 0.0]).expand_as(logp)
    ref = _compare(data, LossConfig(dual_clip_c=3.0), backend)
    assert ref.metrics["dual_clipfrac"] > 0  # ratios e^2, e^1.5 > c = 3 with A < 0


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_delta_caps_the_unclipped_ratio(backend):
    data, logp = _data(seed=2)
    data["old_logp"] = logp - torch.tensor([1.5, 0.0, 0.1, -0.5, 2.0, 0.2]).expand_as(logp)
    cfg = LossConfig(delta=3.0)
    ratio = (logp - data["old_logp"]).exp()
    acted = (data["advantages"] < 0) & (ratio > cfg.delta) & data["mask"]
    assert acted.any()
    _compare(data, cfg, backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_asymmetric_eps_with_tokens_beyond_both_bounds(backend):
    data, logp = _data(seed=3)
    data["old_logp"] = logp - torch.tensor([0.5, -0.5, 0.05, 0.0, 0.3, -0.3]).expand_as(logp)
    adv = data["advantages"]
    adv[:, 0] = adv[:, 0].abs()  # beyond the high bound with A > 0
    adv[:, 1] = -adv[:, 1].abs()  # beyond the low bound with A < 0
    ref = _compare(data, LossConfig(eps_low=0.1, eps_high=0.3), backend)
    assert ref.metrics["clip_low"] > 0 and ref.metrics["clip_high"] > 0


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_log_ratio_clamp_at_20(backend):
    data, logp = _data(seed=4)
    data["old_logp"] = logp.clone()
    data["old_logp"][0, 0] = logp[0, 0] + 25.0  # log-ratio -25: clamped to -20, no gradient
    data["old_logp"][1, 1] = logp[1, 1] - 21.0  # +21
    data["old_logp"][2, 2] = logp[2, 2] + 19.5  # inside: gradient flows
    assert ((logp - data["old_logp"]).abs() > 20).sum() == 2
    _compare(data, LossConfig(loss="sapo"), backend)
    _compare(data, LossConfig(), backend)


@pytest.mark.parametrize("kind", ["k3", "k3+", "k1", "k2", "abs", "k1+"])
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_kl_clamps_act(kind, backend):
    data, logp = _data(seed=5)
    # (no token at logp == ref exactly: abs's kink, where a last-bit difference in logp between
    # implementations legitimately flips the sign of the gradient)
    data["ref_logp"] = logp + torch.tensor([25.0, 3.0, -25.0, 0.5, -0.5, 0.01]).expand_as(logp)
    delta = logp - data["ref_logp"]
    assert (delta.abs() > 20).any()  # k3's log clamp
    raw = (-delta).clamp(-20, 20).exp() + delta.clamp(-20, 20) - 1
    assert (raw > 10).any()  # k3's value clamp
    _compare(data, LossConfig(kl=kind, beta=0.1), backend)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(kl="k3", beta=0.1, kl_clamp=False),  # token level: two passes, torch terms
        LossConfig(kl="k3+", beta=0.1, kl_clamp=False),
        LossConfig(kl="k3", beta=0.1, kl_clamp=False, kl_bias_correction=True),
        LossConfig.preset("gspo", beta=0.1, kl="k3", kl_clamp=False),
    ],
    ids=["k3", "k3+", "k3-bias-corrected", "gspo-k3"],
)
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_unclamped_k3_as_trl_writes_it(cfg, backend):
    """kl_clamp=False (TRL's k3): exp(ref - logp) - (ref - logp) - 1 with no clamp, its value
    and gradient past verl's +-10, on every backend against the oracle; the clamped loss
    differs on the same data (the clamp would have acted)."""
    data, logp = _data(seed=15)
    data["ref_logp"] = logp + torch.tensor([5.0, 3.0, -12.0, 0.5, -0.5, 0.01]).expand_as(logp)
    ref = _compare(data, cfg, backend)
    gap = data["ref_logp"][0, 0] - logp[0, 0]
    assert math.isclose(math.exp(gap) - gap - 1, 142.41, rel_tol=1e-3)  # > 10: past the clamp
    clamped, _ = run_loss(reference.policy_loss, data, cfg.replace(kl_clamp=True))
    assert float(ref.metrics["kl"]) > float(clamped.metrics["kl"]) + 1.0


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_fractional_float_mask(backend):
    data, _ = _data(seed=6)
    weights = torch.rand(data["mask"].shape, generator=torch.Generator().manual_seed(6))
    data["mask"] = torch.where(data["mask"], weights, 0.0)
    data["mask"][0, 0] = 0.0  # a zero weight is a masked token
    assert ((data["mask"] > 0) & (data["mask"] < 1)).sum() > 10
    for agg in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ):
        _compare(data, LossConfig(agg=agg, entropy_coef=0.01), backend)
    # Independently of the shared argument preparation: the weights themselves weight the mean.
    ref = _compare(data, LossConfig(loss="pg"), backend)
    logp = ref.logp.double()
    w, adv = data["mask"].double(), data["advantages"].double()
    expected = (w * -adv * logp).sum() / w.sum()
    torch.testing.assert_close(ref.loss.double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_sequence_is_weights_over_several_tokens(mode, backend):
    data, logp = _data(seed=7)
    data["old_logp"] = logp + 0.05
    data["rollout_logp"] = logp + torch.tensor([0.2, -0.1, 0.15, 0.0, 0.1, -0.2]).expand_as(logp)
    cfg = LossConfig(is_correction=mode, is_cap=1.5)
    ref = _compare(data, cfg, backend)
    log_w = ((data["old_logp"] - data["rollout_logp"]) * data["mask"]).sum(-1)
    assert (data["mask"].sum(-1) >= 3).all() and (log_w.exp() != 1).all()
    assert ref.metrics["is_weight_mean"] != 1


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_kl_penalty_together_with_an_is_correction(backend):
    data, logp = _data(seed=8)
    data["rollout_logp"] = data["old_logp"] + 0.3
    cfg = LossConfig(kl="k3", beta=0.05, is_correction="token_truncate", is_cap=1.2)
    ref = _compare(data, cfg, backend)
    assert ref.metrics["kl"] > 0 and ref.metrics["is_weight_mean"] < 1.2
    # The KL term is not multiplied by the IS weight: the two configs differ by the KL alone.
    no_kl = _compare(data, cfg.replace(beta=0.0, kl=None), backend)
    kl_only = _compare(data, LossConfig(kl="k3", beta=0.05, loss="pg"), backend)
    pg = _compare(data, LossConfig(loss="pg"), backend)
    torch.testing.assert_close(ref.loss - no_kl.loss, kl_only.loss - pg.loss, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_exact_ties_take_the_tie_rule(backend):
    """On policy (old = logp) every ratio is exactly 1: the clipped and unclipped branches tie
    (torch.maximum splits the gradient in half each, which sums to the whole)."""
    data, logp = _data(seed=9)
    data["old_logp"] = None
    ref = _compare(data, LossConfig(dual_clip_c=2.0), backend)
    assert ref.metrics["clipfrac"] == 0
    data["old_logp"] = logp.clone()  # the same ties with an explicit old_logp
    _compare(data, LossConfig(), backend)


def _exactly_known_logp(label_logit, backend, batch=3, time=5, vocab=131, seed=11):
    """Logits whose log-probs every implementation computes exactly: one logit at 0, the label at
    `label_logit` (0 or far below), the rest far below both. Log-softmax is then exactly
    -log(2) (label at 0: p = 1/2) or exactly `label_logit` (p = 0, yet d/dlogit = dlogp), so
    old_logp can put a ratio or log-ratio exactly on a bound."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    other = (labels + torch.randint(1, vocab, (batch, time), generator=gen)) % vocab
    logits = torch.full((batch, time, vocab), -3000.0)
    logits.scatter_(-1, other[..., None], 0.0)
    logits.scatter_(-1, labels[..., None], float(label_logit))
    data = dict(logits=logits, labels=labels, mask=torch.ones(batch, time, dtype=torch.bool))
    logp = torch.full((batch, time), -math.log(2.0) if label_logit == 0 else float(label_logit))
    for got in (
        reference.token_logprobs(logits, labels)[0],
        fusedrl.token_logprobs(logits, labels, backend=backend)[0],
    ):
        assert torch.equal(got, logp)
    return data, logp


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_ratios_exactly_on_the_clip_bounds(backend):
    """r = 2 = 1 + eps_high and r = 1/2 = 1 - eps_low exactly, with A of both signs: clip passes
    the gradient at its bounds (torch.clamp, as verl and TRL), max() of the tied branches gives
    half to each, and the strict clip metrics count none of them."""
    data, logp = _exactly_known_logp(0.0, backend)
    up = torch.tensor([True, False, True, False, True])[None, :].expand_as(logp)
    data["old_logp"] = torch.where(up, 2.0 * logp, torch.zeros_like(logp))  # log r = +-log 2
    data["advantages"] = torch.tensor([[1.0, -1.0, -0.5, 0.5, 2.0]]).expand_as(logp).clone()
    data["advantages"][1] *= -1.0
    cfg = LossConfig(eps_low=0.5, eps_high=1.0)
    ratio = (logp - data["old_logp"]).exp()
    assert torch.equal(ratio, torch.where(up, 2.0, 0.5))  # exactly on the bounds
    ref = _compare(data, cfg, backend)
    assert ref.metrics["clip_low"] == 0 and ref.metrics["clip_high"] == 0
    for c in (2.0, 3.0):  # dual clip exactly at r = c = 2 with A < 0, then beyond r
        _compare(data, cfg.replace(dual_clip_c=c), backend)
    _compare(data, cfg.replace(loss="cispo"), backend)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter,
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # on the p = 0 rows
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_log_ratios_exactly_on_their_clamps(backend):
    """logp = -1000 exactly, so old_logp puts the log-ratio exactly on the +-20 clamp, GMPO's
    [-eps_low, eps_high] and GSPO's sequence cap of 10: each clamp passes the gradient there."""
    data, logp = _exactly_known_logp(-1000.0, backend)
    data["advantages"] = torch.tensor([[-1.0, 1.0, -1.0, 1.0, -0.5]]).expand_as(logp).clone()
    data["old_logp"] = logp - torch.tensor([20.0, -20.0, 19.0, -21.0, 21.0]).expand_as(logp)
    _compare(data, LossConfig(), backend)
    _compare(data, LossConfig(loss="sapo"), backend)
    # GMPO: log-ratios exactly eps_high and -eps_low (both exact binary fractions)
    data["old_logp"] = logp - torch.tensor([0.5, -0.25, 0.5, -0.25, 0.1]).expand_as(logp)
    data["advantages"][1] *= -1.0  # each bound with A of both signs
    ref = _compare(data, LossConfig(loss="gmpo", eps_low=0.25, eps_high=0.5), backend)
    assert ref.metrics["clipfrac"] == 0
    # GSPO: sequence log-ratio exactly 10 (row 0), above it (row 1), below it (row 2); with A < 0
    # the unclipped branch wins, so whether the cap passes the gradient decides the result.
    shift = torch.tensor([[10.0], [10.5], [9.5]]).expand_as(logp)
    data["old_logp"] = logp - shift
    data["advantages"] = -torch.ones_like(logp)
    _compare(data, LossConfig.preset("gspo"), backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_dcpo_bounds_depend_on_the_old_probability(backend):
    data, logp = _data(seed=10)
    data["old_logp"] = logp + torch.tensor([math.log(0.9), -6.0, -0.1, -3.0, 0.0, -9.0]).expand_as(
        logp
    )
    ref = _compare(data, LossConfig.preset("dcpo"), backend)
    assert ref.metrics["clipfrac"] > 0


# ---- tests that kill survivors of the mutation sample (docs/testing.md)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_zero_advantages_gmpo(backend):
    data, logp = _data(seed=7, per_token_adv=False)
    data["advantages"][0] = 0.0  # a group whose rewards all tie: A = 0
    data["old_logp"] = logp + torch.tensor([0.9, -0.9, 0.0, 0.5, -0.5, 0.1]).expand_as(logp)
    _compare(data, LossConfig(loss="gmpo"), backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_zero_advantages_ratio_losses(backend):
    data, logp = _data(seed=8, per_token_adv=False)
    data["advantages"][0] = 0.0
    data["old_logp"] = logp + torch.tensor([2.0, -2.0, 0.0, 0.5, -0.5, 0.1]).expand_as(logp)
    for cfg in (LossConfig(), LossConfig(dual_clip_c=3.0), LossConfig(loss="sapo")):
        _compare(data, cfg, backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_gmpo_fractional_mask(backend):
    data, logp = _data(seed=6)
    weights = torch.rand(data["mask"].shape, generator=torch.Generator().manual_seed(6))
    data["mask"] = torch.where(data["mask"], 0.1 + 0.9 * weights, 0.0)
    _compare(data, LossConfig(loss="gmpo"), backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_log_ratio_21_with_negative_advantage(backend):
    data, logp = _data(seed=4)
    data["old_logp"] = logp.clone()
    data["old_logp"][1, 1] = logp[1, 1] - 21.0
    data["advantages"][1, 1] = -1.0
    _compare(data, LossConfig(), backend)


@needs_interpreter
def test_triton_vocab_above_interpreted_cap():
    data, _ = _data(seed=9, batch=2, time=3, vocab=2500)
    _compare(data, LossConfig(), "triton")


@needs_interpreter
def test_triton_beta_zero_with_kl_and_infinite_ref():
    data, logp = _data(seed=10)
    data["ref_logp"] = logp + 0.3
    data["ref_logp"][0, 0] = float("-inf")
    _compare(data, LossConfig(kl="k2", beta=0.0), "triton")


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_abs_kl_at_its_kink(backend):
    """ref_logp == logp exactly: |delta|'s gradient there is sign(0) = 0 (torch.sign), in every
    backend (random data cannot hit the kink: a last-bit difference flips the sign)."""
    data, logp = _exactly_known_logp(0.0, backend)
    data["advantages"] = torch.ones_like(logp)
    data["ref_logp"] = logp.clone()
    data["ref_logp"][:, 1:] += 0.5  # the other tokens off the kink
    ref = _compare(data, LossConfig(loss="pg", kl="abs", beta=0.5), backend)
    assert ref.metrics["kl"] > 0
