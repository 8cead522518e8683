"""The LM-head loss never holds [N, V]: peak memory measured, not assumed (issue: N = 8192,
V = 32768, H = 128 adds less than a quarter of one fp32 copy of the logits, 1 GiB).

As in tests/test_memory.py, a fresh process measures the peak of one forward + backward of
fusedrl.linear_policy_loss with the torch backend (tests/peak_memory.py).
"""

from __future__ import annotations

import textwrap

import pytest

from .peak_memory import peak_extra_bytes

N, V, H = 8192, 32768, 128
FP32_LOGITS_BYTES = N * V * 4  # 1 GiB

SCRIPT = textwrap.dedent(
    """
    import sys
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
    grads = measure(lambda: step(hidden, weight, rows))
    """
).format(N=N, V=V, H=H)


def _peak_extra(path: str) -> int:
    return peak_extra_bytes(SCRIPT, path, timeout=900)


@pytest.mark.slow
def test_linear_loss_adds_less_than_a_quarter_of_the_fp32_logits():
    extra = _peak_extra("linear")
    # The gradients themselves (N x H + V x H fp32: 20 MiB) and the blocks are inside the bound.
    assert extra < FP32_LOGITS_BYTES // 4, f"{extra / 2**20:.0f} MiB"
    # The measurement can tell: the logits path holds at least one fp32 copy of [N, V].
    assert _peak_extra("logits") > FP32_LOGITS_BYTES, "the logits path should fail the bound"
