"""The host's share of a loss call, fusedrl against Liger in one run, on the CPU.

At a 4k-token micro-batch the loss is host-bound on a GPU: every small [B, T] op around the
kernel costs a launch and some microseconds of Python (about 23 us an op on the H100 host of
2026-11-26). This script measures that share without a GPU: the Triton kernels run under the
interpreter, and with their launches stubbed out (they return at once; the outputs are garbage,
the host path is unchanged) the wall time of a forward + backward is the host's alone. Per call
(after a warm-up) it reports the aten ops dispatched, split into the ones that launch a kernel
on a GPU, views / allocations (no launch), device -> host syncs (each a stall on a GPU and a
break in CUDA-graph capture), and the Triton launches themselves.

    python bench/host_overhead.py [--B 4] [--T 64] [--V 64] [--reps 50] [--out DIR]

Numbers from this machine's CPU are a proxy of the host's share, not a GPU measurement (their
JSON says so); the op counts are exact and are what tests/test_host_overhead.py budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import _git_commit, package_version, results_dir  # noqa: E402

# aten ops that launch nothing on a GPU (views, metadata, allocations, a Python scalar wrapped)
NO_LAUNCH = {
    "aten.scalar_tensor",
    "aten.view",
    "aten._unsafe_view",
    "aten.reshape",
    "aten.expand",
    "aten.t",
    "aten.transpose",
    "aten.permute",
    "aten.squeeze",
    "aten.unsqueeze",
    "aten.slice",
    "aten.select",
    "aten.alias",
    "aten.detach",
    "aten.as_strided",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.lift_fresh",
    "aten._reshape_alias",
    "aten.split",
    "aten.unbind",
    "aten.diagonal",
}
# aten ops that read a device value on the host: a sync on a GPU
SYNC = {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal", "aten.nonzero"}
NOTE = "CPU host time with the Triton kernels stubbed out: a proxy of the GPU host's share"
SMOKE_NOTE = "smoke run, not a measurement"


class _Ops(TorchDispatchMode):
    """The ops dispatched under it, outside the interpreted kernels' own host copies."""

    def __init__(self, launches: _Launches):
        super().__init__()
        self.ops: list[str] = []
        self.launches = launches

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.launches.inside:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Launches:
    """Counts the Triton launches (the interpreter's `run` of a kernel); with `stub`, they return
    at once, before the interpreter binds the arguments, so that the wall time is the caller's
    host path alone (a GPU's launch costs a few microseconds, the interpreter's binding more)."""

    def __init__(self, stub: bool):
        self.stub, self.count, self.inside = stub, 0, False
        self._real = interpreter.InterpretedFunction.run

    def __enter__(self) -> _Launches:
        launches, real = self, self._real
        if self.stub:
            self._hold_label_check()

        def run(function, *args, **kwargs):
            launches.count += 1
            if launches.stub:
                return None
            launches.inside = True
            try:
                return real(function, *args, **kwargs)
            finally:
                launches.inside = False

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        interpreter.InterpretedFunction.run = self._real
        if self.stub:
            from fusedrl import fused_backend

            fused_backend.check_labels_counted = self._label_check

    def _hold_label_check(self) -> None:
        """Stubbed kernels leave their outputs unwritten, the kernels' label check among them:
        it still reads its flag on the host (the same op, the same sync on CPU), and never
        raises on the garbage."""
        from fusedrl import fused_backend

        self._label_check = fused_backend.check_labels_counted
        fused_backend.check_labels_counted = lambda labels_ok, inp: bool(labels_ok)


def classify(ops: list[str]) -> dict[str, int]:
    kinds = Counter()
    for op in ops:
        base = op.rsplit(".", 1)[0]
        if not op.startswith("aten."):
            kinds["custom"] += 1
        elif base in SYNC:
            kinds["sync"] += 1
        elif base in NO_LAUNCH:
            kinds["no_launch"] += 1
        else:
            kinds["launching"] += 1
    return dict(kinds)


