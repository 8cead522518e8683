"""Bad arguments fail with a clear error that names the argument (all backends share the checks)."""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch

IMPLS = {"torch": fusedrl.policy_loss, "reference": reference.policy_loss}


def _call(impl, data, **overrides):
    args = dict(data) | overrides
    return IMPLS[impl](**args)


@pytest.fixture
def data():
    return make_batch(batch=2, time=5, vocab=67, seed=0)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(
    "field, make_bad, match",
    [
        ("labels", lambda d: d["labels"][:, :4], "labels shape"),
        ("mask", lambda d: d["mask"][:, :4], "mask shape"),
        ("advantages", lambda d: d["advantages"][:1], "advantages shape"),
        ("advantages", lambda d: torch.zeros(2, 4), "advantages shape"),
        ("advantages", lambda d: torch.zeros(2, 5, 1), "advantages shape"),
        ("old_logp", lambda d: d["old_logp"][:, :3], "old_logp shape"),
        ("ref_logp", lambda d: d["ref_logp"].T, "ref_logp shape"),
        ("rollout_logp", lambda d: d["rollout_logp"][0], "rollout_logp shape"),
        ("logits", lambda d: d["logits"][0, 0], "logits must be"),
        ("logits", lambda d: d["logits"][..., None], "logits must be"),
    ],
)
def test_shape_mismatch_names_the_argument(impl, data, field, make_bad, match):
    cfg = LossConfig(kl="k3", beta=0.1, is_correction="token_truncate")
    with pytest.raises(ValueError, match=match):
        _call(impl, data, **{field: make_bad(data)}, config=cfg)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("bad", [-1, 67, 10_000])
def test_labels_out_of_range(impl, data, bad):
    labels = data["labels"].clone()
    labels[data["mask"].nonzero()[0].tolist()[0], data["mask"].nonzero()[0].tolist()[1]] = bad
    with pytest.raises(ValueError, match=r"labels must be in \[0, 67\)"):
        _call(impl, data, labels=labels)


def test_labels_out_of_range_under_the_mask_are_allowed(data):
    labels = data["labels"].masked_fill(~data["mask"], -100)  # HF-style padding
    out = fusedrl.policy_loss(**(data | {"labels": labels}))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_integer_logits(impl, data):
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        _call(impl, data, logits=data["logits"].long())


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_float_labels(impl, data):
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        _call(impl, data, labels=data["labels"].float())


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_non_tensor_arguments(impl, data):
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        _call(impl, data, logits=data["logits"].tolist())
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor"):
        _call(impl, data, advantages=[1.0, 2.0])
    with pytest.raises(TypeError, match="old_logp must be a floating tensor"):
        _call(impl, data, old_logp=data["old_logp"].long())
    with pytest.raises(TypeError, match="config must be a fusedrl.LossConfig"):
        _call(impl, data, config={"loss": "ppo"})


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_missing_ref_logp_with_beta(impl, data):
    with pytest.raises(ValueError, match="ref_logp is required when config.beta > 0"):
        _call(impl, data, ref_logp=None, config=LossConfig.preset("grpo"))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_missing_rollout_logp_with_is_correction(impl, data):
    cfg = LossConfig(is_correction="sequence_mask")
    with pytest.raises(ValueError, match="rollout_logp is required"):
        _call(impl, data, rollout_logp=None, config=cfg)


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_non_contiguous_vocab_dimension(impl, data):
    transposed = data["logits"].transpose(0, 2).contiguous().transpose(0, 2)
    assert transposed.stride(-1) != 1
    with pytest.raises(ValueError, match="contiguous in its last"):
        _call(impl, data, logits=transposed)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("bad", [0, -3.0, float("nan"), float("inf")])
def test_bad_normalizer(impl, data, bad):
    with pytest.raises(ValueError, match="normalizer"):
        _call(impl, data, normalizer=bad)


def test_normalizer_must_be_scalar(data):
    with pytest.raises(ValueError, match="normalizer must be a scalar"):
        fusedrl.policy_loss(**data, normalizer=torch.ones(2))


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig.preset("grpo").replace(beta=0.0, kl=None),
        LossConfig.preset("gspo"),
        LossConfig(is_correction="sequence_truncate"),
    ],
)
def test_flat_logits_need_token_level_config(data, cfg):
    flat = {k: v[0] for k, v in data.items()}
    with pytest.raises(ValueError, match=r"\[N, V\] carry no sequence boundaries"):
        fusedrl.policy_loss(**flat, config=cfg)


def test_token_logprobs_checks():
    logits = torch.randn(4, 9)
    with pytest.raises(ValueError, match="labels shape"):
        fusedrl.token_logprobs(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 9\)"):
        fusedrl.token_logprobs(logits, torch.tensor([0, 1, 2, 9]))
    with pytest.raises(ValueError, match="temperature"):
        fusedrl.token_logprobs(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        fusedrl.token_logprobs(logits.int(), torch.zeros(4, dtype=torch.long))


def test_float_mask_is_a_weight(data):
    """A 0/1 float mask behaves exactly like the boolean one."""
    as_bool = fusedrl.policy_loss(**data).loss
    as_float = fusedrl.policy_loss(**(data | {"mask": data["mask"].float()})).loss
    torch.testing.assert_close(as_bool, as_float)
