"""The oracle itself: float64 gradcheck of every variant and hand-derived cases."""

from __future__ import annotations

import math

import pytest
import torch

from fusedrl import LossConfig, reference
from fusedrl.reference import kl_estimate, ratio_bounds

from .conftest import ALL_PRESETS, make_batch

VARIANTS = {f"preset:{name}": LossConfig.preset(name) for name in ALL_PRESETS} | {
    "ppo+dual_clip": LossConfig(dual_clip_c=1.5, eps_low=0.1),
    "ppo+delta": LossConfig(delta=1.25, eps_high=0.1),
    "ppo+entropy": LossConfig(entropy_coef=0.05),
    "ppo+temperature": LossConfig(temperature=0.7),
    "gspo+dual": LossConfig(ratio_level="sequence", dual_clip_c=2.0, eps_low=0.05, eps_high=0.05),
    # k1+ / k3+ are straight-through (value != gradient's integral): see the test below.
    **{f"kl:{kind}": LossConfig(kl=kind, beta=0.1) for kind in ("k1", "k2", "abs", "k3")},
    **{
        f"is:{mode}": LossConfig(is_correction=mode, is_cap=1.3)
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    },
    "is:token_mask+low": LossConfig(is_correction="token_mask", is_cap=1.3, is_cap_low=0.9),
    "gmpo+seq_is": LossConfig(loss="gmpo", is_correction="sequence_truncate", is_cap=1.1),
    **{
        f"agg:{agg}": LossConfig(agg=agg)
        for agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm")
    },
    "agg:norm_constant": LossConfig(agg="seq-mean-token-sum-norm", norm_constant=11.0),
}


# CISPO, GSPO (and LUSPO, its sequence ratio) and VESPO put a stop-gradient inside the objective,
# so their gradient is by design not the derivative of their value: they are checked against an
# equivalent pg surrogate (below, and tests/test_corrections.py for VESPO) instead.
STOP_GRADIENT = {
    "preset:cispo",
    "preset:gspo",
    "preset:gspo_token",
    "gspo+dual",
    "preset:luspo",
    "preset:vespo",
}


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - STOP_GRADIENT))
def test_gradcheck_float64(name):
    cfg = VARIANTS[name]
    per_token_adv = name in ("preset:gspo_token", "preset:dcpo")
    data = make_batch(
        batch=3,
        time=4,
        vocab=7,
        dtype=torch.float64,
        seed=1,
        per_token_adv=per_token_adv,
        old_noise=0.15,
    )
    if cfg.ratio_level == "sequence":  # keep sequence ratios off the narrow clip kinks
        data["old_logp"] = data["old_logp"] * 0 + data["old_logp"].mean()
    logits = data.pop("logits").requires_grad_(True)

    def loss_fn(x):
        return reference.policy_loss(x, config=cfg, **data).loss

    assert torch.autograd.gradcheck(loss_fn, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("kind", ["k1+", "k3+"])
def test_straight_through_kl_loss_has_k2_gradient(kind):
    data = make_batch(dtype=torch.float64)
    grads, losses = {}, {}
    for k in (kind, kind[:-1], "k2"):
        logits = data["logits"].clone().requires_grad_(True)
        args = {name: v for name, v in data.items() if name != "logits"}
        out = reference.policy_loss(logits, config=LossConfig(kl=k, beta=0.5), **args)
        losses[k], grads[k] = out.loss, torch.autograd.grad(out.loss, logits)[0]
    torch.testing.assert_close(losses[kind], losses[kind[:-1]])
    torch.testing.assert_close(grads[kind], grads["k2"])
    assert not torch.allclose(grads[kind], grads[kind[:-1]])


def test_gradcheck_token_logprobs_with_entropy():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, dtype=torch.float64, generator=gen).requires_grad_(True)
    labels = torch.randint(0, 11, (5,), generator=gen)
    weights = torch.randn(5, dtype=torch.float64, generator=gen)

    def fn(x):
        logp, ent = reference.token_logprobs(x, labels, temperature=0.8, return_entropy=True)
        return (logp * weights).sum() + (ent * weights.flip(0)).sum()

    assert torch.autograd.gradcheck(fn, (logits,))


