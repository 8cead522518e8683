"""Per-token temperatures (`temperature=` a [B, T] tensor, or [B] one per sequence): each row's
logits divided by its own, in the kernels' own scalars (loaded once per row) on Triton and per
row block on torch.

Against the oracle (`fusedrl.reference`, which divides each token's logits by its temperature)
on token-level losses (the fused kernel), sequence-level ones (two passes), the log-probs with
and without a gradient, the LM-head forms, in place, [N, V] input, NaN padding and bf16 against
float64; an independent check that a row equals the scalar-temperature call at its own
temperature; then the contracts (shapes, values, what is refused and where)."""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, linear_triton, reference

from .conftest import (
    BACKENDS,
    LOGITS_BACKENDS,
    assert_lm_head_form_matches_the_oracle,
    make_batch,
    run_loss,
)


def _temperatures(shape, seed=0, masked=None):
    """Temperatures in [0.4, 1.6): far enough apart that one scalar would be far off; 0 on
    masked tokens when given (they may hold anything)."""
    gen = torch.Generator().manual_seed(seed)
    temps = 0.4 + 1.2 * torch.rand(shape, generator=gen)
    if masked is not None:
        temps = torch.where(masked, 0.0, temps)
    return temps


CASES = {
    "dapo": ("dapo", dict(entropy_coef=0.01)),  # token-level: the fused kernel
    # sequence-level: two passes (bounds opened: old_logp is at T = 1, far from these ratios)
    "gspo": ("gspo", dict(eps_low=0.99, eps_high=99.0)),
    "grpo-kl": ("grpo", dict()),  # the k3 KL to ref_logp in the fused kernel
}


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_equals_the_oracle(case, backend):
    preset, overrides = CASES[case]
    cfg = LossConfig.preset(preset, **overrides)
    data = make_batch(vocab=131, seed=len(case), with_nan_padding=True)
    temps = _temperatures(data["labels"].shape, masked=~data["mask"])
    kwargs = dict(config=cfg, temperature=temps, return_entropy=True)
    ours, grad = run_loss(fusedrl.policy_loss, data, backend=backend, **kwargs)
    want, want_grad = run_loss(reference.policy_loss, data, **kwargs)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.logp, want.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, want.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    assert (grad[~data["mask"]] == 0).all()
    # One temperature for all (their mean) is far off: the per-token ones acted.
    mean_t = temps[data["mask"]].mean().item()
    scalar, _ = run_loss(fusedrl.policy_loss, data, config=cfg.replace(temperature=mean_t))
    assert (scalar.logp - ours.logp).abs().max() > 0.1


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_in_place_flat_and_per_sequence(backend):
    data = make_batch(vocab=131, seed=7)
    cfg = LossConfig.preset("dapo")
    per_seq = _temperatures((3,), seed=1)
    want, want_grad = run_loss(reference.policy_loss, data, config=cfg, temperature=per_seq)
    logits = data["logits"].clone().requires_grad_(True)
    work = logits * 1.0  # a buffer the in-place loss may overwrite
    args = {k: v for k, v in data.items() if k != "logits"}
    ours = fusedrl.policy_loss(
        work, **args, config=cfg, temperature=per_seq, inplace=True, backend=backend
    )
    (grad,) = torch.autograd.grad(ours.loss, logits)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    # [N, V] input with [N] temperatures
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items() if k != "advantages"}
    flat["advantages"] = data["advantages"][:, None].expand(3, 7).reshape(-1)
    per_token = per_seq[:, None].expand(3, 7).reshape(-1)
    flat_out, flat_grad = run_loss(
        fusedrl.policy_loss, flat, config=cfg, temperature=per_token, backend=backend
    )
    torch.testing.assert_close(flat_out.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat_grad.view_as(want_grad), want_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_token_logprobs_row_by_row(backend):
    """Each row equals the scalar-temperature call at its own temperature (not the oracle's
    broadcast: the plain scalar path), with and without a gradient."""
    data = make_batch(vocab=131, seed=9)
    temps = _temperatures(data["labels"].shape, seed=2)
    logits = data["logits"].clone().requires_grad_(True)
    logp, entropy = fusedrl.token_logprobs(logits, data["labels"], temps, True, backend)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    with torch.no_grad():
        no_grad, _ = fusedrl.token_logprobs(data["logits"], data["labels"], temps, False, backend)
    torch.testing.assert_close(no_grad, logp.detach())
    for b, t in ((0, 0), (1, 3), (2, 6)):
        row = data["logits"][b : b + 1, t : t + 1].clone().requires_grad_(True)
        one, one_entropy = fusedrl.token_logprobs(
            row, data["labels"][b : b + 1, t : t + 1], temps[b, t].item(), True, backend
        )
        (one.sum() + 0.5 * one_entropy.sum()).backward()
        torch.testing.assert_close(logp[b, t], one[0, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(entropy[b, t], one_entropy[0, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(logits.grad[b, t], row.grad[0, 0], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_lm_head_forms_equal_the_oracle(preset, backend, monkeypatch):
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 5 * 131 * 4)  # chunks of 5 rows
    monkeypatch.setattr(fusedrl.row_blocks, "BLOCK_ELEMENTS", 5 * 131)
    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    data = make_batch(vocab=131, seed=4)
    temps = _temperatures((3, 7), seed=3)
    cfg = LossConfig.preset(preset)
    rows = {k: v for k, v in data.items() if k != "logits"}
    assert_lm_head_form_matches_the_oracle(
        hidden, weight, rows, backend, config=cfg, temperature=temps
    )
    logp, _ = fusedrl.linear_token_logprobs(hidden, weight, data["labels"], temps, backend=backend)
    torch.testing.assert_close(
        logp, reference.token_logprobs(hidden @ weight.T, data["labels"], temps)[0]
    )


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_bf16_against_the_float64_truth(backend):
    data = make_batch(vocab=131, seed=5, dtype=torch.bfloat16)
    temps = _temperatures(data["labels"].shape, seed=5)
    cfg = LossConfig.preset("dapo")
    ours, grad = run_loss(fusedrl.policy_loss, data, config=cfg, temperature=temps, backend=backend)
    truth = dict(data, logits=data["logits"].double())
    want, want_grad = run_loss(reference.policy_loss, truth, config=cfg, temperature=temps.double())
    assert abs(ours.loss.item() - want.loss.item()) < 1e-3
    err = (grad.double() - want_grad).norm() / want_grad.norm()
    assert err < 1e-2, err


# min_p alone, and all three (top_p after top_k and min_p; top_p alone on the whole row is
# replayed at one temperature in tests/test_sampling_replay.py: the temperature enters both alike)
FILTERS = {
    "min_p": dict(min_p=0.1),
    "all": dict(top_k=40, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("filters", sorted(FILTERS))
def test_sampling_filters_take_them(filters, backend, monkeypatch):
    """vLLM divides each request's logits by its own temperature before min_p / top_k / top_p,
    so the sampled set itself depends on it: the select (Triton's kernel loads the row's
    temperature; torch's divides the block by its column) against the oracle, through the
    policy loss (one sweep and two), the log-probs with and without a gradient and the LM-head
    forms."""
    monkeypatch.setattr(linear_triton, "GRAD_CHUNK_BYTES", 5 * 131 * 4)
    monkeypatch.setattr(fusedrl.row_blocks, "BLOCK_ELEMENTS", 5 * 131)
    data = make_batch(vocab=131, seed=8, with_nan_padding=True)
    temps = _temperatures(data["labels"].shape, seed=8, masked=~data["mask"])
    filt = FILTERS[filters]
    for preset in ("dapo", "gspo"):
        kwargs = dict(config=LossConfig.preset(preset, **filt), temperature=temps)
        ours, grad = run_loss(fusedrl.policy_loss, data, backend=backend, **kwargs)
        want, want_grad = run_loss(reference.policy_loss, data, **kwargs)
        torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.logp, want.logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    # Every row counts here: the padded ones get logits without ties (top_p keeps all of a tie
    # at its boundary, vLLM's sort an arbitrary part of it).
    fill = 2.0 * torch.randn(data["logits"].shape, generator=torch.Generator().manual_seed(1))
    clean = torch.where(data["mask"][..., None], data["logits"], fill)
    labels = torch.where(data["mask"], data["labels"], 0)
    row_t = torch.where(data["mask"], temps, 1.0)
    up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    for grad_on in (False, True):
        x, x_ref = (clean.clone().requires_grad_(grad_on) for _ in "ab")
        logp, entropy = fusedrl.token_logprobs(x, labels, row_t, True, backend, **filt)
        want_logp, want_entropy = reference.token_logprobs(x_ref, labels, row_t, True, **filt)
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
        if grad_on:  # backward over the kept masked copy, at the rows' own temperatures
            (grad,) = torch.autograd.grad((logp * up).sum() + entropy.sum(), x)
            (want_grad,) = torch.autograd.grad((want_logp * up).sum() + want_entropy.sum(), x_ref)
            torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    # The sets are not those the kernels' scalar temperature (1) would choose: a select that
    # ignored the rows' own would fail above.
    args = (labels, filt.get("top_k"), filt.get("top_p"), filt.get("min_p"))
    sets = [reference._vllm_sampling_set(clean / t, *args) for t in (row_t[..., None], 1.0)]
    assert (sets[0] != sets[1]).any()
    gen = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    rows = {k: v for k, v in data.items() if k != "logits"}
    assert_lm_head_form_matches_the_oracle(
        hidden, weight, rows, backend, config=LossConfig.preset("dapo", **filt), temperature=temps
    )
    logp, _ = fusedrl.linear_token_logprobs(hidden, weight, labels, row_t, backend=backend, **filt)
    want = reference.token_logprobs(hidden @ weight.T, labels, row_t, **filt)[0]
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)


def test_misuse_is_named():
    data = make_batch(vocab=37, seed=1)
    temps = _temperatures(data["labels"].shape)
    with pytest.raises(ValueError, match=r"both set: pass one"):
        fusedrl.policy_loss(**data, config=LossConfig(temperature=0.7), temperature=temps)
    with pytest.raises(ValueError, match=r"temperature shape \(3, 6\)"):
        fusedrl.policy_loss(**data, temperature=temps[:, :6])
    bad = temps.clone()
    bad[0, 0] = 0.0  # a counted token (make_batch's first sequence is never empty)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        fusedrl.policy_loss(**data, temperature=bad)
    # The tensor-parallel paths take them (tests/test_tensor_parallel.py, 2 and 3 ranks); a
    # group of one is the plain call.
    one = fusedrl.policy_loss(**data, temperature=temps, vocab_start=0)
    torch.testing.assert_close(one.loss, fusedrl.policy_loss(**data, temperature=temps).loss)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_one_temperature_set_one_way(backend):
    """`temperature=` a number is config.temperature (policy_loss, the LM-head form, the
    oracle); a 0-dim tensor is that number on every token; both set, or a temperature of
    another type, is refused by name."""
    data = make_batch(vocab=37, seed=4)
    cfg = LossConfig.preset("dapo")
    want, want_grad = run_loss(
        fusedrl.policy_loss, data, cfg.replace(temperature=0.7), backend=backend
    )
    for temperature in (0.7, torch.tensor(0.7)):
        out, grad = run_loss(
            fusedrl.policy_loss, data, cfg, backend=backend, temperature=temperature
        )
        torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-6)
    oracle, oracle_grad = run_loss(reference.policy_loss, data, cfg, temperature=0.7)
    torch.testing.assert_close(oracle.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert not torch.equal(oracle.loss, run_loss(reference.policy_loss, data, cfg)[0].loss)
    hidden = torch.randn(*data["labels"].shape, 8, generator=torch.Generator().manual_seed(2))
    weight = torch.randn(37, 8, generator=torch.Generator().manual_seed(3))
    args = {k: v for k, v in data.items() if k != "logits"}
    linear = fusedrl.linear_policy_loss(hidden, weight, **args, config=cfg, temperature=0.7)
    head = reference.policy_loss(hidden @ weight.T, **args, config=cfg.replace(temperature=0.7))
    torch.testing.assert_close(linear.loss, head.loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"temperature=0.7 and config.temperature=0.5"):
        fusedrl.policy_loss(**data, config=cfg.replace(temperature=0.5), temperature=0.7)
    with pytest.raises(ValueError, match=r"temperature=0.7 and config.temperature=0.5"):
        fusedrl.linear_policy_loss(
            hidden, weight, **args, config=cfg.replace(temperature=0.5), temperature=0.7
        )
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        fusedrl.policy_loss(**data, temperature=-1.0)
    with pytest.raises(TypeError, match="temperature must be a number"):
        fusedrl.policy_loss(**data, temperature="0.7")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["jsd", "reverse_kl", "sampled_reverse_kl"])
def test_distillation_takes_them(kind, backend):
    """distill_loss through the two-row ops (Triton's load the row's temperature like the row
    kernels), and the sampled form through the policy loss: against the oracle."""
    data = make_batch(vocab=131, seed=12)
    gen = torch.Generator().manual_seed(13)
    teacher = data["logits"] + 1.5 * torch.randn(data["logits"].shape, generator=gen)
    temps = _temperatures(data["labels"].shape, seed=4, masked=~data["mask"])
    extra = {}
    if kind == "sampled_reverse_kl":
        extra = dict(advantages=data["advantages"], config=LossConfig.preset("dapo"))
    args = (teacher, data["labels"], data["mask"])
    kwargs = dict(kind=kind, beta=0.3, temperature=temps, **extra)
    x = data["logits"].clone().requires_grad_(True)
    ours = fusedrl.distill_loss(x, *args, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(ours.loss, x)
    y = data["logits"].clone().requires_grad_(True)
    want = reference.distill_loss(y, *args, **kwargs)
    (want_grad,) = torch.autograd.grad(want.loss, y)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    mean_t = temps[data["mask"]].mean().item()
    scalar = fusedrl.distill_loss(data["logits"], *args, **dict(kwargs, temperature=mean_t))
    assert (scalar.loss - ours.loss).abs() > 1e-3  # the per-token temperatures acted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl", ["full", "full_reverse"])
def test_the_exact_kl_takes_them(kl, backend, monkeypatch):
    """policy_loss(ref_logits=) and linear_policy_loss(ref_weight=) with kl="full": the two-row
    ops on the row's own temperature, against the oracle."""
    monkeypatch.setattr(fusedrl.distill.heads, "PAIR_CHUNK_BYTES", 2 * 5 * 131 * 4)
    data = make_batch(vocab=131, seed=14)
    del data["ref_logp"]
    gen = torch.Generator().manual_seed(15)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    ref_weight = weight + 0.5 * torch.randn(131, 16, generator=gen)
    temps = _temperatures((3, 7), seed=6)
    cfg = LossConfig.preset("dapo", kl=kl, beta=0.3)
    rows = {k: v for k, v in data.items() if k != "logits"}
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    ours = fusedrl.linear_policy_loss(
        *leaves, **rows, config=cfg, temperature=temps, ref_weight=ref_weight, backend=backend
    )
    grads = torch.autograd.grad(ours.loss, leaves)
    oracle = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    ref_logits = hidden @ ref_weight.T
    want = reference.policy_loss(
        oracle[0] @ oracle[1].T, **rows, config=cfg, temperature=temps, ref_logits=ref_logits
    )
    want_grads = torch.autograd.grad(want.loss, oracle)
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.metrics["kl"], want.metrics["kl"], atol=1e-6, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    logits_form, logits_grad = run_loss(
        fusedrl.policy_loss,
        dict(data, logits=hidden @ weight.T),
        config=cfg,
        temperature=temps,
        ref_logits=ref_logits,
        backend=backend,
    )
    torch.testing.assert_close(logits_form.loss, want.loss, atol=1e-5, rtol=1e-5)
