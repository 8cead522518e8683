"""The LM-head loss never holds [N, V]: peak memory measured, not assumed (issue: N = 8192,
V = 32768, H = 128 adds less than a quarter of one fp32 copy of the logits, 1 GiB).

As in tests/test_memory.py, a fresh process measures the peak of one forward + backward of
fusedrl.linear_policy_loss with the torch backend (tests/peak_memory.py); then, in the same
process, the head's logits made as a model would make them, to show that the measurement sees a
[N, V] fp32 tensor.
"""

from __future__ import annotations

import textwrap

import pytest

from .peak_memory import peaks_extra_bytes

N, V, H = 8192, 32768, 128
FP32_LOGITS_BYTES = N * V * 4  # 1 GiB

SCRIPT = textwrap.dedent(
    """
    import torch
    import fusedrl
    torch.set_num_threads(2)
    cfg = fusedrl.LossConfig.preset("dapo", entropy_coef=0.01)
    def inputs(n, v, h):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g, requires_grad=True)
        weight = (0.1 * torch.randn(v, h, generator=g)).requires_grad_(True)
        labels = torch.randint(0, v, (n,), generator=g)
        mask = torch.ones(n, dtype=torch.bool)
        return hidden, weight, (labels, torch.randn(n, generator=g), mask)
    def step(hidden, weight, rows):
        out = fusedrl.linear_policy_loss(hidden, weight, *rows, config=cfg, backend="torch")
        return torch.autograd.grad(out.loss, (hidden, weight))
    def logits_made(hidden, weight):  # the [N, V] fp32 logits the linear loss never holds
        return torch.autograd.grad((hidden @ weight.T).logsumexp(-1).sum(), (hidden, weight))
    step(*inputs(64, 257, {H}))
    hidden, weight, rows = inputs({N}, {V}, {H})
    grads = measure(lambda: step(hidden, weight, rows))
    del grads
    measure(lambda: logits_made(hidden, weight))
    """
).format(N=N, V=V, H=H)


@pytest.mark.slow
def test_linear_loss_adds_less_than_a_quarter_of_the_fp32_logits():
    linear, logits = peaks_extra_bytes(SCRIPT, timeout=900)
    # The gradients themselves (N x H + V x H fp32: 20 MiB) and the blocks are inside the bound.
    assert linear < FP32_LOGITS_BYTES // 4, f"{linear / 2**20:.0f} MiB"
    # The measurement can tell: the logits made by the head hold at least one fp32 copy.
    assert logits > FP32_LOGITS_BYTES, f"{logits / 2**20:.0f} MiB: the logits should fail it"
