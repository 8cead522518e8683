"""The LM-head loss against its alternatives: time, the GEMM rate and peak memory, one run.

    python bench/bench_linear.py                 # GPU: the issue's grid, bf16, DAPO
    python bench/bench_linear.py --smoke         # tiny shapes, any device: not a measurement
    python bench/bench_linear.py --live-fraction 0.6   # 40% of the rows masked (padding)

For each (N, H, V): forward + backward of
- `fused`: fusedrl.linear_policy_loss (Triton on CUDA, the torch backend elsewhere); on CUDA in
  both Triton designs (fusedrl.linear_triton): `fused:gemm` (cuBLAS logits chunks, the fused
  row kernel, cuBLAS dX / dW: 6·N·H·V flops) and `fused:on-chip` (logits tiles in registers,
  made twice: 8·N·H·V);
- `logits`: hidden @ W.T materialised, then fusedrl.policy_loss in place;
- `liger`: Liger-Kernel's chunked LigerFusedLinearGRPOLoss (token-mean loss, its dapo), if
  installed;
- with `--live-fraction F` < 1 (that share of the rows in the mask, the rest padding): also
  `fused+skip` (linear_policy_loss(live_rows=count): logits for the live rows alone), whose time
  against `fused` is what skipping the masked rows saves;
and the dense bf16 GEMM rate of [N, H] @ [H, V] measured in the same run. `gemm_fraction` is the
three GEMMs of the loss (6·N·H·V flops; N the live rows for fused+skip) per second over that
rate, whatever a design does.
Peak memory is above the inputs (CUDA only). Medians over the repetitions;
inputs rotate over a few copies so that no run reads another's cache. JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import SMOKE_NOTE, _bench, peak_memory_above_inputs, write_run_json  # noqa: E402

import fusedrl  # noqa: E402
from fusedrl import linear_triton  # noqa: E402

GRID = {"N": (8192, 32768), "H": (2048, 4096), "V": (128256, 151936)}
SMOKE_GRID = {"N": (64,), "H": (32,), "V": (1031,)}
COPIES = 2


def _inputs(n, h, v, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h**0.5).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)
    return hidden, weight, labels, adv


def _liger_loss():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    return LigerFusedLinearGRPOLoss(
        beta=0.0, loss_type="bnpo", use_ref_model=False, compiled=torch.cuda.is_available()
    )


def make_step(impl, tensors, cfg, backend, live_fraction=1.0):
    hidden, weight, labels, adv = tensors
    n_live = round(live_fraction * labels.shape[0])
    # padding spread over the batch, as ragged completions leave it; counted on the host
    mask = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(0)) < n_live
    mask = mask.to(labels.device)
    skip = {"live_rows": n_live} if impl.endswith("+skip") else {}

    def leaves():
        return hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)

    if impl.startswith("fused"):
        design = impl.removesuffix("+skip").partition(":")[2]

        def step():
            if design:
                os.environ[linear_triton.DESIGN_ENV] = design
            h, w = leaves()
            out = fusedrl.linear_policy_loss(
                h, w, labels, adv, mask, config=cfg, backend=backend, **skip
            )
            return torch.autograd.grad(out.loss, (h, w))

    elif impl == "logits":

        def step():
            h, w = leaves()
            logits = h @ w.T
            out = fusedrl.policy_loss(logits, labels, adv, mask, config=cfg, inplace=True)
            return torch.autograd.grad(out.loss, (h, w))

    else:
        liger = _liger_loss()
        if liger is None:
            return None

        def step():
            h, w = leaves()
            loss, _ = liger(h[None], w, labels[None], mask[None].long(), adv[:1])
            return torch.autograd.grad(loss, (h, w))

    return step


def gemm_tflops(n, h, v, dtype, device, warmup_ms, rep_ms) -> float:
    a = torch.randn(n, h, device=device, dtype=dtype)
    b = torch.randn(h, v, device=device, dtype=dtype)
    ms = _bench(lambda: a @ b, device, warmup_ms, rep_ms)[0]
    return 2 * n * h * v / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: not a measurement")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument(
        "--live-fraction",
        type=float,
        default=1.0,
        help="share of the rows in the mask (the rest padding); < 1 adds fused+skip",
    )
    parser.add_argument("--N", type=int, nargs="+", help="token counts (default: the grid's)")
    parser.add_argument("--H", type=int, nargs="+", help="hidden sizes (default: the grid's)")
    parser.add_argument("--V", type=int, nargs="+", help="vocab sizes (default: the grid's)")
    args = parser.parse_args(argv)
    if not 0.0 < args.live_fraction <= 1.0:
        parser.error(f"--live-fraction must be in (0, 1], got {args.live_fraction}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = "auto"
    grid = dict(SMOKE_GRID if args.smoke else GRID)
    grid.update({axis: getattr(args, axis) for axis in "NHV" if getattr(args, axis)})
    if args.smoke:
        args.warmup_ms, args.rep_ms = 1, 5
        print(f"# {SMOKE_NOTE}")
    cfg = fusedrl.LossConfig.preset("dapo")
    rows, started = [], time.strftime("%Y%m%d-%H%M%S")
    print(f"{'N':>6} {'H':>5} {'V':>7} {'impl':>18} {'ms':>9} {'gemm %':>7} {'peak MiB':>9}")
    for n, h, v in itertools.product(grid["N"], grid["H"], grid["V"]):
        rate = gemm_tflops(n, h, v, dtype, device, args.warmup_ms, args.rep_ms)
        copies = [_inputs(n, h, v, dtype, device, seed) for seed in range(COPIES)]
        fused = ["fused"]
        if device.type == "cuda":
            fused = [f"fused:{design}" for design in linear_triton.DESIGNS]
        if args.live_fraction < 1.0:
            fused += [f"{name}+skip" for name in fused]
        for impl in (*fused, "logits", "liger"):
            steps = [make_step(impl, c, cfg, backend, args.live_fraction) for c in copies]
            if steps[0] is None:
                continue
            turn = itertools.cycle(steps)
            try:
                ms = _bench(lambda t=turn: next(t)(), device, args.warmup_ms, args.rep_ms)[0]
                peak = peak_memory_above_inputs(steps[0], device)
            except torch.OutOfMemoryError:
                rows.append({"N": n, "H": h, "V": v, "impl": impl, "error": "out of memory"})
                print(f"{n:>6} {h:>5} {v:>7} {impl:>18} out of memory")
                continue
            except Exception as exc:  # a peer that fails at a shape must not end the run
                if impl.startswith("fused"):
                    raise
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append({"N": n, "H": h, "V": v, "impl": impl, "error": error})
                print(f"{n:>6} {h:>5} {v:>7} {impl:>18} FAILED ({error})")
                continue
            # the GEMM work done: fused+skip makes the live rows' logits alone
            rows_done = round(args.live_fraction * n) if impl.endswith("+skip") else n
            fraction = 6 * rows_done * h * v / (ms * 1e-3) / 1e12 / rate
            rows.append(
                {
                    "N": n,
                    "H": h,
                    "V": v,
                    "impl": impl,
                    "ms": ms,
                    "gemm_tflops": rate,
                    "gemm_fraction": fraction,
                    "peak_bytes_above_inputs": peak,
                    "live_fraction": args.live_fraction,
                }
            )
            mib = "-" if peak is None else f"{peak / 2**20:.0f}"
            print(f"{n:>6} {h:>5} {v:>7} {impl:>18} {ms:>9.3f} {100 * fraction:>6.1f}% {mib:>9}")
        del copies
        # Rewritten after every shape: a run cut short by its time limit keeps what it measured.
        write_run_json(
            args.out, "linear", "linear_policy_loss", args.smoke, device, dtype, rows, started
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