def _one_token(logp_minus_old: float, adv: float, vocab: int = 5):
    """A single valid token whose current logp minus old logp is exactly `logp_minus_old`."""
    logits = torch.linspace(-1.0, 1.0, vocab, dtype=torch.float64).reshape(1, 1, vocab)
    labels = torch.tensor([[2]])
    logp = torch.log_softmax(logits, -1)[0, 0, 2]
    return dict(
        logits=logits.clone().requires_grad_(True),
        labels=labels,
        advantages=torch.tensor([adv], dtype=torch.float64),
        mask=torch.ones(1, 1, dtype=torch.bool),
        old_logp=(logp - logp_minus_old).reshape(1, 1).float(),
    )


@pytest.mark.parametrize("log_ratio, adv", [(0.5, 1.0), (-0.5, -1.0)])
def test_clipped_token_has_exactly_zero_gradient(log_ratio, adv):
    data = _one_token(log_ratio, adv)
    out = reference.policy_loss(config=LossConfig(), **data)
    (grad,) = torch.autograd.grad(out.loss, data["logits"])
    assert torch.count_nonzero(grad) == 0
    bound = 1.2 if adv > 0 else 0.8
    assert out.loss.item() == pytest.approx(-adv * bound)
    assert out.metrics["clipfrac"].item() == 1.0


@pytest.mark.parametrize("log_ratio, adv", [(0.5, -1.0), (-0.5, 1.0), (0.1, 1.0)])
def test_unclipped_token_has_gradient(log_ratio, adv):
    data = _one_token(log_ratio, adv)
    out = reference.policy_loss(config=LossConfig(), **data)
    (grad,) = torch.autograd.grad(out.loss, data["logits"])
    assert grad.abs().max() > 0
    assert out.loss.item() == pytest.approx(-adv * math.exp(log_ratio), rel=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_on_policy_ppo_loss_is_minus_aggregated_advantage(agg):
    data = make_batch(per_token_adv=True)
    data["old_logp"] = None
    cfg = LossConfig(agg=agg)
    out = reference.policy_loss(config=cfg, **data)
    adv, mask = data["advantages"], data["mask"].float()
    if agg == "token-mean":
        expected = -(adv * mask).sum() / mask.sum()
    else:
        per_seq = (adv * mask).sum(-1)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / mask.sum(-1).clamp_min(1)
        expected = -per_seq.sum() / (mask.sum(-1) > 0).sum()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_gspo_equals_token_ppo_for_one_token_sequences():
    data = make_batch(batch=6, time=1, empty_rows=(), old_noise=0.05)
    gspo = LossConfig(
        ratio_level="sequence", eps_low=0.02, eps_high=0.03, agg="seq-mean-token-mean"
    )
    ppo = LossConfig(eps_low=0.02, eps_high=0.03, agg="seq-mean-token-mean")
    outs = []
    for cfg in (gspo, ppo):
        logits = data["logits"].clone().requires_grad_(True)
        out = reference.policy_loss(
            logits, **{k: v for k, v in data.items() if k != "logits"}, config=cfg
        )
        outs.append((out.loss, torch.autograd.grad(out.loss, logits)[0], out.metrics["clipfrac"]))
    assert 0 < outs[1][2] < 1  # some tokens clipped, some not: the comparison means something
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


def test_dual_clip_only_acts_on_negative_advantages():
    data = make_batch(old_noise=2.0)
    data["old_logp"] = data["old_logp"] - 2.0  # large ratios: r > c for many tokens
    plain, dual = LossConfig(), LossConfig(dual_clip_c=1.5)
    pos = dict(data, advantages=data["advantages"].abs() + 0.1)
    assert (
        reference.policy_loss(config=plain, **pos).loss
        == reference.policy_loss(config=dual, **pos).loss
    )
    neg = dict(data, advantages=-(data["advantages"].abs() + 0.1))
    out_plain = reference.policy_loss(config=plain, **neg)
    out_dual = reference.policy_loss(config=dual, **neg)
    assert out_dual.metrics["dual_clipfrac"] > 0
    assert out_dual.loss < out_plain.loss  # the dual bound caps -A r from above


def test_dual_clip_caps_loss_with_zero_gradient():
    data = _one_token(2.0, -1.0)  # r = e^2 > c = 3
    out = reference.policy_loss(config=LossConfig(dual_clip_c=3.0), **data)
    (grad,) = torch.autograd.grad(out.loss, data["logits"])
    assert out.loss.item() == pytest.approx(3.0)
    assert torch.count_nonzero(grad) == 0


def test_delta_caps_the_unclipped_ratio():
    data = _one_token(1.0, -1.0)  # r = e > delta = 2
    out = reference.policy_loss(config=LossConfig(delta=2.0), **data)
    assert out.loss.item() == pytest.approx(2.0)


def test_dcpo_bounds_widen_as_probability_shrinks():
    cfg = LossConfig.preset("dcpo")
    old = torch.log(torch.tensor([0.9, 0.5, 0.1, 0.01, 1e-4]))
    low, high = ratio_bounds(old, cfg)
    assert torch.all(low[1:] <= low[:-1]) and torch.all(high[1:] >= high[:-1])
    assert torch.all(high <= cfg.dcpo_r_max) and high[-1] == cfg.dcpo_r_max
    q = 0.9
    assert low[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 - 4 * 0.16 / q), rel=1e-6)
    assert high[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 + 4 * 0.2 / q), rel=1e-6)
    assert low[1].item() == 0.5  # 1 - 4 eps / q < 0: the lower bound bottoms out at 1/2


