"""Decide once, then run (fusedrl.call_plan): a call of a kind already seen skips the checks and
decisions and must give exactly what the general path gives, raise what it raises on bad data,
and never be taken for a call the plan does not cover."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import fusedrl
from fusedrl import api, call_plan, output, reference, single_process
from fusedrl._inputs import prepare_loss_inputs
from fusedrl.arguments import ModelHead, RolloutInputs

from .conftest import make_batch, needs_interpreter

pytestmark = needs_interpreter

PRESETS = ("dapo", "grpo", "cispo", "dr_grpo")


def _kind_batch(
    seed, *, mask_kind="bool", per_token_adv=False, flat=False, old=True, ref=False, rollout=False
):
    """Inputs of one call kind: a fresh draw for each seed."""
    data = make_batch(batch=3, time=9, vocab=131, seed=seed, per_token_adv=per_token_adv)
    if not rollout:
        data.pop("rollout_logp")
    if not ref:
        data.pop("ref_logp")
    if not old:
        data.pop("old_logp")
    gen = torch.Generator().manual_seed(seed + 100)
    if mask_kind == "float":  # fractional weights, 0 on the masked tokens
        data["mask"] = data["mask"] * torch.rand(data["mask"].shape, generator=gen)
    elif mask_kind == "int":
        data["mask"] = data["mask"].long()
    if flat:  # [N, V]: one packed row, per-token advantages
        data["advantages"] = data["advantages"].reshape(-1) if per_token_adv else None
        data = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items() if v is not None}
        data["advantages"] = torch.randn(data["labels"].shape, generator=gen)
    return data


KINDS = {
    "bool mask": {},
    "float mask": {"mask_kind": "float"},
    "int mask": {"mask_kind": "int", "per_token_adv": True},
    "flat": {"flat": True},
    "on-policy": {"old": False},
    "kl": {"ref": True},
    "rollout": {"rollout": True},  # the train / inference mismatch metrics
}


def _keywords(data, cfg, normalizer=None) -> dict:
    """policy_loss's keywords after the logits."""
    names = ("labels", "advantages", "mask", "old_logp", "ref_logp", "rollout_logp")
    return {**{name: data.get(name) for name in names}, "config": cfg, "normalizer": normalizer}


def _general(logits, data, cfg, **options):
    """The general path of a `policy_loss` call (`single_process.policy_loss`, no plan)."""
    rollout = RolloutInputs(data.get("old_logp"), data.get("ref_logp"), data.get("rollout_logp"))
    call = (data["labels"], data["advantages"], data["mask"], rollout, ModelHead(), cfg, None)
    return single_process.policy_loss(logits, *call, backend="triton", **options)


def _call(data, cfg, normalizer=None, grad_scale=None) -> call_plan.Call:
    """A `policy_loss` call of the Triton backend with a gradient, as the entry point hands it
    to the plan."""
    return call_plan.Call(
        data["logits"],
        data["labels"],
        data["advantages"],
        data["mask"],
        data.get("old_logp"),
        data.get("ref_logp"),
        data.get("rollout_logp"),
        cfg,
        normalizer,
        "triton",
        False,
        grad_scale,
        False,
    )


