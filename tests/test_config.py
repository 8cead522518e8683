"""LossConfig: defaults, presets, replace, and a ValueError naming the field for bad values."""

from __future__ import annotations

import dataclasses

import pytest

from fusedrl import LossConfig
from fusedrl.config import AGGS, KLS, LOSSES, PRESETS


def test_defaults_match_design():
    cfg = LossConfig()
    assert (cfg.loss, cfg.ratio_level, cfg.agg) == ("ppo", "token", "token-mean")
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.2)
    assert cfg.dual_clip_c is None and cfg.delta is None and cfg.kl is None
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.dcpo_r_max) == (1.0, 1.05, 10.0)
    assert (cfg.beta, cfg.entropy_coef, cfg.temperature) == (0.0, 0.0, 1.0)
    assert cfg.is_correction is None and cfg.is_cap == 2.0 and cfg.is_cap_low is None


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LossConfig().eps_low = 0.3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_constructs(name):
    cfg = LossConfig.preset(name)
    assert isinstance(cfg, LossConfig)
    assert LossConfig(**cfg.to_dict()) == cfg


def test_preset_values():
    grpo = LossConfig.preset("grpo")
    assert (grpo.agg, grpo.kl, grpo.beta, grpo.eps_low) == ("seq-mean-token-mean", "k3", 0.04, 0.2)
    dapo = LossConfig.preset("dapo")
    assert (dapo.eps_low, dapo.eps_high, dapo.agg, dapo.beta) == (0.2, 0.28, "token-mean", 0.0)
    gspo = LossConfig.preset("gspo")
    assert (gspo.ratio_level, gspo.eps_low, gspo.eps_high) == ("sequence", 3e-4, 4e-4)
    assert LossConfig.preset("gmpo").eps_low == 0.4
    assert LossConfig.preset("dr_grpo").agg == "seq-mean-token-sum-norm"
    assert set(LossConfig.presets()) == {
        "ppo",
        "grpo",
        "dapo",
        "dr_grpo",
        "lite_ppo",
        "gspo",
        "gspo_token",
        "cispo",
        "sapo",
        "gmpo",
        "dcpo",
        "pg",
        "luspo",
        "vespo",
    }
    luspo = LossConfig.preset("luspo")
    assert (luspo.loss, luspo.ratio_level, luspo.agg) == ("luspo", "sequence", "seq-mean-token-sum")
    vespo = LossConfig.preset("vespo")
    assert (vespo.vespo_k_pos, vespo.vespo_lambda_pos) == (2.0, 3.0)  # TRL's defaults
    assert (vespo.vespo_k_neg, vespo.vespo_lambda_neg) == (3.0, 2.0)


def test_luspo_defaults_to_a_sequence_ratio_summed_per_sequence():
    cfg = LossConfig(loss="luspo")
    assert (cfg.ratio_level, cfg.agg, cfg.eps_low, cfg.eps_high) == (
        "sequence",
        "seq-mean-token-sum",
        3e-4,
        4e-4,
    )
    token = LossConfig(loss="luspo", ratio_level="token", agg="token-mean")
    assert (token.ratio_level, token.agg, token.eps_low) == ("token", "token-mean", 0.2)
    assert LossConfig(loss="luspo", delta=2.0, dual_clip_c=3.0).delta == 2.0


def test_corrections_off_by_default():
    cfg = LossConfig()
    assert not cfg.kl_bias_correction and cfg.off_policy_mask is None
    assert cfg.top_entropy_quantile == 1.0 and not cfg.needs_entropy
    assert LossConfig(top_entropy_quantile=0.2).needs_entropy
    assert LossConfig(entropy_coef=0.01).needs_entropy


def test_variant_dependent_eps_defaults():
    assert (
        LossConfig(ratio_level="sequence").eps_low,
        LossConfig(ratio_level="sequence").eps_high,
    ) == (3e-4, 4e-4)
    assert LossConfig(loss="gmpo").eps_high == 0.4
    assert (LossConfig(loss="dcpo").eps_low, LossConfig(loss="dcpo").eps_high) == (0.16, 0.2)
    assert LossConfig(loss="gmpo", eps_low=0.1).eps_low == 0.1


