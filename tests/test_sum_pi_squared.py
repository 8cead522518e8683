"""sum_v pi_v^2 per token (`return_sum_pi_squared=True` of token_logprobs and policy_loss; the
Optimal Token Baseline's input, verl's calculate_sum_pi_squared): against the oracle
(`fusedrl.reference.sum_pi_squared`, from the probabilities) on rows with banned tokens and
improbable labels, at a temperature, [N, V] input, in place (read before the logits are
overwritten), NaN padding, bf16 against float64, and over vocab-sharded logits (2 gloo ranks)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import BACKENDS, LOGITS_BACKENDS, make_batch, needs_interpreter
from .worlds import free_port, run_world


def _logits(seed=0, batch=3, time=7, vocab=131, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch, time, vocab, generator=gen)
    logits[0, :, 5] = float("-inf")  # a banned token: p = 0 adds nothing
    logits[2, 3] *= 4.0  # a peaked row: sum pi^2 near 1
    logits[1, 0] *= 0.02  # a flat row: sum pi^2 near 1 / V
    labels = torch.randint(0, vocab, (batch, time), generator=gen)
    labels[1, 2] = logits[1, 2].argmin()  # an improbable label (p ~ 1e-9)
    return logits.to(dtype), labels


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_token_logprobs_equals_the_oracle(backend):
    logits, labels = _logits()
    for temperature, flat in ((1.0, False), (0.7, True)):
        x = logits.reshape(-1, logits.shape[-1]) if flat else logits
        y = labels.reshape(-1) if flat else labels
        logp, entropy, sum_sq = fusedrl.token_logprobs(
            x, y, temperature, True, backend, return_sum_pi_squared=True
        )
        want = reference.sum_pi_squared(x, temperature)
        torch.testing.assert_close(sum_sq, want, atol=1e-6, rtol=1e-4)
        assert sum_sq.shape == y.shape and entropy is not None
        torch.testing.assert_close(logp, reference.token_logprobs(x, y, temperature)[0])
        assert want.min() < 0.05 and want.max() > 0.9  # flat and peaked rows both present


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_policy_loss_returns_it_without_changing_the_loss(backend, inplace):
    data = make_batch(vocab=131, seed=4, with_nan_padding=True)
    cfg = LossConfig.preset("dapo", temperature=0.8)
    outs, grads = [], []
    for asked in (False, True):
        logits = data["logits"].clone().requires_grad_(True)
        work = logits * 1.0 if inplace else logits  # a non-leaf buffer the loss may overwrite
        args = {k: v for k, v in data.items() if k != "logits"}
        out = fusedrl.policy_loss(
            work, **args, config=cfg, inplace=inplace, backend=backend, return_sum_pi_squared=asked
        )
        grads.append(torch.autograd.grad(out.loss, logits)[0])
        outs.append(out)
    assert outs[0].sum_pi_squared is None
    mask = data["mask"]
    want = torch.where(mask, reference.sum_pi_squared(data["logits"], 0.8), 0.0)
    torch.testing.assert_close(outs[1].sum_pi_squared, want, atol=1e-6, rtol=1e-4)
    assert (outs[1].sum_pi_squared[~mask] == 0).all()  # NaN padding does not leak
    torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=0, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)
    oracle = reference.policy_loss(**data, config=cfg, return_sum_pi_squared=True)
    torch.testing.assert_close(oracle.sum_pi_squared, want, atol=1e-6, rtol=1e-4)


def test_the_oracle_takes_per_token_temperatures_and_refuses_sampling_filters():
    """reference.policy_loss(return_sum_pi_squared=True) at per-token temperatures: each row's
    from its own (`reference.sum_pi_squared` row by row); sampled sets are refused as by
    policy_loss."""
    data = make_batch(vocab=131, seed=6, with_nan_padding=True)
    temps = 0.5 + torch.rand(data["labels"].shape, generator=torch.Generator().manual_seed(1))
    out = reference.policy_loss(**data, temperature=temps, return_sum_pi_squared=True)
    for b, t in [(0, 0), (1, 3), (2, 5)]:
        if data["mask"][b, t]:
            row = reference.sum_pi_squared(data["logits"][b, t][None], float(temps[b, t]))[0]
            torch.testing.assert_close(out.sum_pi_squared[b, t], row, atol=1e-6, rtol=1e-5)
    assert (out.sum_pi_squared[~data["mask"]] == 0).all() and data["mask"][0, 0]
    with pytest.raises(NotImplementedError, match="sum"):
        reference.policy_loss(**data, config=LossConfig(top_k=5), return_sum_pi_squared=True)


@needs_interpreter
def test_triton_sums_the_squares_in_the_same_read(monkeypatch):
    """The log-prob kernel's SUM_PI_SQUARED: no second read at T / 2 (sum_pi_squared_of is never
    called), with and without a gradient (the squares carry none), per-token temperatures, and
    labels so improbable that the fast sums (relative to the label) overflow: one where only the
    squares do (60 nats below the row max), one where the sums do (100): the exact fallback."""
    second_reads = []
    monkeypatch.setattr(fusedrl.output, "sum_pi_squared_of", lambda *a: second_reads.append(a))
    logits, labels = _logits(seed=6)
    for (b, t), gap in (((0, 0), 60.0), ((0, 1), 100.0)):
        logits[b, t] *= 0.1  # flat: many terms of one size, each running sum rescaled often
        logits[b, t, labels[b, t]] = logits[b, t].max() - gap
    temps = 0.6 + 0.5 * torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    for temperature in (1.0, temps):
        column = temperature[..., None] if isinstance(temperature, torch.Tensor) else temperature
        want_sq = reference.sum_pi_squared(logits / column)
        for grad_on in (False, True):
            x, x_ref = (logits.clone().requires_grad_(grad_on) for _ in "ab")
            logp, entropy, sum_sq = fusedrl.token_logprobs(
                x, labels, temperature, True, "triton", return_sum_pi_squared=True
            )
            want_logp, want_entropy = reference.token_logprobs(x_ref, labels, temperature, True)
            torch.testing.assert_close(sum_sq, want_sq, atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(logp, want_logp, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
            assert not sum_sq.requires_grad
            if grad_on:
                (grad,) = torch.autograd.grad((logp * up).sum() + entropy.sum(), x)
                want = (want_logp * up).sum() + want_entropy.sum()
                torch.testing.assert_close(grad, torch.autograd.grad(want, x_ref)[0])
            no_entropy = fusedrl.token_logprobs(
                x, labels, temperature, False, "triton", return_sum_pi_squared=True
            )
            assert no_entropy[1] is None and torch.equal(no_entropy[2], sum_sq)
    assert not second_reads
    assert want_sq.min() < 0.05 and want_sq.max() > 0.9


@needs_interpreter
def test_triton_policy_loss_sums_the_squares_in_its_own_read(monkeypatch):
    """policy_loss(return_sum_pi_squared=True) on Triton: the fused kernel's sweep 1 (in place
    too) and pass 1 of the two-pass path (gspo) sum pi^2 beside the loss, with per-token
    temperatures and a soft cap: no second read at T / 2; the exact KL (two-row kernels, no
    squares) takes that read. The loss, logp and gradient are the call's without it."""
    second_reads = []
    real = fusedrl.output.sum_pi_squared_of
    monkeypatch.setattr(
        fusedrl.output, "sum_pi_squared_of", lambda *a: second_reads.append(1) or real(*a)
    )
    data = make_batch(vocab=131, seed=12, with_nan_padding=True)
    mask = data["mask"]
    temps = 0.6 + 0.5 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(data["logits"].shape, generator=torch.Generator().manual_seed(2))
    args = {k: v for k, v in data.items() if k not in ("logits", "ref_logp")}
    cases = (  # (kwargs, whether the loss's own read sums the squares)
        (dict(config=LossConfig.preset("dapo", entropy_coef=0.01), temperature=temps), True),
        (dict(config=LossConfig.preset("dapo"), inplace=True, softcap=3.0), True),
        (dict(config=LossConfig.preset("gspo", temperature=0.8)), True),
        (
            dict(
                config=LossConfig.preset("dapo", kl="full", beta=0.1),
                ref_logits=data["logits"] + noise,
            ),
            False,
        ),
    )
    for kwargs, in_loss in cases:
        second_reads.clear()
        outs, grads = [], []
        for asked in (False, True):
            logits = data["logits"].clone().requires_grad_(True)
            work = logits * 1.0 if kwargs.get("inplace") else logits
            out = fusedrl.policy_loss(
                work, **args, **kwargs, backend="triton", return_sum_pi_squared=asked
            )
            grads.append(torch.autograd.grad(out.loss, logits)[0])
            outs.append(out)
        assert len(second_reads) == (0 if in_loss else 1), kwargs
        column = kwargs.get("temperature", kwargs["config"].temperature)
        column = column[..., None] if isinstance(column, torch.Tensor) else column
        clean = torch.where(mask[..., None], data["logits"], 0.0)
        if "softcap" in kwargs:
            clean = reference._model_logits(clean, None, kwargs["softcap"])
        want = torch.where(mask, reference.sum_pi_squared(clean / column), 0.0)
        torch.testing.assert_close(outs[1].sum_pi_squared, want, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(outs[1].loss, outs[0].loss, atol=0, rtol=0)
        torch.testing.assert_close(outs[1].logp, outs[0].logp, atol=0, rtol=0)
        torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_bf16_against_the_float64_truth(backend):
    logits, labels = _logits(seed=2)
    truth = reference.sum_pi_squared(logits.double())
    _, _, got = fusedrl.token_logprobs(
        logits.bfloat16(), labels, backend=backend, return_sum_pi_squared=True
    )
    # the bf16 logits are the input: the error is the rounding of the logits, not ours
    rounded = reference.sum_pi_squared(logits.bfloat16().double())
    torch.testing.assert_close(got.double(), rounded, atol=1e-5, rtol=1e-4)
    assert (got.double() - truth).abs().max() < 0.05


def test_unsupported_combinations_say_so():
    data = make_batch(vocab=37, seed=1)
    with pytest.raises(NotImplementedError, match="with top_k / top_p / min_p"):
        fusedrl.token_logprobs(data["logits"], data["labels"], top_k=5, return_sum_pi_squared=True)
    cfg = LossConfig.preset("dapo", top_k=5)
    with pytest.raises(NotImplementedError, match="with top_k / top_p / min_p"):
        fusedrl.policy_loss(**data, config=cfg, return_sum_pi_squared=True)
    with pytest.raises(NotImplementedError, match="under tensor parallelism"):
        fusedrl.policy_loss(**data, vocab_start=0, return_sum_pi_squared=True)


@needs_interpreter
def test_the_in_kernel_paths_refuse_sampling_filters_too():
    """Triton's own sums (token_logprobs, the gemm design's sweep) take no sampled set: refused
    by name, as the half-temperature route is."""
    data = make_batch(vocab=37, seed=1)
    with pytest.raises(NotImplementedError, match="with top_k / top_p / min_p"):
        fusedrl.token_logprobs(
            data["logits"], data["labels"], top_k=5, backend="triton", return_sum_pi_squared=True
        )
    hidden, weight = torch.randn(3, 7, 8), torch.randn(37, 8)
    with pytest.raises(NotImplementedError, match="with top_k / top_p / min_p"):
        fusedrl.linear_token_logprobs(
            hidden, weight, data["labels"], top_p=0.9, backend="triton", return_sum_pi_squared=True
        )


def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    logits, labels = _logits(seed=3, vocab=1031)
    start = [0, 400][rank]  # uneven slices
    stop = [400, 1031][rank]
    result = fusedrl.token_logprobs(
        logits[..., start:stop],
        labels,
        0.9,
        backend="torch",
        tp_group=dist.group.WORLD,
        return_sum_pi_squared=True,
    )
    torch.save(result[2], os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done before any leaves (a gloo exit abort otherwise)
    dist.destroy_process_group()


def test_over_vocab_sharded_logits(tmp_path):
    """2 gloo ranks, each holding a slice of the vocabulary: every rank gets the whole rows'
    sum pi^2 (two sharded log-prob calls: the ranks' partial sums are merged by them)."""
    out = str(tmp_path)
    per_rank = run_world(_tp_worker, 2, (2, free_port(), out), out, 300, "the tp world of 2")
    logits, labels = _logits(seed=3, vocab=1031)
    want = reference.sum_pi_squared(logits, 0.9)
    for got in per_rank:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lm_head_form(backend, monkeypatch):
    """linear_token_logprobs(return_sum_pi_squared=True) on the head's soft-capped logits: the
    Triton "gemm" design sums the squares in its own sweep (no sweep at T / 2), with and without
    a gradient; the torch backend takes the half-temperature sweep (the cap applied there too)."""
    second_sweeps = []
    real = fusedrl.output.sum_pi_squared_of
    monkeypatch.setattr(
        fusedrl.output, "sum_pi_squared_of", lambda *a: second_sweeps.append(1) or real(*a)
    )
    gen = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    labels = torch.randint(0, 131, (3, 7), generator=gen)
    logits = 3.0 * torch.tanh(hidden @ weight.T / 3.0)
    for grad_on in (False, True):
        h = hidden.clone().requires_grad_(grad_on)
        logp, entropy, sum_sq = fusedrl.linear_token_logprobs(
            h,
            weight,
            labels,
            0.8,
            True,
            backend=backend,
            softcap=3.0,
            return_sum_pi_squared=True,
        )
        want_sq = reference.sum_pi_squared(logits, 0.8)
        torch.testing.assert_close(sum_sq, want_sq, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(logp, reference.token_logprobs(logits, labels, 0.8)[0])
        assert entropy is not None and not sum_sq.requires_grad
        if grad_on:  # the gradient of logp and the entropy through the capped head
            (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), h)
            h_ref = hidden.clone().requires_grad_(True)
            capped = 3.0 * torch.tanh(h_ref @ weight.T / 3.0)
            want_logp, want_entropy = reference.token_logprobs(capped, labels, 0.8, True)
            (want,) = torch.autograd.grad(want_logp.sum() + want_entropy.sum(), h_ref)
            torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-4)
    # [N, H], no entropy asked, with a gradient: (logp, None, sum pi^2)
    flat = hidden.reshape(-1, 16).clone().requires_grad_(True)
    logp, entropy, sum_sq = fusedrl.linear_token_logprobs(
        flat,
        weight,
        labels.reshape(-1),
        0.8,
        False,
        backend=backend,
        softcap=3.0,
        return_sum_pi_squared=True,
    )
    assert entropy is None and sum_sq.shape == (21,)
    torch.testing.assert_close(sum_sq, want_sq.reshape(-1), atol=1e-6, rtol=1e-4)
    torch.autograd.grad(logp.sum(), flat)
    assert len(second_sweeps) == (0 if backend == "triton" else 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_policy_loss_returns_it_without_changing_the_loss(backend):
    """linear_policy_loss(return_sum_pi_squared=True): per-token temperatures and a soft cap
    (both in the half-temperature sweep), masked tokens 0, the loss and gradients unchanged."""
    data = make_batch(vocab=131, seed=12)
    rows = {k: v for k, v in data.items() if k != "logits"}
    gen = torch.Generator().manual_seed(12)
    hidden, weight = torch.randn(3, 7, 16, generator=gen), torch.randn(131, 16, generator=gen)
    temps = 0.5 + torch.rand(3, 7, generator=gen)
    cfg = LossConfig.preset("dapo")
    kwargs = dict(config=cfg, temperature=temps, softcap=3.0, backend=backend)
    results = []
    for wanted in (True, False):
        leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        out = fusedrl.linear_policy_loss(*leaves, **rows, **kwargs, return_sum_pi_squared=wanted)
        results.append((out, torch.autograd.grad(out.loss, leaves)))
    (out, grads), (plain, plain_grads) = results
    assert plain.sum_pi_squared is None
    torch.testing.assert_close(out.loss, plain.loss)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want)
    logits = 3.0 * torch.tanh(hidden @ weight.T / 3.0)
    want = reference.sum_pi_squared(logits / temps[..., None])  # each token at its own T
    mask = data["mask"]
    torch.testing.assert_close(out.sum_pi_squared[mask], want[mask], atol=1e-6, rtol=1e-4)
    assert (out.sum_pi_squared[~mask] == 0).all()
    with pytest.raises(NotImplementedError, match="under tensor parallelism"):
        fusedrl.linear_policy_loss(
            hidden, weight, **rows, vocab_start=0, return_sum_pi_squared=True
        )
