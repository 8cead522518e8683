"""fusedrl.integrations.verl against verl itself (runs in .venv-verl: `make test-verl`).

verl's own policy losses (`core_algos.get_policy_loss_fn(mode)`) and ours on the same random
inputs, fp32: same loss (1e-5 relative), same gradient w.r.t. log_prob (1e-4 relative), same
metrics; and the log-prob / entropy drop-ins against `verl.utils.torch_functional`, gradients
included, then both halves together from the logits; and the Megatron (tensor-parallel) drop-ins
in spawned gloo worlds (see their section below)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

verl = pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

import fusedrl  # noqa: E402
from fusedrl.integrations import verl as fverl  # noqa: E402
from fusedrl.tp.header import FIELDS  # noqa: E402

from .test_tensor_parallel import CollectiveLog, rank_slice  # noqa: E402
from .worlds import free_port, run_world  # noqa: E402

B, T, V = 6, 11, 1031
LENGTHS = (11, 4, 0, 9, 1, 7)  # ragged, one empty response
# verl's defaults, clip-higher, and GSPO's narrow sequence-level range; DPPO's thresholds are a
# probability difference / a binary KL, narrow enough that tokens leave the trust region.
CLIP = {
    "gspo": dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    "dppo_tv": dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.5),
    "dppo_kl": dict(clip_ratio_low=0.005, clip_ratio_high=0.01, clip_ratio_c=1.5),
}
# clip_cov with a ratio of 1 zeroes every candidate (verl's randperm then picks them all: no
# draw to compare); kl_cov penalises a fifth of the tokens; DRO's beta.
POLICY_LOSS = {
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=-0.2, clip_cov_ub=0.3),
    "kl_cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    "dro": dict(dro_beta=0.4),
}
GLOBAL_INFO = dict(dp_size=2, batch_num_tokens=70, global_batch_size=10, loss_scale_factor=16)


def _actor(mode: str, **overrides) -> FSDPActorConfig:
    kwargs = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        policy_loss=PolicyLossConfig(loss_mode=mode, **POLICY_LOSS.get(mode, {})),
    )
    kwargs.update(CLIP.get(mode, {}))
    kwargs.update(overrides)
    return FSDPActorConfig(**kwargs)


def _mask() -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]


def _batch(seed: int = 0, per_token_adv: bool = False, beyond_clamp: bool = True):
    """log-probs whose ratios to old straddle the clip bounds, with some far outside (dual-clip,
    the GSPO log clamp); junk (finite: verl's seq-mean modes multiply it by the mask) on
    padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = _mask()
    log_prob = -3.0 * torch.rand(B, T, generator=gen)
    old = log_prob + 0.3 * torch.randn(B, T, generator=gen)
    old[0, :3] = log_prob[0, :3] - 2.0  # ratio e^2 > clip_ratio_c
    if beyond_clamp:  # a log-ratio beyond verl's +-20 clamp
        old[3, 2] = log_prob[3, 2] + 25.0
    if per_token_adv:
        adv = torch.randn(B, T, generator=gen)
    else:
        adv = torch.randn(B, 1, generator=gen).expand(B, T).clone()
    adv[0] = -adv[0].abs()  # the dual-clip row has a negative advantage
    rollout = old + 0.2 * torch.randn(B, T, generator=gen)
    log_prob = torch.where(mask, log_prob, -50.0)
    return dict(old=old, log_prob=log_prob, adv=adv, mask=mask, rollout=rollout)


def _is_weights(batch, level):
    if level is None:
        return None
    weights, _ = compute_rollout_correction_weights(
        log_ratio=batch["old"] - batch["rollout"],
        response_mask=batch["mask"],
        rollout_is=level,
        rollout_is_threshold=2.0,
    )
    return weights


def _run(fn, batch, agg, config, weights):
    log_prob = batch["log_prob"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=batch["old"],
        log_prob=log_prob,
        advantages=batch["adv"],
        response_mask=batch["mask"],
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=weights,
    )
    loss.backward()
    grad = torch.where(batch["mask"], log_prob.grad, 0.0)
    return loss.detach(), grad, metrics


def _assert_same(ours, theirs):
    loss, grad, metrics = ours
    ref_loss, ref_grad, ref_metrics = theirs
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    scale = max(ref_grad.abs().max().item(), 1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6 * scale)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
        assert isinstance(metrics[key], float)
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("is_level", [None, "token", "sequence"])
@pytest.mark.parametrize("agg", fverl.LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", list(fverl.LOSS_MODES))
def test_policy_loss_parity(mode, agg, is_level):
    # verl's gspo averages unclamped token log-ratios, fusedrl clamps them at +-20 first: the
    # one documented difference, left out here (test_gspo_log_ratio_clamp pins it).
    batch = _batch(seed=len(agg) + 13, per_token_adv=mode == "gspo", beyond_clamp=mode != "gspo")
    weights = _is_weights(batch, is_level)
    config = _actor(mode, loss_agg_mode=agg)
    theirs = _run(core_algos.get_policy_loss_fn(mode), batch, agg, config, weights)
    ours = _run(core_algos.get_policy_loss_fn(fverl.LOSS_MODES[mode]), batch, agg, config, weights)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("agg", fverl.LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "gpg", "cispo"])
def test_policy_loss_parity_global_batch(mode, agg):
    """dp_size / global token and sequence counts / loss_scale_factor, as ppo_loss sets them."""
    batch = _batch(seed=7, beyond_clamp=mode != "gspo")
    config = _actor(mode, loss_agg_mode=agg)
    config.global_batch_info.update(GLOBAL_INFO)
    weights = _is_weights(batch, "token")
    theirs = _run(core_algos.get_policy_loss_fn(mode), batch, agg, config, weights)
    ours = _run(core_algos.get_policy_loss_fn(fverl.LOSS_MODES[mode]), batch, agg, config, weights)
    _assert_same(ours, theirs)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None),
        dict(clip_ratio_c=1.5),
        dict(clip_ratio_low=0.1, clip_ratio_high=0.4, tau_pos=2.0, tau_neg=3.0),
        # verl's CISPO recipe: a lower bound 1 - 10 that never binds (fusedrl's open bound)
        dict(clip_ratio_low=10.0, clip_ratio_high=0.2),
    ],
)
@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo", "geo_mean"])
def test_policy_loss_parity_options(mode, overrides):
    batch = _batch(seed=3)
    config = _actor(mode, **overrides)
    fns = core_algos.get_policy_loss_fn(mode), core_algos.get_policy_loss_fn(f"fusedrl_{mode}")
    theirs, ours = (_run(fn, batch, "token-mean", config, None) for fn in fns)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("mode", list(fverl.LOSS_MODES))
