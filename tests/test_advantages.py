"""Tests for fusedrl.advantages (outcome advantages, DCPO SAS, DAPO/DUPO rollout tricks)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from fusedrl import advantages as adv

# --------------------------------------------------------------------------------------------
# independent loop references (python floats, no shared code with the module)
# --------------------------------------------------------------------------------------------


def _mean(xs):
    return sum(xs) / len(xs)


def _ustd(xs):
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _groups(rewards, g):
    vals = rewards.double().tolist()
    return [vals[i : i + g] for i in range(0, len(vals), g)]


def ref_grpo(rewards, g, eps):
    out = []
    for grp in _groups(rewards, g):
        m, s = _mean(grp), _ustd(grp)
        out += [(x - m) / (s + eps) for x in grp]
    return torch.tensor(out, dtype=torch.float32)


def ref_rloo(rewards, g):
    out = []
    for grp in _groups(rewards, g):
        for i, x in enumerate(grp):
            others = grp[:i] + grp[i + 1 :]
            out.append(x - _mean(others) if others else 0.0)
    return torch.tensor(out, dtype=torch.float32)


def ref_whiten(vals, eps):
    m, s = _mean(vals), _ustd(vals)
    return torch.tensor([(x - m) / (s + eps) for x in vals], dtype=torch.float32)


def rand_rewards(num_groups, g, seed, binary=False):
    gen = torch.Generator().manual_seed(seed)
    if binary:
        return torch.randint(0, 2, (num_groups * g,), generator=gen).float()
    return torch.randn(num_groups * g, generator=gen)


GROUPED = [adv.grpo, adv.dr_grpo, adv.lite_ppo, adv.reinforce_pp_baseline, adv.rloo]


# --------------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------------


def test_grpo_hand_computed():
    # mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    out = adv.grpo(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_grpo_default_eps_is_verl_epsilon():
    out = adv.grpo(torch.tensor([1.0, 0.0]), 2)
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out, torch.tensor([expected, -expected]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -0.7, 1e6 + 0.3])
def test_grpo_identical_rewards_exactly_zero(g, value, eps):
    rewards = torch.full((3 * g,), value)
    out = adv.grpo(rewards, g, eps=eps)
    assert not torch.isnan(out).any()
    assert torch.equal(out, torch.zeros(3 * g))


@pytest.mark.parametrize("fn", [adv.lite_ppo, adv.reinforce_pp_baseline])
def test_eps_zero_constant_inputs_give_zero_not_nan(fn):
    assert torch.equal(fn(torch.full((6,), 0.1), 3, eps=0.0), torch.zeros(6))
    assert torch.equal(adv.reinforce_pp(torch.full((6,), 0.1), eps=0.0), torch.zeros(6))


@pytest.mark.parametrize("g", [2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_per_group_loop(g, seed):
    rewards = rand_rewards(5, g, seed)
    torch.testing.assert_close(adv.grpo(rewards, g), ref_grpo(rewards, g, 1e-6))


def test_grpo_mixed_constant_and_varied_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.3, 0.3, 0.3])
    out = adv.grpo(rewards, 3)
    assert torch.equal(out[:3], torch.zeros(3))
    assert torch.equal(out[6:], torch.zeros(3))
    torch.testing.assert_close(out, ref_grpo(rewards, 3, 1e-6))


# --------------------------------------------------------------------------------------------
# Dr.GRPO, RLOO, zero-mean property
# --------------------------------------------------------------------------------------------


def test_dr_grpo_hand_computed():
    out = adv.dr_grpo(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), 2)
    torch.testing.assert_close(out[:4], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    torch.testing.assert_close(out[4:], torch.tensor([-1.0, 1.0]))


def test_dr_grpo_has_no_std_scaling():
    rewards = torch.tensor([10.0, 0.0])
    torch.testing.assert_close(adv.dr_grpo(rewards, 2), torch.tensor([5.0, -5.0]))


@pytest.mark.parametrize("fn", [adv.grpo, adv.dr_grpo, adv.rloo])
@pytest.mark.parametrize("g", [2, 5])
def test_zero_mean_within_each_group(fn, g):
    rewards = rand_rewards(6, g, seed=3)
    out = fn(rewards, g).view(-1, g)
    torch.testing.assert_close(out.sum(dim=1), torch.zeros(6), rtol=0, atol=1e-5)
    assert out.abs().sum() > 1.0  # not trivially zero


def test_rloo_hand_computed():
    out = adv.rloo(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    torch.testing.assert_close(out, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


@pytest.mark.parametrize("g", [2, 3, 7])
def test_rloo_matches_leave_one_out_loop(g):
    rewards = rand_rewards(4, g, seed=g)
    torch.testing.assert_close(adv.rloo(rewards, g), ref_rloo(rewards, g))


def test_rloo_group_size_one_is_zero():
    assert torch.equal(adv.rloo(torch.tensor([1.0, 0.0, 0.5]), 1), torch.zeros(3))


def test_rloo_is_scaled_dr_grpo():
    rewards = rand_rewards(3, 4, seed=9)
    torch.testing.assert_close(adv.rloo(rewards, 4), adv.dr_grpo(rewards, 4) * 4 / 3)


@pytest.mark.parametrize("fn", GROUPED)
@pytest.mark.parametrize("value", [0.1, 0.3, 0.9, 1e6 + 0.3])
def test_constant_groups_exactly_zero_despite_float_mean_rounding(fn, value):
    # in float32, 8 copies of 0.1 minus their mean is ~7e-9, not 0: the estimators must not leak
    g = 8
    rewards = torch.cat([torch.full((g,), value), torch.arange(g, dtype=torch.float32)])
    out = fn(rewards, g)
    assert torch.equal(out[:g], torch.zeros(g))
    assert out[g:].abs().min() > 0


# --------------------------------------------------------------------------------------------
# LitePPO
# --------------------------------------------------------------------------------------------


def test_lite_ppo_uses_batch_std():
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0])
    batch_std = math.sqrt((1.75**2 + 2.75**2 + 2 * 2.25**2) / 3)  # unbiased std of all four
    expected = torch.tensor([0.5 / batch_std, -0.5 / batch_std, 0.0, 0.0])
    out = adv.lite_ppo(rewards, 2, eps=0.0)
    torch.testing.assert_close(out, expected)
    # group-std GRPO gives +-1/sqrt(2) for the first group: clearly different
    assert (out - adv.grpo(rewards, 2, eps=0.0)).abs().max() > 0.4


def test_lite_ppo_matches_reference():
    rewards = rand_rewards(4, 4, seed=5)
    vals = rewards.double().tolist()
    s = _ustd(vals)
    expected = []
    for grp in _groups(rewards, 4):
        m = _mean(grp)
        expected += [(x - m) / (s + 1e-6) for x in grp]
    torch.testing.assert_close(adv.lite_ppo(rewards, 4), torch.tensor(expected))


def test_lite_ppo_degenerate_cases_zero():
    assert torch.equal(adv.lite_ppo(torch.tensor([0.3]), 1), torch.zeros(1))
    assert torch.equal(adv.lite_ppo(torch.full((8,), 0.1), 4), torch.zeros(8))
    assert torch.equal(adv.lite_ppo(torch.tensor([0.0, 1.0]), 1), torch.zeros(2))


# --------------------------------------------------------------------------------------------
# REINFORCE++ and REINFORCE++-baseline
# --------------------------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    out = adv.reinforce_pp(torch.tensor([0.0, 1.0, 2.0]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0]))


def test_reinforce_pp_batch_mean_zero_std_one():
    rewards = rand_rewards(8, 4, seed=11) * 3.0 + 2.0
    out = adv.reinforce_pp(rewards)
    torch.testing.assert_close(out.mean(), torch.tensor(0.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.std(), torch.tensor(1.0), rtol=0, atol=1e-5)
    torch.testing.assert_close(out, ref_whiten(rewards.double().tolist(), 1e-6))


def test_reinforce_pp_degenerate_cases_zero():
    assert torch.equal(adv.reinforce_pp(torch.full((5,), 0.1)), torch.zeros(5))
    assert torch.equal(adv.reinforce_pp(torch.tensor([3.0])), torch.zeros(1))
    assert adv.reinforce_pp(torch.empty(0)).shape == (0,)


def test_reinforce_pp_baseline_matches_reference():
    rewards = rand_rewards(5, 4, seed=2) + torch.arange(20.0) // 4  # distinct group means
    centered = []
    for grp in _groups(rewards, 4):
        m = _mean(grp)
        centered += [x - m for x in grp]
    expected = ref_whiten(centered, 1e-6)
    out = adv.reinforce_pp_baseline(rewards, 4)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.mean(), torch.tensor(0.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.std(), torch.tensor(1.0), rtol=0, atol=1e-5)
    # the group baseline matters: plain batch whitening differs
    assert (out - adv.reinforce_pp(rewards)).abs().max() > 0.1


def test_reinforce_pp_baseline_all_constant_groups_zero():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.1, 0.1])
    assert torch.equal(adv.reinforce_pp_baseline(rewards, 2), torch.zeros(6))
    assert torch.equal(adv.reinforce_pp_baseline(torch.tensor([0.5, 2.0]), 1), torch.zeros(2))


# --------------------------------------------------------------------------------------------
# common properties: dtype, device, sync-free, validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_is_fp32(fn, dtype):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=dtype)
    out = fn(rewards, 2)
    assert out.dtype == torch.float32 and out.shape == (4,)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("fn", GROUPED)
def test_grouped_estimators_are_sync_free(fn):
    # meta tensors carry no data: any .item()/nonzero/host read would raise
    out = fn(torch.empty(12, device="meta"), 4)
    assert out.device.type == "meta" and out.shape == (12,) and out.dtype == torch.float32


def test_other_tensor_functions_are_sync_free():
    r = torch.empty(12, device="meta")
    assert adv.reinforce_pp(r).device.type == "meta"
    assert adv.dynamic_sampling_filter(r, 4).shape == (3,)
    lengths = torch.empty(12, device="meta", dtype=torch.long)
    assert adv.soft_overlong_punishment(lengths, 100, 10).device.type == "meta"


def test_does_not_modify_input():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    before = rewards.clone()
    for fn in GROUPED:
        fn(rewards, 2)
    adv.reinforce_pp(rewards)
    assert torch.equal(rewards, before)


@pytest.mark.parametrize("fn", GROUPED)
def test_group_size_validation(fn):
    rewards = torch.zeros(6)
    with pytest.raises(ValueError, match="group_size"):
        fn(rewards, 4)  # 6 % 4 != 0
    with pytest.raises(ValueError, match="group_size"):
        fn(rewards, 0)
    with pytest.raises(TypeError, match="group_size"):
        fn(rewards, 2.0)


@pytest.mark.parametrize("fn", GROUPED)
def test_rewards_validation(fn):
    with pytest.raises(ValueError, match="rewards"):
        fn(torch.zeros(2, 3), 3)
    with pytest.raises(ValueError, match="rewards"):
        fn(torch.zeros(6, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="rewards"):
        fn([0.0, 1.0], 2)
    with pytest.raises(ValueError, match="rewards"):
        adv.reinforce_pp(torch.zeros(2, 3))


@pytest.mark.parametrize("fn", [adv.grpo, adv.lite_ppo, adv.reinforce_pp_baseline])
def test_eps_validation(fn):
    with pytest.raises(ValueError, match="eps"):
        fn(torch.zeros(4), 2, eps=-1e-3)
    with pytest.raises(ValueError, match="eps"):
        adv.reinforce_pp(torch.zeros(4), eps=float("nan"))


# --------------------------------------------------------------------------------------------
# unscorable (non-finite) rewards: out of every statistic, advantage 0 (TRL's nan rule)
# --------------------------------------------------------------------------------------------


UNSCORABLE = torch.tensor(
    [1.0, float("nan"), 0.0, 0.5]  # a NaN among scored rewards
    + [float("inf"), 0.2, 0.2, 0.9]  # an inf
    + [float("nan")] * 4  # nothing scored
    + [0.3, float("-inf"), 0.3, 0.3]  # the scored ones all equal
    + [2.0, float("nan"), float("nan"), float("nan")]  # one scored
    + [0.1, 0.7, -0.4, 1.3]  # a plain group
)


def _group_reference(kind, rewards, g, eps):
    """Per group over its scored rewards: grpo / dr_grpo / rloo / the baseline of the others."""
    out = []
    for grp in _groups(rewards, g):
        scored = [x for x in grp if math.isfinite(x)]
        m = _mean(scored) if scored else 0.0
        s = _ustd(scored)
        for x in grp:
            if not math.isfinite(x) or max(scored) == min(scored):
                out.append(0.0)
            elif kind == "grpo":
                out.append((x - m) / (s + eps))
            elif kind == "dr_grpo":
                out.append(x - m)
            else:  # rloo
                others = list(scored)
                others.remove(x)
                out.append(x - _mean(others))
    return torch.tensor(out, dtype=torch.float64)


def _batch_reference(values, eps):
    scored = [x for x in values if math.isfinite(x)]
    m, s = _mean(scored), _ustd(scored)
    same = max(scored) == min(scored)
    return torch.tensor(
        [0.0 if not math.isfinite(x) or same else (x - m) / (s + eps) for x in values],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unscorable_rewards_sit_out_every_statistic(dtype):
    rewards, g, eps = UNSCORABLE.to(dtype), 4, 1e-4  # TRL's eps
    vals = rewards.double().tolist()
    want = {
        "grpo": _group_reference("grpo", rewards, g, eps),
        "dr_grpo": _group_reference("dr_grpo", rewards, g, eps),
        "rloo": _group_reference("rloo", rewards, g, eps),
        "reinforce_pp": _batch_reference(vals, eps),
    }
    centered = _group_reference("dr_grpo", rewards, g, eps).tolist()
    baseline = [c if math.isfinite(v) else math.nan for c, v in zip(centered, vals)]
    want["reinforce_pp_baseline"] = _batch_reference(baseline, eps)
    batch_std = _ustd([x for x in vals if math.isfinite(x)])
    want["lite_ppo"] = torch.tensor([c / (batch_std + eps) for c in centered], dtype=torch.float64)
    got = {
        "grpo": adv.grpo(rewards, g, eps=eps),
        "dr_grpo": adv.dr_grpo(rewards, g),
        "rloo": adv.rloo(rewards, g),
        "reinforce_pp": adv.reinforce_pp(rewards, eps=eps),
        "reinforce_pp_baseline": adv.reinforce_pp_baseline(rewards, g, eps=eps),
        "lite_ppo": adv.lite_ppo(rewards, g, eps=eps),
    }
    for name, out in got.items():
        assert torch.isfinite(out).all(), name
        assert out.abs().sum() > 1.0, name  # not trivially zero
        torch.testing.assert_close(out.double(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(adv.grpo(rewards, g)[~torch.isfinite(rewards)], torch.zeros(10))


def test_trl_nan_rule_in_numbers():
    """TRL 1.16's scale_rewards="group" on [1, nan, 0, 1]: nanmean 2/3, nanstd 0.5774, eps 1e-4."""
    out = adv.grpo(torch.tensor([1.0, float("nan"), 0.0, 1.0]), 4, eps=1e-4)
    std = math.sqrt(1.0 / 3.0)
    want = torch.tensor(
        [(1 / 3) / (std + 1e-4), 0.0, -(2 / 3) / (std + 1e-4), (1 / 3) / (std + 1e-4)]
    )
    torch.testing.assert_close(out, want)


