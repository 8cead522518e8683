"""The fused driver's decisions, tested directly (fusedrl/fused_backend.py): which configs take
the single fused kernel and which the two passes (`needs_two_passes`), and the arguments the
fused op receives (`fused_token_args`, a kernels/token_args.py `TokenLossArgs`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference
from fusedrl._inputs import prepare_loss_inputs
from fusedrl.fused_backend import (
    fused_token_args,
    needs_two_passes,
    planned_call,
    policy_loss,
)

from .conftest import make_batch, needs_interpreter, run_loss


def _inputs(cfg: LossConfig, *, old: bool = True, entropy_coef=None, is_weights=False):
    data = make_batch(vocab=67, seed=2)
    return prepare_loss_inputs(
        data["logits"],
        data["labels"],
        data["advantages"],
        data["mask"],
        data["old_logp"] if old else None,
        data["ref_logp"],
        data["rollout_logp"],
        cfg,
        None,
        torch.ones(data["labels"].shape) if is_weights else None,
        entropy_coef=entropy_coef,
    )


@pytest.mark.parametrize(
    "config, old, two_passes",
    [
        (LossConfig.preset("dapo"), True, False),  # token-level: one kernel
        (LossConfig.preset("cispo"), True, False),
        (LossConfig.preset("grpo", beta=0.04, kl="k3"), True, False),  # a KL estimate fits
        (LossConfig.preset("dapo"), False, False),  # on-policy with constant bounds
        (LossConfig.preset("gspo"), True, True),  # a sequence-level ratio
        (LossConfig.preset("gmpo"), True, True),  # a sequence objective
        (LossConfig.preset("dapo", top_entropy_quantile=0.5), True, True),  # a batch quantile
        (LossConfig.preset("dcpo"), False, True),  # bounds from old = logp: after pass 1
        (LossConfig.preset("dcpo"), True, False),
        (LossConfig.preset("dapo", is_correction="token_truncate", is_cap=2.0), False, True),
        (LossConfig.preset("grpo", beta=0.04, kl="k3", kl_bias_correction=True), True, True),
        (LossConfig.preset("dapo", m2po_tau=0.04), True, True),  # a batch statistic of logp
        (LossConfig.preset("dapo", entropy_coef=0.01, entropy_agg="token-mean"), True, True),
        (LossConfig.preset("dapo", entropy_coef=0.01), True, False),  # the kernel's own bonus
    ],
)
def test_which_configs_take_two_passes(config, old, two_passes):
    assert needs_two_passes(_inputs(config, old=old), config) is two_passes


@pytest.mark.parametrize(
    "config, covered",
    [
        (LossConfig.preset("gspo"), True),  # the sequence ratio
        (LossConfig.preset("luspo", beta=0.04, kl="k3"), True),
        (LossConfig.preset("dcpo"), True),  # on-policy bounds: the token ratio after pass 1
        (LossConfig.preset("gspo", is_correction="sequence_truncate"), True),
        (LossConfig.preset("sapo", entropy_coef=0.01), True),
        (LossConfig.preset("gmpo"), False),  # a sequence objective of its own
        (LossConfig.preset("vespo"), False),
        (LossConfig(loss="clip_cov"), False),  # a covariance over the batch
        (LossConfig.preset("dapo", top_entropy_quantile=0.5), False),  # a batch quantile
        (LossConfig.preset("dapo", m2po_tau=0.04), False),
        (LossConfig.preset("dapo", off_policy_mask=0.1), False),  # a batch statistic's mask
        (LossConfig.preset("dapo", rejection="token_k1", rejection_threshold=2.0), False),
        (LossConfig.preset("grpo", kl_bias_correction=True), False),  # a ratio-weighted KL
        (LossConfig.preset("dapo", entropy_coef=0.01, entropy_agg="token-mean"), False),
    ],
)
def test_which_two_pass_configs_the_terms_kernel_covers(config, covered):
    """`sequence_kernel_covers`: the variants the fused kernel knows, with no batch statistic
    deciding a mask or a weight; the rest take token_terms in torch."""
    from fusedrl.fused_backend import sequence_kernel_covers

    assert sequence_kernel_covers(_inputs(config, old=False), config) is covered


@pytest.mark.parametrize("sums", [False, True])
def test_the_fused_op_gets_its_arguments_by_name(sums):
    """Per-token tensors and the variant's numbers as the config says them. An op that keeps no
    sums (the CUDA extension's) gets tensor bounds and weights; one that sums (Triton's) the
    constant bounds as numbers, the mask, and for token-mean no weights (it weighs the mask)."""
    cfg = LossConfig.preset("dapo", dual_clip_c=3.0, entropy_coef=0.01)
    inp = _inputs(cfg, is_weights=True)
    args = fused_token_args(inp, cfg, sums=sums)
    assert args.labels is inp.labels and args.valid is inp.valid
    assert args.old_logp is inp.old_logp and args.is_weight is inp.is_weights
    variant = args.variant
    assert variant.loss == "ppo" and variant.dual_clip_c == 3.0 and variant.kl is None
    assert variant.temperature == cfg.temperature and variant.entropy_coef == 0.01
    assert variant.beta == 0.0 and variant.agg_from_mask is sums
    if sums:
        assert args.low is None and args.agg_weight is None and args.mask is inp.mask
        assert (variant.low_bound, variant.high_bound) == (1 - cfg.eps_low, 1 + cfg.eps_high)
        return
    assert torch.equal(args.low, torch.full_like(inp.mask, 1 - cfg.eps_low))
    assert torch.equal(args.high, torch.full_like(inp.mask, 1 + cfg.eps_high))
    # token-mean: each counted token's weight is its mask over the counted tokens' mask sum
    weights = torch.where(inp.valid, inp.mask, 0.0)
    torch.testing.assert_close(args.agg_weight, weights / weights.sum())
    assert args.mask is None and variant.low_bound == variant.high_bound == 0.0


def test_the_fused_op_gets_dcpo_bounds_per_token_and_a_flushed_subnormal():
    """DCPO's bounds come from old per token; a config number below fp32's normal range reaches
    the kernel as 0 (an fp64 kernel variant otherwise: `kernel_float`)."""
    cfg = LossConfig.preset("dcpo", entropy_coef=1e-310)
    inp = _inputs(cfg)
    for sums in (False, True):
        args = fused_token_args(inp, cfg, sums=sums)
        assert args.variant.loss == "dcpo"  # (the kernels read its bounds per token, as PPO's)
        assert not torch.equal(args.low, args.low.flatten()[0].expand_as(args.low))
        assert args.variant.entropy_coef == 0.0


def test_the_op_keywords_rebuild_the_arguments():
    """An op cannot take the object: its keywords (`keywords()`, the op's schema `op_schema()`)
    rebuild it exactly, and every field has a schema entry."""
    from fusedrl.kernels.token_args import TokenLossArgs, op_schema

    cfg = LossConfig.preset("grpo", beta=0.04, kl="k3")
    args = fused_token_args(_inputs(cfg, is_weights=True), cfg, sums=True)
    keywords = args.keywords()
    assert TokenLossArgs.from_keywords(keywords) == args
    names = [part.split("=")[0].split()[-1] for part in op_schema().split(", ")]
    assert names == list(keywords)
    chunk = args.rows(lambda t: t[:, 1:])
    assert chunk.labels.shape[1] == args.labels.shape[1] - 1 and chunk.variant is args.variant


# ------------------------------------------------------------------ the kernel's own sums
def _use_ops(monkeypatch, ops) -> None:
    """The Triton backend runs `ops` on the general path and on a planned one (call_plan)."""
    from fusedrl import triton_backend

    monkeypatch.setattr(triton_backend, "policy_loss", functools.partial(policy_loss, ops))
    monkeypatch.setattr(triton_backend, "planned_call", functools.partial(planned_call, ops))


def _spy_sums(monkeypatch) -> list:
    """The Triton backend's `token_loss_sums` op, its calls counted."""
    import dataclasses

    from fusedrl import triton_backend

    calls = []
    real = triton_backend.OPS.token_loss_sums

    def spy(partials):
        calls.append(partials.shape)
        return real(partials)

    ops = dataclasses.replace(triton_backend.OPS, token_loss_sums=spy)
    _use_ops(monkeypatch, ops)
    return calls


# Token-level configs whose loss and metrics come from the fused kernel's sums: every loss it
# knows, each KL estimate (beta 0: the kl metric alone), the entropy bonus, the clip options,
# each aggregation; the batch's flags straddle the bounds (asserted below).
KERNEL_SUM_CONFIGS = {
    "dapo": LossConfig.preset("dapo"),
    "grpo": LossConfig.preset("grpo"),
    "cispo": LossConfig.preset("cispo"),
    "sapo": LossConfig.preset("sapo"),
    "pg": LossConfig.preset("pg"),
    "dcpo": LossConfig.preset("dcpo"),
    "dual_delta_bonus": LossConfig(dual_clip_c=1.5, delta=2.0, eps_low=0.1, entropy_coef=0.02),
    "ref_metric_only": LossConfig(kl="k2", beta=0.0),
    **{f"kl_{k}": LossConfig(kl=k, beta=0.1) for k in ("k1", "k2", "abs", "k3", "k1+", "k3+")},
    "seq_sum": LossConfig(agg="seq-mean-token-sum"),
    "sum_norm": LossConfig(agg="seq-mean-token-sum-norm", norm_constant=13.0),
    "temperature": LossConfig(temperature=0.7, entropy_coef=-0.01),
}


@needs_interpreter
@pytest.mark.parametrize("name", sorted(KERNEL_SUM_CONFIGS))
@pytest.mark.parametrize("rollout", [False, True])
def test_kernel_sums_give_the_loss_and_metrics(name, rollout, monkeypatch):
    """The loss and every metric from the fused kernel's per-program sums (one `token_loss_sums`
    call, no token_terms) equal the oracle's, gradient included; with rollout log-probs the
    mismatch metrics join them from the host."""
    cfg = KERNEL_SUM_CONFIGS[name]
    calls = _spy_sums(monkeypatch)
    # DCPO's bounds widen as the old probability falls: ratios far from 1 reach them.
    noise = 3.0 if cfg.loss == "dcpo" else 1.0
    data = make_batch(batch=4, time=9, vocab=131, seed=7, per_token_adv=True, old_noise=noise)
    if not rollout:
        data.pop("rollout_logp")
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="triton", return_entropy=True)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    assert len(calls) == 1, "the kernel's sums were not used"
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert set(ours.metrics) == set(want.metrics)
    for key, value in want.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-6, rtol=1e-5, msg=key)
    if cfg.loss != "pg":  # the clip flags acted (pg has none, sapo no clipfrac)
        assert float(want.metrics["clip_low"]) + float(want.metrics["clip_high"]) > 0
        assert cfg.loss == "sapo" or float(want.metrics["clipfrac"]) > 0, want.metrics
    if cfg.dual_clip_c is not None:
        assert float(want.metrics["dual_clipfrac"]) > 0


