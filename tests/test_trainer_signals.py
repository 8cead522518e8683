"""SIGINT / SIGTERM stop `fusedrl-train` after the current step, checkpointed; a second one
aborts at once; never a traceback. The CLI runs in a subprocess, as a user runs it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fusedrl.trainer.logger import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fusedrl.trainer",
            "--progress",
            "false",
            "--rollout",
            "hf",
            "--warmstart-steps",
            "0",
            "--out",
            str(out),
            "--save-every",
            "1000",
            *args,
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail("the run logged no step in time")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_with_a_checkpoint(sig, tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--max-steps", "200")
    _wait_for_steps(proc, out, 1)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert "stopping after the current step" in stderr and "Traceback" not in stderr
    steps = [r["step"] for r in read_metrics(out)]
    last = steps[-1]
    # One numbering (from 1): the last logged step, the message, the checkpoint's name.
    assert f"stopped on {sig.name} after step {last}" in stderr
    assert (out / "checkpoints" / f"step_{last:06d}" / "model.pt").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    # ... and the run continues from there.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusedrl.trainer",
            "--resume",
            str(out),
            "--max-steps",
            str(last + 1),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {last}" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, last + 2))


def test_a_second_sigint_aborts_at_once(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, "--max-steps", "200")
    _wait_for_steps(proc, out, 1)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr])
    reader.start()
    proc.send_signal(signal.SIGINT)
    # The second once the first was handled: two sent before the process runs its handler
    # (a loaded machine) arrive as one, and the run stops gracefully instead.
    seen = []
    try:
        while not any("stopping after the current step" in line for line in seen):
            seen.append(lines.get(timeout=60))
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:  # a run that never said it would leave its process behind
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)
    stderr = "".join(seen) + "".join(lines.queue)
    assert proc.returncode == 130, stderr
    assert "SIGINT again: aborting now" in stderr and "Traceback" not in stderr