def test_dynamic_sampling_filter_reads_scored_rewards_only():
    keep = adv.dynamic_sampling_filter(UNSCORABLE, 4)
    assert keep.tolist() == [True, True, False, False, False, True]


# --------------------------------------------------------------------------------------------
# DCPO smooth advantage standardization
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rewards",
    [[1e8, 1e8 + 1, 1e8, 1e8 + 1], [1000, 1000 + 1e-5, 1000, 1000 + 1e-5], [1e4, 1e4 + 1e-4] * 2],
)
def test_sas_keeps_the_spread_of_rewards_with_a_large_offset(rewards):
    """A running sum of squares cancelled here (first visit +-500000 where GRPO says +-0.866)."""
    rewards = torch.tensor(rewards, dtype=torch.float64)
    sas = adv.SmoothAdvantageStandardizer()
    first = sas(rewards, 4, ["p"])
    torch.testing.assert_close(first, adv.grpo(rewards, 4), rtol=1e-5, atol=1e-6)
    assert first.abs().max() > 0.5
    second = sas(rewards.flip(0), 4, ["p"])  # visit 2: half this group's, half all 8 rewards'
    vals = rewards.flip(0).tolist()
    history = vals * 2
    m, s_all = _mean(history), _ustd(history)
    want = [0.5 * a + 0.5 * (x - m) / (s_all + 1e-6) for a, x in zip(first.flip(0).tolist(), vals)]
    torch.testing.assert_close(second, torch.tensor(want, dtype=torch.float32))