def test_policy_loss_parity_left_padding(mode):
    """Responses that start with padding (per-sequence weights must not be read from it)."""
    batch = _batch(seed=9, beyond_clamp=mode != "gspo")
    batch["mask"] = batch["mask"].flip(-1)
    batch["log_prob"] = batch["log_prob"].flip(-1)
    weights = _is_weights(batch, "token")
    config = _actor(mode)
    fns = core_algos.get_policy_loss_fn(mode), core_algos.get_policy_loss_fn(f"fusedrl_{mode}")
    theirs, ours = (_run(fn, batch, "seq-mean-token-mean", config, weights) for fn in fns)
    _assert_same(ours, theirs)


def test_gspo_log_ratio_clamp():
    """A token with |log_prob - old| > 20 moves verl's gspo sequence ratio further than fusedrl's
    (which clamps each token at +-20 as verl's other modes do); the gradient direction is the same
    per token."""
    batch = _batch(seed=1, per_token_adv=True)
    config = _actor("gspo")
    fns = core_algos.get_policy_loss_fn("gspo"), core_algos.get_policy_loss_fn("fusedrl_gspo")
    (ref_loss, ref_grad, _), (loss, grad, _) = (
        _run(fn, batch, "token-mean", config, None) for fn in fns
    )
    assert not torch.allclose(loss, ref_loss, rtol=1e-5)
    rows = [0, 1, 2, 4, 5]  # every sequence but the one with the extreme token
    torch.testing.assert_close(grad[rows], ref_grad[rows], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", list(fverl.LOSS_MODES))
def test_nan_padding_does_not_leak(mode):
    batch = _batch(seed=11)
    config = _actor(mode, loss_agg_mode="seq-mean-token-sum")
    fn = core_algos.get_policy_loss_fn(fverl.LOSS_MODES[mode])
    clean = _run(fn, batch, "seq-mean-token-sum", config, _is_weights(batch, "token"))
    for key in ("log_prob", "old", "adv", "rollout"):
        batch[key] = torch.where(batch["mask"], batch[key], float("nan"))
    dirty = _run(fn, batch, "seq-mean-token-sum", config, _is_weights(batch, "token"))
    _assert_same(dirty, clean)


def test_registered_names_and_replace_builtin():
    for name in fverl.LOSS_MODES.values():
        assert core_algos.get_policy_loss_fn(name) is fverl.POLICY_LOSSES[name]
    saved = dict(core_algos.POLICY_LOSS_REGISTRY)
    try:
        fverl.register(replace_builtin=True)
        assert core_algos.get_policy_loss_fn("vanilla") is fverl.POLICY_LOSSES["fusedrl_vanilla"]
        assert core_algos.get_policy_loss_fn("kl_cov") is fverl.POLICY_LOSSES["fusedrl_kl_cov"]
        # not ours: untouched
        assert core_algos.get_policy_loss_fn("bypass_mode") is saved["bypass_mode"]
    finally:
        core_algos.POLICY_LOSS_REGISTRY.clear()
        core_algos.POLICY_LOSS_REGISTRY.update(saved)


@pytest.mark.parametrize("mode", list(fverl.UNSUPPORTED_LOSS_MODES) + ["no_such_mode"])
def test_unsupported_loss_modes_raise(mode):
    with pytest.raises(ValueError, match=mode):
        fverl.loss_config_from_verl(_actor("vanilla"), loss_mode=mode)


def test_clip_cov_draws_as_many_tokens_as_verl():
    """At verl's default-sized ratio both draw max(1, int(ratio x tokens)) of the candidates at
    random (verl by randperm, fusedrl by keys): the same count, not the same tokens."""
    batch = _batch(seed=31)
    config = _actor(
        "clip_cov",
        policy_loss=PolicyLossConfig(
            loss_mode="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-0.2, clip_cov_ub=0.3
        ),
    )
    run = {
        name: _run(core_algos.get_policy_loss_fn(name), batch, "token-mean", config, None)
        for name in ("clip_cov", "fusedrl_clip_cov")
    }
    theirs, ours = run["clip_cov"], run["fusedrl_clip_cov"]
    tokens = int(batch["mask"].sum())
    assert round(theirs[2]["actor/pg_clipfrac"] * tokens) == max(1, int(0.1 * tokens))
    assert ours[2] == pytest.approx(theirs[2], rel=1e-6)


def test_dro_needs_its_beta():
    with pytest.raises(ValueError, match="dro_beta must be a positive value"):
        fverl.loss_config_from_verl(_actor("dro", policy_loss=PolicyLossConfig(loss_mode="dro")))


REJECTION_CASES = [
    ("token_k1", "0.8_1.25"),
    ("token_k2", 0.02),
    ("token_k3", "0.02"),
    ("seq_sum_k1", "0.8_1.3"),
    ("seq_sum_k2,seq_sum_k3", "0.2,0.1"),
    ("seq_mean_k1", 1.2),
    ("seq_mean_k2, seq_mean_k3", "0.02"),
    ("seq_max_k2,seq_max_k3,token_k1,seq_max_k2", "0.3,0.2,0.7_1.5"),
]


def _against_verls_rejection(cfg, verl_option, threshold, seeds):
    """(fusedrl's loss under `cfg` with the rollout's log-probs, fusedrl's plain loss on the mask
    verl's compute_rollout_rejection_mask leaves, verl's metrics), on log r = old - rollout of
    noise large enough that the rule rejects some tokens but not all (asserted). `seeds`: the
    batch's, the rollout noise's, the logits' and the labels'."""
    batch = _batch(seed=seeds[0], beyond_clamp=False)
    gens = [torch.Generator().manual_seed(seed) for seed in seeds[1:]]
    batch["rollout"] = batch["old"] + 0.3 * torch.randn(B, T, generator=gens[0])
    verl_mask, verl_metrics = compute_rollout_rejection_mask(
        log_ratio=batch["old"] - batch["rollout"],
        response_mask=batch["mask"].float(),
        rollout_rs=verl_option,
        rollout_rs_threshold=threshold,
    )
    assert 0 < verl_mask.sum() < batch["mask"].sum()
    logits = torch.randn(B, T, 97, generator=gens[1])
    labels = torch.randint(0, 97, (B, T), generator=gens[2])
    common = dict(labels=labels, advantages=batch["adv"], old_logp=batch["old"], backend="torch")
    ours = fusedrl.policy_loss(
        logits, mask=batch["mask"], rollout_logp=batch["rollout"], config=cfg, **common
    )
    by_mask = fusedrl.policy_loss(
        logits, mask=verl_mask.bool(), config=fusedrl.LossConfig(), **common
    )
    return ours, by_mask, verl_metrics


@pytest.mark.parametrize(("options", "threshold"), REJECTION_CASES)
def test_rejection_sampling_parity(options, threshold):
    """LossConfig.rejection against verl's compute_rollout_rejection_mask on log r = old -
    rollout: the loss equals fusedrl's loss on verl's modified mask, the masked shares equal
    verl's metrics, and each case rejects some tokens but not all."""
    cfg = fusedrl.LossConfig(rejection=options, rejection_threshold=threshold)
    ours, by_mask, verl_metrics = _against_verls_rejection(cfg, options, threshold, (41, 3, 4, 5))
    torch.testing.assert_close(ours.loss, by_mask.loss)
    assert float(ours.metrics["rs_masked"]) == pytest.approx(
        verl_metrics["rollout_rs_masked_fraction"], abs=1e-6
    )
    assert float(ours.metrics["rs_masked_seqs"]) == pytest.approx(
        verl_metrics["rollout_rs_seq_masked_fraction"], abs=1e-6
    )
    for rule in cfg.rejection_rules:
        key = f"rollout_rs_{rule.option}_masked_fraction"
        assert float(ours.metrics[f"rs_{rule.option}_masked"]) == pytest.approx(
            verl_metrics[key], abs=1e-6
        ), key


@pytest.mark.parametrize(
    ("mode", "delta", "verl_option"),
    [
        ("max", 0.5, "seq_max_k2"),
        ("mean", 0.15, "seq_mean_k1"),
    ],
)
def test_trust_region_masking_is_verls_rejection_with_its_bounds(mode, delta, verl_option):
    """LossConfig(trust_region_delta=, trust_region_mode=) masks what verl's
    compute_rollout_rejection_mask masks with seq_max_k2 at delta^2 / 2 (|log r| <= delta on
    every token) or seq_mean_k1 in [exp(-delta), exp(delta)] (the mean log r in [-delta, delta])."""
    threshold = 0.5 * delta * delta if mode == "max" else f"{math.exp(-delta)}_{math.exp(delta)}"
    cfg = fusedrl.LossConfig(trust_region_delta=delta, trust_region_mode=mode)
    ours, by_mask, _ = _against_verls_rejection(cfg, verl_option, threshold, (43, 6, 7, 8))
    torch.testing.assert_close(ours.loss, by_mask.loss)


def test_unsupported_options_raise():
    batch = _batch()
    fn = core_algos.get_policy_loss_fn("fusedrl_vanilla")
    with pytest.raises(ValueError, match="loss_agg_mode='seq-sum'"):
        _run(fn, batch, "seq-sum", _actor("vanilla"), None)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        fverl.loss_config_from_verl(_actor("vanilla", clip_ratio_low=-0.1))
    for mode in ("vanilla", "gspo", "cispo"):  # a bound <= 0: open, as verl's never binds
        cfg = fverl.loss_config_from_verl(_actor(mode, clip_ratio_low=1.0))
        assert cfg.eps_low == fusedrl.config.OPEN_LOWER_BOUND, mode
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fverl.verl_normalizer(batch["mask"], "token-mean", {"dp_size": 2})
    with pytest.raises(ValueError, match="config"):
        _run(fn, batch, "token-mean", None, None)


def test_loss_config_from_verl_mapping():
    cfg = fverl.loss_config_from_verl(_actor("vanilla", clip_ratio_c=2.5))
    assert (cfg.loss, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c) == ("ppo", 0.2, 0.28, 2.5)
    cfg = fverl.loss_config_from_verl(_actor("gspo", loss_agg_mode="seq-mean-token-sum-norm"))
    assert (cfg.ratio_level, cfg.eps_low, cfg.agg) == ("sequence", 3e-4, "seq-mean-token-sum-norm")
    cfg = fverl.loss_config_from_verl(_actor("sapo", loss_agg_mode="token-mean"))
    assert (cfg.loss, cfg.agg, cfg.sapo_tau_neg) == ("sapo", "seq-mean-token-mean", 1.05)
    assert fverl.loss_config_from_verl(_actor("fusedrl_gpg")).loss == "pg"
    cfg = fverl.loss_config_from_verl(
        _actor("vanilla", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=64)
    )
    assert cfg.norm_constant == 64


def test_import_fusedrl_does_not_import_verl():
    code = "import sys, fusedrl; assert 'verl' not in sys.modules, 'verl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_switch_on_through_verl_environment(tmp_path):
    """The documented route: verl imports the module itself (VERL_USE_EXTERNAL_MODULES, as
    `external_lib` does in each worker), which registers the losses and, with
    FUSEDRL_VERL_PATCH_ACTOR=1, patches the log-prob / entropy path."""
    code = (
        "import verl, fusedrl.integrations.verl as fv\n"
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
        "from verl.utils import torch_functional as F\n"
        "assert get_policy_loss_fn('fusedrl_gspo') is fv.POLICY_LOSSES['fusedrl_gspo']\n"
        "assert F.logprobs_from_logits is fv.logprobs_from_logits\n"
        "assert F.entropy_from_logits is fv.entropy_from_logits\n"
    )
    env = {
        **os.environ,
        "VERL_USE_EXTERNAL_MODULES": "fusedrl.integrations.verl",
        "FUSEDRL_VERL_PATCH_ACTOR": "1",
    }
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)