@pytest.mark.parametrize("normalizer", [None, 17.0, "tensor"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_planned_inputs_equal_prepare_loss_inputs(kind, normalizer):
    """What a plan hands the backend is, field by field, what `prepare_loss_inputs` gives."""
    cfg = fusedrl.LossConfig.preset("dapo" if kind != "kl" else "grpo")
    data = _kind_batch(0, **KINDS[kind])
    norm = torch.tensor(23.0) if normalizer == "tensor" else normalizer
    scale = torch.tensor(0.5) if normalizer == "tensor" else 0.25 if normalizer else None
    data["labels"] = data["labels"].int()  # (int32 labels: the plan widens them as the checks do)
    logits = data["logits"].requires_grad_(True)
    call = _call({**data, "logits": logits}, cfg, norm, scale)
    plan = call_plan._decide(call)
    assert plan is not None, f"{kind}: not planned"
    got = plan.inputs(call)
    want = prepare_loss_inputs(*call[:7], cfg, norm, mask_rows=False, grad_scale=scale)
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), field.name
            assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), field.name
            assert torch.equal(a, b), field.name
        elif field.name != "derived":
            assert a == b, field.name


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_planned_calls_equal_the_general_path(preset, kind):
    """The second and third calls of a kind (new data each) run the plan and give the general
    path's loss, gradient, log-probs, entropy and metrics, to the bit; the oracle agrees."""
    cfg = fusedrl.LossConfig.preset(preset)
    if kind == "kl":
        cfg = dataclasses.replace(cfg, beta=0.05, kl="k3")
    if kind == "flat" and cfg.needs_sequences:
        pytest.skip(f"{preset} ({cfg.agg}) needs sequences: [N, V] logits are refused")
    for seed in range(3):
        data = _kind_batch(seed, **{**KINDS[kind], "ref": cfg.beta > 0})
        leaf = data["logits"].detach().requires_grad_(True)
        out = fusedrl.policy_loss(
            leaf, **_keywords(data, cfg), backend="triton", return_entropy=True
        )
        (grad,) = torch.autograd.grad(out.loss, leaf)
        general_leaf = data["logits"].detach().requires_grad_(True)
        want = _general(general_leaf, data, cfg, return_entropy=True)
        (want_grad,) = torch.autograd.grad(want.loss, general_leaf)
        assert torch.equal(out.loss, want.loss) and torch.equal(grad, want_grad)
        assert torch.equal(out.logp, want.logp) and torch.equal(out.entropy, want.entropy)
        assert out.metrics.keys() == want.metrics.keys()
        for name in want.metrics:
            assert torch.equal(out.metrics[name], want.metrics[name]), name
        oracle = reference.policy_loss(data["logits"].double(), **_keywords(data, cfg))
        torch.testing.assert_close(out.loss.double(), oracle.loss, rtol=1e-5, atol=1e-6)
    plans = [p for p in call_plan._PLANS.values() if p is not None and p.config is cfg]
    assert len(plans) == 1, "the calls of one kind were not planned once"


def test_planned_metrics_are_made_when_first_read():
    """The planned call's output holds its metrics as slots of the kernel's means until
    `metrics` is read; then a plain dict, the same object on every read, equal to the general
    path's; a LossOutput to dataclasses (replace, ==) and to an assignment."""
    cfg = fusedrl.LossConfig.preset("dapo")
    data = _kind_batch(0, rollout=True)
    leaf = data["logits"].detach().requires_grad_(True)
    for _ in range(2):  # the second call is planned
        out = fusedrl.policy_loss(leaf, **_keywords(data, cfg), backend="triton")
    assert isinstance(out, fusedrl.LossOutput)
    assert isinstance(out.__dict__["metrics"], output.MetricSlots)
    metrics = out.metrics
    assert type(metrics) is dict and out.metrics is metrics
    assert {"clipfrac", "ppo_kl", "logp_mean"} <= metrics.keys() and "is_weight_mean" not in metrics
    assert any(name.startswith("mismatch") for name in metrics), sorted(metrics)
    want = _general(leaf, data, cfg)
    assert metrics.keys() == want.metrics.keys()
    assert all(torch.equal(metrics[k], want.metrics[k]) for k in metrics)
    again = dataclasses.replace(out, loss=out.loss * 2)
    assert again.metrics is metrics and out == dataclasses.replace(out)
    out.metrics = {"x": out.loss}
    assert out.metrics.keys() == {"x"}


def test_every_argument_is_planned_or_at_its_default():
    """A new `policy_loss` argument must join `call_plan.PLANNED` (the plan reads it) or the
    entry point's `_plannable` gate (its default keeps the call off the plan)."""
    entry = set(inspect.signature(api.policy_loss).parameters)
    gated = set(inspect.signature(api._plannable).parameters)
    assert entry == set(call_plan.PLANNED) | gated
    assert not set(call_plan.PLANNED) & gated