@needs_interpreter
def test_kernel_sums_of_an_all_masked_batch_and_a_nan_input(monkeypatch):
    """No counted token: loss and metrics 0, not NaN (the weight clamped at 1e-8). A NaN old
    log-prob on a counted token: the loss NaN, the token's clip flags 0 (torch's comparisons
    of a NaN ratio), its ppo_kl NaN, as the oracle."""
    calls = _spy_sums(monkeypatch)
    cfg = LossConfig(dual_clip_c=1.5, kl="k3", beta=0.1)
    data = make_batch(batch=3, time=5, vocab=67, seed=3)
    masked = {**data, "mask": torch.zeros_like(data["mask"])}
    out, grad = run_loss(fusedrl.policy_loss, masked, cfg, backend="triton")
    assert float(out.loss) == 0.0 and not grad.any()
    assert all(float(v) == 0.0 for v in out.metrics.values()), out.metrics
    counted = data["mask"].nonzero()[0].tolist()
    old = data["old_logp"].clone()
    old[tuple(counted)] = float("nan")
    poisoned = {**data, "old_logp": old}
    ours, _ = run_loss(fusedrl.policy_loss, poisoned, cfg, backend="triton")
    want, _ = run_loss(reference.policy_loss, poisoned, cfg)
    assert len(calls) == 2 and torch.isnan(ours.loss) and torch.isnan(want.loss)
    for key, value in want.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, equal_nan=True, msg=key)
    assert torch.isfinite(want.metrics["clipfrac"]) and torch.isnan(want.metrics["ppo_kl"])