# ------------------------------------------------------------------ log-prob / entropy drop-ins
def _logits(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(*shape, V, generator=gen)
    labels = torch.randint(0, V, shape, generator=gen)
    return logits.to(dtype), labels


def _logp_entropy_grads(logprob_fn, entropy_fn, logits, labels, w_logp, w_ent):
    leaf = logits.clone().requires_grad_(True)
    logp = logprob_fn(leaf, labels)
    entropy = entropy_fn(leaf)
    ((logp.float() * w_logp).sum() + (entropy.float() * w_ent).sum()).backward()
    return logp.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("shape", [(B * T,), (B, T)], ids=["rmpad", "padded"])
def test_logprobs_entropy_parity(shape):
    logits, labels = _logits(shape)
    gen = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    # A padding row: no upstream gradient must mean exactly zero gradient.
    w_logp.view(-1)[5], w_ent.view(-1)[5] = 0.0, 0.0
    theirs = _logp_entropy_grads(
        verl_F.logprobs_from_logits, verl_F.entropy_from_logits, logits, labels, w_logp, w_ent
    )
    ours = _logp_entropy_grads(
        fverl.logprobs_from_logits, fverl.entropy_from_logits, logits, labels, w_logp, w_ent
    )
    for mine, ref in zip(ours, theirs):
        assert mine.dtype == ref.dtype and mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert ours[2].reshape(-1, V)[5].eq(0).all()
    chunked = fverl.entropy_from_logits_with_chunking(logits.reshape(-1, V), chunk_size=7)
    ref_chunked = verl_F.entropy_from_logits_with_chunking(logits.view(-1, V))
    torch.testing.assert_close(chunked, ref_chunked)


def test_logprobs_entropy_bf16():
    """bf16 logits: fp32 results as verl computes them from the upcast logits (verl's own bf16
    path rounds its log-softmax to bf16); the gradient comes back in bf16."""
    logits, labels = _logits((B * T,), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    w_logp, w_ent = torch.randn(B * T, generator=gen), torch.randn(B * T, generator=gen)
    logp, ent, grad = _logp_entropy_grads(
        fverl.logprobs_from_logits, fverl.entropy_from_logits, logits, labels, w_logp, w_ent
    )
    ref_logp, ref_ent, ref_grad = _logp_entropy_grads(
        verl_F.logprobs_from_logits,
        verl_F.entropy_from_logits,
        logits.float(),
        labels,
        w_logp,
        w_ent,
    )
    assert grad.dtype == torch.bfloat16 and logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=1e-2 * ref_grad.abs().max())
    # verl's own bf16 path agrees to bf16 precision.
    torch.testing.assert_close(
        logp, verl_F.logprobs_from_logits(logits, labels).float(), rtol=0.02, atol=0.1
    )


def test_logprobs_and_entropy_one_pass():
    logits, labels = _logits((B, T))
    logp, entropy = fverl.logprobs_and_entropy_from_logits(logits, labels)
    torch.testing.assert_close(logp, verl_F.logprobs_from_logits(logits, labels))
    torch.testing.assert_close(entropy, verl_F.entropy_from_logits(logits))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_logprobs_entropy_triton_interpreter(monkeypatch):
    monkeypatch.setattr(fverl, "BACKEND", "triton")
    logits, labels = _logits((3, 5))
    w = torch.ones(3, 5)
    ours = _logp_entropy_grads(
        fverl.logprobs_from_logits, fverl.entropy_from_logits, logits, labels, w, w
    )
    theirs = _logp_entropy_grads(
        verl_F.logprobs_from_logits, verl_F.entropy_from_logits, logits, labels, w, w
    )
    for mine, ref in zip(ours, theirs):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)


