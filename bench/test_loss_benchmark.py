"""pytest-benchmark cases for kernel engineers: `pytest bench --benchmark-only`.

With a CUDA device they time the Triton backend on CUDA tensors at real sizes (each call ends
with a `torch.cuda.synchronize()`, so the time is the kernels', not the launch's); without one,
the torch backend on CPU tensors at small sizes (they never gate CI, and measure nothing about the
GPU). Compare commits with `--benchmark-autosave` and `--benchmark-compare`. The GPU benchmark
with the bandwidth floor, peers and JSON results is bench/bench_loss.py.
"""

from __future__ import annotations

import pytest
import torch

import fusedrl

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "triton" if CUDA else "torch"
SHAPES = [(16384, 32000), (16384, 151936)] if CUDA else [(512, 4099), (256, 32003)]


def _inputs(n, v, dtype=torch.bfloat16):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(n, v, generator=gen, dtype=dtype, device=DEVICE)
    labels = torch.randint(0, v, (n,), generator=gen, device=DEVICE)
    adv = torch.randn(n, generator=gen, device=DEVICE)
    return logits, labels, adv, torch.ones(n, dtype=torch.bool, device=DEVICE)


def _sync():
    if CUDA:
        torch.cuda.synchronize()


@pytest.mark.parametrize("n, v", SHAPES)
def test_token_logprobs_no_grad(benchmark, n, v):
    logits, labels, _, _ = _inputs(n, v)

    def run():
        with torch.no_grad():
            out = fusedrl.token_logprobs(logits, labels, backend=BACKEND)
        _sync()
        return out

    benchmark(run)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("n, v", SHAPES)
def test_policy_loss_fwd_bwd(benchmark, preset, n, v):
    logits, labels, adv, mask = _inputs(n, v)
    cfg = fusedrl.LossConfig.preset(preset)
    if cfg.is_sequence_level or cfg.agg != "token-mean":  # needs sequences: 8 rows of n / 8
        logits, labels, mask = (x.view(8, n // 8, *x.shape[1:]) for x in (logits, labels, mask))
        adv = adv[:8]
    leaf = logits.requires_grad_(True)

    def run():
        out = fusedrl.policy_loss(leaf, labels, adv, mask, config=cfg, backend=BACKEND)
        grad = torch.autograd.grad(out.loss, leaf)
        _sync()
        return grad

    benchmark(run)
