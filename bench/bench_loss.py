"""Kernel benchmark: fusedrl against its peers and against the memory-bandwidth floor.

    python bench/bench_loss.py                         # the full matrix (GPU)
    python bench/bench_loss.py --N 16384 --V 151936 --presets dapo
    python bench/bench_loss.py --smoke                 # tiny shapes, any device (CI uses it)

Ops: `token_logprobs_fwd` (no grad: what old / reference log-probs cost) and
`policy_loss_fwd_bwd` (loss + d loss / d logits). Impls: fusedrl-triton (+ -inplace),
fusedrl-torch, torch-eager (what TRL does: fp32 log_softmax + gather + loss math + autograd),
torch-compile (torch.compile of fusedrl.reference), liger (liger_kernel's logits-level
triton_grpo_loss with its loss type matched to the preset).

Every number of one run is measured in that run: the device-to-device copy bandwidth (a large
`copy_`, bytes read + written) sets the floor; each case is timed with `triton.testing.do_bench`
(median, p20, p80) over inputs rotated so that L2 does not serve a repeated call; peak memory is
the allocator's high-water mark above the inputs. A table is printed and one JSON file per op is
written to bench/results/<op>-<gpu>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import fusedrl
from fusedrl import LossConfig, reference

RESULTS = Path(__file__).resolve().parent / "results"
OPS = ("token_logprobs_fwd", "policy_loss_fwd_bwd")
IMPLS = (
    "fusedrl-triton",
    "fusedrl-triton-inplace",
    "fusedrl-torch",
    "torch-eager",
    "torch-compile",
    "liger",
)


# ------------------------------------------------------------------------------ timing
def _bench(fn, device: torch.device, warmup_ms: int, rep_ms: int) -> tuple[float, float, float]:
    """(median, p20, p80) in ms."""
    if device.type == "cuda":
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8]
        )
        return p50, p20, p80
    times = []
    fn()
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    q = torch.tensor(times).quantile(torch.tensor([0.5, 0.2, 0.8])).tolist()
    return q[0], q[1], q[2]


def copy_bandwidth_gbps(device: torch.device, gib: float) -> float:
    """Device-to-device copy: bytes read + written per second, the practical memory floor."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms, _, _ = _bench(lambda: dst.copy_(src), device, 50, 300)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------ inputs
class Case:
    """Inputs of one (N, V, preset) case; `copies` logits buffers rotate between calls."""

    def __init__(self, n, vocab, preset, dtype, device, copies, sequences):
        gen = torch.Generator(device=device).manual_seed(0)
        self.cfg = LossConfig.preset(preset)
        self.batch = sequences
        self.time = n // sequences
        shape = (self.batch, self.time, vocab)
        # Liger wants [B, T+1, V] (it drops the last position): give every impl a view of one.
        self.buffers = [
            torch.randn(
                (self.batch, self.time + 1, vocab), generator=gen, device=device, dtype=dtype
            )
            for _ in range(copies)
        ]
        self.labels = torch.randint(0, vocab, shape[:2], generator=gen, device=device)
        self.mask = torch.rand(shape[:2], generator=gen, device=device) > 0.1
        self.advantages = torch.randn(self.batch, generator=gen, device=device)
        with torch.no_grad():
            logp, _ = fusedrl.token_logprobs(self.buffers[0][:, :-1], self.labels)
        self.old = logp + 0.1 * torch.randn(shape[:2], generator=gen, device=device)
        self.ref = logp + 0.1 * torch.randn(shape[:2], generator=gen, device=device)
        self._next = 0

    def logits(self, with_extra_position=False):
        buf = self.buffers[self._next % len(self.buffers)]
        self._next += 1
        return buf if with_extra_position else buf[:, :-1]

    @property
    def bytes_of_logits(self):
        return self.batch * self.time * self.buffers[0].shape[-1] * self.buffers[0].element_size()


