"""fusedrl-train's default job, padded against packed (--pack), in one run on this machine.

    python bench/bench_pack_job.py [--steps 40] [--budgets 256 512] [--out bench/results]
    python bench/bench_pack_job.py --smoke       # 4 steps: checks it runs, not a measurement

Each variant is the same seeded run (the same prompts, samples and updates: their losses agree
to float rounding): the padded micro-batches, --pack with the whole minibatch in one packed row,
and --pack --max-tokens-per-microbatch B for each budget. Reported per variant: the median of
the update's wall time (`train_time` in metrics.jsonl: the old / reference log-prob passes, the
forward, the loss and backward, the optimizer; the rollouts excluded) over the steps after the
first five, and the last step's loss. Results: a table and
bench/results/pack_job-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_loss import RESULTS, SMOKE_NOTE, results_dir

WARMUP_STEPS = 5  # not counted: allocator and kernel caches


def variants(budgets: list[int]) -> dict[str, list[str]]:
    runs = {"padded": ["--no-pack"], "packed": ["--pack"]}
    for budget in budgets:
        runs[f"packed-{budget}"] = ["--pack", "--max-tokens-per-microbatch", str(budget)]
    return runs


# A smoke run's runs: no warm start and transformers' sampling (no vLLM start-up)
SMOKE_FLAGS = ["--warmstart-steps", "0", "--rollout", "hf"]


def run(flags: list[str], steps: int, out: Path, trainer=None) -> dict:
    """One variant's run. `trainer(*args)`: runs `python -m fusedrl.trainer ARGS` and returns its
    subprocess.CompletedProcess (a test's forking runner); by default a plain subprocess."""
    args = ["--max-steps", str(steps), "--seed", "3", "--out", str(out), "--overwrite"]
    args += ["--no-progress", *flags]
    if trainer is None:
        command = [sys.executable, "-m", "fusedrl.trainer", *args]
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    else:
        proc = trainer(*args)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [row["train_time"] for row in rows[WARMUP_STEPS:]] or [rows[-1]["train_time"]]
    return {"train_time_s": statistics.median(timed), "steps": len(rows), "loss": rows[-1]["loss"]}


def main(argv: list[str] | None = None, trainer=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budgets", type=int, nargs="*", default=[256, 512])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="4 steps: not a measurement")
    args = parser.parse_args(argv)
    steps = 4 if args.smoke else args.steps
    if args.smoke:
        print(f"# {SMOKE_NOTE}")
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {}
    with tempfile.TemporaryDirectory() as runs:
        for name, flags in variants(args.budgets).items():
            flags = [*flags, *SMOKE_FLAGS] if args.smoke else flags
            results[name] = run(flags, steps, Path(runs) / name, trainer)
            row = results[name]
            print(f"{name:14s} {row['train_time_s'] * 1e3:9.1f} ms/update   loss {row['loss']:.6f}")
    padded = results["padded"]["train_time_s"]
    for row in results.values():
        row["vs_padded"] = row["train_time_s"] / padded
    record = {
        "device": device,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
        "job": "fusedrl-train's default (built-in sum task, tiny model), --seed 3",
        "steps": steps,
        "results": results,
    }
    if args.smoke:
        record["note"] = SMOKE_NOTE
    out = results_dir(args.out, args.smoke)
    out.mkdir(parents=True, exist_ok=True)
    slug = device.lower().replace(" ", "-")
    path = out / f"pack_job-{slug}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