def test_patch_actor():
    from verl.workers.rollout.naive import naive_rollout  # binds logprobs_from_logits by name

    original = verl_F.logprobs_from_logits
    logits, labels = _logits((B, T))
    mask = _mask()
    ref_entropy_loss = core_algos.compute_entropy_loss(logits, mask)
    try:
        patched = fverl.patch_actor()
        assert "verl.utils.torch_functional.logprobs_from_logits" in patched
        assert "verl.workers.rollout.naive.naive_rollout.logprobs_from_logits" in patched
        assert naive_rollout.logprobs_from_logits is fverl.logprobs_from_logits
        assert verl_F.entropy_from_logits is fverl.entropy_from_logits
        assert fverl.patch_actor() == []  # idempotent
        # verl code that looks the helpers up at call time now runs fusedrl.
        torch.testing.assert_close(core_algos.compute_entropy_loss(logits, mask), ref_entropy_loss)
    finally:
        fverl.unpatch_actor()
    assert verl_F.logprobs_from_logits is original
    assert naive_rollout.logprobs_from_logits is original


# ------------------------------------------------------------------ both halves, from the logits
@pytest.mark.parametrize("is_level", [None, "token"])
@pytest.mark.parametrize(
    "mode, agg",
    [
        ("vanilla", "token-mean"),
        ("vanilla", "seq-mean-token-sum-norm"),
        ("gspo", "seq-mean-token-mean"),
        ("cispo", "token-mean"),
        ("geo_mean", "token-mean"),
    ],
)
def test_logits_to_loss_parity(mode, agg, is_level):
    """verl's path (its log-probs, its loss) and ours (drop-in log-probs, fused registry loss),
    and the fully fused `fusedrl.policy_loss` on the logits with loss_config_from_verl: the same
    loss and the same gradient w.r.t. the logits."""
    logits, labels = _logits((B, T), seed=4)
    batch = _batch(seed=5)
    mask = batch["mask"]
    with torch.no_grad():
        logp0 = verl_F.logprobs_from_logits(logits, labels)
    gen = torch.Generator().manual_seed(6)
    batch["old"] = logp0 + 0.3 * torch.randn(B, T, generator=gen)
    batch["rollout"] = batch["old"] + 0.2 * torch.randn(B, T, generator=gen)
    weights = _is_weights(batch, is_level)
    config = _actor(mode, loss_agg_mode=agg)

    def through(logprob_fn, loss_name):
        leaf = logits.clone().requires_grad_(True)
        loss, metrics = core_algos.get_policy_loss_fn(loss_name)(
            batch["old"], logprob_fn(leaf, labels), batch["adv"], mask, agg, config, weights
        )
        loss.backward()
        return loss.detach(), leaf.grad, metrics

    ref_loss, ref_grad, ref_metrics = through(verl_F.logprobs_from_logits, mode)
    loss, grad, metrics = through(fverl.logprobs_from_logits, fverl.LOSS_MODES[mode])
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6 * scale)
    assert metrics == pytest.approx(ref_metrics, rel=1e-5, abs=1e-6)

    # Fully fused: one fusedrl.policy_loss call on the logits.
    is_weights = weights
    if mode == "geo_mean" and weights is not None:
        is_weights = fverl._geo_mean_is_weights(weights, mask)
    leaf = logits.clone().requires_grad_(True)
    out = fusedrl.policy_loss(
        leaf,
        labels,
        batch["adv"],
        mask,
        old_logp=batch["old"],
        config=fverl.loss_config_from_verl(config, mode),
        normalizer=fverl.verl_normalizer(mask, agg) if mode != "geo_mean" else None,
        is_weights=is_weights,
        backend="torch",
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=1e-4, atol=1e-6 * scale)


# --- issue 29 item 9 ---