def trl_style_loss(logits, case: Case):
    """What TRL's GRPOTrainer does per step: fp32 log-softmax + gather, loss math, autograd."""
    cfg = case.cfg
    logp = torch.log_softmax(logits.float() / cfg.temperature, dim=-1)
    logp = logp.gather(-1, case.labels[..., None]).squeeze(-1)
    mask = case.mask.float()
    log_ratio = logp - case.old
    if cfg.ratio_level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = logp - logp.detach() + seq.detach()
    ratio = torch.exp(log_ratio)
    adv = case.advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    if cfg.beta > 0:
        d = case.ref - logp
        per_token = per_token + cfg.beta * (torch.exp(d) - d - 1)
    if cfg.agg == "token-mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _liger_fn():
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    def run(case: Case, logits_plus_one):
        cfg = case.cfg
        loss_type = "dapo" if cfg.agg == "token-mean" else "grpo"
        out = triton_grpo_loss(
            logits_plus_one,
            case.old,
            case.ref if cfg.beta > 0 else None,
            case.labels,
            case.advantages,
            case.mask,
            temperature=cfg.temperature,
            beta=cfg.beta,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            inplace=True,
            loss_type=loss_type,
            importance_sampling_level=cfg.ratio_level,
            reduce=True,
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def make_step(op: str, impl: str, case: Case):
    """A zero-argument callable running one step of `impl` on the next rotated input."""
    cfg = case.cfg
    kwargs = dict(old_logp=case.old, ref_logp=case.ref if cfg.beta > 0 else None, config=cfg)
    if op == "token_logprobs_fwd":
        if impl.endswith("-inplace"):
            return None  # no gradient, nothing to write in place
        if impl.startswith("fusedrl"):
            backend = impl.split("-")[1]

            def step():
                with torch.no_grad():
                    fusedrl.token_logprobs(case.logits(), case.labels, backend=backend)
        elif impl == "torch-eager":

            def step():
                with torch.no_grad():
                    lp = torch.log_softmax(case.logits().float(), -1)
                    lp.gather(-1, case.labels[..., None])
        elif impl == "torch-compile":
            fn = torch.compile(reference.token_logprobs)

            def step():
                with torch.no_grad():
                    fn(case.logits(), case.labels)
        else:
            return None
        return step

    if impl.startswith("fusedrl"):
        backend = impl.split("-")[1]  # triton | cuda | torch
        inplace = impl.endswith("inplace")

        def step():
            logits = case.logits().detach().requires_grad_(True)
            out = fusedrl.policy_loss(
                logits,
                case.labels,
                case.advantages,
                case.mask,
                backend=backend,
                inplace=inplace,
                **kwargs,
            )
            torch.autograd.grad(out.loss, logits)
    elif impl == "torch-eager":

        def step():
            logits = case.logits().detach().requires_grad_(True)
            torch.autograd.grad(trl_style_loss(logits, case), logits)
    elif impl == "torch-compile":
        fn = torch.compile(reference.policy_loss)

        def step():
            logits = case.logits().detach().requires_grad_(True)
            out = fn(logits, case.labels, case.advantages, case.mask, **kwargs)
            torch.autograd.grad(out.loss, logits)
    elif impl == "liger":
        run = _liger_fn()

        def step():
            logits = case.logits(with_extra_position=True).detach().requires_grad_(True)
            torch.autograd.grad(run(case, logits), logits)
    else:
        raise ValueError(impl)
    return step


def floor_bytes(op: str, case: Case) -> int:
    logits = case.bytes_of_logits
    if op == "token_logprobs_fwd":
        return logits  # one read
    if case.cfg.is_sequence_level:
        return 3 * logits  # read (pass 1), read + write (pass 2)
    return 2 * logits  # one read, one write of the gradient


def peak_memory_above_inputs(step, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ------------------------------------------------------------------------------ main
def _git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--N", nargs="+", type=int, default=[4096, 16384, 65536])
    parser.add_argument("--V", nargs="+", type=int, default=[32000, 128256, 151936])
    parser.add_argument("--presets", nargs="+", default=["dapo", "grpo", "gspo"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sequences", type=int, default=16, help="B; T = N / B")
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on any device: checks the script runs"
    )
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.N, args.V, args.sequences = [32], [263], 4
        args.copy_gib, args.warmup_ms, args.rep_ms = 0.01, 1, 20
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
            args.impls = [
                i for i in args.impls if i not in ("torch-compile", "liger") and "cuda" not in i
            ]
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth_gbps(device, args.copy_gib)
    meta = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger_kernel"),
        "commit": _git_commit(),
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "copy_bandwidth_gbps": round(bandwidth, 1),
    }
    print(
        f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  "
        f"copy bandwidth {bandwidth:.0f} GB/s"
    )
    header = (
        f"{'op':<20} {'impl':<23} {'preset':<6} {'N':>6} {'V':>7} {'ms':>9} {'p20':>8} "
        f"{'p80':>8} {'GB/s':>7} {'%floor':>7} {'peak MiB':>9}"
    )
    print(header)
    print("-" * len(header))

    rows_by_op: dict[str, list] = {op: [] for op in args.ops}
    for n in args.N:
        for vocab in args.V:
            for preset in args.presets:
                rows = _run_case(args, device, dtype, n, vocab, preset, bandwidth)
                for row in rows:
                    rows_by_op[row["op"]].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    for op, rows in rows_by_op.items():
        name = f"{op}-{_slug(meta['device'])}-{date}{'-' + args.tag if args.tag else ''}.json"
        path = args.out / name
        path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _run_case(args, device, dtype, n, vocab, preset, bandwidth) -> list[dict]:
    rows = []
    try:
        logits_bytes = n * vocab * torch.finfo(dtype).bits // 8
        copies = 1
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info()
            copies = 2 if 4 * logits_bytes < free * 0.5 else 1
        case = Case(n, vocab, preset, dtype, device, copies, min(args.sequences, n))
    except torch.cuda.OutOfMemoryError:
        print(f"{'-':<20} inputs do not fit: N={n} V={vocab}")
        return rows
    for op in args.ops:
        if op == "token_logprobs_fwd" and preset != args.presets[0]:
            continue  # no-grad logprobs do not depend on the loss preset
        for impl in args.impls:
            row = {
                "op": op,
                "impl": impl,
                "preset": preset if op != "token_logprobs_fwd" else None,
                "N": n,
                "V": vocab,
                "dtype": str(dtype).replace("torch.", ""),
                "bytes_floor": floor_bytes(op, case),
            }
            try:
                step = make_step(op, impl, case)
                if step is None:
                    continue
                peak = peak_memory_above_inputs(step, device)
                ms, p20, p80 = _bench(step, device, args.warmup_ms, args.rep_ms)
                floor_ms = row["bytes_floor"] / (bandwidth * 1e9) * 1e3
                row.update(
                    ms=ms,
                    ms_p20=p20,
                    ms_p80=p80,
                    gbps=row["bytes_floor"] / (ms * 1e-3) / 1e9,
                    pct_of_floor=100.0 * floor_ms / ms,
                    peak_mem_bytes=peak,
                )
            except torch.cuda.OutOfMemoryError:
                row.update(ms=None, error="out of memory")
            except Exception as exc:  # a peer that lacks a feature: record, keep going
                row.update(ms=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            _print_row(row)
    del case
    return rows


def _print_row(row: dict) -> None:
    if row.get("ms") is None:
        print(
            f"{row['op']:<20} {row['impl']:<23} {str(row['preset'] or '-'):<6} {row['N']:>6} "
            f"{row['V']:>7}  {row.get('error', '')}"
        )
        return
    peak = row["peak_mem_bytes"]
    peak_s = f"{peak / 2**20:9.0f}" if peak is not None else f"{'-':>9}"
    print(
        f"{row['op']:<20} {row['impl']:<23} {str(row['preset'] or '-'):<6} {row['N']:>6} "
        f"{row['V']:>7} {row['ms']:9.3f} {row['ms_p20']:8.3f} {row['ms_p80']:8.3f} "
        f"{row['gbps']:7.0f} {row['pct_of_floor']:6.1f}% {peak_s}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