# The aggregation modes and normalizers whose weights are the mask's over one number, which
# the fused kernel weighs itself (AGG_FROM_MASK), and those that take the weights kernel.
AGG_CASES = {
    "token-mean": ("token-mean", None, True),
    "token-mean-number": ("token-mean", 23.0, True),
    "token-mean-tensor": ("token-mean", "tensor", False),
    "sum-norm": ("seq-mean-token-sum-norm", None, True),
    "sum-norm-number": ("seq-mean-token-sum-norm", 5.0, True),
    "seq-mean": ("seq-mean-token-mean", None, False),
}


@needs_interpreter
@pytest.mark.parametrize("weights", ["bool", "fractional"])
@pytest.mark.parametrize("case", sorted(AGG_CASES))
def test_the_fused_kernel_weighs_the_mask_itself(case, weights, monkeypatch):
    """token-mean and seq-mean-token-sum-norm with no device normalizer: no weights launch, the
    kernel counts or scales the mask; loss and gradient equal the oracle's, a fractional mask's
    weights and an all-masked batch (loss and gradient 0) included."""
    from fusedrl import triton_backend

    agg, normalizer, in_kernel = AGG_CASES[case]
    weight_calls = []
    real = triton_backend.OPS.aggregation_weights

    def spy(*args):
        weight_calls.append(args[1])
        return real(*args)

    _use_ops(monkeypatch, dataclasses.replace(triton_backend.OPS, aggregation_weights=spy))
    cfg = LossConfig.preset("dapo").replace(agg=agg)
    data = make_batch(batch=3, time=6, vocab=67, seed=8, per_token_adv=True, old_noise=0.1)
    data.pop("rollout_logp"), data.pop("ref_logp")
    if weights == "fractional":
        gen = torch.Generator().manual_seed(9)
        data["mask"] = data["mask"] * (0.25 + torch.rand(data["mask"].shape, generator=gen))
    norm = torch.tensor(23.0) if normalizer == "tensor" else normalizer
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="triton", normalizer=norm)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, normalizer=norm)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-7)
    assert grad.abs().sum() > 0
    assert bool(weight_calls) != in_kernel, weight_calls
    masked = {**data, "mask": torch.zeros_like(data["mask"])}
    out, grad = run_loss(fusedrl.policy_loss, masked, cfg, backend="triton", normalizer=norm)
    assert float(out.loss) == 0.0 and not grad.any()


