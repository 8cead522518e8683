"""The batch-invariance contract: a row's results do not depend on the rest of the batch.

`token_logprobs` and `policy_loss` give bitwise-identical per-row results (logp, entropy and the
row's gradient) whatever else is in the batch, where the row sits and how many rows there are.
For `policy_loss` the gradient of a row is scaled by its aggregation weight, which depends on
the batch unless the caller fixes it with `normalizer` (what verl and TRL pass in multi-step
updates); with a normalizer, every preset is batch-invariant row by row (sequence-level ones too,
per sequence), except `top_entropy_quantile` < 1, whose quantile is over the whole batch by
definition. The same sequences are put into batches of several sizes and orders, each row block
of the torch backend and each program of the Triton kernels sees a different neighbourhood, and
the rows are compared with torch.equal. Runs for the torch backend and the Triton kernels through
the interpreter; tests/test_gpu.py checks the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, row_blocks

from .conftest import ALL_PRESETS, LOGITS_BACKENDS, make_batch

# Batches made of the same pool of sequences: (pool indices), the sequence under test is 2.
BATCHES = {"whole pool": [0, 1, 2, 3, 4], "moved, fewer rows": [4, 2], "alone": [2]}
WATCHED = 2


@pytest.fixture(params=LOGITS_BACKENDS)
def backend(request, monkeypatch):
    if request.param == "torch":
        # Blocks of a few rows: the sequence lands at another offset of a block in each batch.
        monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 3 * 1031)
    return request.param


def _pool(vocab=1031, seed=0, padding=True):
    """Five sequences of 9 tokens, none empty (the watched one must have tokens). With padding:
    ragged lengths, the watched sequence too, NaN logits and label -100 in the padding."""
    data = make_batch(batch=5, time=9, vocab=vocab, seed=seed, empty_rows=(), with_nan_padding=True)
    if padding:
        data["mask"][WATCHED, 6:] = False
        data["logits"][WATCHED, 6:] = float("nan")
        data["labels"][WATCHED, 6:] = -100
    else:
        data["mask"][:] = True
        gen = torch.Generator().manual_seed(seed)
        fill = torch.randn(data["logits"].shape, generator=gen)
        data["logits"] = torch.where(data["logits"].isnan(), fill, data["logits"])
        data["labels"] = data["labels"].clamp_min(0)
    return data


def _take(pool, rows):
    index = torch.tensor(rows)
    return {k: v[index] for k, v in pool.items()}


def _watched_rows(results, batches):
    """Each result tensor's rows of the watched sequence, one tuple per batch."""
    return [tuple(t[rows.index(WATCHED)] for t in result) for result, rows in zip(results, batches)]


def _assert_all_equal(per_batch, names):
    first = per_batch[0]
    labels = [*list(BATCHES)[1:], "alone, a row per block"]
    for label, other in zip(labels, per_batch[1:]):
        for name, a, b in zip(names, first, other):
            assert torch.equal(a, b), f"{name} of the watched sequence differs in '{label}'"


def _logprobs_and_grad(pool, rows, upstream, backend):
    data = _take(pool, rows)
    logits, labels = data["logits"].requires_grad_(True), data["labels"]
    logp, ent = fusedrl.token_logprobs(logits, labels, return_entropy=True, backend=backend)
    weights = upstream[:, torch.tensor(rows)]
    (grad,) = torch.autograd.grad((logp * weights[0]).sum() + (ent * weights[1]).sum(), logits)
    return logp, ent, grad


@pytest.mark.parametrize("vocab", [1031, 151936])
def test_token_logprobs_and_their_gradient(backend, vocab, monkeypatch):
    if backend == "triton" and vocab > 1031:
        pytest.skip("a real vocab through the interpreter is slow; tests/test_gpu.py has it")
    pool = _pool(vocab=vocab, seed=1, padding=False)
    upstream = torch.randn(2, *pool["labels"].shape, generator=torch.Generator().manual_seed(2))
    # Blocks of 4 rows: the watched rows share their block with 0 to 3 others, the same rows
    # or others, depending on the batch.
    monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", 4 * vocab)
    results = [_logprobs_and_grad(pool, rows, upstream, backend) for rows in BATCHES.values()]
    batches = list(BATCHES.values())
    if backend == "torch":  # and each row alone in its block
        monkeypatch.setattr(row_blocks, "BLOCK_ELEMENTS", vocab)
        results.append(_logprobs_and_grad(pool, [WATCHED], upstream, backend))
        batches.append([WATCHED])
    per_batch = _watched_rows(results, batches)
    _assert_all_equal(per_batch, ("logp", "entropy", "grad"))


INVARIANT_PRESETS = sorted(set(ALL_PRESETS))


def _policy_loss_watched_rows(pool, cfg, backend, inplace):
    """(logp, entropy, grad) of the watched sequence in each batch, with a fixed normalizer."""
    results = []
    for rows in BATCHES.values():
        data = _take(pool, rows)
        logits = data.pop("logits").clone().requires_grad_(True)
        work = logits.clone() if inplace else logits
        out = fusedrl.policy_loss(
            work,
            **data,
            config=cfg,
            normalizer=12.0,
            backend=backend,
            inplace=inplace,
            return_entropy=True,
        )
        (grad,) = torch.autograd.grad(out.loss, logits)
        results.append((out.logp, out.entropy, grad))
    return _watched_rows(results, list(BATCHES.values()))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", INVARIANT_PRESETS)
def test_policy_loss_rows_with_a_normalizer(backend, name, inplace):
    cfg = LossConfig.preset(name)
    cfg = cfg.replace(entropy_coef=0.01, beta=0.02, kl=cfg.kl or "k3")
    per_batch = _policy_loss_watched_rows(_pool(seed=3), cfg, backend, inplace)
    assert per_batch[0][2].abs().sum() > 0, "the watched sequence must get a gradient"
    _assert_all_equal(per_batch, ("logp", "entropy", "grad"))


@pytest.mark.parametrize("inplace", [False, True])
def test_sampling_mask_replay_rows(backend, inplace):
    """The sampled sets are found per row (torch: per block of rows; Triton: the select kernel
    per program): a row's set, and so its results, do not depend on its neighbours."""
    cfg = LossConfig.preset("dapo").replace(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    per_batch = _policy_loss_watched_rows(_pool(seed=4), cfg, backend, inplace)
    assert (per_batch[0][2] == 0).sum() > per_batch[0][2].numel() // 2  # the mask acted
    _assert_all_equal(per_batch, ("logp", "entropy", "grad"))
