"""The benchmark scripts run end to end (tiny shapes, CPU, Triton interpreted): they cannot rot
between GPU sessions. The numbers are meaningless here and are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_bench_loss_smoke_and_plot(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_loss.py"),
            "--smoke",
            "--out",
            str(tmp_path),
            "--presets",
            "dapo",
            "gspo",
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    files = sorted(tmp_path.glob("*.json"))
    assert {f.name.split("-")[0] for f in files} == {"token_logprobs_fwd", "policy_loss_fwd_bwd"}
    result = json.loads((tmp_path / files[0].name).read_text())
    assert {
        "device",
        "torch",
        "triton",
        "commit",
        "timestamp",
        "copy_bandwidth_gbps",
        "rows",
    } <= set(result)
    loss_rows = json.loads(next(tmp_path.glob("policy_loss_fwd_bwd-*.json")).read_text())["rows"]
    measured = {(r["impl"], r["preset"]) for r in loss_rows if r.get("ms") is not None}
    assert ("fusedrl-triton", "gspo") in measured and ("torch-eager", "dapo") in measured
    for row in loss_rows:
        assert {"op", "impl", "preset", "N", "V", "dtype", "ms", "bytes_floor"} <= set(row)
    pytest.importorskip("matplotlib")
    subprocess.run(
        [
            sys.executable,
            str(BENCH / "plot_loss.py"),
            str(next(tmp_path.glob("policy_loss_fwd_bwd-*.json"))),
            "--out",
            str(tmp_path / "plot.png"),
        ],
        check=True,
        timeout=300,
    )
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_bench_train_step_smoke(tmp_path):
    pytest.importorskip("transformers")
    subprocess.run(
        [sys.executable, str(BENCH / "bench_train_step.py"), "--smoke", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(next(tmp_path.glob("train_step-*.json")).read_text())
    assert [r["impl"] for r in result["rows"]] == ["eager", "fusedrl"]
    assert all(r["step_ms"] > 0 and r["tokens"] > 0 for r in result["rows"])
