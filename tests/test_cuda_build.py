"""The CUDA extension builds: every .cu in csrc/ compiles to object code for sm_80 and sm_90 (no
link, no GPU), and the torch bindings pass a compiler syntax check. Skipped only without nvcc.
The GPU correctness suite of the CUDA backend is tests/test_gpu.py (backend="cuda")."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from fusedrl.fused_backend import FUSED_ARGS

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")


def _cuda_include() -> Path:
    """The CUDA toolkit's include dir (nvcc may be a wrapper script outside the toolkit)."""
    candidates = [
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        "/usr/local/cuda",
        str(Path(NVCC).resolve().parents[1]),
    ]
    for home in filter(None, candidates):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    pytest.skip("CUDA headers not found (set CUDA_HOME)")


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """source name -> object file for sm_80 + sm_90, compiled once per test run."""
    built: dict[str, Path] = {}

    def build(source: str) -> Path:
        if source not in built:
            built[source] = _compile(source, tmp_path_factory.mktemp("cu"))
        return built[source]

    return build


def _compile(source: str, tmp_path: Path) -> Path:
    cmd = [
        NVCC,
        "-c",
        "-O3",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "-I",
        str(CSRC),
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
        str(CSRC / source),
        "-o",
        str(tmp_path / (source + ".o")),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / (source + ".o")).stat().st_size > 0
    return tmp_path / (source + ".o")


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_cu_compiles_for_sm80_and_sm90(source, objects):
    usage = _resource_usage(objects(source))
    assert {arch for arch, _, _ in usage} == {"sm_80", "sm_90"}
    for arch, function, fields in usage:
        print(f"{arch} {fields['REG']:>3} regs {fields['LOCAL']:>3} B local  {function}")
    # A spill is per-thread local-memory traffic on the bus these kernels are bound by.
    spills = [
        f"{arch} {function}: LOCAL {fields['LOCAL']} B, STACK {fields['STACK']} B"
        for arch, function, fields in usage
        if fields["LOCAL"] or fields["STACK"]
    ]
    assert not spills, "\n".join(spills)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_sweeps_within_the_instruction_budget(arch, objects):
    """The same static check as the Triton kernels' (tests/test_kernels_compile.py), from the
    extension's SASS: per kernel and dtype, the sweep-1 loop (the cheaper stats loop: the other is
    the exact online fallback) and every gradient loop (with and without the entropy term) load and
    store 128 bits, hold no barrier, issue one MUFU per element, and stay within
    fusedrl.kernels.aot.SWEEP_BUDGET; the fused kernel's two sweeps within FUSED_BUDGET."""
    from fusedrl.kernels.aot import FUSED_BUDGET, SWEEP_BUDGET, sass_loops, with_costs

    sass = subprocess.run(
        [_cuobjdump(), "-sass", "-arch", arch, str(objects("fused_loss.cu"))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    assert len(functions) >= 9, f"expected 3 kernels x 3 dtypes in the {arch} SASS"
    failures, table = [], []
    for text in functions:
        name = text.split("\n", 1)[0].strip()
        kernel = re.search(
            r"(logprobs_forward|logits_grad|fused_token_loss_cluster|fused_token_loss)_kernel", name
        )
        dtype = "bf16" if "bfloat16" in name else "fp16" if "__half" in name else "fp32"
        elem_bytes = 4 if dtype == "fp32" else 2
        assert kernel, name
        if kernel.group(1) == "fused_token_loss_cluster" and arch == "sm_80":
            continue  # sm_90 only (thread-block clusters): a trap on sm_80
        loops = with_costs(sass_loops(text), 16 // elem_bytes, elem_bytes)
        stats = [loop for loop in loops if loop["role"] == "stats"]
        grads = [loop for loop in loops if loop["role"] == "grad"]
        checked = ([min(stats, key=lambda loop: loop["instructions"])] if stats else []) + grads
        assert checked, f"{kernel.group(1)} {dtype}: no 128-bit main loop found"
        for loop in checked:
            cost, role = loop["warp_instructions_per_element"], loop["role"]
            table.append(f"{arch} {kernel.group(1):<24} {dtype} {role:<5} {cost:.3f} w-instr/elem")
            memory = {**loop["loads"], **loop["stores"], **loop["shared_loads"]}
            wide = all(op.endswith(".128") for op in memory)
            if cost > SWEEP_BUDGET[role] or loop["mufu_per_element"] > 1 or loop["barriers"]:
                failures.append(f"{table[-1]}, {loop['mufu_per_element']} MUFU/elem, "
                                f"{loop['barriers']} BAR")  # fmt: skip
            if not wide:
                failures.append(f"{table[-1]}: {loop['loads']} {loop['stores']}")
        if kernel.group(1).startswith("fused_token_loss"):
            total = checked[0]["warp_instructions_per_element"] + max(
                loop["warp_instructions_per_element"] for loop in grads
            )
            if total > FUSED_BUDGET:
                failures.append(f"{arch} fused {dtype}: both sweeps {total:.3f} > {FUSED_BUDGET}")
    print("\n" + "\n".join(table))
    assert not failures, "\n".join(failures)


def _cuobjdump() -> str:
    """The toolkit's cuobjdump (beside the real nvcc, which may hide behind a wrapper script),
    else one on PATH, else the one Triton ships."""
    candidates = [Path(NVCC).resolve().parent / "cuobjdump"]
    text = Path(NVCC).resolve().read_bytes()[:4096]
    if match := re.search(rb"exec\s+(\S+/)nvcc\b", text):
        candidates.append(Path(match.group(1).decode()) / "cuobjdump")
    if shutil.which("cuobjdump"):
        candidates.append(Path(shutil.which("cuobjdump")))
    if importlib.util.find_spec("triton") is not None:
        triton_dir = Path(importlib.util.find_spec("triton").origin).parent
        candidates.append(triton_dir / "backends" / "nvidia" / "bin" / "cuobjdump")
    for path in candidates:
        if path.exists():
            return str(path)
    pytest.skip("no cuobjdump (CUDA toolkit or Triton)")


def _resource_usage(obj: Path) -> list[tuple[str, str, dict[str, int]]]:
    """(arch, function, {REG, STACK, SHARED, LOCAL}) of every kernel in an object file."""
    out = subprocess.run(
        [_cuobjdump(), "--dump-resource-usage", str(obj)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows, arch, function = [], None, None
    for line in out.splitlines():
        if m := re.match(r"arch = (sm_\d+)", line.strip()):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\S+):", line):
            function = m.group(1)
        elif function and "REG:" in line:
            fields = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            rows.append((arch, function, fields))
            function = None
    assert rows, f"no kernel found by cuobjdump in {obj}:\n{out[-2000:]}"
    return rows


@needs_nvcc
@pytest.mark.slow
def test_bindings_pass_a_syntax_check(tmp_path):
    """bindings.cpp against this machine's torch headers. A CPU wheel of torch lacks one header
    generated at CUDA build time; a stub with its real content stands in for it."""
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [
        cxx,
        "-std=c++20",
        "-fsyntax-only",
        "-Wall",
        "-Werror=return-type",
        f"-I{tmp_path}",
        *(f"-I{p}" for p in include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{_cuda_include()}",
        f"-I{CSRC}",
        "-DTORCH_EXTENSION_NAME=_C",
        str(CSRC / "bindings.cpp"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0 and not errors, "\n".join(errors[:20]) or result.stderr[-4000:]


def test_cuda_op_schema_matches_the_triton_op():
    """Both backends run through one driver, so the fused op's arguments must agree."""
    text = (CSRC / "bindings.cpp").read_text()
    block = re.search(r"#define FUSEDRL_FUSED_ARGS(.*?)\n\n", text, re.S).group(1)
    cpp_args = "".join(re.findall(r'"([^"]*)"', block))
    assert cpp_args == FUSED_ARGS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_load_without_gpu_raises_clearly():
    from fusedrl.kernels import cuda

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda.load()
