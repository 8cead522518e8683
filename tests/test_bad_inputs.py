"""Bad arguments fail with a clear error that names the argument (all backends share the checks)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch, needs_interpreter

IMPLS = {"torch": fusedrl.policy_loss, "reference": reference.policy_loss}
TRITON = pytest.param("triton", marks=needs_interpreter)


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


@pytest.mark.parametrize("impl", [*sorted(IMPLS), TRITON])
@pytest.mark.parametrize("bad", [-1, 67, 10_000])
def test_labels_out_of_range(impl, data, bad):
    labels = data["labels"].clone()
    labels[data["mask"].nonzero()[0].tolist()[0], data["mask"].nonzero()[0].tolist()[1]] = bad
    # every backend names the label it refused (the Triton kernels check the labels they read)
    call = partial(fusedrl.policy_loss, backend="triton") if impl == "triton" else IMPLS[impl]
    with pytest.raises(ValueError, match=rf"labels must be in \[0, 67\)[^,]*, found {bad}$"):
        call(**(data | {"labels": labels}))


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
    """A 0/1 float or integer mask behaves exactly like the boolean one; a negative integer
    weight is refused as a negative float one is."""
    as_bool = fusedrl.policy_loss(**data).loss
    as_float = fusedrl.policy_loss(**(data | {"mask": data["mask"].float()})).loss
    torch.testing.assert_close(as_bool, as_float)
    as_int = fusedrl.policy_loss(**(data | {"mask": data["mask"].long()})).loss
    torch.testing.assert_close(as_bool, as_int)
    negative = data["mask"].long()
    negative[0, 0] = -1
    with pytest.raises(ValueError, match="mask must hold finite weights >= 0"):
        fusedrl.policy_loss(**(data | {"mask": negative}))


# ---------------------------------------------------------------- inputs that used to get through


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("bad", [-1.0, -0.25, float("nan"), float("inf")])
def test_mask_weights_must_be_finite_and_non_negative(impl, data, bad):
    """A negative weight flipped the token's gradient silently; NaN / inf poisoned the loss."""
    mask = data["mask"].float()
    mask[0, 0] = bad
    with pytest.raises(ValueError, match="mask must hold finite weights >= 0"):
        _call(impl, data, mask=mask)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize(
    "normalizer, error, match",
    [
        (torch.tensor(0.0), ValueError, "normalizer must be a finite number > 0"),
        (torch.tensor(-3.0), ValueError, "normalizer must be a finite number > 0"),
        (torch.tensor(float("nan")), ValueError, "normalizer must be a finite number > 0"),
        (torch.tensor(float("inf")), ValueError, "normalizer must be a finite number > 0"),
        (torch.tensor(True), TypeError, "normalizer must be a real number tensor"),
        (torch.tensor(0), ValueError, "normalizer must be a finite number > 0"),
    ],
)
def test_normalizer_tensors_are_checked(impl, data, normalizer, error, match):
    with pytest.raises(error, match=match):
        _call(impl, data, normalizer=normalizer)
    out = _call(impl, data, normalizer=torch.tensor(7))  # an integer count is fine
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
@pytest.mark.parametrize("cap", [1.0, 0.8])
def test_mask_correction_with_a_cap_at_or_below_one_is_rejected(mode, cap):
    with pytest.raises(ValueError, match=r"\[1 / is_cap, is_cap\].*empty"):
        LossConfig(is_correction=mode, is_cap=cap)
    LossConfig(is_correction=mode, is_cap=cap, is_cap_low=0.5)  # an explicit range is fine
    LossConfig(is_correction="token_truncate", is_cap=cap)  # truncation has no lower bound


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered")  # interpreter numpy
@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_inplace_when_autograd_saved_the_logits_raises(data, backend):
    """logits = x.exp() saves its output for backward; writing the gradient into it must make
    autograd raise, as for any in-place op, not return a gradient computed from it."""
    x = data["logits"].detach().clone().requires_grad_(True)
    logits = x.exp()
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, inplace=True, backend=backend, **args)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_inplace_needs_distinct_memory(data, backend):
    args = {k: v for k, v in data.items() if k != "logits"}
    expanded = data["logits"][:, :1].expand(-1, 5, -1).detach().requires_grad_(True)
    with pytest.raises(ValueError, match="inplace=True needs logits whose elements are distinct"):
        fusedrl.policy_loss(expanded, inplace=True, backend=backend, **args)
    out = fusedrl.policy_loss(expanded, inplace=False, backend=backend, **args)  # reads are fine
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("backend", ["torch", TRITON])
def test_double_backward_raises(data, backend):
    logits = data["logits"].detach().requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.policy_loss(logits, backend=backend, **args)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.loss, logits, create_graph=True)


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("preset", list(LossConfig.presets()))
def test_empty_batches_give_zero_loss_in_every_mode(shape, preset):
    batch, time = shape
    cfg = LossConfig.preset(preset).replace(kl="k3", beta=0.1)
    per_token = cfg.is_sequence_level or preset == "gspo_token"
    logits = torch.randn(batch, time, 11, requires_grad=True)
    args = dict(
        labels=torch.zeros(batch, time, dtype=torch.long),
        advantages=torch.zeros(batch, time) if per_token else torch.zeros(batch),
        mask=torch.ones(batch, time, dtype=torch.bool),
        ref_logp=torch.zeros(batch, time),
        config=cfg,
    )
    for fn in (reference.policy_loss, fusedrl.policy_loss):
        out = fn(logits, **args)
        assert out.loss.item() == 0.0, (fn.__module__, preset)
        (grad,) = torch.autograd.grad(out.loss, logits, allow_unused=True)
        assert grad is None or grad.numel() == 0


