"""`grad_scale=`: the gradient written already times the caller's loss factor (gradient
accumulation), so that a backward whose upstream gradient is that factor touches no
logits-sized tensor; any other upstream gradient stays exact; the loss is as without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, _autograd

from .conftest import LOGITS_BACKENDS, make_batch

# One config per path that writes the gradient: the fused kernel (dapo, grpo), two passes
# (gspo: the sequence terms; dapo on-policy with an IS correction), the exact KL's two-row
# kernels, a sampled set (the select's floors, then the fused kernel reading through them).
CONFIGS = {
    "dapo": LossConfig.preset("dapo"),
    "grpo": LossConfig.preset("grpo"),
    "gspo": LossConfig.preset("gspo"),
    "full_kl": dataclasses.replace(LossConfig.preset("grpo"), kl="full"),
    "entropy_bonus": dataclasses.replace(LossConfig.preset("dapo"), entropy_coef=0.01),
    "top_k": dataclasses.replace(LossConfig.preset("dapo"), top_k=20),
}
SCALES = [1 / 3, "tensor"]  # (a factor with rounding; a device scalar: the pointer path)


def _data(name):
    data = make_batch(batch=3, time=7, vocab=131, seed=3, per_token_adv=True)
    data.pop("rollout_logp")
    if name == "full_kl":
        data.pop("ref_logp")
        gen = torch.Generator().manual_seed(4)
        data["ref_logits"] = data["logits"] + 0.3 * torch.randn(data["logits"].shape, generator=gen)
    elif CONFIGS[name].beta == 0:
        data.pop("ref_logp")
    return data


def _run(data, cfg, backend, upstream, grad_scale=None, dtype=torch.float32):
    leaf = data["logits"].detach().to(dtype).requires_grad_(True)
    args = {k: v for k, v in data.items() if k != "logits"}
    if "ref_logits" in args:
        args["ref_logits"] = args["ref_logits"].to(dtype)
    out = fusedrl.policy_loss(leaf, config=cfg, backend=backend, grad_scale=grad_scale, **args)
    (grad,) = torch.autograd.grad(out.loss * upstream, leaf)
    return out, grad


def _factors(monkeypatch) -> list[float]:
    """The factors backward scales the written gradient by (1: it is left untouched)."""
    factors = []
    real = _autograd.scale_unless_one

    def spy(grad, factor):
        factors.append(float(factor))
        return real(grad, factor)

    monkeypatch.setattr(_autograd, "scale_unless_one", spy)
    return factors


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_the_gradient_is_written_scaled(backend, name, scale, monkeypatch):
    """(loss x s).backward() with grad_scale=s: the gradient equals s x the plain one, and
    backward scales nothing (its factor is exactly 1); the loss and metrics are the plain ones.
    A plain backward (upstream 1) with grad_scale=s rescales: the plain gradient again."""
    cfg = CONFIGS[name]
    data = _data(name)
    s = 0.25 if scale == "tensor" else scale
    given = torch.tensor(s) if scale == "tensor" else s
    plain, plain_grad = _run(data, cfg, backend, 1.0)
    factors = _factors(monkeypatch)
    out, grad = _run(data, cfg, backend, given, grad_scale=given)
    assert factors == [1.0], "backward rescaled a gradient written at the declared factor"
    assert torch.equal(out.loss, plain.loss)
    for metric in plain.metrics:
        assert torch.equal(out.metrics[metric], plain.metrics[metric]), metric
    torch.testing.assert_close(grad, plain_grad * s, rtol=1e-5, atol=1e-9)
    assert grad.abs().sum() > 0
    factors.clear()
    _, rescaled = _run(data, cfg, backend, 1.0, grad_scale=given)
    assert factors and factors[0] != 1.0
    torch.testing.assert_close(rescaled, plain_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_gradient_at_the_declared_factor(backend):
    """bf16 logits: the scaled gradient written in one rounding equals s x the plain one to
    bf16's precision (1 / 8: an exact power of two, the bits too)."""
    data = _data("dapo")
    plain, plain_grad = _run(data, CONFIGS["dapo"], backend, 1.0, dtype=torch.bfloat16)
    out, grad = _run(data, CONFIGS["dapo"], backend, 0.125, 0.125, dtype=torch.bfloat16)
    assert torch.equal(out.loss, plain.loss)
    assert torch.equal(grad, plain_grad * 0.125)


def test_planned_calls_take_the_factor():
    """The second call of a kind runs the plan (call_plan): the same scaled gradient."""
    data = _data("dapo")
    first = _run(data, CONFIGS["dapo"], "triton", 0.5, grad_scale=0.5)[1]
    second = _run(data, CONFIGS["dapo"], "triton", 0.5, grad_scale=0.5)[1]
    third = _run(data, CONFIGS["dapo"], "triton", 0.5, grad_scale=torch.tensor(0.5))[1]
    assert torch.equal(first, second) and torch.equal(first, third)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (0.0, ValueError, "grad_scale must be a finite number != 0"),
        (float("inf"), ValueError, "grad_scale must be a finite number != 0"),
        (float("nan"), ValueError, "grad_scale must be a finite number != 0"),
        (torch.tensor(0.0), ValueError, "grad_scale must be a finite number != 0"),
        (torch.tensor([0.5, 0.5]), ValueError, "grad_scale must hold one number"),
        (torch.tensor(1), TypeError, "grad_scale must be a float tensor"),
        (True, TypeError, "grad_scale must be a number or a 0-dim tensor"),
        ("0.5", TypeError, "grad_scale must be a number or a 0-dim tensor"),
    ],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_grad_scale_is_named(backend, bad, error, match):
    data = _data("dapo")
    with pytest.raises(error, match=match):
        _run(data, CONFIGS["dapo"], backend, 1.0, grad_scale=bad)