# ------------------------------------------------------------ the two-pass terms kernel
def _spy_sequence_terms(monkeypatch) -> list:
    """The Triton backend's `sequence_terms` op, the `sequence_ratio` of each call recorded."""
    import dataclasses

    from fusedrl import triton_backend

    calls = []
    real = triton_backend.OPS.sequence_terms

    def spy(*args, **keywords):
        calls.append(keywords["sequence_ratio"])
        return real(*args, **keywords)

    ops = dataclasses.replace(triton_backend.OPS, sequence_terms=spy)
    _use_ops(monkeypatch, ops)
    return calls


# Two-pass configs whose terms come from kernels/sequence_terms.py: (config, sequence ratio,
# old log-probs given). GSPO's clip bounds are widened where a case needs sequences on both
# sides of them (its own 3e-4 puts every sequence of a random batch outside).
SEQUENCE_TERM_CONFIGS = {
    "gspo": (LossConfig.preset("gspo"), True, True),
    "gspo_wide": (LossConfig.preset("gspo", eps_low=0.3, eps_high=0.3), True, True),
    "gspo_token_kl": (LossConfig.preset("gspo_token", kl="k3", beta=0.1), True, True),
    "gspo_dual_delta_bonus": (
        LossConfig.preset(
            "gspo", eps_low=0.02, eps_high=0.02, dual_clip_c=1.05, delta=2.0, entropy_coef=0.02
        ),
        True,
        True,
    ),
    "gspo_seq_is": (
        LossConfig.preset("gspo", is_correction="sequence_truncate", is_cap=2.0),
        True,
        True,
    ),
    "luspo": (LossConfig.preset("luspo"), True, True),
    "dcpo_on_policy": (LossConfig.preset("dcpo"), False, False),
    "dapo_on_policy_is": (
        LossConfig.preset("dapo", is_correction="token_truncate", is_cap=1.5),
        False,
        False,
    ),
}