def test_numpy_scalars_in_loss_config():
    np = pytest.importorskip("numpy")
    cfg = LossConfig(
        eps_low=np.float32(0.2),
        eps_high=np.float64(0.28),
        beta=np.float32(0.01),
        kl="k3",
        temperature=np.float32(0.7),
        is_cap=np.int64(2),
        is_correction="token_truncate",
    )
    assert type(cfg.eps_low) is float and abs(cfg.eps_low - 0.2) < 1e-7
    assert type(cfg.temperature) is float and type(cfg.is_cap) is float
    assert cfg == cfg.replace()  # still a value type
    with pytest.raises(ValueError, match="eps_low must be a finite number"):
        LossConfig(eps_low=np.float32("nan"))


def test_token_logprobs_label_errors_do_not_mention_a_mask():
    logits = torch.randn(2, 3, 11)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 11\), found 11$"):
        fusedrl.token_logprobs(logits, torch.full((2, 3), 11))


def test_policy_loss_module_rejects_an_unknown_backend_at_construction():
    with pytest.raises(ValueError, match="backend='jax' is not one of"):
        fusedrl.PolicyLoss("dapo", backend="jax")


def test_nan_reward_never_poisons_the_smooth_standardizer():
    """A NaN reward is unscorable (TRL's rule, as in the tensor estimators): advantage 0, and
    out of the prompt's running statistics, which stay finite."""
    sas = fusedrl.advantages.SmoothAdvantageStandardizer()
    sas(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, ["a", "b"])
    out = sas(torch.tensor([1.0, 1.0, float("nan"), 0.0]), 2, ["a", "b"])
    assert torch.isfinite(out).all() and out[2] == 0
    assert sas.num_visits("a") == 2 and sas.num_visits("b") == 2
    state = sas.state_dict()
    b = state["keys"].index("b")
    assert state["count"][b] == 3 and state["mean"][b] == pytest.approx(1 / 3)
    assert all(torch.isfinite(v).all() for v in state.values() if isinstance(v, torch.Tensor))
    good = sas(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, ["a", "b"])
    assert torch.isfinite(good).all()
