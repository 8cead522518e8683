"""The LM-head loss never holds [N, V]: peak memory measured, not assumed (issue: N = 8192,
V = 32768, H = 128 adds less than a quarter of one fp32 copy of the logits, 1 GiB).

As in tests/test_memory.py, a fresh process reads its peak RSS (ru_maxrss) before and after one
forward + backward of fusedrl.linear_policy_loss with the torch backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

N, V, H = 8192, 32768, 128
FP32_LOGITS_BYTES = N * V * 4  # 1 GiB

SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import fusedrl
    torch.set_num_threads(2)
    materialise = sys.argv[1] == "logits"
    cfg = fusedrl.LossConfig.preset("dapo", entropy_coef=0.01)
    def inputs(n, v, h):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g, requires_grad=True)
        weight = (0.1 * torch.randn(v, h, generator=g)).requires_grad_(True)
        labels = torch.randint(0, v, (n,), generator=g)
        mask = torch.ones(n, dtype=torch.bool)
        return hidden, weight, (labels, torch.randn(n, generator=g), mask)
    def step(hidden, weight, rows):
        if materialise:  # the logits path, for contrast: [N, V] fp32 logits and their gradient
            out = fusedrl.policy_loss(hidden @ weight.T, *rows, config=cfg, backend="torch")
        else:
            out = fusedrl.linear_policy_loss(hidden, weight, *rows, config=cfg, backend="torch")
        return torch.autograd.grad(out.loss, (hidden, weight))
    step(*inputs(64, 257, {H}))
    hidden, weight, rows = inputs({N}, {V}, {H})
    kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    before = kib()
    grads = step(hidden, weight, rows)
    print(json.dumps({{"extra_bytes": (kib() - before) * 1024}}))
    """
).format(N=N, V=V, H=H)


def _peak_extra(path: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, path],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["extra_bytes"]


@pytest.mark.slow
def test_linear_loss_adds_less_than_a_quarter_of_the_fp32_logits():
    extra = _peak_extra("linear")
    # The gradients themselves (N x H + V x H fp32: 20 MiB) and the blocks are inside the bound.
    assert extra < FP32_LOGITS_BYTES // 4, f"{extra / 2**20:.0f} MiB"
    # The measurement can tell: the logits path holds at least one fp32 copy of [N, V].
    assert _peak_extra("logits") > FP32_LOGITS_BYTES, "the logits path should fail the bound"