def test_sas_unscorable_rewards():
    sas = adv.SmoothAdvantageStandardizer(eps=0.0)
    nan = float("nan")
    out = sas(torch.tensor([1.0, nan, 0.0, 1.0, nan, nan, nan, nan]), 4, ["a", "b"])
    want = adv.grpo(torch.tensor([1.0, nan, 0.0, 1.0]), 4, eps=0.0)
    torch.testing.assert_close(out[:4], want)
    assert out[1] == 0 and torch.equal(out[4:], torch.zeros(4))
    assert sas.num_visits("a") == 1 and sas.num_visits("b") == 0  # nothing scored: no visit
    out = sas(torch.tensor([0.0, 0.0, float("inf"), 1.0]), 4, ["a"])  # history of 6 scored
    assert torch.isfinite(out).all() and out[2] == 0 and sas.num_visits("a") == 2


def test_sas_loads_a_state_saved_with_sums_of_squares():
    """Checkpoints written before 2026-11-30 hold sum / sumsq: a resumed run reads them."""
    sas = adv.SmoothAdvantageStandardizer()
    first = torch.tensor([1.0, 0.0, 0.0, 2.0])
    sas(first, 4, ["p"])
    old = {
        "eps": 1e-6,
        "keys": ["p"],
        "visits": torch.tensor([1]),
        "count": torch.tensor([4]),
        "sum": torch.tensor([3.0], dtype=torch.float64),
        "sumsq": torch.tensor([5.0], dtype=torch.float64),
        "min": torch.tensor([0.0], dtype=torch.float64),
        "max": torch.tensor([2.0], dtype=torch.float64),
    }
    restored = adv.SmoothAdvantageStandardizer()
    restored.load_state_dict(old)
    nxt = torch.tensor([0.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(restored(nxt, 4, ["p"]), sas(nxt, 4, ["p"]))


def test_sas_first_visit_equals_grpo():
    rewards = rand_rewards(4, 5, seed=7, binary=True)
    rewards[:5] = 1.0  # one constant group
    sas = adv.SmoothAdvantageStandardizer()
    out = sas(rewards, 5, ["a", "b", "c", "d"])
    torch.testing.assert_close(out, adv.grpo(rewards, 5))
    assert torch.equal(out[:5], torch.zeros(5))
    assert out.dtype == torch.float32
    assert all(sas.num_visits(k) == 1 for k in "abcd") and len(sas) == 4


def test_sas_second_visit_weights_are_symmetric():
    # i = 2: SA_new == SA_total == (A_new + A_total) / 2
    sas = adv.SmoothAdvantageStandardizer(eps=0.0)
    sas(torch.tensor([1.0, 0.0]), 2, ["p"])
    out = sas(torch.tensor([1.0, 1.0]), 2, ["p"])
    # A_new = 0; history [1, 0, 1, 1]: mean 0.75, std 0.5 -> A_total = 0.5
    torch.testing.assert_close(out, torch.tensor([0.25, 0.25]))
    assert sas.num_visits("p") == 2


def test_sas_third_visit_constant_group_picks_sa_new():
    sas = adv.SmoothAdvantageStandardizer(eps=0.0)
    sas(torch.tensor([1.0, 0.0]), 2, ["p"])
    sas(torch.tensor([1.0, 1.0]), 2, ["p"])
    out = sas(torch.tensor([1.0, 1.0]), 2, ["p"])
    # history [1,0,1,1,1,1]: mean 5/6, var 1/6 -> A_total = (1/6)/sqrt(1/6) = sqrt(1/6)
    # SA_new = 2/3*0 + 1/3*A_total, SA_total = 1/3*0 + 2/3*A_total -> pick SA_new
    a_total = math.sqrt(1 / 6)
    torch.testing.assert_close(out, torch.full((2,), a_total / 3))


def test_sas_third_visit_picks_per_element():
    sas = adv.SmoothAdvantageStandardizer(eps=0.0)
    sas(torch.tensor([1.0, 1.0]), 2, [7])
    sas(torch.tensor([1.0, 1.0]), 2, [7])
    out = sas(torch.tensor([1.0, 0.0]), 2, [7])
    a_new = [math.sqrt(0.5), -math.sqrt(0.5)]  # group [1, 0]: mean .5, std sqrt(.5)
    s_tot = math.sqrt(1 / 6)  # history [1,1,1,1,1,0]: mean 5/6, var 1/6
    a_tot = [(1 - 5 / 6) / s_tot, (0 - 5 / 6) / s_tot]
    sa_new = [2 / 3 * n + 1 / 3 * t for n, t in zip(a_new, a_tot)]
    sa_tot = [1 / 3 * n + 2 / 3 * t for n, t in zip(a_new, a_tot)]
    # r=1: SA_new 0.6075 vs SA_total 0.5079 -> SA_total; r=0: -1.1518 vs -1.5965 -> SA_new
    expected = torch.tensor([sa_tot[0], sa_new[1]])
    assert abs(sa_tot[0]) < abs(sa_new[0]) and abs(sa_new[1]) < abs(sa_tot[1])
    torch.testing.assert_close(out, expected)


def test_sas_prompts_are_independent_and_repeat_key_counts_as_visit():
    sas = adv.SmoothAdvantageStandardizer(eps=0.0)
    sas(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, ["x", "y"])
    out = sas(torch.tensor([1.0, 1.0, 1.0, 0.0]), 2, ["x", "z"])
    # x: second visit, same as test_sas_second_visit_weights_are_symmetric; z: first visit
    torch.testing.assert_close(out[:2], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(out[2:], torch.tensor([math.sqrt(0.5), -math.sqrt(0.5)]))
    assert sas.num_visits("y") == 1 and sas.num_visits("w") == 0
    # the same key twice within one call: processed in order, two visits
    sas2 = adv.SmoothAdvantageStandardizer(eps=0.0)
    out2 = sas2(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, ["p", "p"])
    assert sas2.num_visits("p") == 2
    torch.testing.assert_close(out2[2:], torch.tensor([0.25, 0.25]))


def test_sas_state_dict_round_trip():
    sas = adv.SmoothAdvantageStandardizer()
    keys = ["q0", "q1", 2, ("t", 3)]
    for seed in range(3):
        sas(rand_rewards(4, 4, seed=seed, binary=True), 4, keys)
    state = sas.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = adv.SmoothAdvantageStandardizer(eps=0.5)
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert restored.eps == sas.eps
    fresh = adv.SmoothAdvantageStandardizer()
    nxt = rand_rewards(4, 4, seed=100, binary=True)
    nxt[:4] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    a, b = sas(nxt, 4, keys), restored(nxt, 4, keys)
    assert torch.equal(a, b)
    assert not torch.equal(a, fresh(nxt, 4, keys))  # history actually matters
    assert restored.num_visits("q0") == 4


def test_sas_validation():
    sas = adv.SmoothAdvantageStandardizer()
    with pytest.raises(ValueError, match="prompt_keys"):
        sas(torch.zeros(4), 2, ["a"])
    with pytest.raises(ValueError, match="group_size"):
        sas(torch.zeros(4), 3, ["a"])
    with pytest.raises(TypeError, match="prompt_keys"):
        sas(torch.zeros(4), 2, [["a"], ["b"]])
    with pytest.raises(ValueError, match="eps"):
        adv.SmoothAdvantageStandardizer(eps=-1.0)
    assert len(sas) == 0  # failed calls did not record anything


# --------------------------------------------------------------------------------------------
# DAPO soft overlong punishment and overlong filtering
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_soft_overlong_punishment_values(dtype):
    lengths = torch.tensor([0, 50, 80, 81, 90, 99, 100, 101, 1000], dtype=dtype)
    out = adv.soft_overlong_punishment(lengths, max_length=100, cache_length=20)
    expected = torch.tensor([0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0])
    torch.testing.assert_close(out, expected)
    assert out.dtype == torch.float32
    assert out[4].item() == -0.5  # exactly at the middle of the cache zone


def test_soft_overlong_punishment_edge_cache_lengths():
    lengths = torch.tensor([0, 50, 100, 101])
    no_zone = adv.soft_overlong_punishment(lengths, 100, 0)
    assert torch.equal(no_zone, torch.tensor([0.0, 0.0, 0.0, -1.0]))
    full_zone = adv.soft_overlong_punishment(lengths, 100, 100)
    torch.testing.assert_close(full_zone, torch.tensor([0.0, -0.5, -1.0, -1.0]))


def test_soft_overlong_punishment_validation():
    lengths = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="cache_length"):
        adv.soft_overlong_punishment(lengths, 10, 11)
    with pytest.raises(ValueError, match="cache_length"):
        adv.soft_overlong_punishment(lengths, 10, -1)
    with pytest.raises(ValueError, match="max_length"):
        adv.soft_overlong_punishment(lengths, 0, 0)
    with pytest.raises(ValueError, match="lengths"):
        adv.soft_overlong_punishment(torch.tensor([True]), 10, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_overlong_filter_zeroes_exactly_truncated_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).to(dtype)
    mask[:, 0] = 1
    before = mask.clone()
    truncated = torch.tensor([False, True, False, True, False])
    out = adv.overlong_filter(mask, truncated)
    assert out.dtype == dtype and out.shape == mask.shape
    assert not out[truncated].any()
    assert torch.equal(out[~truncated], mask[~truncated])
    assert torch.equal(mask, before)  # a copy, input untouched


def test_overlong_filter_validation():
    mask = torch.ones(3, 4)
    with pytest.raises(ValueError, match="truncated"):
        adv.overlong_filter(mask, torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="truncated"):
        adv.overlong_filter(mask, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="mask"):
        adv.overlong_filter(torch.ones(3), torch.tensor([True, False, True]))


# --------------------------------------------------------------------------------------------
# DAPO dynamic sampling filter and DUPO duplicate fill
# --------------------------------------------------------------------------------------------


def test_dynamic_sampling_filter_binary_rewards():
    rewards = torch.tensor(
        [0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1], dtype=torch.float32
    )
    keep = adv.dynamic_sampling_filter(rewards, 4)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, True]
    correct = rewards.view(-1, 4).sum(dim=1)
    assert torch.equal(keep, (correct > 0) & (correct < 4))


def test_dynamic_sampling_filter_general_rewards_and_expand():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.9, -1.0, -1.0])
    keep = adv.dynamic_sampling_filter(rewards, 2)
    assert keep.tolist() == [False, True, False]
    rows = adv.expand_group_mask(keep, 2)
    assert rows.tolist() == [False, False, True, True, False, False]
    assert not adv.dynamic_sampling_filter(torch.tensor([1.0, 0.0]), 1).any()
    with pytest.raises(ValueError, match="group_size"):
        adv.dynamic_sampling_filter(rewards, 4)
    with pytest.raises(ValueError, match="group_keep"):
        adv.expand_group_mask(torch.tensor([1, 0]), 2)


