"""`fusedrl-train --rollout hf`: rollouts with transformers' generate, where vLLM is not installed
(a GPU image without vLLM, a laptop). Runs the CLI in a subprocess like a user, on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedrl.trainer.logger import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TIMES = ("step_time", "gen_time", "train_time")


def fusedrl_train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "fusedrl.trainer", "--progress", "false", "--rollout", "hf", *args],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "hf"
    fusedrl_train("--out", str(out), "--max-steps", "20", "--save-every", "10")
    return out


def test_hf_rollouts_learn_the_default_task(hf_run):
    rows = read_metrics(hf_run)
    assert [r["step"] for r in rows] == list(range(20))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-5:]) / 5
    assert last - first >= 0.1, (first, last)
    assert (hf_run / "final_model" / "config.json").exists()


def test_hf_rollouts_resume_exactly(hf_run, tmp_path):
    out = tmp_path / "resumed"
    fusedrl_train("--out", str(out), "--max-steps", "13", "--save-every", "10",
                  "--resume", str(hf_run / "checkpoints" / "step_000010"))
    resumed = read_metrics(out)
    reference = read_metrics(hf_run)[10:13]
    assert [r["step"] for r in resumed] == [10, 11, 12]
    for got, want in zip(resumed, reference):
        assert {k: v for k, v in got.items() if k not in TIMES} == {
            k: v for k, v in want.items() if k not in TIMES}
