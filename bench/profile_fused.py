"""Nsight Compute (ncu) driver for the fused Triton kernels, and the parser of what ncu reports.

    # one ncu run per call (bench/run_gpu.sh profile does this for dapo, logprobs and gspo):
    ncu --profile-from-start off --launch-count 4 -o rep-dapo \
        --kernel-name regex:'_fused_token_loss_kernel|_logprobs_fwd_kernel|_logits_grad_kernel' \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,... \
        python bench/profile_fused.py --calls dapo --manifest manifest.json
    ncu -i rep-dapo.ncu-rep --csv --page details --print-units base > dapo.csv
    python bench/profile_fused.py parse --manifest manifest.json --csv dapo=dapo.csv ... \
        --out ncu-<gpu>.json
    python bench/profile_fused.py --smoke     # CPU, TRITON_INTERPRET=1, tiny shapes, no ncu

Calls (N = 16384 tokens as 16 sequences of 1024, V = 151936, bf16 by default), each run once as a
warm-up (compilation, autotuning, allocations) and once inside cudaProfilerStart/Stop, so that
`ncu --profile-from-start off` sees only the second call:

- `dapo`: the fused token-level loss, forward + backward (`_fused_token_loss_kernel`: one read of
  the logits, one write of the gradient; floor 1R + 1W = 2 x N x V x 2 bytes in bf16);
- `dapo_split`: the same loss by the split-row kernel (`_split_row_loss_kernel`,
  FUSEDRL_SPLIT_ROWS=on; floor 1R + 1W, whatever L2 holds);
- `logprobs`: no-grad `token_logprobs` (`_logprobs_fwd_kernel`; floor 1R);
- `gspo`: the sequence-level loss, two passes (`_logprobs_fwd_kernel`, then `_logits_grad_kernel`;
  floor 2R + 1W).

`parse` turns ncu's CSV (details page, base units) into one JSON: DRAM bytes read / written, DRAM
throughput (% of peak) and duration per kernel, and their ratio to the bytes of the logits and to
the call's floor. ncu locks the clocks to base and flushes the caches before every kernel, so its
durations are not the benchmark's times (bench/bench_loss.py measures those); its byte counts are
what decides whether a sweep is served from L2 or re-read from HBM.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import sys
from pathlib import Path

CALLS = ("dapo", "dapo_split", "logprobs", "gspo")
KERNELS = (
    "_fused_token_loss_kernel",
    "_split_row_loss_kernel",
    "_logprobs_fwd_kernel",
    "_logits_grad_kernel",
)
METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__time_duration.sum",
)
# The bytes each call must move, in units of the logits' bytes: (reads, writes).
FLOOR = {"dapo": (1, 1), "dapo_split": (1, 1), "logprobs": (1, 0), "gspo": (2, 1)}
WHAT = {
    "dapo": "fused token-level loss (dapo), forward + backward",
    "dapo_split": "the same by the split-row kernel (FUSEDRL_SPLIT_ROWS=on)",
    "logprobs": "no-grad token_logprobs",
    "gspo": "sequence-level loss (gspo), two passes, forward + backward",
}
SMOKE_NOTE = "smoke run, not a measurement"


# ------------------------------------------------------------------------------ driver
def _inputs(n: int, vocab: int, sequences: int, dtype, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    time = n // sequences
    logits = torch.randn(sequences, time, vocab, generator=gen, dtype=dtype, device=device)
    labels = torch.randint(0, vocab, (sequences, time), generator=gen, device=device)
    mask = torch.rand(sequences, time, generator=gen, device=device) > 0.1
    advantages = torch.randn(sequences, generator=gen, device=device)
    return logits, labels, mask, advantages


def _call(name: str, logits, labels, mask, advantages, old, backend: str):
    """One call of `name` (see the module docstring); returns a tensor to check."""
    import torch

    import fusedrl
    from fusedrl.kernels import split_rows

    split_rows.POLICY = "on" if name == "dapo_split" else "off"
    if name == "logprobs":
        with torch.no_grad():
            return fusedrl.token_logprobs(logits, labels, backend=backend)[0]
    leaf = logits.detach().requires_grad_(True)
    out = fusedrl.policy_loss(
        leaf,
        labels,
        advantages,
        mask,
        old_logp=old,
        config=fusedrl.LossConfig.preset(name.removesuffix("_split")),
        backend=backend,
    )
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return grad


def run(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run the calls that ncu profiles")
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=CALLS)
    parser.add_argument("--N", type=int, default=16384)
    parser.add_argument("--V", type=int, default=151936)
    parser.add_argument("--sequences", type=int, default=16, help="B; T = N / B")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="triton", choices=["triton", "cuda"])
    parser.add_argument("--manifest", type=Path, help="write the shapes here, for `parse`")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, CPU tensors through the Triton interpreter when no GPU: no ncu",
    )
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.N, args.V, args.sequences = 32, 263, 4
        if not cuda:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    elif not cuda:
        print("profile_fused.py: no CUDA device (use --smoke on CPU)", file=sys.stderr)
        return 2
    import fusedrl

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    logits, labels, mask, advantages = _inputs(args.N, args.V, args.sequences, dtype, device)
    with torch.no_grad():
        logp, _ = fusedrl.token_logprobs(logits, labels, backend=args.backend)
    old = logp + 0.1 * torch.randn(logp.shape, device=device)
    if args.smoke:
        print(f"# {SMOKE_NOTE}")
    for name in args.calls:
        _call(name, logits, labels, mask, advantages, old, args.backend)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()  # ncu --profile-from-start off: only this call
        out = _call(name, logits, labels, mask, advantages, old, args.backend)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        if not bool(torch.isfinite(out).all()):
            print(f"profile_fused.py: {name} produced non-finite values", file=sys.stderr)
            return 1
        print(f"{name}: {WHAT[name]}, N={args.N} V={args.V} {args.dtype}: ran")
    if args.manifest is not None:
        args.manifest.parent.mkdir(parents=True, exist_ok=True)
        args.manifest.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__,
                    "backend": args.backend,
                    "N": args.N,
                    "V": args.V,
                    "sequences": args.sequences,
                    "dtype": args.dtype,
                    "logits_bytes": args.N * args.V * logits.element_size(),
                    "smoke": args.smoke,
                },
                indent=1,
            )
            + "\n"
        )
    if args.smoke:
        print(SMOKE_NOTE)
    return 0


# ------------------------------------------------------------------------------ parser
_SCALE = {  # ncu's units (base with --print-units base; scaled otherwise) -> bytes, ns, %
    "byte": 1,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "nsecond": 1,
    "ns": 1,
    "usecond": 1e3,
    "us": 1e3,
    "msecond": 1e6,
    "ms": 1e6,
    "second": 1e9,
    "s": 1e9,
    "%": 1,
}
_KEYS = {
    "dram__bytes_read.sum": "dram_bytes_read",
    "dram__bytes_write.sum": "dram_bytes_write",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_throughput_pct_of_peak",
    "gpu__time_duration.sum": "gpu_time_ns",
}


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels (in launch order) of `ncu --csv --page details` output, each with the metrics of
    METRICS in bytes, nanoseconds and percent (whatever unit ncu printed them in)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        key = _KEYS.get(rec.get("Metric Name", ""))
        if key is None:
            continue
        unit = (rec.get("Metric Unit") or "").strip().lower()
        raw = (rec.get("Metric Value") or "").replace(",", "").strip()
        try:
            value = float(raw) * _SCALE.get(unit, 1)
        except ValueError:
            continue
        kernel = kernels.setdefault(
            rec["ID"], {"id": int(rec["ID"]), "kernel": rec.get("Kernel Name", "?")}
        )
        kernel[key] = value
    return sorted(kernels.values(), key=lambda k: k["id"])


def summarize(manifest: dict, per_call: dict[str, list[dict]]) -> dict:
    """The JSON of `parse`: per call, its kernels and their bytes against the logits and floor."""
    logits_bytes = manifest["logits_bytes"]
    calls = {}
    for name, kernels in per_call.items():
        reads, writes = FLOOR[name]
        for k in kernels:
            for src, dst in (
                ("dram_bytes_read", "read_over_logits"),
                ("dram_bytes_write", "write_over_logits"),
            ):
                if src in k:
                    k[dst] = round(k[src] / logits_bytes, 4)
        read = sum(k.get("dram_bytes_read", 0.0) for k in kernels)
        write = sum(k.get("dram_bytes_write", 0.0) for k in kernels)
        floor = (reads + writes) * logits_bytes
        calls[name] = {
            "what": WHAT[name],
            "floor": f"{reads}R + {writes}W of the logits",
            "floor_bytes": floor,
            "kernels": kernels,
            "dram_bytes_read": read,
            "dram_bytes_write": write,
            "read_over_logits": round(read / logits_bytes, 4),
            "write_over_logits": round(write / logits_bytes, 4),
            "bytes_over_floor": round((read + write) / floor, 4),
        }
    return {
        **manifest,
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "metrics": list(METRICS),
        "note": "ncu locks clocks to base and flushes caches per kernel: gpu_time_ns is not the "
        "benchmark's time; bytes_over_floor = DRAM bytes read + written / the call's floor",
        "calls": calls,
    }


def parse(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="ncu --csv output -> one JSON")
    parser.add_argument("--manifest", type=Path, required=True, help="written by the driver")
    parser.add_argument(
        "--csv", nargs="+", required=True, metavar="CALL=PATH", help=f"CALL in {CALLS}"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    manifest = json.loads(args.manifest.read_text())
    per_call, missing = {}, []
    for item in args.csv:
        name, _, path = item.partition("=")
        if name not in CALLS or not path:
            parser.error(f"--csv {item!r}: expected CALL=PATH with CALL in {CALLS}")
        kernels = parse_ncu_csv(Path(path).read_text()) if Path(path).is_file() else []
        if not kernels:
            missing.append(name)
        per_call[name] = kernels
    result = summarize(manifest, per_call)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'call':<9} {'kernel':<26} {'read/logits':>11} {'write/logits':>12} {'DRAM %peak':>10}")
    for name, call in result["calls"].items():
        for k in call["kernels"]:
            nan = float("nan")
            print(
                f"{name:<9} {k['kernel'][:26]:<26} {k.get('read_over_logits', nan):11.3f} "
                f"{k.get('write_over_logits', nan):12.3f} "
                f"{k.get('dram_throughput_pct_of_peak', nan):10.1f}"
            )
        print(f"{name:<9} {'total / floor':<26} {call['bytes_over_floor']:>11.3f}")
    print(f"wrote {args.out}")
    if missing:
        print(f"profile_fused.py parse: no kernel found for {missing}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["parse"]:
        return parse(argv[1:])
    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