@pytest.mark.parametrize("option", ["token_k1", "seq_sum_k1", "seq_mean_k1"])
def test_rejection_parity_on_the_lower_bound(option):
    """tests/test_exact_bounds.py's data, whose k1 statistic equals the lower bound to the bit in
    some kept token or sequence: verl's own mask is the one written out there (so `>` for `>=`
    on either side fails a test), and LossConfig.rejection gives verl's loss and metrics."""
    from .test_exact_bounds import REJECTION_BOUNDS, rejection_batch

    data, cfg, keep = rejection_batch(option)
    verl_mask, verl_metrics = compute_rollout_rejection_mask(
        log_ratio=data["old_logp"] - data["rollout_logp"],
        response_mask=data["mask"].float(),
        rollout_rs=option,
        rollout_rs_threshold=REJECTION_BOUNDS[option][0],
    )
    assert torch.equal(verl_mask.bool(), data["mask"] & keep.bool())
    args = {k: v for k, v in data.items() if k not in ("logits", "mask", "rollout_logp")}
    ours = fusedrl.policy_loss(
        data["logits"],
        mask=data["mask"],
        rollout_logp=data["rollout_logp"],
        config=cfg,
        backend="torch",
        **args,
    )
    by_mask = fusedrl.policy_loss(
        data["logits"], mask=verl_mask.bool(), config=fusedrl.LossConfig(), backend="torch", **args
    )
    torch.testing.assert_close(ours.loss, by_mask.loss)
    assert float(ours.metrics["rs_masked"]) == pytest.approx(
        verl_metrics["rollout_rs_masked_fraction"], abs=1e-6
    )
    key = f"rollout_rs_{option}_masked_fraction"
    assert float(ours.metrics[f"rs_{option}_masked"]) == pytest.approx(verl_metrics[key], abs=1e-6)


# ------------------------------------------------ verl's Megatron helpers on vocab-sharded logits
# One spawned world of 3 gloo processes runs every case below twice: over ranks {0, 1} and over
# all three (the world of 2 is a subgroup: one spawn, three interpreter start-ups). Each rank
# saves what it computed; the tests compare it with
# - the single-process result on the gathered logits (rank 0, fusedrl's own drop-ins): values,
#   and each rank's gradient slice;
# - verl's own helpers: verl/utils/megatron/tensor_parallel.py of verl 0.9.1, the installed file
#   itself, run with stand-ins for what it imports from megatron, which is not installed here:
#   `parallel_state.get_tensor_model_parallel_group()` (the test's gloo group) and
#   `tensor_parallel.vocab_parallel_cross_entropy` (Megatron's formulas, as bench/bench_tp.py's
#   eager baseline writes them: megatron/core/tensor_parallel/cross_entropy.py). The
#   `torch.compile` of verl's entropy (a fused multiply-sum) runs eagerly.
# Megatron's layout is even slices (rank r from r * V / tp): verl's helpers are compared there;
# uneven slices and padded vocabularies against the single-process result only.
TP_V = 1032  # even over 2 and 3 ranks
TP_UNEVEN = {2: (600, 432), 3: (400, 332, 300)}
TP_TRUE_V = 1025  # the padded case: 1025 tokens padded to 1032 columns (Megatron pads so)
TP_B, TP_T, TP_H = 4, 6, 16
TP_DEADLINE_S = 420


