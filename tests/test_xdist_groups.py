"""`make test` runs on every core with pytest-xdist (`--dist loadgroup`); tests/xdist_groups.py
keeps the heavy files on one worker, one after another (XDIST_GROUPS, its own scheduler: xdist
3.8's loadgroup stopped grouping under pytest 9.2 without a word). Checked on a stand-in suite whose
files carry the grouped names."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from .xdist_groups import XDIST_GROUPS, xdist_scope

ROOT = Path(__file__).resolve().parents[1]


def test_each_test_belongs_to_its_files_group_or_to_itself():
    assert xdist_scope("tests/test_kernels_compile.py::test_x[sm_90]") == "exclusive"
    assert xdist_scope("tests/test_tensor_parallel.py::TestA::test_y") == "exclusive"
    assert xdist_scope("tests/test_trl_integration.py::test_z") == "test_trl_integration"
    assert xdist_scope("tests/test_config.py::test_a[x@y]") == "tests/test_config.py::test_a[x@y]"
    assert xdist_scope("tests/test_config.py::test_a@mine") == "mine"  # an xdist_group mark
    grouped = [name for names in XDIST_GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped))
    for name in grouped:  # a renamed or removed file would silently leave its group
        assert (ROOT / "tests" / name).is_file(), name


STAND_IN = """
import os, time, pytest

@pytest.mark.parametrize("i", range(4))
def test_one(i):
    time.sleep(0.2)
    with open(os.environ["XDIST_GROUPS_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""


def test_groups_run_on_one_worker(tmp_path):
    pytest.importorskip("xdist")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "from tests.xdist_groups import pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    files = ["test_kernels_compile", "test_trainer_e2e", "test_trl_integration", "test_free"]
    for name in files:
        (suite / f"{name}.py").write_text(STAND_IN)
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(XDIST_GROUPS_LOG=str(log), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(suite),
            str(suite),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = defaultdict(list)
    for line in log.read_text().splitlines():
        module, worker = line.split()
        workers[module].append(worker)
    assert sorted(workers) == sorted(files) and all(len(w) == 4 for w in workers.values())
    exclusive = workers["test_kernels_compile"] + workers["test_trainer_e2e"]
    assert len(set(exclusive)) == 1, workers  # one group: never two at a time
    assert len(set(workers["test_trl_integration"])) == 1, workers