def test_k3_is_nonnegative_and_clamped():
    gen = torch.Generator().manual_seed(0)
    logp = 5 * torch.randn(10_000, generator=gen)
    ref = 5 * torch.randn(10_000, generator=gen)
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.all(k3 >= 0) and torch.all(k3 <= 10.0)
    assert kl_estimate(torch.zeros(1), torch.zeros(1), "k3").item() == 0.0
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0


def test_straight_through_kl_value_and_gradient():
    logp = torch.tensor([0.3, -0.2], requires_grad=True)
    ref = torch.tensor([0.0, 0.5])
    for kind, base in (("k1+", "k1"), ("k3+", "k3")):
        value = kl_estimate(logp, ref, kind)
        torch.testing.assert_close(value, kl_estimate(logp, ref, base))
        (grad,) = torch.autograd.grad(value.sum(), logp)
        torch.testing.assert_close(grad, (logp - ref).detach())


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_normalizer_replaces_the_denominator(agg):
    data = make_batch()
    cfg = LossConfig(agg=agg)
    mask = data["mask"].float()
    default = reference.policy_loss(config=cfg, **data).loss
    scaled = reference.policy_loss(config=cfg, normalizer=123.0, **data).loss
    if agg == "token-mean":
        denom = mask.sum()
    elif agg == "seq-mean-token-sum-norm":
        denom = torch.tensor(float(mask.shape[0]))
    else:
        denom = (mask.sum(-1) > 0).sum().float()
    torch.testing.assert_close(scaled, default * denom / 123.0)
    tensor_norm = reference.policy_loss(config=cfg, normalizer=torch.tensor(123.0), **data).loss
    torch.testing.assert_close(tensor_norm, scaled)


def test_seq_mean_excludes_empty_sequences():
    data = make_batch(batch=4, empty_rows=(1, 3))
    cfg = LossConfig(agg="seq-mean-token-mean")
    full = reference.policy_loss(config=cfg, **data).loss
    keep = [0, 2]
    sub = {k: v[keep] for k, v in data.items()}
    torch.testing.assert_close(full, reference.policy_loss(config=cfg, **sub).loss)


def test_hand_computed_simple_losses():
    data = _one_token(0.0, 2.0)
    logp = torch.log_softmax(data["logits"].detach(), -1)[0, 0, 2]
    pg = reference.policy_loss(config=LossConfig(loss="pg"), **data).loss
    assert pg.item() == pytest.approx(-2.0 * logp.item())
    sapo = reference.policy_loss(config=LossConfig.preset("sapo"), **data).loss
    assert sapo.item() == pytest.approx(-(4.0 / 1.0) * 0.5 * 2.0)  # sigmoid(0) = 1/2
    cispo = reference.policy_loss(config=LossConfig(loss="cispo"), **data).loss
    assert cispo.item() == pytest.approx(-2.0 * logp.item())
    gmpo = reference.policy_loss(config=LossConfig.preset("gmpo"), **data).loss
    assert gmpo.item() == pytest.approx(-2.0)