def test_bad_data_raises_on_the_plan():
    """The data checks run on every call of a planned kind: labels outside the vocabulary, a
    negative mask weight, a normalizer <= 0; a bad shape is a new kind, and the general path's
    check names it."""
    cfg = fusedrl.LossConfig.preset("dapo")
    data = _kind_batch(0, mask_kind="float")

    def call(**changes):
        args = {**data, **changes}
        leaf = args.pop("logits").detach().requires_grad_(True)
        return fusedrl.policy_loss(leaf, config=cfg, backend="triton", **args)

    call()
    call(normalizer=5.0)
    assert any(p is not None for p in call_plan._PLANS.values())
    labels = data["labels"].clone()
    labels[0, 0] = 131
    mask = data["mask"].clone()
    mask[0, 0] = 1.0
    with pytest.raises(ValueError, match=r"labels must be in \[0, 131\)"):
        call(labels=labels, mask=mask)
    with pytest.raises(ValueError, match="mask must hold finite weights >= 0"):
        call(mask=-data["mask"])
    with pytest.raises(ValueError, match="normalizer must be a finite number > 0"):
        call(normalizer=-1.0)
    with pytest.raises(ValueError, match="mask shape"):
        call(mask=data["mask"][:, :-1])


def test_an_all_masked_call_on_the_plan():
    """Loss 0 and a zero gradient, never NaN, on a planned kind too."""
    cfg = fusedrl.LossConfig.preset("dapo")
    for _ in range(2):
        data = _kind_batch(0)
        data["mask"] = torch.zeros_like(data["mask"])
        leaf = data.pop("logits").detach().requires_grad_(True)
        out = fusedrl.policy_loss(leaf, config=cfg, backend="triton", **data)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        assert out.loss.item() == 0.0 and not grad.any()


def test_unplanned_calls_take_the_general_path():
    """No gradient wanted (two passes), a two-pass config (GSPO), the torch backend: no plan."""
    data = _kind_batch(0)
    gspo = fusedrl.LossConfig.preset("gspo")
    dapo = fusedrl.LossConfig.preset("dapo")
    leaf = data["logits"].detach().requires_grad_(True)
    fusedrl.policy_loss(leaf, **_keywords(data, gspo), backend="triton")
    fusedrl.policy_loss(leaf, **_keywords(data, dapo), backend="torch")
    with torch.no_grad():
        fusedrl.policy_loss(leaf, **_keywords(data, dapo), backend="triton")
    assert call_plan._PLANS and all(p is None for p in call_plan._PLANS.values())


def test_plans_are_bounded():
    """A config made anew for every step must not grow the plans without end."""
    data = _kind_batch(0)
    for step in range(call_plan.MAX_PLANS + 5):
        cfg = fusedrl.LossConfig.preset("dapo").replace(eps_high=0.2 + step * 1e-3)
        leaf = data["logits"].detach().requires_grad_(True)
        fusedrl.policy_loss(leaf, **_keywords(data, cfg), backend="triton")
    assert len(call_plan._PLANS) == call_plan.MAX_PLANS


@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_planned_inplace_calls_equal_the_general_path(preset):
    """inplace=True (fusedrl-train's call): the planned calls write the general path's
    gradient into the logits buffer and hand it back to autograd."""
    cfg = fusedrl.LossConfig.preset(preset)
    for seed in range(3):
        data = _kind_batch(seed, ref=cfg.beta > 0)
        leaf = data["logits"].clone().requires_grad_(True)
        out = fusedrl.policy_loss(leaf, **_keywords(data, cfg), backend="triton", inplace=True)
        out.loss.backward()
        general = data["logits"].clone().requires_grad_(True)
        want = _general(general, data, cfg, inplace=True)
        want.loss.backward()
        assert torch.equal(out.loss, want.loss)
        assert torch.equal(leaf.grad, general.grad) and torch.equal(leaf.detach(), leaf.grad)
    plans = [p for p in call_plan._PLANS.values() if p is not None and p.config is cfg]
    assert len(plans) == 1 and plans[0].inplace
