"""fusedrl.integrations.verl_engine inside verl's own actor update (runs in .venv-verl: `make
test-verl`).

verl 0.9.1's `TrainingWorker.train_mini_batch` (the function its driver's `update_actor` calls)
runs on CPU twice on the same tiny model and batch (tests/verl_cpu.py): with verl's FSDP engine
and `ppo_loss`, and with `FusedPolicyLossEngine`, whose training step hands the logits and the
layout to one `fusedrl.policy_loss`. Every parameter's accumulated gradient, the loss and verl's
metrics (clip fractions, ppo_kl, the entropy and KL losses, grad_norm) must agree, packed
(`use_remove_padding=True`: `cu_seqlens`) and padded, over the aggregations and the modes the
engine takes; the cases it leaves to verl must run verl's path.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("verl")
os.environ.setdefault("TRITON_INTERPRET", "1")

from . import verl_cpu  # noqa: E402  (installs the CPU platform before verl's engines load)

verl_engine = pytest.importorskip("fusedrl.integrations.verl_engine")
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

CASES = {
    "vanilla token-mean": dict(loss_mode="vanilla", loss_agg_mode="token-mean"),
    "vanilla seq-mean-token-mean, entropy": dict(
        loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01
    ),
    "vanilla seq-mean-token-sum-norm, kl": dict(
        loss_mode="vanilla", loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=True
    ),
    "gspo seq-mean-token-mean": dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean"),
    "vanilla token-mean, rollout IS weights": dict(
        loss_mode="vanilla", loss_agg_mode="token-mean", rollout_is_weights=True
    ),
    "cispo token-mean, T=0.7, micro-batch 1": dict(
        loss_mode="cispo", loss_agg_mode="token-mean", temperature=0.7, micro_batch_size=1
    ),
}
# Metrics compared (verl's names); grad_norm is the norm of the gradients compared below.
METRICS = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/entropy_loss",
    "kl_loss",
    "actor/grad_norm",
)


@pytest.fixture
def fused_calls(monkeypatch):
    """How many micro-batches the fused loss took (the engine must not fall back silently)."""
    calls = []
    real = verl_engine.fused_ppo_loss

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(verl_engine, "fused_ppo_loss", counted)
    return calls


def _flatten(value):
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flatten(v)]
    return [float(value)]


def _assert_same_update(got: dict, want: dict) -> None:
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        scale = float(grad.abs().max()) or 1.0
        diff = float((got["grads"][name] - grad).abs().max())
        assert diff <= 1e-5 * scale + 1e-8, f"{name}: {diff} against {scale}"
    for name in METRICS:
        assert (name in got["metrics"]) == (name in want["metrics"]), name
        if name in want["metrics"]:
            a, b = _flatten(got["metrics"][name]), _flatten(want["metrics"][name])
            assert len(a) == len(b) and all(
                math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b)
            ), (name, a, b)


@pytest.mark.parametrize("packed", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fused_engine_equals_verls_update(case, packed, fused_calls):
    options = dict(CASES[case], use_remove_padding=packed)
    want = verl_cpu.run_actor_update(FSDPEngineWithLMHead, **options)
    assert not fused_calls
    got = verl_cpu.run_actor_update(verl_engine.FusedPolicyLossEngine, **options)
    assert fused_calls, "the fused engine fell back to verl's loss"
    _assert_same_update(got, want)
    assert _flatten(want["metrics"]["actor/ppo_kl"])[0] != 0  # the ratios are not all 1
    if options["loss_mode"] != "gspo":  # (verl's default bounds are wide for a sequence ratio)
        assert _flatten(want["metrics"]["actor/pg_clipfrac"])[0] > 0  # some ratios clip


def test_what_fusedrl_does_not_reproduce_stays_verls(fused_calls):
    """geo_mean (one IS weight per sequence, a mean over all rows) runs verl's own loss inside
    the fused engine: the same update, and no fused call."""
    options = dict(loss_mode="geo_mean", loss_agg_mode="token-mean", use_remove_padding=True)
    want = verl_cpu.run_actor_update(FSDPEngineWithLMHead, **options)
    got = verl_cpu.run_actor_update(verl_engine.FusedPolicyLossEngine, **options)
    assert not fused_calls
    _assert_same_update(got, want)
    assert not verl_engine.reproduces({"policy_loss": {"loss_mode": "sapo"}, "entropy_coeff": 0.1})
    assert verl_engine.reproduces({"policy_loss": {"loss_mode": "sapo"}, "entropy_coeff": 0.0})
    # the registry's names are the same losses; a setting fusedrl refuses stays verl's (which
    # runs it, or says its own error), not a fused step that fails
    for mode in ("fusedrl_vanilla", "fusedrl_gspo"):
        assert verl_engine.reproduces({"policy_loss": {"loss_mode": mode}}), mode
    assert verl_engine.reproduces({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 10.0})
    refused = {"policy_loss": {"loss_mode": "vanilla"}, "clip_ratio_c": 0.5}  # dual clip <= 1
    assert not verl_engine.reproduces(refused)


def test_importing_registers_for_nvidia_gpus():
    from verl.workers.engine.base import EngineRegistry

    engines = EngineRegistry._engines["language_model"]
    assert engines["fsdp2"][("cuda", "nvidia")] is verl_engine.FusedPolicyLossEngine
    assert engines["fsdp2"]["cuda"] is FSDPEngineWithLMHead  # verl's own entry untouched