def test_preset_overrides_and_replace():
    cfg = LossConfig.preset("dapo", entropy_coef=0.01)
    assert cfg.entropy_coef == 0.01 and cfg.eps_high == 0.28
    new = cfg.replace(eps_high=0.3)
    assert new.eps_high == 0.3 and cfg.eps_high == 0.28 and new.entropy_coef == 0.01
    with pytest.raises(ValueError, match="beta"):
        cfg.replace(beta=-1.0)
    with pytest.raises(ValueError, match="unknown field"):
        cfg.replace(epsilon=0.2)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'grpoo'"):
        LossConfig.preset("grpoo")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(loss="ppo2"), "loss"),
        (dict(ratio_level="seq"), "ratio_level"),
        (dict(agg="mean"), "agg"),
        (dict(kl="k4"), "kl"),
        (dict(is_correction="token"), "is_correction"),
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(eps_high=0.0), "eps_high"),
        # CISPO's cap 1 + eps_high may be below 1, never at or below the lower bound 1 - eps_low
        (dict(loss="cispo", eps_low=0.2, eps_high=-0.2), "eps_high"),
        (dict(loss="cispo", eps_high=float("inf")), "eps_high"),
        (dict(eps_high=float("nan")), "eps_high"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(dual_clip_c=0.5), "dual_clip_c"),
        (dict(loss="cispo", dual_clip_c=3.0), "dual_clip_c"),
        (dict(delta=1.1), "delta"),
        (dict(loss="sapo", delta=2.0), "delta"),
        (dict(sapo_tau_pos=0.0), "sapo_tau_pos"),
        (dict(sapo_tau_neg=-1.0), "sapo_tau_neg"),
        (dict(dcpo_r_max=1.0), "dcpo_r_max"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(beta=-0.1), "beta"),
        (dict(beta=0.04), "beta"),  # beta > 0 without a KL estimator
        (dict(beta=True, kl="k3"), "beta"),
        (dict(entropy_coef=float("nan")), "entropy_coef"),
        (dict(is_cap=0.0, is_correction="token_mask"), "is_cap"),
        (dict(is_cap_low=3.0, is_cap=2.0, is_correction="token_mask"), "is_cap_low"),
        (dict(is_cap_low=0.5), "is_cap_low"),  # without is_correction
        (dict(norm_constant=100.0), "norm_constant"),  # only for seq-mean-token-sum-norm
        (dict(agg="seq-mean-token-sum-norm", norm_constant=0.0), "norm_constant"),
        (dict(loss="pg", ratio_level="sequence"), "ratio_level"),
        (dict(loss="gmpo", ratio_level="sequence"), "ratio_level"),
        (dict(loss="gmpo", is_correction="token_truncate"), "is_correction"),
        (dict(loss="vespo", is_correction="sequence_truncate"), "is_correction"),
        (dict(loss="vespo", vespo_k_pos=0.0), "vespo_k_pos"),
        (dict(loss="vespo", vespo_lambda_neg=-1.0), "vespo_lambda_neg"),
        (dict(loss="vespo", vespo_lambda_pos=float("nan")), "vespo_lambda_pos"),
        (dict(kl_bias_correction=1), "kl_bias_correction"),
        (dict(kl_clamp="no"), "kl_clamp"),
        (dict(off_policy_mask=-0.1), "off_policy_mask"),
        (dict(off_policy_mask=float("inf")), "off_policy_mask"),
        (dict(loss="gmpo", off_policy_mask=0.1), "off_policy_mask"),
        (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
        (dict(loss="gmpo", top_entropy_quantile=0.5), "top_entropy_quantile"),
        (dict(loss="vespo", delta=2.0), "delta"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)


def test_a_cispo_cap_below_one_is_accepted():
    """TRL's cispo with epsilon_high <= 1 (its default when unset: epsilon = 0.2)."""
    assert LossConfig(loss="cispo", eps_low=1 - 1e-12, eps_high=-0.8).eps_high == -0.8
    with pytest.raises(ValueError, match="eps_high must be > 0"):
        LossConfig(loss="ppo", eps_high=-0.1)


def test_all_choices_accepted():
    for loss in LOSSES:
        LossConfig(loss=loss, dro_beta=0.1 if loss == "dro" else None)
    for agg in AGGS:
        LossConfig(agg=agg)
    for kl in KLS:
        LossConfig(kl=kl, beta=0.1)
    LossConfig(agg="seq-mean-token-sum-norm", norm_constant=4096)
    LossConfig(dual_clip_c=3.0, delta=2.0)


def test_is_sequence_level():
    assert LossConfig.preset("gspo").is_sequence_level
    assert LossConfig.preset("luspo").is_sequence_level
    assert LossConfig.preset("vespo").is_sequence_level  # phi of the whole sequence's ratio
    assert LossConfig(off_policy_mask=0.1).is_sequence_level
    assert LossConfig(top_entropy_quantile=0.5).is_sequence_level  # a quantile of the batch
    assert LossConfig.preset("gmpo").is_sequence_level
    assert LossConfig(is_correction="sequence_mask").is_sequence_level
    assert not LossConfig.preset("dapo").is_sequence_level
