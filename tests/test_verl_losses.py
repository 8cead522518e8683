"""verl 0.9.1's clip_cov, kl_cov, dppo_tv, dppo_kl and dro in fusedrl's core (LossConfig.loss).

Agreement with the reference is in test_backends / test_linear (VERL_LOSS_OPTIONS); parity with
verl's own functions in test_verl_integration. Here: every branch acts on the test data, the
selections take exactly the number of tokens verl takes, and the configs are validated.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch, run_loss
from .test_backends import VERL_LOSS_OPTIONS

BRANCH_METRICS = {
    "dppo_tv": ("clipfrac", "ratio_capped"),
    "dppo_kl": ("clipfrac", "ratio_capped"),
    "dppo_tv_kl_tau": ("clipfrac", "ratio_capped"),
    "kl_cov": ("cov_selected",),
    "clip_cov": ("clipfrac", "clip_low", "clip_high"),
    "clip_cov_seq_mean": ("clipfrac",),
}


@pytest.mark.parametrize("name", sorted(BRANCH_METRICS))
def test_every_branch_acts_on_the_option_data(name):
    """The data of test_options_fp32 makes each masking branch act, and not on every token."""
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    out, _ = run_loss(fusedrl.policy_loss, data, VERL_LOSS_OPTIONS[name], backend="torch")
    for key in BRANCH_METRICS[name]:
        assert 0 < out.metrics[key] < 1, (key, float(out.metrics[key]))


def _counted(data):
    return int(data["mask"].sum())


def test_kl_cov_penalises_exactly_verls_number_of_tokens():
    data = make_batch(batch=5, time=11, vocab=211, seed=7, empty_rows=(2,))
    for ratio in (1e-4, 0.05, 0.3, 1.0):
        cfg = LossConfig(loss="kl_cov", kl_cov_ratio=ratio)
        out, _ = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
        n = _counted(data)
        expected = max(1, int(n * ratio))
        assert round(float(out.metrics["cov_selected"]) * n) == expected


def test_clip_cov_zeroes_min_of_its_count_and_the_candidates():
    """max(1, int(ratio x tokens)) tokens drawn among the candidates; all of them when fewer."""
    data = make_batch(batch=5, time=11, vocab=211, seed=8, per_token_adv=True)
    n = _counted(data)
    wide = dict(loss="clip_cov", clip_cov_lb=-100.0, clip_cov_ub=100.0, clip_cov_seed=0)
    few = run_loss(fusedrl.policy_loss, data, LossConfig(**wide, clip_cov_ratio=0.1))[0]
    assert round(float(few.metrics["clipfrac"]) * n) == max(1, int(0.1 * n))
    everything = run_loss(fusedrl.policy_loss, data, LossConfig(**wide, clip_cov_ratio=1.0))[0]
    clipped_by_ppo = everything.metrics["clip_low"] + everything.metrics["clip_high"]
    unclipped = n - round(float(clipped_by_ppo) * n)
    assert round(float(everything.metrics["clipfrac"]) * n) == unclipped


def test_clip_cov_draw_follows_its_seed():
    data = make_batch(batch=4, time=9, vocab=211, seed=9, per_token_adv=True)
    cfg = LossConfig(loss="clip_cov", clip_cov_ratio=0.05, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    grads = []
    for seed in (1, 1, 2):
        grads.append(run_loss(fusedrl.policy_loss, data, cfg.replace(clip_cov_seed=seed))[1])
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    # Without a seed, torch's default generator: the draw follows torch.manual_seed.
    torch.manual_seed(5)
    a = run_loss(fusedrl.policy_loss, data, cfg)[1]
    torch.manual_seed(5)
    b = run_loss(reference.policy_loss, data, cfg)[1]
    torch.testing.assert_close(a, b)


def test_dro_gradient_is_minus_advantage_plus_beta_log_ratio():
    """d(loss)/d(logp) = (-A + beta (logp - old)) / tokens, through logp's own gradient."""
    data = make_batch(batch=3, time=5, vocab=97, seed=10, per_token_adv=True)
    cfg = LossConfig(loss="dro", dro_beta=0.7)
    logits = data["logits"].double().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, config=cfg, backend="torch", **args)
    (ours,) = torch.autograd.grad(out.loss, logits)
    leaf = logits.detach().clone().requires_grad_(True)
    logp, _ = reference.token_logprobs(leaf, data["labels"])
    mask = data["mask"].double()
    dlogp = (-args["advantages"] + 0.7 * (logp.detach() - args["old_logp"])) * mask / mask.sum()
    (expected,) = torch.autograd.grad((logp * dlogp).sum(), leaf)
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(loss="dro"), "dro_beta must be set"),
        (dict(loss="dro", dro_beta=-1.0), "dro_beta must be > 0"),
        (dict(loss="kl_cov", kl_cov_ratio=0.0), "kl_cov_ratio must be > 0"),
        (dict(loss="clip_cov", clip_cov_ratio=2.0), "clip_cov_ratio must be in"),
        (dict(loss="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb=5.0 must be <"),
        (dict(loss="clip_cov", clip_cov_seed=1.5), "clip_cov_seed must be an int"),
        (dict(loss="dppo_tv", dppo_ratio_cap=0.0), "dppo_ratio_cap must be > 0"),
        (dict(loss="dppo_tv", kl_tau=-0.1), "kl_tau must be > 0"),
        (dict(loss="ppo", kl_tau=0.1), "kl_tau=0.1 is DPPO's trust-region KL term"),
        (dict(loss="ppo", dro_beta=0.1), "dro_beta=0.1 is DRO's penalty"),
        (dict(loss="dro", dro_beta=0.1, is_correction="sequence_mask"), "token-level loss"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**changes)


@pytest.mark.parametrize("loss", ["dppo_tv", "dppo_kl"])
def test_dppo_kl_term_is_prime_rls(loss):
    """kl_tau: prime-rl's default loss (its trainer/rl/loss.py, default_loss_fn), written out
    here: sum(-keep x A x r + kl_tau x (log r)^2) over the counted tokens / their count, r with
    its gradient, the tokens outside the trust region dropped from the first term only. The
    same gradient to the logits as fusedrl's dppo with kl_tau (whose first term is A sg(w) logp,
    w uncapped here), and the KL term acts on the dropped tokens too."""
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    eps = 0.002 if loss == "dppo_tv" else 5e-4  # trust regions that drop some tokens here
    cfg = LossConfig(loss=loss, eps_low=eps, eps_high=eps, dppo_ratio_cap=1e6, kl_tau=0.3)
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    logits = data["logits"].clone().requires_grad_(True)
    logp, _ = reference.token_logprobs(logits, data["labels"])
    old, adv, mask = data["old_logp"], data["advantages"], data["mask"].float()
    log_r = logp - old
    p, p_old = logp.exp(), old.exp()
    if loss == "dppo_tv":
        up_ok, down_ok = p - p_old <= eps, p - p_old >= -eps
    else:
        kl = p_old * (old - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        up_ok, down_ok = (kl <= eps) | (p <= p_old), (kl <= eps) | (p >= p_old)
    keep = torch.where(adv > 0, up_ok, down_ok).detach().float() * mask
    prime = (-keep * adv * log_r.exp() + 0.3 * mask * log_r**2).sum() / mask.sum()
    (prime_grad,) = torch.autograd.grad(prime, logits)
    torch.testing.assert_close(grad, prime_grad, atol=1e-7, rtol=1e-5)
    assert 0 < float(keep.sum() / mask.sum()) < 1  # the trust region dropped some tokens
    term = (mask * log_r.detach() ** 2).sum() / mask.sum()
    torch.testing.assert_close(ours.metrics["dppo_kl_term"], term, rtol=1e-5, atol=1e-7)
    _, without = run_loss(fusedrl.policy_loss, data, cfg.replace(kl_tau=0.0), backend="torch")
    assert (grad - without).abs().max() > 1e-4  # the term acted


@pytest.mark.parametrize(
    "name, metric",
    [
        ("trust_region_max", "rs_tr_max_k2_masked"),
        ("trust_region_mean_gspo", "rs_tr_mean_k1_masked"),
    ],
)
def test_trust_region_masking_drops_whole_sequences(name, metric):
    """Trust-region sequence masking (arXiv 2512.23075) on the option data: some sequences, not
    all, leave the loss whole; what remains is the loss on the survivors' mask (written out:
    |log(old / rollout)| > delta on a token, or on the sequence's mean)."""
    from .test_backends import OPTIONS

    cfg = OPTIONS[name]
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    out, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    assert 0 < out.metrics[metric] < 1
    log_r = torch.where(data["mask"], data["old_logp"] - data["rollout_logp"], 0.0)
    if cfg.trust_region_mode == "max":
        bad = (log_r.abs() > cfg.trust_region_delta).any(-1)
    else:
        bad = (log_r.sum(-1) / data["mask"].sum(-1).clamp_min(1)).abs() > cfg.trust_region_delta
    assert (grad[bad] == 0).all() and bad.any() and not bad[data["mask"].any(-1)].all()
    survivors = dict(data, mask=data["mask"] & ~bad[:, None])
    plain = cfg.replace(trust_region_delta=None)
    want, want_grad = run_loss(fusedrl.policy_loss, survivors, plain, backend="torch")
    if cfg.rejection is None:  # with a rejection chained, its tokens are measured on both masks
        torch.testing.assert_close(out.loss, want.loss)
        torch.testing.assert_close(grad, want_grad)


def test_trust_region_options_are_checked():
    with pytest.raises(ValueError, match="trust_region_mode='any' is not one of"):
        LossConfig(trust_region_delta=0.5, trust_region_mode="any")
    with pytest.raises(ValueError, match="trust_region_delta must be > 0"):
        LossConfig(trust_region_delta=0.0)
    data = make_batch(vocab=37, seed=1)
    with pytest.raises(ValueError, match="rollout_logp is required when config.trust_region"):
        fusedrl.policy_loss(
            **dict(data, rollout_logp=None), config=LossConfig(trust_region_delta=1.0)
        )


def test_m2po_drops_the_largest_second_moments_until_the_rest_is_below_tau():
    """M2PO (AReaL's m2_threshold) on the option data: the dropped tokens are exactly those of
    largest (log pi - log pi_old)^2, as many as AReaL's rule (the first suffix of the downward
    sort whose mean is below tau), they leave the loss and its denominator, and the token
    metrics still see them."""
    from .test_backends import OPTIONS

    cfg = OPTIONS["m2po"]
    data = make_batch(batch=4, time=9, vocab=523, seed=4, per_token_adv=True)
    out, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    logp, _ = reference.token_logprobs(data["logits"], data["labels"])
    m2 = torch.where(data["mask"], (logp - data["old_logp"]) ** 2, -1.0)
    ordered = m2[data["mask"]].sort(descending=True).values
    suffix_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(ordered), 0, -1)
    below = torch.nonzero(suffix_means < cfg.m2po_tau)
    count = int(below[0]) if len(below) else len(ordered) - 1
    assert 0 < count < len(ordered)  # the rule acted, and kept some
    dropped = m2 >= ordered[count - 1]
    assert int(dropped.sum()) == count
    assert out.metrics["m2po_masked"] == pytest.approx(count / len(ordered))
    survivors = dict(data, mask=data["mask"] & ~dropped)
    want, want_grad = run_loss(
        fusedrl.policy_loss, survivors, cfg.replace(m2po_tau=None), backend="torch"
    )
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(grad, want_grad)
    full, _ = run_loss(fusedrl.policy_loss, data, cfg.replace(m2po_tau=None), backend="torch")
    torch.testing.assert_close(out.metrics["logp_mean"], full.metrics["logp_mean"])