@pytest.mark.parametrize("target", [4, 5, 7, 9, 10, 16, 17])
@pytest.mark.parametrize("seed", range(4))
def test_dupo_fill_properties(target, seed):
    keep = torch.tensor([False, True, True, False, True, False, False, True])
    kept = [1, 2, 4, 7]
    idx = adv.dupo_fill(keep, target, generator=torch.Generator().manual_seed(seed))
    assert idx.dtype == torch.int64 and idx.shape == (target,)
    values = idx.tolist()
    assert values[:4] == kept  # every kept group once, in order
    assert set(values) == set(kept)  # only kept groups
    counts = [values.count(k) for k in kept]
    assert max(counts) - min(counts) <= 1  # duplicates spread evenly


def test_dupo_fill_duplicates_are_distinct_when_deficit_below_kept():
    keep = torch.ones(10, dtype=torch.bool)
    for seed in range(20):
        idx = adv.dupo_fill(keep, 19, generator=torch.Generator().manual_seed(seed)).tolist()
        assert idx[:10] == list(range(10))
        assert len(set(idx[10:])) == 9  # 9 distinct extra copies, no group tripled


def test_dupo_fill_more_kept_than_target_and_determinism():
    keep = torch.tensor([True, False, True, True, True, False])
    assert adv.dupo_fill(keep, 3).tolist() == [0, 2, 3]
    assert adv.dupo_fill(keep, 4).tolist() == [0, 2, 3, 4]
    keep = torch.ones(10, dtype=torch.bool)
    keep[::3] = False

    def fill(seed):
        return adv.dupo_fill(keep, 10, generator=torch.Generator().manual_seed(seed)).tolist()

    assert fill(1) == fill(1)
    assert len({tuple(fill(s)) for s in range(8)}) > 1  # the duplicates are random


def test_dupo_fill_raises_when_nothing_kept():
    with pytest.raises(ValueError, match="no group was kept"):
        adv.dupo_fill(torch.zeros(4, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="target_num_groups"):
        adv.dupo_fill(torch.ones(4, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="group_keep"):
        adv.dupo_fill(torch.ones(4), 4)


def test_dupo_end_to_end_batch_has_signal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    keep = adv.dynamic_sampling_filter(rewards, 2)
    idx = adv.dupo_fill(keep, 4, generator=torch.Generator().manual_seed(0))
    rows = adv.expand_group_indices(idx, 2)
    assert rows.shape == (8,)
    batch = rewards[rows]
    assert adv.dynamic_sampling_filter(batch, 2).all()
    assert adv.expand_group_indices(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]
