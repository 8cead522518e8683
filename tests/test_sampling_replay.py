"""Sampling-mask replay: log-probs over the set vLLM sampled from (top_k / top_p / min_p).

The torch backend against the reference (written from vLLM's sampler, independently of
`fusedrl.sampling`) on odd shapes, gradients included. Against vLLM itself:
tests/test_sampling_vllm.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS, LOGITS_BACKENDS, make_batch, run_loss

# The torch backend applies the mask per block; Triton (through the interpreter) reads the logits
# through each row's floor (tests/test_sampling_floors.py); CUDA reads a masked copy.

# (temperature, top_k, top_p, min_p): each filter alone, then all three (vLLM: min_p, top_k, top_p)
FILTERS = {
    "top_k": (1.3, 5, None, None),
    "top_p": (1.0, None, 0.7, None),
    "min_p": (0.7, None, None, 0.2),
    "all": (0.8, 20, 0.9, 0.05),
    "tight": (0.5, 50, 0.5, 0.02),
}


def _logits_and_sampled_labels(seed=0, batch=3, time=7, vocab=1031):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch, time, vocab, generator=gen)
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    labels[:, :4] = logits[:, :4].argmax(-1)  # most sampled tokens are near the top
    return logits, labels


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("name", sorted(FILTERS))
def test_token_logprobs_match_the_reference(name, backend):
    temperature, top_k, top_p, min_p = FILTERS[name]
    logits, labels = _logits_and_sampled_labels(seed=1)
    kwargs = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    ours = logits.clone().requires_grad_(True)
    logp, ent = fusedrl.token_logprobs(ours, labels, temperature, True, backend, **kwargs)
    theirs = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = reference.token_logprobs(theirs, labels, temperature, True, **kwargs)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    weights = torch.randn(2, *labels.shape, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad((logp * weights[0] + ent * weights[1]).sum(), ours)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights[0] + ref_ent * weights[1]).sum(), theirs)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    # The filter acted: the log-probs differ from the plain ones, the entropy is smaller.
    plain, plain_ent = reference.token_logprobs(logits, labels, temperature, True)
    assert (logp - plain).abs().max() > 1e-3 and (ent < plain_ent - 1e-3).all()
    with torch.no_grad():  # the no-grad path (old / reference log-probs), block by block
        fast, fast_ent = fusedrl.token_logprobs(
            logits, labels, temperature, True, backend, **kwargs
        )
    torch.testing.assert_close(fast, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_ent, ref_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
def test_policy_loss_replays_the_mask(preset, inplace, backend):
    data = make_batch(batch=4, time=9, vocab=523, seed=3, per_token_adv=True)
    cfg = LossConfig.preset(preset, temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    cfg = cfg.replace(entropy_coef=0.01)
    ref, ref_grad = run_loss(reference.policy_loss, data, cfg, return_entropy=True)
    ours, grad = run_loss(
        fusedrl.policy_loss,
        dict(data, logits=data["logits"].clone()),
        cfg,
        backend=backend,
        return_entropy=True,
        inplace=inplace,
    )
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, ref.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    # Tokens outside the set get no gradient, except the label.
    outside = ref_grad == 0
    assert outside.float().mean() > 0.5
    with torch.no_grad():
        args = {k: v for k, v in data.items() if k != "logits"}
        no_grad = fusedrl.policy_loss(data["logits"], **args, config=cfg, backend=backend)
    torch.testing.assert_close(no_grad.loss, ref.loss, atol=1e-5, rtol=1e-5)


def test_ties_at_the_top_k_boundary_are_kept_and_the_label_always():
    logits = torch.tensor([[[3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -4.0]]])
    labels = torch.tensor([[6]])  # far below every filter: still scored, never -inf
    logp, ent = fusedrl.token_logprobs(logits, labels, 1.0, True, "torch", top_k=2)
    kept = torch.tensor([3.0, 2.0, 2.0, 2.0, -4.0])
    expected = torch.log_softmax(kept, -1)
    torch.testing.assert_close(logp[0, 0], expected[-1])
    torch.testing.assert_close(ent[0, 0], -(expected.exp() * expected).sum())


def test_unsupported_paths_and_bad_values_are_named():
    logits, labels = _logits_and_sampled_labels(seed=4)
    for kwargs, message in [
        (dict(top_k=-2), "top_k must be an int >= 1, or 0 / -1 / None"),
        (dict(top_k=2.0), "top_k must be an int >= 1, or 0 / -1 / None"),
        (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
        (dict(min_p=1.5), "min_p must be in \\[0, 1\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            fusedrl.token_logprobs(logits, labels, **kwargs)
        with pytest.raises(ValueError, match="LossConfig." + message):
            LossConfig(**kwargs)
    # vLLM's "off" values, as SamplingParams takes them (top_k=0 its default, TRL's too)
    for off in (dict(top_p=1.0, min_p=0.0), dict(top_k=0), dict(top_k=-1)):
        assert LossConfig(**off).sampling is None, off
        for backend in ("torch", "triton"):
            got = fusedrl.token_logprobs(logits, labels, backend=backend, **off)[0]
            torch.testing.assert_close(got, fusedrl.token_logprobs(logits, labels)[0])
            want = reference.token_logprobs(logits, labels, **off)[0]
            torch.testing.assert_close(got, want, msg=str(off))


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_sampling_values_as_numpy_numbers_and_min_p_one(backend):
    """SamplingParams' numbers straight through: numpy scalars (LossConfig took them, the entry
    points refused them) and min_p = 1 (vLLM keeps the largest probability and its ties)."""
    logits, labels = _logits_and_sampled_labels(seed=6)
    plain = dict(top_k=5, top_p=0.9, min_p=0.05)
    numpy_ = dict(top_k=np.int64(5), top_p=np.float64(0.9), min_p=np.float64(0.05))
    want = fusedrl.token_logprobs(logits, labels, backend=backend, **plain)[0]
    got = fusedrl.token_logprobs(logits, labels, backend=backend, **numpy_)[0]
    torch.testing.assert_close(got, want)
    assert LossConfig(**numpy_) == LossConfig(**plain)
    logp = fusedrl.token_logprobs(logits, labels, backend=backend, min_p=1.0)[0]
    torch.testing.assert_close(logp, reference.token_logprobs(logits, labels, min_p=1.0)[0])
    is_max = labels == logits.argmax(-1)
    assert is_max.any() and (~is_max).any()
    torch.testing.assert_close(logp[is_max], torch.zeros_like(logp[is_max]))  # the set: itself


def test_torch_backend_finds_each_floor_once(monkeypatch):
    """Pass 1 keeps each row's floor for pass 2 (top_p alone sorts every row: once is enough)."""
    from fusedrl import row_blocks, torch_backend

    calls = []
    real = torch_backend.sampling_floor
    monkeypatch.setattr(
        torch_backend, "sampling_floor", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 8 * 1031)  # 21 rows: 3 blocks
    logits, labels = _logits_and_sampled_labels(seed=5)
    data = make_batch(seed=5)
    data["logits"], data["labels"] = logits.clone().requires_grad_(True), labels
    cfg = LossConfig.preset("dapo").replace(top_p=0.8)
    run_loss(fusedrl.policy_loss, data, cfg, backend="torch")
    assert calls == [8, 8, 5]
    calls.clear()
    ours = logits.clone().requires_grad_(True)
    logp, _ = fusedrl.token_logprobs(ours, labels, 1.0, backend="torch", top_p=0.8)
    logp.sum().backward()
    assert calls == [8, 8, 5]


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_no_grad_chunks_of_a_strided_slice(backend, monkeypatch):
    """Without a gradient, on a [B, P+T, V] slice, which cannot be flattened: Triton's floors
    read it in place; a masked copy (the CUDA extension's select-kernel chunks, the torch
    route's blocks) is made 5 rows at a time, walked sequence by sequence, with a partial last
    chunk."""
    from fusedrl import fused_backend, row_blocks

    monkeypatch.setattr(fused_backend, "SAMPLED_CHUNK_ELEMENTS", 5 * 1031)
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 5 * 1031)
    full, labels = _logits_and_sampled_labels(seed=6, time=11)
    logits, labels = full[:, 4:], labels[:, 4:]
    kwargs = dict(top_k=30, top_p=0.8, min_p=0.02)
    with torch.no_grad():
        logp, ent = fusedrl.token_logprobs(logits, labels, 0.9, True, backend, **kwargs)
    ref_logp, ref_ent = reference.token_logprobs(logits, labels, 0.9, True, **kwargs)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