@needs_interpreter
@pytest.mark.parametrize("name", sorted(SEQUENCE_TERM_CONFIGS))
def test_sequence_terms_kernel_gives_the_loss_metrics_and_gradient(name, monkeypatch):
    """Two passes over the logits with the terms between them from one kernel (one program per
    sequence) and `token_loss_sums`: loss, gradient and every metric equal the oracle's."""
    cfg, sequence_ratio, with_old = SEQUENCE_TERM_CONFIGS[name]
    calls = _spy_sequence_terms(monkeypatch)
    data = make_batch(batch=5, time=11, vocab=131, seed=11, per_token_adv=True, old_noise=0.4)
    if not with_old:
        data.pop("old_logp")
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend="triton", return_entropy=True)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    assert calls == [sequence_ratio], "the terms kernel was not used"
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert set(ours.metrics) == set(want.metrics)
    for key, value in want.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-6, rtol=1e-5, msg=key)
    if with_old:  # the clip flags acted
        assert float(want.metrics["clip_low"]) + float(want.metrics["clip_high"]) > 0
        assert float(want.metrics["clipfrac"]) > 0, want.metrics
    if name == "gspo_wide":  # some sequences inside the bounds, some outside
        assert 0 < float(want.metrics["clipfrac"]) < 1
    if cfg.dual_clip_c is not None:
        assert float(want.metrics["dual_clipfrac"]) > 0


@needs_interpreter
def test_sequence_terms_of_masked_batches_and_a_nan_input(monkeypatch):
    """No counted token: loss, metrics and gradient 0. A NaN old log-prob in one sequence: its
    sequence ratio is NaN, so the loss and that sequence's gradient are NaN, the others'
    finite and the oracle's (torch's clamp keeps the NaN; a GPU's would drop it)."""
    calls = _spy_sequence_terms(monkeypatch)
    cfg = LossConfig.preset("gspo", kl="k3", beta=0.1)
    data = make_batch(batch=4, time=6, vocab=67, seed=5)
    masked = {**data, "mask": torch.zeros_like(data["mask"])}
    out, grad = run_loss(fusedrl.policy_loss, masked, cfg, backend="triton")
    assert float(out.loss) == 0.0 and not grad.any()
    assert all(float(v) == 0.0 for v in out.metrics.values()), out.metrics
    b, t = data["mask"].nonzero()[0].tolist()
    old = data["old_logp"].clone()
    old[b, t] = float("nan")
    poisoned = {**data, "old_logp": old}
    ours, grad = run_loss(fusedrl.policy_loss, poisoned, cfg, backend="triton")
    want, want_grad = run_loss(reference.policy_loss, poisoned, cfg)
    assert len(calls) == 2 and torch.isnan(ours.loss) and torch.isnan(want.loss)
    counted = data["mask"][b]
    assert torch.isnan(grad[b][counted]).all(), "the NaN sequence's gradient is not NaN"
    others = torch.arange(grad.shape[0]) != b
    assert torch.isfinite(grad[others]).all()
    torch.testing.assert_close(grad[others], want_grad[others], atol=1e-6, rtol=1e-5)
    for key, value in want.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, equal_nan=True, msg=key)


# ------------------------------------------------------------ the kernels' label check
@needs_interpreter
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("bad", [-1, 67, 10_000])
def test_kernels_check_the_labels_they_read(preset, bad, monkeypatch):
    """The kernels read the labels unmasked and unchecked (no torch.where, no range reduction
    on the host path): a counted label outside [0, V) is read as 0, counted, and the call
    raises with the host check's message; labels outside the range under the mask (-100, HF's
    padding) count for nothing, on the fused kernel's path and the two-pass terms kernel's."""
    calls = _spy_sums(monkeypatch)
    cfg = LossConfig.preset(preset)
    data = make_batch(batch=3, time=6, vocab=67, seed=4)
    padded = {**data, "labels": data["labels"].masked_fill(~data["mask"], -100)}
    out, grad = run_loss(fusedrl.policy_loss, padded, cfg, backend="triton")
    want, want_grad = run_loss(reference.policy_loss, data, cfg)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    labels = padded["labels"].clone()
    labels[tuple(data["mask"].nonzero()[-1].tolist())] = bad
    with pytest.raises(ValueError, match=r"labels must be in \[0, 67\) where mask is set"):
        run_loss(fusedrl.policy_loss, {**padded, "labels": labels}, cfg, backend="triton")
    assert len(calls) == 2  # both calls took the kernels' sums (no host-side range check)
