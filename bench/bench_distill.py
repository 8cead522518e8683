"""Distillation (two distributions per token): fusedrl.distill_loss against the peers, one run.

    python bench/bench_distill.py            # GPU: N in {4096, 16384}, V in {32000, 151936}, bf16
    python bench/bench_distill.py --smoke    # tiny shapes, any device: not a measurement

Forward + backward of the student-teacher divergence over the vocabulary (kind jsd, beta 0.5,
and reverse_kl), per impl:
- `fusedrl-triton`: kernels/two_rows.py (both rows read once forward, once backward; jsd reads
  them a second time in the forward, from L2 when the rows in flight fit there);
- `fusedrl-torch`: the torch backend (row blocks, no fp32 copy of [N, V] beyond a block);
- `trl-eager`: TRL's `GKDTrainer.generalized_jsd_loss` (log-softmax of both, their mixture, two
  kl_div, all [N, V] fp32), and `trl-compile`, the same under torch.compile.
The floor is 2R + 1W of [N, V] (both logits read once, the student's gradient written once) at
the device copy bandwidth measured in the same run. Medians over rotating inputs; peak memory
above the inputs; JSON under bench/results/.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import (  # noqa: E402
    SMOKE_NOTE,
    _bench,
    one_table_setup,
    peak_memory_above_inputs,
    write_run_json,
)

import fusedrl  # noqa: E402

GRID = {"N": (4096, 16384), "V": (32000, 151936)}
SMOKE_GRID = {"N": (6,), "V": (1031,)}
COPIES = 2
KINDS = {"jsd": 0.5, "reverse_kl": 1.0}  # kind -> TRL's beta for the same divergence
IMPLS = ("fusedrl-triton", "fusedrl-torch", "trl-eager", "trl-compile")
# The torch backend (the fallback without Triton) took 60-440 ms a case on the H100 (2026-11-26,
# bench/results/2026-11-26-nvidia-h100-80gb-hbm3-bench_distill*.log): enough to run the stage out
# of time. A GPU run measures it only when --impls names it.
GPU_DEFAULT_IMPLS = ("fusedrl-triton", "trl-eager", "trl-compile")


def _inputs(n, v, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    student = (torch.randn(1, n, v, generator=g) * 2.0).to(device, dtype)
    teacher = (student.float().cpu() + torch.randn(1, n, v, generator=g)).to(device, dtype)
    labels = torch.randint(0, v, (1, n), generator=g).to(device)
    return student, teacher, labels


def _trl_loss():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def make_step(impl: str, tensors, kind: str):
    student, teacher, labels = tensors
    mask = torch.ones_like(labels, dtype=torch.bool)
    if impl.startswith("fusedrl"):
        backend = impl.split("-")[1]

        def step():
            leaf = student.detach().requires_grad_(True)
            out = fusedrl.distill_loss(leaf, teacher, labels, mask, kind=kind, backend=backend)
            torch.autograd.grad(out.loss, leaf)

        return step
    loss_fn = _trl_loss()
    if impl == "trl-compile":
        loss_fn = torch.compile(loss_fn)
    beta = KINDS[kind]

    def step():
        leaf = student.detach().requires_grad_(True)
        torch.autograd.grad(loss_fn(leaf, teacher, labels, beta=beta), leaf)

    return step


def skip_reason(impl: str, device: torch.device, smoke: bool) -> str | None:
    if impl == "fusedrl-triton" and device.type != "cuda" and not smoke:
        return "needs a GPU"
    if impl.startswith("trl"):
        try:
            _trl_loss()
        except ImportError as err:
            return f"trl not installed ({err})"
    if impl == "trl-compile" and device.type != "cuda":
        return "torch.compile is timed on the GPU only"
    return None


def main(argv=None) -> int:
    args, device, bandwidth = one_table_setup(
        __doc__,
        argv,
        lambda p: p.add_argument("--impls", nargs="+", default=None, choices=IMPLS),
    )
    if args.impls is None:
        args.impls = list(GPU_DEFAULT_IMPLS if device.type == "cuda" else IMPLS)
    dtype = torch.bfloat16
    grid = SMOKE_GRID if args.smoke else GRID
    rows, impls, started = [], [], time.strftime("%Y%m%d-%H%M%S")
    for impl in args.impls:
        reason = skip_reason(impl, device, args.smoke)
        if reason:
            print(f"skip {impl}: {reason}")
            rows.append({"impl": impl, "skipped": reason})
        else:
            impls.append(impl)
    print(
        f"copy bandwidth {bandwidth:.0f} GB/s" + ("  (smoke run, not a measurement)" * args.smoke)
    )
    print(f"{'N':>6} {'V':>7} {'kind':>11} {'impl':>15} {'ms':>9} {'%floor':>7} {'peak MiB':>9}")
    for n, v in itertools.product(grid["N"], grid["V"]):
        copies = [_inputs(n, v, dtype, device, seed) for seed in range(COPIES)]
        floor_bytes = 3 * n * v * dtype.itemsize  # 2R + 1W
        floor_ms = floor_bytes / (bandwidth * 1e9) * 1e3
        for kind, impl in itertools.product(KINDS, impls):
            base = {"N": n, "V": v, "kind": kind, "impl": impl, "bytes_floor": floor_bytes}
            steps = [make_step(impl, c, kind) for c in copies]
            cycle = itertools.cycle(steps)
            try:
                ms = _bench(lambda s=cycle: next(s)(), device, args.warmup_ms, args.rep_ms)[0]
                peak = peak_memory_above_inputs(steps[0], device)
            except torch.OutOfMemoryError:
                rows.append({**base, "error": "OOM"})
                print(f"{n:>6} {v:>7} {kind:>11} {impl:>15} {'OOM':>9}")
                continue
            pct = 100.0 * floor_ms / ms
            rows.append({**base, "ms": ms, "pct_of_floor": pct, "peak_mib": peak})
            shown = "-" if peak is None else f"{peak / 2**20:.0f}"
            print(f"{n:>6} {v:>7} {kind:>11} {impl:>15} {ms:>9.3f} {pct:>6.1f}% {shown:>9}")
        steps = cycle = copies = None  # this shape's inputs freed before the next shape's
        # Rewritten after every shape: a run cut short by its time limit keeps what it measured.
        write_run_json(
            args.out,
            "distill",
            "distill_loss_fwd_bwd",
            args.smoke,
            device,
            dtype,
            rows,
            started,
            copy_bandwidth_gbps=round(bandwidth, 1),
        )
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
