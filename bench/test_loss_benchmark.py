"""pytest-benchmark cases for kernel engineers: `pytest bench --benchmark-only`.

On a CPU machine they run the torch backend at small sizes (they never gate CI); compare commits
with `--benchmark-autosave` and `--benchmark-compare`. The GPU benchmark with the bandwidth floor,
peers and JSON results is bench/bench_loss.py (issue: Triton kernels).
"""

from __future__ import annotations

import pytest
import torch

import fusedrl

SHAPES = [(512, 4099), (256, 32003)]


def _inputs(n, v, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=gen, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    return logits, labels, torch.randn(n, generator=gen), torch.ones(n, dtype=torch.bool)


@pytest.mark.parametrize("n, v", SHAPES)
def test_token_logprobs_no_grad(benchmark, n, v):
    logits, labels, _, _ = _inputs(n, v)

    def run():
        with torch.no_grad():
            return fusedrl.token_logprobs(logits, labels, backend="torch")

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
        out = fusedrl.policy_loss(leaf, labels, adv, mask, config=cfg, backend="torch")
        return torch.autograd.grad(out.loss, leaf)

    benchmark(run)
