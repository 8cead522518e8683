"""SIGINT / SIGTERM stop `fusedrl-train` after the current step, checkpointed; a second one
aborts at once; never a traceback. The CLI runs in a process of its own, as a user runs it
(forked from one that imported the trainer once: tests/trainer_cli.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from fusedrl.trainer.logger import read_metrics

from .trainer_cli import Run, TrainerCLI

ROOT = Path(__file__).resolve().parents[1]
_CLI: list[TrainerCLI] = []


@pytest.fixture(scope="module", autouse=True)
def _trainer_cli():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    _CLI.append(TrainerCLI(env, with_vllm=False))
    yield _CLI[0]
    _CLI.pop().close()


def _start(out: Path, *args: str) -> Run:
    return _CLI[0].start(
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
    )


def _wait_for_steps(run: Run, out: Path, steps: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.process.poll() is None, run.stderr()[-3000:]
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    run.process.kill()
    pytest.fail("the run logged no step in time")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_with_a_checkpoint(sig, tmp_path):
    out = tmp_path / "run"
    run = _start(out, "--max-steps", "200")
    _wait_for_steps(run, out, 1)
    run.process.send_signal(sig)
    code, stderr = run.process.wait(timeout=300), run.stderr()
    run.close()
    assert code == 128 + sig, stderr[-3000:]
    assert "stopping after the current step" in stderr and "Traceback" not in stderr
    steps = [r["step"] for r in read_metrics(out)]
    last = steps[-1]
    # One numbering (from 1): the last logged step, the message, the checkpoint's name.
    assert f"stopped on {sig.name} after step {last}" in stderr
    assert (out / "checkpoints" / f"step_{last:06d}" / "model.pt").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    # ... and the run continues from there.
    done = _CLI[0].run("--resume", str(out), "--max-steps", str(last + 1), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {last}" in done.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, last + 2))


def test_a_second_sigint_aborts_at_once(tmp_path):
    out = tmp_path / "run"
    run = _start(out, "--max-steps", "200")
    _wait_for_steps(run, out, 1)
    run.process.send_signal(signal.SIGINT)
    # The second once the first was handled: two sent before the process runs its handler
    # (a loaded machine) arrive as one, and the run stops gracefully instead.
    try:
        deadline = time.monotonic() + 60
        while "stopping after the current step" not in run.stderr():
            assert time.monotonic() < deadline, run.stderr()[-3000:]
            time.sleep(0.05)
        run.process.send_signal(signal.SIGINT)
        run.process.wait(timeout=120)
    finally:  # a run that never said it would leave its process behind
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait(60)
    stderr = run.stderr()
    run.close()
    assert run.process.returncode == 130, stderr
    assert "SIGINT again: aborting now" in stderr and "Traceback" not in stderr


def test_sigterm_before_training_unwinds_the_start(tmp_path):
    """A scheduler's SIGTERM during the warm start: the start is unwound as for Ctrl-C (no
    base model or lock left of a run that never ran), so the same command requeued starts."""
    out = tmp_path / "run"
    # (a warm start of this length is never in the cache: it runs while the signal comes)
    run = _CLI[0].start("--rollout", "hf", "--out", str(out), "--warmstart-steps", "200000")
    try:
        deadline = time.monotonic() + 120
        while "warm start" not in _written(run.stdout):
            assert run.process.poll() is None, run.stderr()[-3000:]
            assert time.monotonic() < deadline, run.stdout()[-3000:]
            time.sleep(0.1)
        run.process.send_signal(signal.SIGTERM)
        code = run.process.wait(timeout=120)
    finally:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait(60)
    stderr = run.stderr()
    run.close()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "terminated (SIGTERM) before training started" in stderr
    assert "Traceback" not in stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def _written(stream) -> str:
    """What a started run has written so far ('' before its output file exists)."""
    try:
        return stream()
    except FileNotFoundError:
        return ""