def test_is_weights_modes():
    data = make_batch()
    mask = data["mask"]
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        cfg = LossConfig(is_correction=mode, is_cap=1.5)
        out = reference.policy_loss(config=cfg, **data)
        assert out.metrics["is_weight_max"] <= 1.5 + 1e-6
    log_w = data["old_logp"] - data["rollout_logp"]
    w = log_w.exp()
    cfg = LossConfig(is_correction="token_mask", is_cap=1.5)
    kept = (w >= 1 / 1.5) & (w <= 1.5) & mask
    expected = (w * kept).sum() / mask.sum()
    assert reference.policy_loss(config=cfg, **data).metrics[
        "is_weight_mean"
    ].item() == pytest.approx(expected.item(), rel=1e-5)


def _grad(cfg, data, **extra):
    logits = data["logits"].clone().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"} | extra
    out = reference.policy_loss(logits, config=cfg, **args)
    return out, torch.autograd.grad(out.loss, logits)[0]


def test_cispo_gradient_is_pg_gradient_scaled_by_clipped_ratio():
    data = make_batch(dtype=torch.float64, per_token_adv=True)
    cfg = LossConfig(loss="cispo", eps_low=0.1, eps_high=0.1)
    out, grad = _grad(cfg, data)
    assert 0 < out.metrics["clipfrac"] < 1
    ratio = (out.logp - data["old_logp"]).exp()
    scaled_adv = data["advantages"] * ratio.clamp(0.9, 1.1)
    _, expected = _grad(LossConfig(loss="pg"), data, advantages=scaled_adv)
    torch.testing.assert_close(grad, expected)


def test_gspo_gradient_is_pg_gradient_with_sequence_ratio_advantages():
    data = make_batch(dtype=torch.float64, per_token_adv=True, old_noise=0.02)
    cfg = LossConfig(ratio_level="sequence", eps_low=0.004, eps_high=0.004)
    out, grad = _grad(cfg, data)
    mask = data["mask"].double()
    seq_ratio = (((out.logp - data["old_logp"]) * mask).sum(-1) / mask.sum(-1).clamp_min(1)).exp()
    seq_ratio = seq_ratio[:, None].expand_as(mask)
    adv = data["advantages"]
    clipped = ((seq_ratio > 1.004) & (adv > 0)) | ((seq_ratio < 0.996) & (adv < 0))
    assert clipped[data["mask"]].any() and not clipped[data["mask"]].all()
    surrogate_adv = torch.where(clipped, 0.0, adv * seq_ratio)
    _, expected = _grad(LossConfig(loss="pg"), data, advantages=surrogate_adv)
    torch.testing.assert_close(grad, expected)


def test_the_oracle_shares_no_code_with_what_it_judges():
    """fusedrl.reference imports only argument validation, the config and the output type; no
    module of the package imports it (the package's __init__ only exposes it as
    `fusedrl.reference`). A bug in shared code would sit on both sides of every comparison."""
    import ast
    from pathlib import Path

    root = Path(reference.__file__).resolve().parents[1]
    allowed = {"_inputs", "config", "output"}

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                names.add(node.module or "")
                names.update(a.name for a in node.names if not node.module)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fusedrl"):
                names.add(node.module.split(".")[-1] if node.module != "fusedrl" else "")
                names.update(a.name for a in node.names if node.module == "fusedrl")
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[-1] for a in node.names if "fusedrl" in a.name)
        return names

    assert imported(root / "fusedrl" / "reference.py") - {"torch", ""} <= allowed
    for folder in ("fusedrl", "kernels", "trainer"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "reference.py" or (folder == "fusedrl" and path.name == "__init__.py"):
                continue
            assert "reference" not in imported(path), f"{path} imports the oracle"