def test_the_oracle_takes_it_as_a_checked_no_op():
    """fusedrl divides its declared factor out of the upstream gradient, so its gradients are
    autograd's at any factor: the oracle's with grad_scale are its own without, and a bad one
    is named there too."""
    data = make_batch(seed=3)
    logits = data.pop("logits")
    outs = []
    for scale in (None, 0.25):
        leaf = logits.detach().requires_grad_(True)
        out = fusedrl.reference.policy_loss(leaf, **data, grad_scale=scale)
        outs.append((out.loss, torch.autograd.grad(out.loss * 0.25, leaf)[0]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    leaf = logits.detach().requires_grad_(True)
    ours = fusedrl.policy_loss(leaf, **data, backend="torch", grad_scale=0.25)
    (grad,) = torch.autograd.grad(ours.loss * 0.25, leaf)
    torch.testing.assert_close(grad, outs[1][1], atol=1e-7, rtol=1e-5)
    with pytest.raises(ValueError, match="grad_scale must be a finite number != 0"):
        fusedrl.reference.policy_loss(logits, **data, grad_scale=0.0)


LINEAR_CONFIGS = {
    "dapo": LossConfig.preset("dapo"),  # one sweep: the derivatives with each chunk
    "gspo": LossConfig.preset("gspo"),  # a forward sweep, the terms, a gradient sweep
    "full_kl": dataclasses.replace(LossConfig.preset("grpo"), kl="full"),  # the reference head
}


@pytest.mark.parametrize("name", sorted(LINEAR_CONFIGS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_lm_head_gradients_are_written_scaled(backend, name, monkeypatch):
    """linear_policy_loss(grad_scale=s), (loss x s).backward(): the gradients of the hidden
    states and of the head equal s x the plain ones, and backward scales none of them."""
    cfg = LINEAR_CONFIGS[name]
    data = make_batch(batch=3, time=5, vocab=131, seed=5, per_token_adv=True, old_noise=0.05)
    data.pop("rollout_logp")
    if cfg.beta == 0 or cfg.full_kl:
        data.pop("ref_logp")
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, 5, 24, generator=gen)
    weight = 0.3 * torch.randn(131, 24, generator=gen)
    ref_weight = weight + 0.05 * torch.randn(131, 24, generator=gen)
    extra = {"ref_weight": ref_weight} if cfg.full_kl else {}
    rows = {k: v for k, v in data.items() if k != "logits"}

    def run(upstream, grad_scale=None):
        leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        out = fusedrl.linear_policy_loss(
            *leaves, config=cfg, backend=backend, grad_scale=grad_scale, **rows, **extra
        )
        return out, torch.autograd.grad(out.loss * upstream, leaves)

    plain, plain_grads = run(1.0)
    factors = _factors(monkeypatch)
    out, grads = run(0.25, grad_scale=0.25)
    assert factors == [1.0, 1.0], "backward rescaled a gradient written at the declared factor"
    assert torch.equal(out.loss, plain.loss)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want * 0.25, rtol=1e-5, atol=1e-8)
        assert want.abs().sum() > 0


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd", "sampled_reverse_kl"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_distillation_gradients_are_written_scaled(backend, kind, monkeypatch):
    """distill_loss and linear_distill_loss with grad_scale=s: the student's gradients at s x
    the plain ones, nothing rescaled in backward, the loss unchanged."""
    data = make_batch(batch=3, time=5, vocab=131, seed=11, per_token_adv=True)
    gen = torch.Generator().manual_seed(12)
    teacher = data["logits"] + torch.randn(data["logits"].shape, generator=gen)
    rows = dict(labels=data["labels"], mask=data["mask"], kind=kind, backend=backend)
    if kind == "sampled_reverse_kl":
        rows.update(advantages=data["advantages"], old_logp=data["old_logp"])
    hidden = torch.randn(3, 5, 24, generator=gen)
    heads = [0.3 * torch.randn(131, 24, generator=gen) for _ in range(2)]

    def logits_form(upstream, grad_scale=None):
        leaf = data["logits"].detach().requires_grad_(True)
        out = fusedrl.distill_loss(leaf, teacher, grad_scale=grad_scale, **rows)
        return out, torch.autograd.grad(out.loss * upstream, [leaf])

    def head_form(upstream, grad_scale=None):
        leaves = [hidden.clone().requires_grad_(True), heads[0].clone().requires_grad_(True)]
        out = fusedrl.linear_distill_loss(*leaves, hidden, heads[1], grad_scale=grad_scale, **rows)
        return out, torch.autograd.grad(out.loss * upstream, leaves)

    for form, calls in ((logits_form, 1), (head_form, 2)):
        plain, plain_grads = form(1.0)
        factors = _factors(monkeypatch)
        out, grads = form(0.25, grad_scale=0.25)
        assert factors == [1.0] * calls, (form.__name__, factors)
        assert torch.equal(out.loss, plain.loss)
        for got, want in zip(grads, plain_grads):
            torch.testing.assert_close(got, want * 0.25, rtol=1e-5, atol=1e-8)
            assert want.abs().sum() > 0
        monkeypatch.undo()
