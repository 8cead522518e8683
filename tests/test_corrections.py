"""VESPO, LUSPO, the bias-corrected KL, the off-policy sequence mask and the top-entropy token
selection: each on data where it provably acts, every backend against `fusedrl.reference`, and the
reference's formulas against TRL 1.16's own helpers where TRL has them as functions.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference
from fusedrl.token_terms import masked_quantile

from .conftest import LOGITS_BACKENDS, make_batch, run_loss


def _data(seed=0, batch=6, time=7, vocab=137):
    data = make_batch(batch=batch, time=time, vocab=vocab, seed=seed, empty_rows=(4,))
    data["mask"][[0, 1, 2, 3, 5], :2] = True  # one empty sequence, the others >= 2 tokens
    with torch.no_grad():
        logp, _ = reference.token_logprobs(data["logits"], data["labels"])
    return data, logp


def _compare(data, cfg, backend, **kwargs):
    ours, grad = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend=backend, **k),
        data,
        cfg,
        return_entropy=True,
        **kwargs,
    )
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True, **kwargs)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    assert set(ours.metrics) == set(ref.metrics)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-6, rtol=1e-5, msg=key)
    return ref


def _loss(data, cfg):
    return reference.policy_loss(config=cfg, **data).loss


def _trl():
    pytest.importorskip("trl")
    from fusedrl.integrations.trl import GRPOTrainer

    return GRPOTrainer


# ------------------------------------------------------------------------------------ VESPO
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("is_correction", [None, "token_mask"])
def test_vespo_weights_both_advantage_signs(backend, is_correction):
    data, logp = _data(seed=1)
    # Sequence log-ratios around 0 (phi ~ 1) and far below (phi -> 0); both advantage signs.
    shift = torch.tensor([0.02, -0.05, 0.3, -0.6, 0.0, 0.1])[:, None]
    data["old_logp"] = logp - shift
    data["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.3, -0.2])
    data["rollout_logp"] = data["old_logp"] + 0.2 * torch.randn_like(logp)
    cfg = LossConfig(loss="vespo", is_correction=is_correction, is_cap=1.15)
    ref = _compare(data, cfg, backend)
    assert 0 < ref.metrics["vespo_phi_mean"] < 1.5
    if is_correction is not None:  # some weights masked to 0: each counts as log 1e-8 in phi
        assert ref.metrics["is_weight_mean"] < 1


def test_vespo_phi_is_trls_gamma_weight():
    trainer = _trl()
    data, logp = _data(seed=2)
    data["old_logp"] = logp - torch.tensor([0.02, -0.05, 0.3, -0.6, 0.0, 0.1])[:, None]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.3, -0.2])
    w = torch.rand(logp.shape) + 0.5
    mask = data["mask"].float()
    padded_w = w * mask + 1 - mask  # TRL's ratio is 1 on padding
    phi = trainer.get_gamma_weights(adv[:, None], logp - data["old_logp"], mask, padded_w)
    ours = reference.policy_loss(
        data["logits"],
        data["labels"],
        adv,
        data["mask"],
        data["old_logp"],
        config=LossConfig.preset("vespo", agg="seq-mean-token-sum"),
        normalizer=1.0,
        is_weights=w,
    )
    # Summed per sequence, normaliser 1: loss = -sum_b phi_b A_b sum_t logp_bt.
    expected = -(phi[:, 0] * adv * (logp * mask).sum(-1)).sum()
    torch.testing.assert_close(ours.loss, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ LUSPO
def test_luspo_is_gspo_summed_over_each_sequences_tokens():
    data, _ = _data(seed=3)
    luspo = _loss(data, LossConfig.preset("luspo"))
    explicit = LossConfig(
        ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, agg="seq-mean-token-sum"
    )
    torch.testing.assert_close(luspo, _loss(data, explicit))
    gspo = _loss(data, LossConfig.preset("gspo"))
    assert not torch.allclose(luspo, gspo)  # the per-sequence sum, not the mean


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_luspo_with_a_token_ratio_takes_the_fused_kernel(backend):
    data, _ = _data(seed=4)
    cfg = LossConfig(loss="luspo", ratio_level="token", eps_low=0.1, eps_high=0.1)
    ref = _compare(data, cfg, backend)
    assert ref.metrics["clipfrac"] > 0


# -------------------------------------------------------------------- the bias-corrected KL
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_kl_bias_correction_multiplies_the_kl_by_the_ratio(backend, preset):
    data, logp = _data(seed=5)
    data["old_logp"] = logp - 0.4 * torch.randn_like(logp)  # ratios far from 1
    cfg = LossConfig.preset(preset, kl="k3", beta=0.5, kl_bias_correction=True)
    _compare(data, cfg, backend)
    assert not torch.allclose(_loss(data, cfg), _loss(data, cfg.replace(kl_bias_correction=False)))


def test_kl_bias_correction_gradient_of_the_kl_term():
    """d(beta kl r)/dlogp = beta (dkl r + kl r): the KL term alone (A = 0), token ratio."""
    data, logp = _data(seed=6)
    data["advantages"] = torch.zeros(6)
    data["old_logp"] = logp - 0.3
    cfg = LossConfig(kl="k1", beta=1.0, kl_bias_correction=True, agg="seq-mean-token-sum")
    _, grad = run_loss(reference.policy_loss, data, cfg, normalizer=1.0)
    ratio, kl = (logp - data["old_logp"]).exp(), logp - data["ref_logp"]
    dlogp = torch.where(data["mask"], ratio + kl * ratio, 0.0)  # k1: dkl = 1
    probs = torch.softmax(data["logits"], -1)
    onehot = torch.nn.functional.one_hot(data["labels"], probs.shape[-1])
    torch.testing.assert_close(grad, dlogp[..., None] * (onehot - probs), atol=1e-6, rtol=1e-5)


def test_kl_bias_correction_at_the_sequence_level_differentiates_the_whole_ratio():
    """At ratio_level="sequence" the KL is multiplied by the sequence ratio s_i and, as TRL
    differentiates it, through every token of the sequence: with A = 0, k1 and a per-sequence
    sum, d/dlogp_u = s_i (m_u + m_u / |y_i| sum_t m_t kl_t) (not the per-token s_i (1 + kl_u))."""
    data, logp = _data(seed=6)
    data["advantages"] = torch.zeros(6)
    data["old_logp"] = logp - 0.3 + 0.1 * torch.randn_like(logp)
    cfg = LossConfig(
        kl="k1", beta=1.0, kl_bias_correction=True, agg="seq-mean-token-sum", ratio_level="sequence"
    )
    _, grad = run_loss(reference.policy_loss, data, cfg, normalizer=1.0)
    m = data["mask"].float()
    length = m.sum(-1, keepdim=True).clamp_min(1.0)
    s = (((logp - data["old_logp"]) * m).sum(-1, keepdim=True) / length).exp()
    kl = logp - data["ref_logp"]
    dlogp = s * (m + m / length * (m * kl).sum(-1, keepdim=True))
    probs = torch.softmax(data["logits"], -1)
    onehot = torch.nn.functional.one_hot(data["labels"], probs.shape[-1])
    torch.testing.assert_close(grad, dlogp[..., None] * (onehot - probs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_kl_bias_correction_at_the_sequence_level_on_every_backend(agg, backend):
    """GSPO with TRL's bias-corrected KL: every backend equals the oracle (whose gradient the
    closed form above pins)."""
    data, logp = _data(seed=9)
    data["old_logp"] = logp - 0.3 * torch.randn_like(logp)
    cfg = LossConfig.preset("gspo", kl="k3", beta=0.5, kl_bias_correction=True, agg=agg)
    _compare(data, cfg.replace(eps_low=0.2, eps_high=0.2), backend)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_cispo_and_sapo_take_the_sequence_ratio(loss, backend):
    """ratio_level="sequence" with CISPO (-sg(clip(s_i)) A logp) and SAPO (the soft gate of
    s_i): every backend equals the oracle, the sequence ratio acting (not the token loss; CISPO's
    cap clips some sequences)."""
    data, logp = _data(seed=8)
    # Sequence log-ratios of 0.1, 0.3 (above CISPO's cap, 1.05) and below it, with token noise.
    shift = torch.tensor([0.1, -0.02, 0.3, 0.01, 0.0, -0.2])[:, None]
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(8))
    data["old_logp"] = logp - shift - 0.05 * noise
    cfg = LossConfig(loss=loss, ratio_level="sequence", agg="seq-mean-token-mean", eps_high=0.05)
    ref = _compare(data, cfg, backend)
    assert not torch.allclose(_loss(data, cfg), _loss(data, cfg.replace(ratio_level="token")))
    if loss == "cispo":
        assert 0 < ref.metrics["clipfrac"] < 1


# -------------------------------------------------------------------- off-policy sequence mask
def _off_policy_data(seed):
    data, logp = _data(seed=seed)
    data["old_logp"] = logp.clone()
    # Mean rollout - policy gaps 0.5 (dropped when A < 0) and 0.01 (kept), both signs of A.
    gap = torch.tensor([0.5, 0.5, 0.01, 0.01, 0.5, -0.3])[:, None]
    data["rollout_logp"] = logp + gap
    data["advantages"] = torch.tensor([-1.0, 1.0, -1.0, 1.0, -0.5, -2.0])
    return data


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("with_rollout", [True, False])
def test_off_policy_mask_drops_negative_advantage_sequences_that_drifted(backend, with_rollout):
    data = _off_policy_data(seed=7)
    if not with_rollout:  # the gap is then old - policy
        data["old_logp"], data["rollout_logp"] = data["rollout_logp"], None
    ref = _compare(data, LossConfig(off_policy_mask=0.1), backend)
    counted = data["mask"].sum(-1).float()
    # Only sequence 0 drifts with A < 0 (4 is empty): its tokens, one of five sequences.
    assert ref.metrics["off_policy_masked"].item() == pytest.approx(counted[0] / counted.sum())
    assert ref.metrics["off_policy_masked_seqs"].item() == pytest.approx(1 / 5)


def test_off_policy_mask_is_trls():
    trainer = _trl()
    data = _off_policy_data(seed=8)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(data["logits"], data["labels"])
    keep = trainer.get_off_policy_mask(
        data["advantages"][:, None], logp, data["rollout_logp"], data["mask"].float(), 0.1
    )
    cfg = LossConfig(loss="pg", off_policy_mask=0.1, agg="seq-mean-token-sum")
    ours = reference.policy_loss(config=cfg, normalizer=1.0, **data).loss
    expected = -(keep[:, 0] * data["advantages"] * (logp * data["mask"]).sum(-1)).sum()
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- top-entropy token selection
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5])
def test_top_entropy_quantile_trains_the_high_entropy_tokens(backend, rho):
    data, _ = _data(seed=9)
    data["logits"] = data["logits"] * torch.rand(6, 7, 1) * 3  # entropies spread out
    cfg = LossConfig(top_entropy_quantile=rho, entropy_coef=0.05, is_correction="token_truncate")
    ref = _compare(data, cfg, backend)
    assert 1 - rho - 0.1 < ref.metrics["entropy_masked"] < 1 - rho + 0.1  # rho = 0: one token
    with torch.no_grad():
        _, entropy = reference.token_logprobs(data["logits"], data["labels"], return_entropy=True)
    counted = data["mask"]
    threshold = torch.quantile(entropy[counted], 1 - rho)
    keep = (entropy >= threshold) & counted
    # A token below the threshold has no gradient at all (policy term and entropy bonus).
    _, grad = run_loss(reference.policy_loss, data, cfg)
    assert grad[counted & ~keep].abs().max() == 0
    assert grad[keep].abs().amax(-1).min() > 0


def test_top_entropy_without_counted_tokens_trains_nothing():
    data, _ = _data(seed=10)
    data["mask"][:] = False
    out, grad = run_loss(reference.policy_loss, data, LossConfig(top_entropy_quantile=0.3))
    assert out.loss == 0 and grad.abs().max() == 0
    ours, grad = run_loss(fusedrl.policy_loss, data, LossConfig(top_entropy_quantile=0.3))
    assert ours.loss == 0 and grad.abs().max() == 0


@pytest.mark.parametrize("count", [0, 1, 2, 7, 100])
@pytest.mark.parametrize("q", [0.0, 0.3, 0.5, 1.0])
def test_masked_quantile_is_torch_quantile(count, q):
    gen = torch.Generator().manual_seed(count)
    x = torch.randn(13, 11, generator=gen)
    selected = torch.zeros(143, dtype=torch.bool)
    selected[torch.randperm(143, generator=gen)[:count]] = True
    selected = selected.view(13, 11)
    got = masked_quantile(x, selected, q)
    if count == 0:
        assert got == float("inf")
    else:
        torch.testing.assert_close(got, torch.quantile(x[selected], q))


# ------------------------------------------------------------------------- mismatch metrics
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_mismatch_metrics_vanish_without_a_mismatch_and_grow_with_it(backend):
    data, logp = _data(seed=11)
    data["old_logp"] = None
    data["rollout_logp"] = logp.clone()
    out, _ = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend=backend, **k), data, LossConfig()
    )
    for name in ("mismatch_kl_k1", "mismatch_kl_k3", "mismatch_chi2_token", "mismatch_chi2_seq"):
        assert abs(out.metrics[name]) < 1e-5, name
    data["rollout_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator())
    ref = _compare(data, LossConfig(), backend)
    assert ref.metrics["mismatch_kl_k3"] > 0 and ref.metrics["mismatch_chi2_seq"] > 0
    gap = (data["rollout_logp"] - logp)[data["mask"]]
    assert ref.metrics["mismatch_kl_k1"].item() == pytest.approx(gap.mean().item(), abs=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_effective_sample_size_and_masked_share_of_the_is_weights(backend):
    data, _ = _data(seed=12)
    counted = data["mask"]
    weights = torch.ones(counted.shape)
    weights[0] = 0.0  # one whole sequence masked by its IS weight
    data["rollout_logp"] = None
    ref = _compare(data, LossConfig(), backend, is_weights=weights)
    share = counted[0].sum() / counted.sum()
    assert ref.metrics["is_masked"].item() == pytest.approx(share.item())
    assert ref.metrics["is_masked_seqs"].item() == pytest.approx(1 / 5)
    # weights 0 or 1: E[w^2] / E[w]^2 = 1 / (1 - share), so ESS = 1 - share
    assert ref.metrics["is_ess"].item() == pytest.approx(1 - share.item(), rel=1e-5)
