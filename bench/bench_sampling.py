"""Sampling-mask replay: the cost of finding each row's sampled set, and of the loss over it.

    python bench/bench_sampling.py            # GPU: N = 16384, V in {32000, 151936}, bf16
    python bench/bench_sampling.py --smoke    # tiny shapes, any device: not a measurement

For each vLLM filter setting (min_p, top_k, top_p and together), in one run:
- `loss:sampled`: the DAPO loss over the sampled sets, forward + backward, as a user
  calls it (`LossConfig(top_k=, top_p=, min_p=)`): the select kernel's floors, then the fused
  kernel reading the logits through them (no masked copy);
- `select:kernel`: the select alone, kernels/sampling.py's on-chip select writing one floor
  per row (the row's first read from HBM, the others from L2): the gathered candidates where
  the filters allow (top_k up to 128, top_p), else the radix passes;
- `select:radix`: the same kernel with the gathered way off (the bench swaps the launcher's
  rule for one call), the radix passes alone: the A/B of the two ways in one run;
- `select:torch`: fusedrl.sampling, torch.topk / sort / where writing the masked logits a block
  of rows at a time (the route a backend without the kernel takes);
next to `loss:plain`, the same loss without a filter (the logits read once and the gradient
written once; both losses not in place, so that every call selects over the same logits), and
the device copy bandwidth. Each row gives ms and `x_plain_loss`, the
multiple of `loss:plain` (the target: `loss:sampled` <= 1.5x). `passes` is the most reads of
each row the select makes (top_p skips the passes whose digits are already known; the traffic
model is in the kernel's docstring and docs/losses.md). Medians; inputs rotate over copies; JSON
under bench/results/.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import SMOKE_NOTE, _bench, one_table_setup, write_run_json  # noqa: E402

import fusedrl  # noqa: E402
from fusedrl import fused_backend  # noqa: E402
from fusedrl.sampling import SamplingMask  # noqa: E402

GRID = {"N": (16384,), "V": (32000, 151936)}
SMOKE_GRID = {"N": (4,), "V": (1031,)}
COPIES = 2
# (top_k, top_p, min_p): the settings people sample with.
FILTERS = {
    "min_p=0.05": (None, None, 0.05),
    "top_k=50": (50, None, None),
    "top_p=0.9": (None, 0.9, None),
    "top_k=50,top_p=0.9": (50, 0.9, None),
    "all": (50, 0.9, 0.05),
}
KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}
COUNT_BITS, MASS_BITS = 8, 2  # kernels/sampling.py: top_k's and top_p's bits of key a pass


def kernel_passes(dtype: torch.dtype, top_k, top_p, min_p, gathered: bool = True) -> int:
    """The most reads of each row by the select kernel: gathered, the max and the gather; else
    the max (min_p, top_p) and the radix passes of top_k and of top_p (either may skip some)."""
    from fusedrl.kernels.sampling import _gathers_candidates

    if gathered and _gathers_candidates(
        top_k is not None, top_p is not None, min_p is not None, top_k
    ):
        return 2
    count = -(-KEY_BITS[dtype] // COUNT_BITS)
    mass = -(-KEY_BITS[dtype] // MASS_BITS)
    return (
        int(min_p is not None or top_p is not None)
        + count * (top_k is not None)
        + mass * (top_p is not None)
    )


def _inputs(n, v, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    # LM-like rows: a few large logits over a broad low tail.
    logits = (torch.randn(1, n, v, generator=g) * 2.0).to(device, dtype)
    labels = torch.randint(0, v, (1, n), generator=g).to(device)
    return logits, labels


def _torch_ops():
    """The Triton backend's ops without the select kernel: fusedrl.sampling's torch route."""
    from dataclasses import replace

    from fusedrl import triton_backend

    return replace(triton_backend.OPS, sampled_set=None)


def make_select(impl, tensors, sampling: SamplingMask, cfg):
    logits, labels = tensors
    if impl == "loss:sampled":
        return make_loss(tensors, cfg.replace(**vars(sampling)))
    if impl in ("select:kernel", "select:radix"):
        from fusedrl.kernels import sampling as kernel

        def select():
            return kernel.sampled_floors(
                logits, labels, 1.0, sampling.top_k, sampling.top_p, sampling.min_p
            )

        return select if impl == "select:kernel" else _radix_only(kernel, select)
    ops = _torch_ops()
    out = torch.empty_like(logits)
    return lambda: fused_backend._write_sampled_set(ops, logits, labels, 1.0, sampling, out)


def _radix_only(kernel_module, select):
    """`select` with the launcher's rule for the gathered way answering no (the A/B: one
    attribute swapped around the call, nothing else changed)."""

    def run():
        rule = kernel_module._gathers_candidates
        kernel_module._gathers_candidates = lambda *filters: False
        try:
            return select()
        finally:
            kernel_module._gathers_candidates = rule

    return run


def make_loss(tensors, cfg, inplace: bool = False):
    """One forward + backward of `policy_loss` on these logits. Here not in place: the logits
    stay the model's, whose sampled sets the select works on (in place, the next call would
    select over the last gradient: other data, other passes skipped; the gradient buffer comes
    from the caching allocator). `inplace` (bench/sweep_fused.py, no sampled set): the buffer
    holds the previous call's gradient, which the kernel reads as logits: the same bytes, the
    same work."""
    logits, labels = tensors
    leaf = (logits.clone() if inplace else logits).detach()
    adv = torch.randn(labels.shape, device=logits.device)
    mask = torch.ones_like(labels, dtype=torch.bool)

    def step():
        x = leaf.detach().requires_grad_(True)
        out = fusedrl.policy_loss(x, labels, adv, mask, config=cfg, inplace=inplace)
        torch.autograd.grad(out.loss, x)

    return step


IMPLS = ("loss:sampled", "select:kernel", "select:radix", "select:torch")


def _arguments(parser) -> None:
    parser.add_argument("--V", type=int, nargs="+", help="vocab sizes (default: the grid's)")
    parser.add_argument("--filters", nargs="+", choices=sorted(FILTERS), help="default: all")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))


def main(argv=None) -> int:
    args, device, bandwidth = one_table_setup(__doc__, argv, _arguments)
    dtype = torch.bfloat16
    grid = SMOKE_GRID if args.smoke else GRID
    if args.V and not args.smoke:
        grid = {**grid, "V": tuple(args.V)}
    filters = {name: FILTERS[name] for name in args.filters or FILTERS}
    cfg = fusedrl.LossConfig.preset("dapo")
    rows = []
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s" + ("  (smoke run, not a measurement)" * args.smoke)
    )
    print(f"{'N':>6} {'V':>7} {'filters':>20} {'impl':>14} {'ms':>9} {'x plain':>8} {'passes':>6}")
    for n, v in itertools.product(grid["N"], grid["V"]):
        copies = [_inputs(n, v, dtype, device, seed) for seed in range(COPIES)]
        plain_steps = itertools.cycle([make_loss(c, cfg) for c in copies])
        plain = _bench(lambda s=plain_steps: next(s)(), device, args.warmup_ms, args.rep_ms)[0]
        floor_ms = 2 * n * v * dtype.itemsize / (bandwidth * 1e9) * 1e3
        rows.append({"N": n, "V": v, "impl": "loss:plain", "ms": plain, "floor_1r1w_ms": floor_ms})
        print(f"{n:>6} {v:>7} {'-':>20} {'loss:plain':>14} {plain:>9.3f} {1:>8.2f} {1:>6}")
        for name, (top_k, top_p, min_p) in filters.items():
            sampling = SamplingMask(top_k, top_p, min_p)
            for impl in args.impls:
                steps = itertools.cycle([make_select(impl, c, sampling, cfg) for c in copies])
                try:
                    ms = _bench(lambda s=steps: next(s)(), device, args.warmup_ms, args.rep_ms)[0]
                except torch.OutOfMemoryError:
                    rows.append({"N": n, "V": v, "filters": name, "impl": impl, "error": "OOM"})
                    continue
                passes = None
                if impl.startswith("select:") and impl != "select:torch":
                    gathered = impl == "select:kernel"
                    passes = kernel_passes(dtype, top_k, top_p, min_p, gathered)
                rows.append(
                    {
                        "N": n,
                        "V": v,
                        "filters": name,
                        "impl": impl,
                        "ms": ms,
                        "x_plain_loss": ms / plain,
                        "kernel_row_reads": passes,
                    }
                )
                shown = "-" if passes is None else str(passes)
                print(
                    f"{n:>6} {v:>7} {name:>20} {impl:>14} {ms:>9.3f} {ms / plain:>8.2f} {shown:>6}"
                )
    write_run_json(
        args.out,
        "sampling",
        "sampling_select",
        args.smoke,
        device,
        dtype,
        rows,
        copy_bandwidth_gbps=round(bandwidth, 1),
    )
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
