"""The entropy bonus's coefficient as a device scalar (`entropy_coef=` a one-element tensor):
what adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy) changes between steps,
without a recompile or a host sync.

Against the oracle (`fusedrl.reference` with the same tensor) and against the plain number in
LossConfig.entropy_coef: token-level losses (the fused kernel reads the scalar), sequence-level
ones (two passes: the coefficient is in d(loss)/d(entropy)), the fused kernel's one pass, the
LM-head forms, in place;
a coefficient of 0 still computes the entropy; one compiled graph serves every value; then the
contracts (what is refused, by name)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, fused_backend, reference
from fusedrl._inputs import prepare_loss_inputs

from .conftest import (
    BACKENDS,
    LOGITS_BACKENDS,
    assert_lm_head_form_matches_the_oracle,
    make_batch,
    needs_interpreter,
    run_loss,
)

COEF = 0.3  # large, so the bonus moves the loss and the gradient far beyond the tolerances


def _close(ours, want, grad, want_grad):
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.metrics["entropy"], want.metrics["entropy"])


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo"])  # the fused kernel; two passes
def test_tensor_coefficient_equals_the_oracle_and_the_number(preset, backend):
    data = make_batch(vocab=131, seed=3, with_nan_padding=True)
    cfg = LossConfig.preset(preset)
    coef = torch.tensor(COEF)
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, entropy_coef=coef, backend=backend)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, entropy_coef=coef)
    _close(ours, want, grad, want_grad)
    # The oracle's own number path agrees (the tensor is the number, moved to the device).
    number, number_grad = run_loss(reference.policy_loss, data, cfg.replace(entropy_coef=COEF))
    _close(number, want, number_grad, want_grad)
    # The bonus acted: without it the loss and the gradient are far off.
    plain, plain_grad = run_loss(fusedrl.policy_loss, data, cfg, backend=backend)
    assert (ours.loss - plain.loss).abs() > 0.1
    assert (grad - plain_grad).abs().max() > 1e-3
    assert (grad[~data["mask"]] == 0).all()


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_a_zero_coefficient_still_computes_the_entropy(backend):
    """Adaptive control starts (or falls) to 0: the bonus then adds nothing, but the entropy it
    steers by is still measured, in the same graph."""
    data = make_batch(vocab=131, seed=4)
    cfg = LossConfig.preset("dapo")
    ours, grad = run_loss(
        fusedrl.policy_loss, data, cfg, entropy_coef=torch.tensor(0.0), backend=backend
    )
    plain, plain_grad = run_loss(fusedrl.policy_loss, data, cfg, backend=backend)
    assert "entropy" in ours.metrics and "entropy" not in plain.metrics
    torch.testing.assert_close(ours.loss, plain.loss)
    torch.testing.assert_close(grad, plain_grad)
    want, _ = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    torch.testing.assert_close(ours.metrics["entropy"], want.metrics["entropy"])


@needs_interpreter
def test_a_token_level_loss_reads_the_scalar_in_the_fused_kernel():
    """A tensor coefficient keeps a token-level loss in one pass: the fused kernel reads it (both
    fused backends take `entropy_coef_tensor=`), with the oracle's numbers."""
    from fusedrl import triton_backend

    data = make_batch(vocab=131, seed=5)
    cfg = LossConfig.preset("dapo")
    coef = torch.tensor(COEF)
    args = [data[k] for k in ("labels", "advantages", "mask", "old_logp", "ref_logp")]
    inp = prepare_loss_inputs(data["logits"], *args, None, cfg, None, entropy_coef=coef)
    assert not fused_backend.needs_two_passes(inp, cfg)
    calls = []
    ops = triton_backend.OPS
    ops = dataclasses.replace(ops, fused_token_loss=_spy(ops.fused_token_loss, calls, ops))
    grad = torch.empty_like(data["logits"])
    _, _, terms = fused_backend.policy_loss(ops, inp, cfg, False, grad)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, entropy_coef=coef)
    torch.testing.assert_close(terms.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert calls == [triton_backend.OPS]  # one pass: the fused kernel ran, once


def _spy(op, calls, ops):
    def call(*args, **kwargs):
        calls.append(ops)
        return op(*args, **kwargs)

    return call


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_form_and_in_place(backend):
    data = make_batch(vocab=131, seed=6)
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    cfg = LossConfig.preset("dapo")
    coef = torch.tensor(COEF)
    rows = {k: v for k, v in data.items() if k != "logits"}
    assert_lm_head_form_matches_the_oracle(
        hidden, weight, rows, backend, config=cfg, entropy_coef=coef
    )
    # In place on the logits.
    logits = (hidden @ weight.T).requires_grad_(True)
    work = logits * 1.0
    out = fusedrl.policy_loss(
        work, **rows, config=cfg, entropy_coef=coef, inplace=True, backend=backend
    )
    (grad,) = torch.autograd.grad(out.loss, logits)
    want, want_grad = run_loss(
        reference.policy_loss, dict(data, logits=hidden @ weight.T), cfg, entropy_coef=coef
    )
    torch.testing.assert_close(out.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)


@needs_interpreter
def test_one_compiled_graph_serves_every_value():
    """The point of a tensor: a new value is new data, not a new graph (a float in the config
    would be a guard, and a recompile whenever the controller moves it)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    data = make_batch(batch=2, time=4, vocab=67, seed=7)
    cfg = LossConfig.preset("dapo")
    counter = CompileCounterWithBackend("aot_eager")

    def loss_fn(logits, coef):
        return fusedrl.policy_loss(
            logits,
            data["labels"],
            data["advantages"],
            data["mask"],
            old_logp=data["old_logp"],
            config=cfg,
            backend="triton",
            entropy_coef=coef,
        ).loss

    compiled = torch.compile(loss_fn, fullgraph=True, backend=counter)
    for value in (0.0, 0.05, COEF):
        logits = data["logits"].clone().requires_grad_(True)
        loss = compiled(logits, torch.tensor(value))
        (grad,) = torch.autograd.grad(loss, logits)
        coef = torch.tensor(value)
        want, want_grad = run_loss(reference.policy_loss, data, cfg, entropy_coef=coef)
        torch.testing.assert_close(loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "coef, config, error, match",
    [
        (0.1, None, TypeError, "entropy_coef must be a one-element tensor"),
        (torch.tensor([0.1, 0.2]), None, ValueError, r"entropy_coef must hold one number.*\(2,\)"),
        (torch.tensor(1), None, TypeError, "entropy_coef must be a float tensor.*int64"),
        (torch.tensor(float("nan")), None, ValueError, "entropy_coef must be finite"),
        (torch.tensor(0.1), {"entropy_coef": 0.01}, ValueError, "config.entropy_coef=0.01"),
    ],
)
def test_bad_coefficients_are_refused_by_name(coef, config, error, match):
    data = make_batch(vocab=67, seed=8)
    cfg = LossConfig.preset("dapo", **(config or {}))
    for fn in (fusedrl.policy_loss, reference.policy_loss):
        with pytest.raises(error, match=match):
            run_loss(fn, data, cfg, entropy_coef=coef)


def test_tensor_parallel_refuses_it():
    data = make_batch(vocab=67, seed=9)
    with pytest.raises(NotImplementedError, match="tensor entropy_coef"):
        run_loss(
            fusedrl.policy_loss,
            data,
            LossConfig(),
            entropy_coef=torch.tensor(0.1),
            vocab_start=0,
            vocab_size=67,
        )


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("grpo", {}),  # seq-mean-token-mean policy, its own token mean for the bonus
        ("dapo", {"top_entropy_quantile": 0.5}),  # over the tokens the bonus acts on
    ],
)
def test_the_bonus_with_its_own_token_mean(preset, overrides, backend):
    """entropy_agg="token-mean" (TRL's bonus): sum(H m) / max(sum(m), 1) over the tokens it acts
    on, whatever the policy's agg and normalizer; a number or a tensor coefficient."""
    data = make_batch(vocab=131, seed=10, with_nan_padding=True)
    cfg = LossConfig.preset(preset, entropy_coef=COEF, entropy_agg="token-mean", **overrides)
    kwargs = dict(normalizer=5.0)  # the policy's own denominator: the bonus must ignore it
    ours, grad = run_loss(fusedrl.policy_loss, data, cfg, backend=backend, **kwargs)
    want, want_grad = run_loss(reference.policy_loss, data, cfg, **kwargs)
    _close(ours, want, grad, want_grad)
    tensor_cfg = cfg.replace(entropy_coef=0.0)
    coef = torch.tensor(COEF)
    ours_t, grad_t = run_loss(
        fusedrl.policy_loss, data, tensor_cfg, backend=backend, entropy_coef=coef, **kwargs
    )
    _close(ours_t, want, grad_t, want_grad)
    # It acted: aggregated with the policy (entropy_agg=None) the bonus is another number.
    shared, _ = run_loss(
        fusedrl.policy_loss, data, cfg.replace(entropy_agg=None), backend=backend, **kwargs
    )
    assert (shared.loss - ours.loss).abs() > 1e-2
    # Written out: the policy term alone, minus coef x the token mean of the entropy.
    plain, _ = run_loss(
        reference.policy_loss, data, cfg.replace(entropy_coef=0.0), return_entropy=True, **kwargs
    )
    if cfg.top_entropy_quantile == 1:
        entropy = torch.where(data["mask"], plain.entropy, 0.0)
        own_mean = entropy.sum() / data["mask"].sum()
        torch.testing.assert_close(ours.loss, plain.loss - COEF * own_mean, atol=1e-5, rtol=1e-5)


def test_entropy_agg_is_checked():
    with pytest.raises(ValueError, match="entropy_agg must be one of"):
        LossConfig(entropy_agg="seq-mean")