def _tp_sizes(world: int, layout: str) -> list[int]:
    return list(TP_UNEVEN[world]) if layout == "uneven" else [TP_V // world] * world


# name: (what runs, token shape, layout, dtype); "linear" cases take the LM head's rows.
TP_CASES = {
    "logprobs_rmpad": ("logprobs", (TP_B * TP_T,), "even", torch.float32),
    "entropy_thd": ("entropy", (1, TP_B * TP_T), "even", torch.float32),
    "entropy_chunking": ("entropy_chunking", (TP_B, TP_T), "even", torch.float32),
    "together": ("together", (TP_B, TP_T), "even", torch.float32),
    "together_bf16": ("together", (TP_B, TP_T), "even", torch.bfloat16),
    "together_default_group": ("together_default_group", (TP_B, TP_T), "even", torch.float32),
    "together_uneven": ("together", (TP_B, TP_T), "uneven", torch.float32),
    "together_padded": ("together", (TP_B, TP_T), "padded", torch.float32),
    "linear_none": ("linear", (TP_B, TP_T), "even", torch.float32),
    "linear_mean_uneven": ("linear_mean", (TP_B, TP_T), "uneven", torch.float32),
    "bad_label": ("bad_label", (TP_B, TP_T), "even", torch.float32),
}


def _tp_inputs(name: str) -> dict:
    """The whole logits (or LM head), labels and upstream gradients of a case, the same on every
    rank (labels: true token ids; one row gets no upstream gradient)."""
    kind, shape, layout, dtype = TP_CASES[name]
    # The default-group case gets the explicit-group case's inputs: it must equal it bit for bit.
    gen = torch.Generator().manual_seed(sum(map(ord, name.removesuffix("_default_group"))))
    vocab = TP_TRUE_V if layout == "padded" else TP_V
    data = {
        "logits": (3.0 * torch.randn(*shape, TP_V, generator=gen)).to(dtype),
        "labels": torch.randint(0, vocab, shape, generator=gen),
        "w_logp": torch.randn(shape, generator=gen),
        "w_ent": torch.randn(shape, generator=gen),
        "hidden": torch.randn(*shape, TP_H, generator=gen),
        "weight": 0.5 * torch.randn(TP_V, TP_H, generator=gen),
    }
    data["w_logp"].view(-1)[3] = data["w_ent"].view(-1)[3] = 0.0
    if layout == "padded":  # the padding columns hold garbage that must not count
        data["logits"][..., TP_TRUE_V::2] = float("nan")
        data["logits"][..., TP_TRUE_V + 1 :: 2] = 1e4
    return data


def _megatron_stand_in(group_of):
    """Modules `megatron`, `megatron.core`, `megatron.core.parallel_state` and
    `megatron.core.tensor_parallel` with what verl's tensor_parallel.py and the drop-ins' default
    group use, put in sys.modules (in a spawned child only)."""
    import importlib.machinery
    import types

    from .test_bench_smoke import _load

    bench_tp = _load("bench_tp")
    modules = {}
    for name in (
        "megatron",
        "megatron.core",
        "megatron.core.parallel_state",
        "megatron.core.tensor_parallel",
    ):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        modules[name] = module
    state = modules["megatron.core.parallel_state"]
    state.get_tensor_model_parallel_group = lambda: group_of[0]

    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        assert label_smoothing == 0.0
        group = state.get_tensor_model_parallel_group()
        return -bench_tp.MegatronLogProbs.apply(vocab_parallel_logits, target, group)

    cross_entropy = modules["megatron.core.tensor_parallel"]
    cross_entropy.vocab_parallel_cross_entropy = vocab_parallel_cross_entropy
    modules["megatron"].core = modules["megatron.core"]
    modules["megatron.core"].parallel_state = state
    modules["megatron.core"].tensor_parallel = modules["megatron.core.tensor_parallel"]
    sys.modules.update(modules)


def _eager_compile(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


def _tp_run(fn, inputs: dict, labels, data, log, grad: bool = True) -> dict:
    """`fn(**leaves, labels)` -> (logp or None, entropy or None); the outputs, the gradients of
    the leaves under the upstream weights (None with grad=False: no backward), and the
    collectives of forward and backward."""
    leaves = {k: v.detach().clone().requires_grad_(grad) for k, v in inputs.items()}
    logp, entropy = fn(*leaves.values(), labels)
    fwd = log.take()
    if not grad:
        return {"logp": logp, "entropy": entropy, "fwd": fwd, "bwd": [], "grads": None}
    total = 0.0
    if logp is not None:  # a scalar (reduction="mean"): weighted by one of the weights
        weight = data["w_logp"].reshape(-1)[0] if logp.dim() == 0 else data["w_logp"]
        total = total + (logp.float() * weight.reshape(logp.shape)).sum()
    if entropy is not None:
        total = total + (entropy.float() * data["w_ent"].reshape(entropy.shape)).sum()
    grads = torch.autograd.grad(total, list(leaves.values()))

    def detach(t):
        return None if t is None else t.detach()

    return {
        "logp": detach(logp),
        "entropy": detach(entropy),
        "fwd": fwd,
        "bwd": log.take(),
        "grads": dict(zip(leaves, grads)),
    }


def _tp_fns(kind: str, group, verl_tp, vocab_size):
    """(ours, verl's or None, single-process) for a case kind."""
    kw = {"group": group, "vocab_size": vocab_size}

    def pair(logp_fn, entropy_fn):
        return lambda x, labels: (logp_fn(x, labels), entropy_fn(x))

    if kind == "logprobs":
        return (
            lambda x, y: (fverl.vocab_parallel_log_probs_from_logits(x, y, **kw), None),
            lambda x, y: (verl_tp.vocab_parallel_log_probs_from_logits(x, y), None),
            lambda x, y: (fverl.logprobs_from_logits(x, y), None),
        )
    if kind == "entropy":
        return (
            lambda x, y: (None, fverl.vocab_parallel_entropy(x, **kw)),
            lambda x, y: (None, verl_tp.vocab_parallel_entropy(x)),
            lambda x, y: (None, fverl.entropy_from_logits(x)),
        )
    if kind == "entropy_chunking":
        return (
            lambda x, y: (None, fverl.vocab_parallel_entropy_with_chunking(x, 4, **kw)),
            lambda x, y: (None, verl_tp.vocab_parallel_entropy_with_chunking(x, chunk_size=4)),
            lambda x, y: (None, fverl.entropy_from_logits(x)),
        )

    def verl_engine(x, labels):  # transformer_impl._lm_head_logits_processor's order
        copy = x.clone()
        entropy = verl_tp.vocab_parallel_entropy(x)
        return verl_tp.vocab_parallel_log_probs_from_logits(copy, labels), entropy

    if kind == "together_default_group":
        kw["group"] = None  # megatron's (the stand-in's): the same group
    return (
        lambda x, y: fverl.vocab_parallel_log_probs_and_entropy(x, y, **kw),
        verl_engine,
        fverl.logprobs_and_entropy_from_logits,
    )


def _tp_case(name: str, world: int, rank: int, group, verl_tp, log) -> dict:
    kind, shape, layout, dtype = TP_CASES[name]
    data = _tp_inputs(name)
    sizes = _tp_sizes(world, layout)
    start = sum(sizes[:rank])
    vocab_size = TP_TRUE_V if layout == "padded" else None
    out = {"start": start, "size": sizes[rank]}
    labels = data["labels"]
    if kind.startswith("linear"):
        reduction = "mean" if kind == "linear_mean" else "none"
        weight = data["weight"][start : start + sizes[rank]]

        def ours(h, w, y):
            return fverl.linear_cross_entropy(h, w, y, 0.7, reduction, group)

        out["ours"] = _tp_run(ours, {"hidden": data["hidden"], "weight": weight}, labels, data, log)
        if rank == 0:
            single = {"hidden": data["hidden"], "weight": data["weight"]}
            out["single"] = _tp_run(
                lambda h, w, y: fverl.linear_cross_entropy(h, w, y, 0.7, reduction),
                single,
                labels,
                data,
                log,
            )

            def torch_ref(h, w, y):
                logp = torch.log_softmax((h.double() @ w.double().T) / 0.7, -1)
                entropy = -(logp.exp() * logp).sum(-1)
                picked = logp.gather(-1, y[..., None]).reshape(-1)
                return picked.mean() if reduction == "mean" else picked, entropy.reshape(-1)

            out["reference"] = _tp_run(torch_ref, single, labels, data, log)
        return out
    part = rank_slice(data["logits"], start, sizes[rank])
    if kind == "bad_label":
        if rank == 0:
            labels = labels.clone()
            labels[0, 0] = TP_V  # one past the vocabulary, on one rank only
        try:
            fverl.vocab_parallel_log_probs_and_entropy(part, labels, group=group)
            out["error"] = None
        except Exception as err:
            out["error"] = (type(err).__name__, str(err))
        out["calls"] = log.take()
        return out
    ours, theirs, single = _tp_fns(kind, group, verl_tp, vocab_size)
    out["ours"] = _tp_run(ours, {"logits": part}, labels, data, log)
    if layout == "even":
        # verl 0.9.1's vocab_parallel_entropy_with_chunking cannot run backward over more than
        # one chunk: each chunk's backward edits its saved logits view in place (sub_ / add_),
        # which bumps the version counter that every chunk's view shares, and autograd then
        # refuses the next chunk ("modified by an inplace operation"). Its values only.
        grad = kind != "entropy_chunking"
        out["verl"] = _tp_run(theirs, {"logits": part}, labels, data, log, grad=grad)
    if rank == 0:
        columns = data["logits"][..., : vocab_size or TP_V]
        out["single"] = _tp_run(single, {"logits": columns}, labels, data, log)
    return out


def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    groups = {2: dist.new_group([0, 1]), 3: dist.group.WORLD}
    group_of = [None]  # what megatron's parallel_state answers, per case
    _megatron_stand_in(group_of)
    torch.compile = _eager_compile
    import verl.utils.megatron.tensor_parallel as verl_tp

    log = CollectiveLog()
    log.install()
    results = {}
    for size, group in groups.items():
        if rank >= size:
            continue
        group_of[0] = group
        for name in TP_CASES:
            try:
                results[(size, name)] = _tp_case(name, size, rank, group, verl_tp, log)
            except Exception:
                results[(size, name)] = {"crash": traceback.format_exc()}
            log.take()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_world(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("verl_tp"))
    args = (3, free_port(), out_dir)
    per_rank = run_world(_tp_worker, 3, args, out_dir, TP_DEADLINE_S, "the gloo world")

    def results(world: int, name: str) -> list[dict]:
        out = [per_rank[rank][(world, name)] for rank in range(world)]
        for rank, result in enumerate(out):
            assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
        return out

    return results


def _tp_compare(mine: dict, truth: dict, tol: dict, what: str) -> None:
    for key in ("logp", "entropy"):
        if truth[key] is None:
            assert mine[key] is None, (what, key)
            continue
        assert mine[key].dtype == torch.float32 and mine[key].shape == truth[key].shape, what
        torch.testing.assert_close(
            mine[key],
            truth[key].to(mine[key].dtype),
            **tol,
            msg=lambda m, k=key: f"{what} {k}: {m}",
        )


def _grad_columns(grad: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Columns [start, start + size) of a gradient over the true vocabulary, zeros past it."""
    part = grad[..., start : start + size]
    pad = size - part.shape[-1]
    return torch.cat([part, part.new_zeros(*part.shape[:-1], pad)], -1) if pad else part


TP_LOGITS_CASES = [n for n, c in TP_CASES.items() if not c[0].startswith(("linear", "bad"))]


@pytest.mark.parametrize("name", TP_LOGITS_CASES)
@pytest.mark.parametrize("world", [2, 3])
def test_megatron_helpers_match_single_process(tp_world, world, name):
    """Every rank: the single-process values of the gathered logits, and its gradient slice (in
    the logits' dtype; padding columns get 0); the same bits on every rank."""
    _, _, layout, dtype = TP_CASES[name]
    per_rank = tp_world(world, name)
    single = per_rank[0]["single"]
    bf16 = dtype == torch.bfloat16
    tol = dict(rtol=1e-5, atol=1e-5)
    for rank, result in enumerate(per_rank):
        ours = result["ours"]
        _tp_compare(ours, single, tol, f"rank {rank} vs single-process")
        grad = ours["grads"]["logits"]
        assert grad.dtype == dtype and grad.shape[-1] == result["size"]
        expected = _grad_columns(single["grads"]["logits"], result["start"], result["size"])
        torch.testing.assert_close(
            grad.float(), expected.float(), **(dict(rtol=1e-2, atol=1e-2) if bf16 else tol)
        )
        for key in ("logp", "entropy"):  # the same bits on every rank
            if ours[key] is not None:
                assert torch.equal(ours[key], per_rank[0]["ours"][key]), (rank, key)
        assert not grad.reshape(-1, grad.shape[-1])[3].any()  # no upstream gradient there
    if layout == "padded":
        last = per_rank[-1]
        width = TP_TRUE_V - last["start"]
        assert not last["ours"]["grads"]["logits"][..., width:].any()
        assert torch.isfinite(last["ours"]["entropy"]).all()


@pytest.mark.parametrize("name", [n for n in TP_LOGITS_CASES if TP_CASES[n][2] == "even"])
@pytest.mark.parametrize("world", [2, 3])
def test_megatron_helpers_match_verl(tp_world, world, name):
    """verl's own helpers (stand-in megatron, see above) on the same slices: the same values and
    gradient slices. verl's entropy is in the logits' dtype (bf16 here: bf16 tolerances)."""
    _, _, _, dtype = TP_CASES[name]
    bf16 = dtype == torch.bfloat16
    for rank, result in enumerate(tp_world(world, name)):
        ours, verls = result["ours"], result["verl"]
        tol = dict(rtol=2e-2, atol=5e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        _tp_compare(ours, verls, tol, f"rank {rank} vs verl")
        if verls["grads"] is None:  # entropy_chunking: see _tp_case
            continue
        mine, theirs = ours["grads"]["logits"], verls["grads"]["logits"]
        assert mine.dtype == theirs.dtype == dtype and mine.shape == theirs.shape
        torch.testing.assert_close(
            mine.float(), theirs.float(), **(dict(rtol=2e-2, atol=2e-2) if bf16 else tol)
        )


@pytest.mark.parametrize("world", [2, 3])
def test_megatron_helpers_collectives(tp_world, world):
    """Ours: the header and one all-gather of 3 fp32 per token in the forward, nothing in the
    backward, whatever they return. verl's: 3 all-reduces per helper, 6 for both."""
    verl_calls = {"logprobs_rmpad": 3, "entropy_thd": 3, "together": 6}
    for name in TP_CASES:
        if TP_CASES[name][0] == "bad_label":
            continue
        for rank, result in enumerate(tp_world(world, name)):
            ours = result["ours"]
            tokens = TP_B * TP_T
            assert [call[0] for call in ours["fwd"]] == ["all_gather_into_tensor"] * 2 or [
                call[0] for call in ours["fwd"]
            ] == ["all_gather_single"] * 2, (name, rank, ours["fwd"])
            assert ours["fwd"][0][1][-1] == ("torch.int64", len(FIELDS)), (name, ours["fwd"])
            assert ours["fwd"][1][1][-1] == ("torch.float32", 3 * tokens), (name, ours["fwd"])
            assert ours["bwd"] == [], (name, rank, ours["bwd"])
            if name in verl_calls:
                names = [call[0] for call in result["verl"]["fwd"]]
                assert names == ["all_reduce"] * verl_calls[name], (name, names)


def test_megatron_default_group_is_megatrons(tp_world):
    """group=None: megatron's tensor-parallel group (here the stand-in's), bit for bit the
    explicit group's result."""
    for world in (2, 3):
        for rank, (default, explicit) in enumerate(
            zip(tp_world(world, "together_default_group"), tp_world(world, "together"))
        ):
            for key in ("logp", "entropy"):
                assert torch.equal(default["ours"][key], explicit["ours"][key]), (world, rank)
            assert torch.equal(
                default["ours"]["grads"]["logits"], explicit["ours"]["grads"]["logits"]
            )


@pytest.mark.parametrize("name", ["linear_none", "linear_mean_uneven"])
@pytest.mark.parametrize("world", [2, 3])
def test_linear_cross_entropy_drop_in(tp_world, world, name):
    """verl's fused-kernel signature on the LM head's rows: the single-process values (and a
    float64 torch reference), flat [N] (a scalar for reduction="mean"); d weight: this rank's
    rows; d hidden: this rank's part, the parts summing to the single-process gradient."""
    per_rank = tp_world(world, name)
    single, ref = per_rank[0]["single"], per_rank[0]["reference"]
    tol = dict(rtol=1e-5, atol=1e-5)
    _tp_compare(single, ref, tol, "single vs float64")
    for rank, result in enumerate(per_rank):
        ours = result["ours"]
        _tp_compare(ours, single, tol, f"rank {rank}")
        assert ours["entropy"].shape == (TP_B * TP_T,)
        assert ours["logp"].shape == (() if name == "linear_mean_uneven" else (TP_B * TP_T,))
        rows = single["grads"]["weight"][result["start"] : result["start"] + result["size"]]
        torch.testing.assert_close(ours["grads"]["weight"], rows, **tol)
    parts = [result["ours"]["grads"]["hidden"] for result in per_rank]
    torch.testing.assert_close(sum(parts), single["grads"]["hidden"], **tol)
    assert not torch.allclose(parts[0], single["grads"]["hidden"])  # a part, not the sum


@pytest.mark.parametrize("world", [2, 3])
def test_megatron_bad_label_raises_on_every_rank(tp_world, world):
    per_rank = tp_world(world, "bad_label")
    errors = [result["error"] for result in per_rank]
    assert errors[0] is not None and errors == [errors[0]] * world, errors
    assert errors[0][0] == "TensorParallelInputError", errors
    assert f"labels must be global token ids in [0, {TP_V})" in errors[0][1], errors
    assert all(len(result["calls"]) == 1 for result in per_rank)  # the header, then nothing


def test_megatron_helpers_need_a_group_without_megatron():
    """Without megatron (as here) the default group cannot be found: a ValueError says to pass
    group=, before any collective; patch_megatron says megatron is missing."""
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron is installed: the default group is megatron's")
    logits, labels = _logits((B, T))
    for call in (
        lambda: fverl.vocab_parallel_log_probs_from_logits(logits, labels),
        lambda: fverl.vocab_parallel_entropy(logits),
        lambda: fverl.vocab_parallel_entropy_with_chunking(logits, 4),
        lambda: fverl.vocab_parallel_log_probs_and_entropy(logits, labels),
    ):
        with pytest.raises(ValueError, match="pass group="):
            call()
    with pytest.raises(ImportError, match="needs megatron-core"):
        fverl.patch_megatron()


def test_linear_cross_entropy_single_process_and_bad_reduction():
    """dist_process_group=None: the whole head on one rank; verl's reductions."""
    gen = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(2, 5, 8, generator=gen), torch.randn(V, 8, generator=gen)
    labels = torch.randint(0, V, (2, 5), generator=gen)
    logp, entropy = fverl.linear_cross_entropy(hidden, weight, labels, 0.5)
    ref = torch.log_softmax(hidden @ weight.T / 0.5, -1)
    torch.testing.assert_close(logp, ref.gather(-1, labels[..., None]).reshape(-1))
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1).reshape(-1))
    total, _ = fverl.linear_cross_entropy(hidden, weight, labels, 0.5, "sum")
    torch.testing.assert_close(total, logp.sum())
    with pytest.raises(ValueError, match="Invalid reduction"):
        fverl.linear_cross_entropy(hidden, weight, labels, 0.5, "max")


def _patch_megatron_once(monkeypatch) -> None:
    import types

    _megatron_stand_in([None])
    try:
        import verl.utils.megatron.tensor_parallel as verl_tp

        original = verl_tp.vocab_parallel_entropy
        engine = types.ModuleType("verl._test_megatron_engine")
        engine.vocab_parallel_entropy = original
        engine.vocab_parallel_log_probs_from_logits = verl_tp.vocab_parallel_log_probs_from_logits
        monkeypatch.setitem(sys.modules, engine.__name__, engine)
        patched = fverl.patch_megatron()
        assert "verl._test_megatron_engine.vocab_parallel_entropy" in patched
        assert f"{fverl.MEGATRON_HELPERS}.vocab_parallel_entropy_with_chunking" in patched
        assert engine.vocab_parallel_entropy is fverl.vocab_parallel_entropy
        assert verl_tp.vocab_parallel_log_probs_from_logits is (
            fverl.vocab_parallel_log_probs_from_logits
        )
        assert fverl.patch_megatron() == []  # idempotent
        from verl.utils.kernel import linear_cross_entropy as lce

        assert lce.linear_cross_entropy is not fverl.linear_cross_entropy
        assert fverl.patch_megatron(fused_kernels=True) == [
            f"{fverl.FUSED_KERNEL_MODULE}.linear_cross_entropy"
        ]
        assert lce.linear_cross_entropy is fverl.linear_cross_entropy
    finally:
        fverl.unpatch_megatron()
        for name in list(sys.modules):
            if name == "megatron" or name.startswith("megatron."):
                del sys.modules[name]
        sys.modules.pop(fverl.MEGATRON_HELPERS, None)
    assert engine.vocab_parallel_entropy is original
    assert verl_tp.vocab_parallel_entropy is original
    assert lce.linear_cross_entropy is not fverl.linear_cross_entropy


def test_patch_megatron(monkeypatch):
    """patch_megatron rebinds verl's Megatron helpers (verl's own module, importable here with
    the megatron stand-in) and the names a module bound from it (as the Megatron engine does);
    unpatch_megatron restores them. Twice: the second time verl's module is imported afresh (new
    function objects), and patching must still find them."""
    if importlib.util.find_spec("megatron") is not None:
        pytest.skip("megatron is installed: no stand-in")
    for _ in range(2):
        _patch_megatron_once(monkeypatch)


def _documented_main_ppo_overrides() -> list[str]:
    """The Hydra overrides of docs/integrations.md's `main_ppo` command, as its shell gives them
    to verl (quotes removed, $HOME expanded)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    block = re.search(r"<!-- verl-main-ppo -->\n```bash\n(.*?)```", text, re.S).group(1)
    command = block.split("verl.trainer.main_ppo", 1)[1].replace("\\\n", " ")
    return [os.path.expandvars(word) for word in shlex.split(command, comments=True)]


def test_the_documented_main_ppo_command_composes_and_runs_the_fused_loss():
    """docs/integrations.md's command, nothing elided: verl's own ppo_trainer config composed
    with its overrides (as main_ppo does, through Hydra; an override verl does not know fails
    here), verl's actor config built from it, and the loss mode it names is fusedrl's,
    registered by the external_lib import."""
    hydra = pytest.importorskip("hydra")
    from verl.utils.config import omega_conf_to_dataclass

    overrides = _documented_main_ppo_overrides()
    assert len(overrides) > 30 and "..." not in " ".join(overrides)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with hydra.initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = hydra.compose(config_name="ppo_trainer", overrides=overrides)
    assert cfg.actor_rollout_ref.model.external_lib == "fusedrl.integrations.verl"
    importlib.import_module(cfg.actor_rollout_ref.model.external_lib)  # what each worker does
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, FSDPActorConfig)
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (
        0.2,
        0.28,
        "token-mean",
    )
    loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    assert loss_fn.__module__ == "fusedrl.integrations.verl", loss_fn
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.name == "vllm"
    assert cfg.data.train_files.endswith("/data/gsm8k/train.parquet")
