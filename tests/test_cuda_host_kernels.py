"""The CUDA extension's kernel code, run on the CPU (tests/cuda_host_kernels.cu: the two-sweep
kernels' row functions as one block of one thread), against the oracle.

The backend matrices of test_backends.py, test_branches.py, test_degenerate_rows.py,
test_corrections.py, test_backward.py and the logits tests of test_row_temperature.py,
test_logit_transform.py, test_entropy_coef.py, test_decoupled_ppo.py and test_sum_pi_squared.py
list it (`CUDA_ON_THE_HOST`); here: that the path a call takes is the extension's (which of its
kernels ran), and the rows only these kernels treat specially (sums relative to the label logit
that overflow, and take the exact online fallback).
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import CUDA_ON_THE_HOST, make_batch, needs_interpreter, run_loss


def _loss(backend, **kwargs):
    return lambda *a, **k: fusedrl.policy_loss(*a, backend=backend, **k, **kwargs)


@pytest.mark.parametrize("backend", [CUDA_ON_THE_HOST])
def test_each_call_takes_the_extensions_kernels(backend, cuda_host_kernels):
    """Token-level with a gradient: the fused kernel (in place too); a sequence-level loss: the
    log-prob kernel, then the gradient kernel; no gradient: the log-prob kernel alone."""
    data = make_batch(vocab=257, seed=1)
    calls = cuda_host_kernels.calls
    for cfg, kwargs, want in [
        (LossConfig.preset("dapo"), {}, ["fused"]),
        (LossConfig.preset("dapo"), {"inplace": True}, ["fused"]),
        (LossConfig.preset("gspo"), {}, ["logprobs", "grad"]),
    ]:
        calls.clear()
        logits = data["logits"].clone() if kwargs else data["logits"]
        ours, grad = run_loss(_loss(backend, **kwargs), dict(data, logits=logits), cfg)
        ref, ref_grad = run_loss(reference.policy_loss, data, cfg)
        assert calls == want, (cfg.loss, kwargs, calls)
        torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-5)
    calls.clear()
    with torch.no_grad():
        fusedrl.policy_loss(**data, backend=backend)
    assert calls == ["logprobs"]


@needs_interpreter
@pytest.mark.parametrize("preset", ["gspo", "gspo_token", "grpo", "cispo"])
def test_terms_come_from_the_triton_terms_kernel(preset, cuda_on_the_host, monkeypatch):
    """The extension has no kernel on [B, T] scalars: between its two passes a sequence-level
    call takes Triton's terms kernel and sums (cuda_backend.triton_terms), not torch's terms;
    after its fused kernel (which keeps no sums) a token-level call takes them for the loss and
    the metrics. Loss, gradient and metrics equal the oracle's."""
    import dataclasses

    from fusedrl import cuda_backend

    ops = cuda_backend._OPS
    assert ops.sequence_terms is not None and not ops.fused_sums
    ratios = []

    def spy(*args, **keywords):
        ratios.append(keywords["sequence_ratio"])
        return ops.sequence_terms(*args, **keywords)

    monkeypatch.setattr(cuda_backend, "_OPS", dataclasses.replace(ops, sequence_terms=spy))
    cfg = LossConfig.preset(preset, kl="k3", beta=0.05)
    data = make_batch(vocab=257, seed=2, per_token_adv=preset == "gspo_token")
    ours, grad = run_loss(_loss(CUDA_ON_THE_HOST), data, cfg)
    want, want_grad = run_loss(reference.policy_loss, data, cfg)
    sequence = cfg.ratio_level == "sequence"
    assert ratios == [sequence]
    assert cuda_on_the_host.calls == (["logprobs", "grad"] if sequence else ["fused"])
    torch.testing.assert_close(ours.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    for key, value in want.metrics.items():
        torch.testing.assert_close(ours.metrics[key], value, atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("backend", [CUDA_ON_THE_HOST])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_rows_whose_sums_overflow_take_the_exact_fallback(backend, cap, cuda_host_kernels):
    """The sweep sums 2^(y - y_label): a logit ~130 bits above the label's overflows them, and
    the row is read again by the exact online softmax (with a cap, a low temperature does it:
    tanh keeps every logit within 2 / T of the label's); a banned label (-inf) too. Loss,
    log-probs, entropy and gradient equal the oracle's."""
    data = make_batch(batch=3, time=5, vocab=131, seed=2, empty_rows=())
    labels = data["labels"]
    logits = data["logits"]
    kwargs = {}
    if cap is None:
        logits[0, 1, (labels[0, 1] + 1) % 131] = logits[0, 1, labels[0, 1]] + 95.0  # 137 bits
        logits[2, 0, (labels[2, 0] + 5) % 131] = 400.0
    else:  # |tanh| <= 1: 2 / T nats of spread at most; T = 0.01 gives up to 288 bits
        kwargs = {"softcap": cap}
    logits[1, 2, labels[1, 2]] = float("-inf")  # a banned label: logp -inf, as the oracle says
    cfg = LossConfig.preset("dapo", entropy_coef=0.01, temperature=0.01 if cap else 1.0)
    ours, grad = run_loss(_loss(backend, **kwargs), data, cfg, return_entropy=True)
    ref, ref_grad = run_loss(_ref(kwargs), data, cfg, return_entropy=True)
    finite = torch.isfinite(ref.logp)
    assert not finite[1, 2] and finite.sum() >= 10
    torch.testing.assert_close(ours.logp, ref.logp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.entropy[finite], ref.entropy[finite], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ours.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def _ref(kwargs):
    return lambda *a, **k: reference.policy_loss(*a, **k, **kwargs)


@needs_interpreter
def test_the_variant_codes_are_the_triton_kernels():
    """csrc's LossCode / KlCode (through bindings.cpp's mappings) and the Triton kernels'
    LOSS_CODES / KL_CODES: one numbering for both fused kernels."""
    from fusedrl.kernels import token_loss

    from .cuda_host_ops import _codes

    assert _codes("loss_code") == token_loss.LOSS_CODES
    assert _codes("kl_code") == {k: v for k, v in token_loss.KL_CODES.items() if k is not None}