def inputs(batch: int, time_: int, vocab: int, seed: int = 0) -> dict:
    """bf16 logits [B, T + 1, V] (Liger drops the last position; fusedrl reads a [B, T, V] view),
    labels, a mask, per-sequence advantages, old log-probs near the current ones."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, time_ + 1, vocab, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, time_), generator=gen)
    with torch.no_grad():
        now = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels[..., None])[..., 0]
    return dict(
        logits=logits,
        labels=labels,
        mask=torch.rand(batch, time_, generator=gen) > 0.1,
        advantages=torch.randn(batch, generator=gen),
        old_logp=now + 0.1 * torch.randn(batch, time_, generator=gen),
        ref_logp=now + 0.1 * torch.randn(batch, time_, generator=gen),
    )


def fusedrl_step(preset: str, data: dict, read_metrics: bool = False):
    """One forward + backward; `read_metrics`: and every metric read (their 0-dim views are
    made when first read: a caller that logs them on each micro-batch pays for them here)."""
    import fusedrl

    cfg = fusedrl.LossConfig.preset(preset)
    ref = data["ref_logp"] if cfg.beta > 0 else None
    leaf = data["logits"][:, :-1].detach().requires_grad_(True)

    def step():
        out = fusedrl.policy_loss(
            leaf,
            data["labels"],
            data["advantages"],
            data["mask"],
            old_logp=data["old_logp"],
            ref_logp=ref,
            config=cfg,
            backend="triton",
        )
        if read_metrics:
            _ = [out.metrics[name] for name in out.metrics]
        return torch.autograd.grad(out.loss, leaf)

    return step


def liger_step(data: dict):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    import fusedrl

    cfg = fusedrl.LossConfig.preset("dapo")
    leaf = data["logits"].detach().requires_grad_(True)

    def step():
        out = triton_grpo_loss(
            leaf,
            data["old_logp"],
            None,
            data["labels"],
            data["advantages"],
            data["mask"],
            temperature=cfg.temperature,
            beta=0.0,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            inplace=False,
            loss_type="dapo",
            reduce=True,
        )
        return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, leaf)

    return step


def measure(name: str, step, reps: int) -> dict:
    step()  # warm-up: first-call work (compiles, caches) stays out
    with _Launches(stub=True) as launches:
        counter = _Ops(launches)
        with counter:
            step()
        walls = []
        for _ in range(reps):
            start = time.perf_counter()
            step()
            walls.append(time.perf_counter() - start)
    return dict(
        impl=name,
        ops=classify(counter.ops),
        triton_launches=launches.count // (reps + 1),
        host_ms_median=statistics.median(walls) * 1e3,
        host_ms_min=min(walls) * 1e3,
        ops_by_name=dict(Counter(counter.ops).most_common()),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=4)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--V", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="write host-overhead-cpu.json here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 3 reps, marked smoke")
    args = parser.parse_args(argv)
    if args.smoke:
        args.B, args.T, args.V, args.reps = 2, 8, 32, 3
    torch.manual_seed(0)
    data = inputs(args.B, args.T, args.V)
    cases = {f"fusedrl-triton {p}": fusedrl_step(p, data) for p in ("dapo", "grpo", "gspo")}
    cases["fusedrl-triton dapo +metrics"] = fusedrl_step("dapo", data, read_metrics=True)
    try:
        cases["liger triton_grpo_loss dapo"] = liger_step(data)
    except ImportError as err:
        print(f"liger_kernel not importable ({err}): fusedrl alone")
    liger = package_version("liger-kernel")
    print(
        f"{SMOKE_NOTE if args.smoke else NOTE}; torch {torch.__version__}, liger-kernel "
        f"{liger}, B={args.B} T={args.T} V={args.V}, {args.reps} calls"
    )
    print(
        f"{'impl':<30} {'launching':>9} {'syncs':>5} {'custom':>6} {'triton':>6} "
        f"{'host ms (median / min)':>22}"
    )
    rows = []
    for name, step in cases.items():
        row = measure(name, step, args.reps)
        ops = row["ops"]
        print(
            f"{name:<30} {ops.get('launching', 0):>9} {ops.get('sync', 0):>5} "
            f"{ops.get('custom', 0):>6} {row['triton_launches']:>6} "
            f"{row['host_ms_median']:>12.3f} / {row['host_ms_min']:.3f}"
        )
        rows.append(row)
    if args.out is not None:
        out = results_dir(args.out, args.smoke)  # (a smoke run never into bench/results/)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = "host-overhead-cpu-smoke.json" if args.smoke else f"host-overhead-cpu-{stamp}.json"
        result = dict(
            note=SMOKE_NOTE if args.smoke else NOTE,
            smoke=args.smoke,
            commit=_git_commit(),
            triton=package_version("triton"),
            B=args.B,
            T=args.T,
            V=args.V,
            reps=args.reps,
            torch=torch.__version__,
            liger_kernel=liger,
            rows=rows,
        )
        (out / name).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out / name}")
    if args.smoke:
        print(SMOKE_NOTE)
    return rows


if __name__ == "__main__":
    main()
