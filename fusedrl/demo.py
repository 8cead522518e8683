"""A small demo of the fused loss: every preset on random logits, torch backend vs the reference.

    python -m fusedrl.demo [--batch 8 --time 96 --vocab 4099]

For each preset it prints the loss, the largest gradient difference from `fusedrl.reference`, the
time of forward + backward of both, and the clip fraction. It is what `make train` runs until the
trainer lands.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import reference
from .api import policy_loss
from .config import LossConfig


def _forward_backward(fn, logits, *args, **kwargs):
    """(output, d loss / d logits, wall ms) of one forward + backward on a fresh leaf."""
    leaf = logits.clone().requires_grad_(True)
    start = time.perf_counter()
    out = fn(leaf, *args, **kwargs)
    out.loss.backward()
    return out, leaf.grad, (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time", type=int, default=96)
    parser.add_argument("--vocab", type=int, default=4099)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(args.seed)
    b, t, v = args.batch, args.time, args.vocab
    logits = torch.randn(b, t, v, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, v, (b, t), generator=gen)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    advantages = torch.randn(b, generator=gen)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(logits, labels)
    old = logp + 0.2 * torch.randn(b, t, generator=gen)
    ref = logp + 0.1 * torch.randn(b, t, generator=gen)

    print(f"fusedrl demo: logits [{b}, {t}, {v}] bf16, {int(mask.sum())} valid tokens")
    header = (
        f"{'preset':<11} {'loss':>10} {'max|dgrad|':>11} {'fused ms':>9} {'ref ms':>8} clipfrac"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name in LossConfig.presets():
        cfg = LossConfig.preset(name)
        args = (labels, advantages, mask)
        kwargs = dict(old_logp=old, ref_logp=ref, config=cfg)
        out, grad, fused_ms = _forward_backward(
            policy_loss, logits, *args, backend="torch", **kwargs
        )
        _, ref_grad, ref_ms = _forward_backward(reference.policy_loss, logits, *args, **kwargs)
        diff = (grad.float() - ref_grad.float()).abs().max().item()
        worst = max(worst, diff)
        print(
            f"{name:<11} {out.loss.item():>10.5f} {diff:>11.2e} {fused_ms:>9.1f} "
            f"{ref_ms:>8.1f} {out.metrics['clipfrac'].item():.3f}"
        )
    print(f"largest gradient difference vs reference: {worst:.2e} (bf16 gradient rounding)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
