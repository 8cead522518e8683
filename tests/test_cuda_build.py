"""The CUDA extension builds: every .cu in csrc/ compiles to object code for sm_80, sm_90 and, where
this nvcc has them (12.8+), Blackwell's sm_100 and sm_120 (no link, no GPU), with no spill and
within the instruction budget of the Triton kernels; the torch bindings pass a compiler syntax
check; and the launcher's host code, linked with a stub CUDA runtime, chooses the sm_90+ cluster
kernel only where the code a driver would load has its body. Skipped only without nvcc (an arch's
tests: without that arch in nvcc). The GPU correctness suite of the CUDA backend is
tests/test_gpu.py (backend="cuda")."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fusedrl.kernels.token_args import CUDA_FIELDS, op_schema

from .cuda_images import cluster_arch, find_cuobjdump, images, loaded_image

CSRC = Path(__file__).resolve().parents[1] / "csrc"
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")

# The SASS targets of the objects, each compiled from its own virtual architecture. sm_100
# (B200, GB200) and sm_120 (RTX 50xx, RTX PRO 6000 Blackwell) need nvcc 12.8+; with an older nvcc
# their tests skip and say so, and the others still run.
#
# The budgets (no spill; fusedrl.kernels.aot.SWEEP_BUDGET and FUSED_BUDGET) apply to every arch
# unchanged, but FUSED_BUDGET's margin does not carry over to B200. It is half of an H100's
# parity between issue and memory (1.2 warp-instructions per bf16 element). A B200 moves
# ~7.7 TB/s (1.9e12 elements/s at 4 bytes each) against 148 SMs x 4 schedulers x ~1.98 GHz =
# 1.17e12 warp-instructions/s: parity at ~0.61, so 0.6 there only keeps the kernels from being
# issue-bound, with no margin (sm_100 measures 0.46-0.49 for both sweeps: ~80% of parity). Half of
# B200 parity (0.30) would take about half the instructions per element, a kernel change to be
# decided by B200 timings; until then sm_100 is held to the same numbers. On sm_120 (RTX 5090:
# 1.8 TB/s, 170 SMs at ~2.4 GHz, parity ~3.6) the budget keeps a wide margin.
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")


@functools.cache
def _nvcc_codes() -> frozenset[str]:
    """The real architectures this nvcc compiles for (`nvcc --list-gpu-code`)."""
    result = subprocess.run([NVCC, "--list-gpu-code"], capture_output=True, text=True)
    return frozenset(result.stdout.split()) if result.returncode == 0 else frozenset()


def _built_archs() -> list[str]:
    return [arch for arch in ARCHS if arch in _nvcc_codes()]


def _needs_arch(arch: str) -> None:
    if arch not in _nvcc_codes():
        version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
        release = re.search(r"release ([\d.]+)", version)
        pytest.skip(
            f"nvcc {release.group(1) if release else '?'} cannot compile for {arch} "
            "(sm_100 and sm_120 need CUDA 12.8+)"
        )


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
    """source name -> object file for every arch of ARCHS this nvcc has, compiled once per run."""
    built: dict[str, Path] = {}

    def build(source: str) -> Path:
        if source not in built:
            codes = [(f"compute_{arch[3:]}", arch) for arch in _built_archs()]
            built[source] = _compile(source, tmp_path_factory.mktemp("cu"), codes)
        return built[source]

    return build


def _compile(source: str, tmp_path: Path, codes: list[tuple[str, str]]) -> Path:
    """nvcc -c of csrc/<source> for (virtual arch, code) pairs: code=sm_XX for SASS, compute_XX
    for PTX. nvcc compiles each pair on its own, over --threads 0 (every core)."""
    out = tmp_path / (source + ".o")
    gencode = [
        arg for virtual, code in codes for arg in ("-gencode", f"arch={virtual},code={code}")
    ]
    cmd = [
        NVCC,
        "-c",
        "-O3",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "--threads",
        "0",
        "-I",
        str(CSRC),
        *gencode,
        str(CSRC / source),
        "-o",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert out.stat().st_size > 0
    return out


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_cu_compiles_for_every_arch(source, arch, objects):
    """No spill in any kernel: a spill is per-thread local-memory traffic on the bus these
    kernels are bound by. The register bound itself is each kernel's __launch_bounds__ (64 for
    the two-sweep kernels: 2 blocks of 512 threads per SM), which ptxas must meet by spilling."""
    _needs_arch(arch)
    usage = [row for row in _resource_usage(objects(source)) if row[0] == arch]
    assert usage, f"no {arch} code in {source}"
    for _, function, fields in usage:
        print(f"{arch} {fields['REG']:>3} regs {fields['LOCAL']:>3} B local  {function}")
    spills = [
        f"{arch} {function}: LOCAL {fields['LOCAL']} B, STACK {fields['STACK']} B"
        for arch, function, fields in usage
        if fields["LOCAL"] or fields["STACK"]
    ]
    assert not spills, "\n".join(spills)


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_sweeps_within_the_instruction_budget(arch, objects):
    """The same static check as the Triton kernels' (tests/test_kernels_compile.py), from the
    extension's SASS: per kernel and dtype, the sweep-1 loop (the cheaper stats loop: the other is
    the exact online fallback) and every gradient loop (with and without the entropy term) load and
    store 128 bits, hold no barrier, issue one MUFU per element, and stay within
    fusedrl.kernels.aot.SWEEP_BUDGET; the fused kernel's two sweeps within FUSED_BUDGET. The
    soft-capped kernels (kCap: the Triton kernels' SOFTCAP) within SOFTCAP_BUDGET and
    SOFTCAP_FUSED_BUDGET, with SOFTCAP_MUFU_PER_ELEMENT."""
    from fusedrl.kernels.aot import (
        FUSED_BUDGET,
        SOFTCAP_BUDGET,
        SOFTCAP_FUSED_BUDGET,
        SOFTCAP_MUFU_PER_ELEMENT,
        SWEEP_BUDGET,
        sass_loops,
        with_costs,
    )

    _needs_arch(arch)
    sass = subprocess.run(
        [_cuobjdump(), "-sass", "-arch", arch, str(objects("fused_loss.cu"))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    assert len(functions) >= 18, f"expected 3 kernels x 3 dtypes x (capped or not) in {arch}"
    failures, table = [], []
    for text in functions:
        name = text.split("\n", 1)[0].strip()
        kernel = re.search(
            r"(logprobs_forward|logits_grad|fused_token_loss_cluster|fused_token_loss)_kernel", name
        )
        dtype = "bf16" if "bfloat16" in name else "fp16" if "__half" in name else "fp32"
        elem_bytes = 4 if dtype == "fp32" else 2
        assert kernel, name
        capped = re.search(r"Lb1EE", name) is not None  # <T, kCap = true>, mangled
        budget, mufu = (SOFTCAP_BUDGET, SOFTCAP_MUFU_PER_ELEMENT) if capped else (SWEEP_BUDGET, 1)
        label = f"{kernel.group(1)}{'+cap' if capped else ''}"
        if kernel.group(1) == "fused_token_loss_cluster" and int(arch[3:]) < cluster_arch():
            continue  # thread-block clusters exist from sm_90 on: before, the kernel is a trap
        loops = with_costs(sass_loops(text), 16 // elem_bytes, elem_bytes)
        stats = [loop for loop in loops if loop["role"] == "stats"]
        grads = [loop for loop in loops if loop["role"] == "grad"]
        checked = ([min(stats, key=lambda loop: loop["instructions"])] if stats else []) + grads
        assert checked, f"{kernel.group(1)} {dtype}: no 128-bit main loop found"
        for loop in checked:
            cost, role = loop["warp_instructions_per_element"], loop["role"]
            table.append(f"{arch} {label:<28} {dtype} {role:<5} {cost:.3f} w-instr/elem")
            memory = {**loop["loads"], **loop["stores"], **loop["shared_loads"]}
            wide = all(op.endswith(".128") for op in memory)
            if cost > budget[role] or loop["mufu_per_element"] > mufu or loop["barriers"]:
                failures.append(
                    f"{table[-1]}, {loop['mufu_per_element']} MUFU/elem, {loop['barriers']} BAR"
                )
            if not wide:
                failures.append(f"{table[-1]}: {loop['loads']} {loop['stores']}")
        if kernel.group(1).startswith("fused_token_loss"):
            total = checked[0]["warp_instructions_per_element"] + max(
                loop["warp_instructions_per_element"] for loop in grads
            )
            fused_budget = SOFTCAP_FUSED_BUDGET if capped else FUSED_BUDGET
            if total > fused_budget:
                failures.append(f"{arch} {label} {dtype}: both sweeps {total:.3f} > {fused_budget}")
    print("\n" + "\n".join(table))
    assert not failures, "\n".join(failures)


def _cuobjdump() -> str:
    path = find_cuobjdump(NVCC)
    if path is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    return path


def _resource_usage(obj: Path) -> list[tuple[str, str, dict[str, int]]]:
    """(arch, function, {REG, STACK, SHARED, LOCAL}) of every kernel in an object file."""
    out = subprocess.run(
        [_cuobjdump(), "--dump-resource-usage", str(obj)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
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


# ------------------------------------------------------------------ which fused kernel runs
# Builds of fused_loss.cu that a wheel or a JIT build may ship, as the objects holding their
# images (nvcc compiles every -gencode on its own: a build's images are the union of its parts',
# so "sm_80" is the every-arch object's sm_80 image, not a build of its own).
VARIANTS = {
    "compute_80": [("compute_80", "compute_80")],  # PTX only
    # An sm_90 cubin compiled from compute_80: what the driver JITs from compute_80 PTX on an
    # H100, made offline so that its SASS can be read.
    "compute_80->sm_90": [("compute_80", "sm_90")],
}
BUILDS = {
    "sm_80": ["sm_80"],
    "compute_80 (PTX only)": ["compute_80"],
    "8.0+PTX": ["sm_80", "compute_80"],  # TORCH_CUDA_ARCH_LIST="8.0+PTX": the case
    "sm_80 + compute_80->sm_90": ["sm_80", "compute_80->sm_90"],
    "every arch": ["every arch"],  # the objects of the tests above
    "every arch + compute_80 PTX": ["every arch", "compute_80"],
}
# The GPUs the stub runtime plays: compute capability -> (cluster launch, opt-in shared memory per
# block in bytes), as such devices report them.
GPUS = {
    80: (0, 166912),  # A100
    86: (0, 101376),  # A10, RTX 3090
    90: (1, 232448),  # H100, H200
    100: (1, 232448),  # B200, GB200
    120: (1, 101376),  # RTX 5090, RTX PRO 6000
}
BF16, FP32, FP16 = 2, 0, 1  # fusedrl::DType
STUB_STATIC_SMEM = 1440  # kStaticSmem of tests/cuda_stub_runtime.cpp


@pytest.fixture(scope="module")
def variant_objects(objects, tmp_path_factory):
    """name -> object of fused_loss.cu: the VARIANTS and "every arch" (the objects fixture's),
    compiled side by side."""
    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        futures = {
            name: pool.submit(_compile, "fused_loss.cu", tmp_path_factory.mktemp("variant"), codes)
            for name, codes in VARIANTS.items()
        }
        built = {"every arch": objects("fused_loss.cu")}
        built.update({name: future.result() for name, future in futures.items()})
    return built


@pytest.fixture(scope="module")
def builds(variant_objects):
    """build name -> its images (tests/cuda_images.Image)."""
    dump = _cuobjdump()
    found = {name: images(path, dump) for name, path in variant_objects.items()}
    found["sm_80"] = [i for i in found["every arch"] if i.kind == "cubin" and i.arch == 80]
    return {build: [i for part in parts for i in found[part]] for build, parts in BUILDS.items()}


@pytest.fixture(scope="module")
def stub_runtime(variant_objects, tmp_path_factory):
    """tests/cuda_stub_runtime.cpp linked with fused_loss.cu's object instead of libcudart: the
    launchers' host code (the same in every build; the every-arch object's is linked) run against a
    stub runtime. Returns run(commands) -> one dict per command."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("stub") / "stub_runtime"
    source = Path(__file__).with_name("cuda_stub_runtime.cpp")
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-Wall",
        "-Werror",
        "-pthread",
        f"-I{_cuda_include()}",
        f"-I{CSRC}",
        str(source),
        str(variant_objects["every arch"]),
        "-o",
        str(exe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]

    def run(commands: list[str]) -> list[dict]:
        out = subprocess.run(
            [str(exe)],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return [json.loads(line) for line in out.splitlines()]

    return run


@needs_nvcc
@pytest.mark.slow
def test_cluster_kernel_has_a_body_exactly_in_code_compiled_for_compute_90(builds):
    """Image by image, the one-read cluster kernel is real code iff the image was compiled from a
    virtual architecture >= compute_90: what cudaFuncAttributes.ptxVersion reports for loaded
    code, the launcher's test. Neither the GPU's compute capability nor the code's binary version
    would do: an sm_90 cubin compiled from compute_80 (as the driver JITs compute_80 PTX on an
    H100) holds the trap. Every arch from sm_90 on (sm_100 and sm_120 included) has the body."""
    rows = []
    for build, found in builds.items():
        assert found, f"{build}: no image of fused_loss.cu found"
        for image in found:
            rows.append(f"{build:<28} {image}")
            assert image.cluster_body == (image.virtual >= cluster_arch()), rows[-1]
    print("\n" + "\n".join(rows))
    jit_like = [i for i in builds["sm_80 + compute_80->sm_90"] if i.arch == 90]
    assert [(i.virtual, i.cluster_body) for i in jit_like] == [(80, False)]
    new = [i for i in builds["every arch"] if i.arch >= cluster_arch()]
    assert {f"sm_{i.arch}" for i in new} == {a for a in _built_archs() if int(a[3:]) >= 90}
    assert all(i.cluster_body for i in new)


@needs_nvcc
@pytest.mark.slow
def test_launcher_picks_the_cluster_kernel_only_where_the_loaded_code_has_it(builds, stub_runtime):
    """launch_fused_token_loss (the real host code, against the stub runtime) for every build on
    every GPU of GPUS that can run it, told what the driver reports for the image it loads there
    (tests/cuda_images.loaded_image): the cluster kernel iff the GPU launches clusters and that
    image's cluster kernel has its body, else the two-sweep kernel; never the trap; rows too
    long for shared memory on the two-sweep kernel; each launch on the stream it was given. The
    issue's case (8.0+PTX on an H100: binary version 90, the trap) is among them."""
    commands, cases = [], []
    for build, found in builds.items():
        for gpu, (cluster_launch, optin) in GPUS.items():
            loaded = loaded_image(found, gpu)
            if loaded is None:
                continue  # no image runs there: nothing to choose
            device, body = len(cases), int(loaded.image.cluster_body)
            commands.append(
                f"device {device} {cluster_launch} {optin} {loaded.ptx_version} "
                f"{loaded.binary_version} {body}"
            )
            commands += [f"launch {device} {dtype} 151936" for dtype in (BF16, BF16, FP32, FP16)]
            commands += [f"launch {device} {BF16} {1 << 22}", f"info {device} {BF16}"]
            cases.append((build, gpu, loaded, bool(cluster_launch) and loaded.image.cluster_body))
    per_case = len(commands) // len(cases)
    results = stub_runtime(commands)
    assert len(results) == len(commands)
    failures = []
    for i, (build, gpu, loaded, cluster) in enumerate(cases):
        _, *launches, too_long, info = results[i * per_case : (i + 1) * per_case]
        label = (
            f"{build} on sm_{gpu} (ptxVersion {loaded.ptx_version}, binaryVersion "
            f"{loaded.binary_version}, cluster kernel {'body' if cluster else 'trap/none'})"
        )
        print(f"{label}: {launches[0]['kernel']}")
        want = "cluster" if cluster else "two_sweep"
        for launch in launches:
            if launch["kernel"] != want or launch["trapped"] or launch["error"]:
                failures.append(f"{label}: wanted {want}, got {launch}")
        if too_long["kernel"] != "two_sweep" or too_long["error"]:
            failures.append(f"{label}, V = 2^22: {too_long}")
        if not all(launch["stream_ok"] for launch in [*launches, too_long]):
            failures.append(f"{label}: a launch not on the stream it was given")
        versions = (info["available"], info["ptx_version"], info["binary_version"])
        if versions != (cluster, loaded.ptx_version, loaded.binary_version):
            failures.append(f"{label}: query_cluster_kernel says {info}")
    hazard = [c for c in cases if c[0] == "8.0+PTX" and c[1] == 90]
    assert [(c[2].binary_version, c[2].image.cluster_body) for c in hazard] == [(90, False)]
    assert not failures, "\n".join(failures)


@needs_nvcc
@pytest.mark.slow
def test_cluster_kernel_attribute_set_once_per_device_at_its_maximum(stub_runtime):
    """The cluster kernel's dynamic shared memory limit is raised once per device and dtype, to
    the opt-in maximum less its static shared memory, whatever the vocab of later launches; never
    where its code is the trap. FUSEDRL_CUDA_ONE_READ=0 selects the two-sweep kernel."""
    optin = 232448
    commands = [
        f"device 0 1 {optin} 90 90 1",  # H100, sm_90 code
        f"device 1 1 {optin} 90 90 1",  # a second H100
        f"device 2 1 {optin} 80 90 0",  # H100, 8.0+PTX
        *(f"launch 0 {BF16} {vocab}" for vocab in (1000, 151936, 50000, 262144, 151936)),
        *(f"launch 0 {FP32} {vocab}" for vocab in (151936, 1000)),
        *(f"launch 1 {BF16} 151936" for _ in range(3)),
        *(f"launch 2 {BF16} 151936" for _ in range(3)),
        "env 0",
        f"launch 0 {BF16} 151936",
        "env -",
        f"launch 0 {BF16} 151936",
        f"info 0 {BF16}",
        f"info 2 {BF16}",
    ]
    results = stub_runtime(commands)[3:]
    bf16, fp32, second, ptx80 = results[:5], results[5:7], results[7:10], results[10:13]
    env_off, env_on, info, info_ptx80 = results[14], results[16], results[17], results[18]
    maximum = optin - STUB_STATIC_SMEM
    for launch in bf16 + fp32 + second:
        assert launch["kernel"] == "cluster" and launch["max_dynamic_smem"] == maximum, launch
    # The stub counts every cudaFuncSetAttribute call on a device: one per dtype launched there.
    assert [launch["attribute_sets"] for launch in bf16 + fp32] == [1] * 5 + [2] * 2
    assert [launch["attribute_sets"] for launch in second] == [1] * 3
    assert all(r["kernel"] == "two_sweep" and r["attribute_sets"] == 0 for r in ptx80), ptx80
    assert env_off["kernel"] == "two_sweep" and env_on["kernel"] == "cluster"
    assert env_on["attribute_sets"] == 2
    assert info["available"] and info["attribute_sets"] == 1 and info["max_dynamic_smem"] == maximum
    assert not info_ptx80["available"] and info_ptx80["attribute_sets"] == 0


@needs_nvcc
@pytest.mark.slow
def test_soft_capped_launches_take_their_own_instantiations(stub_runtime):
    """A launch with a soft cap (TokenLossParams.read.cap != 0) runs the kCap instantiation of
    the kernel it chooses, by the same rule; the capped cluster kernel gets its own shared-memory
    attribute, set once (its state is per dtype and cap), so that its launch fits."""
    optin = 232448
    commands = [
        f"device 0 1 {optin} 90 90 1",  # H100, sm_90 code
        "device 1 0 166912 80 80 0",  # A100
        f"launch 0 {BF16} 151936",
        *(f"launch 0 {BF16} 151936 0.0333" for _ in range(2)),
        f"launch 0 {FP32} 151936 0.0333",
        f"launch 0 {BF16} {1 << 22} 0.0333",  # rows too long for shared memory
        f"launch 1 {BF16} 151936 0.0333",
    ]
    plain, *capped, fp32, too_long, a100 = stub_runtime(commands)[2:]
    assert plain["kernel"] == "cluster" and not plain["capped"] and plain["attribute_sets"] == 1
    maximum = optin - STUB_STATIC_SMEM
    for launch in capped + [fp32]:
        assert launch["kernel"] == "cluster" and launch["capped"] and not launch["error"], launch
        assert launch["max_dynamic_smem"] == maximum, launch
    assert [launch["attribute_sets"] for launch in capped + [fp32]] == [2, 2, 3]
    for launch in (too_long, a100):
        assert launch["kernel"] == "two_sweep" and launch["capped"] and not launch["error"], launch


@needs_nvcc
@pytest.mark.slow
def test_no_cluster_fits_takes_the_two_sweep_kernel(stub_runtime):
    """Where the occupancy query says no cluster fits at once (an MPS or green-context SM limit),
    the launch is the two-sweep kernel's, without an error, and the next launch that fits takes
    the cluster kernel again."""
    commands = [
        "device 0 1 232448 90 90 1",  # H100, sm_90 code
        "clusters 0 0",
        f"launch 0 {BF16} 151936",
        f"launch 0 {BF16} 151936 0.0333",
        "clusters 0 3",
        f"launch 0 {BF16} 151936",
    ]
    _, _, plain, capped, _, fits = stub_runtime(commands)
    for launch in (plain, capped):
        assert launch["kernel"] == "two_sweep" and not launch["error"], launch
    assert capped["capped"]
    assert fits["kernel"] == "cluster" and fits["cluster"] == 8 and not fits["error"], fits


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


def test_the_module_init_imports_as_fusedrl_C(tmp_path):
    """bindings.cpp's module init (a plain CPython one, no pybind11), built as setup.py names
    it (TORCH_EXTENSION_NAME=_C) and imported: `import fusedrl._C` finds PyInit__C."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    text = (CSRC / "bindings.cpp").read_text()
    source = tmp_path / "module_init.cpp"
    source.write_text("#include <Python.h>\n" + text[text.index("// Importable as fusedrl._C") :])
    library = tmp_path / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [
        cxx,
        "-shared",
        "-fPIC",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-DTORCH_EXTENSION_NAME=_C",
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(library),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    check = "import _C; assert _C.__name__ == '_C' and 'torch.ops.fusedrl' in _C.__doc__"
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_cuda_op_schema_matches_the_triton_op():
    """Both backends run through one driver: the CUDA adapter (`kernels.cuda.by_name`) passes
    a TokenLossArgs' CUDA_FIELDS by name, so the C++ schema has exactly those, each of the type
    kernels/token_args.py gives it (or stricter: a tensor the driver always gives it)."""
    text = (CSRC / "bindings.cpp").read_text()
    block = re.search(r"#define FUSEDRL_FUSED_ARGS(.*?)\n\n", text, re.S).group(1)
    row_read = re.search(r'#define FUSEDRL_ROW_READ "([^"]*)"', text).group(1)
    coef = re.search(r'#define FUSEDRL_ENTROPY_COEF "([^"]*)"', text).group(1)
    cpp = ", ".join(["".join(re.findall(r'"([^"]*)"', block)), row_read, coef]).split(", ")
    cpp = [part.split("=")[0].split() for part in cpp]
    assert [name for _, name in cpp] == list(CUDA_FIELDS)
    ours = dict(reversed(part.split("=")[0].split()) for part in op_schema().split(", "))
    for kind, name in cpp:
        assert kind in (ours[name], ours[name].rstrip("?")), (name, kind, ours[name])
    # ... and every row op takes the Triton ops' keywords for per-token temperatures and a cap
    from fusedrl import triton_backend  # noqa: F401  (defines the Triton ops)

    assert row_read == "Tensor? row_temps=None, float? cap=None"
    for op in ("logprobs_fwd", "logits_grad", "fused_token_loss", "fused_token_loss_inplace"):
        names = {a.name for a in getattr(torch.ops.fusedrl, op).default._schema.arguments}
        assert {"row_temps", "cap"} <= names, op
    for op in (
        "cuda_logprobs_fwd",
        "cuda_logits_grad",
        "cuda_fused_token_loss",
        "cuda_fused_token_loss_inplace",
    ):
        assert re.search(rf'"{op}\(.*?FUSEDRL_ROW_READ', text, re.S), op


def test_the_cuda_adapter_refuses_what_its_op_would_drop():
    """`by_name` passes CUDA_FIELDS alone: an argument outside them at anything but the value
    the op assumes (a grad_scale, the sums' mask or constant bounds, a sum of p^2 buffer) raises
    instead of being lost; the driver's no-sums arguments pass."""
    from fusedrl.kernels.cuda import by_name
    from fusedrl.kernels.token_args import LossVariant, TokenLossArgs

    seen = []
    fused, inplace = by_name(lambda *a, **k: seen.append(k), lambda *a, **k: seen.append(k))
    rows = torch.zeros(1, 3)
    plain = TokenLossArgs(rows.long(), rows > 0, rows, LossVariant(), rows)
    fused(rows, rows, plain)
    inplace(rows, plain)
    assert [set(k) for k in seen] == [set(CUDA_FIELDS)] * 2
    for dropped in (
        {"grad_scale": 0.5},
        {"grad_scale_tensor": torch.tensor(0.5)},
        {"mask": rows > 0},
        {"sum_sq": rows},
        {"variant": LossVariant(low_bound=0.8, high_bound=1.2)},
        {"variant": LossVariant(agg_from_mask=True)},
    ):
        with pytest.raises(ValueError, match="keeps no sums"):
            fused(rows, rows, plain._replace(**dropped))


def test_the_cuda_adapter_refuses_a_number_newer_than_the_extension(monkeypatch):
    """A number of the loss that csrc/ does not take yet (here: `delta`, as if it were new) is
    refused by name where it is set, and passes at its default: a new LossVariant field needs
    no line in the CUDA adapter to be safe."""
    from fusedrl.kernels import cuda
    from fusedrl.kernels.token_args import LossVariant, TokenLossArgs

    monkeypatch.setattr(cuda, "CUDA_FIELDS", tuple(n for n in CUDA_FIELDS if n != "delta"))
    cuda._unknown_numbers.cache_clear()
    fused, _ = cuda.by_name(lambda *a, **k: None, lambda *a, **k: None)
    rows = torch.zeros(1, 3)
    plain = TokenLossArgs(rows.long(), rows > 0, rows, LossVariant(), rows)
    fused(rows, rows, plain)  # delta at its default: nothing lost
    with pytest.raises(NotImplementedError, match="does not implement delta"):
        fused(rows, rows, plain._replace(variant=LossVariant(delta=2.0)))
    cuda._unknown_numbers.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def _top_level_split(text: str, opener: str) -> list[list[str]]:
    """The comma-separated arguments of every `opener(...)` call in C++ `text` (string literals
    and nested brackets respected)."""
    calls, start = [], 0
    while (start := text.find(opener + "(", start)) >= 0:
        args, current, depth, quoted, i = [], "", 1, False, start + len(opener) + 1
        while depth:
            c = text[i]
            if quoted:
                quoted = c != '"' or text[i - 1] == "\\"
            elif c == '"':
                quoted = True
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            if depth and not quoted and depth == 1 and c == ",":
                args.append(current.strip())
                current = ""
            elif depth:
                current += c
            i += 1
        calls.append([*args, current.strip()])
        start = i
    return calls


# Message parts of the bindings' checks that format no number (a string, a name, a device, a
# dtype); numbers and shapes go through the bindings' num() / dims() (std::to_string).
_TEXT_PARTS = {
    "what",
    "cudaGetErrorString(err)",
    "name",
    "type",
    "t.device()",
    "logits.device()",
    "labels.scalar_type()",
    "loss",
    "*kl",
    "device",
}


def test_bindings_format_no_number_through_an_ostream():
    """Found on the H100 (bench/results/...-cuda-bad-argument-segfault-gdb.txt): an error message
    that streamed a shape (`t.sizes()`) through c10::str segfaulted in the extension's inlined
    ostream<<long, built by a compiler newer than the process's libstdc++. Every check's message
    is made of string literals, known text parts and num()/dims() calls."""
    checks = _top_level_split((CSRC / "bindings.cpp").read_text(), "TORCH_CHECK")
    assert len(checks) >= 15
    for args in checks:
        for part in args[1:]:
            ok = part.startswith('"') or part in _TEXT_PARTS or re.match(r"(num|dims)\(", part)
            assert ok, f"TORCH_CHECK message part {part!r} formats through an ostream: {args}"


def test_load_without_gpu_raises_clearly():
    from fusedrl.kernels import cuda

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        cuda.load()


def test_the_cuda_backend_takes_the_two_row_kernels_from_triton(monkeypatch):
    """csrc/ has no two-row kernel: backend="cuda" runs the exact KL with Triton's (as it does the
    sampled-set select) where triton is installed, and says it has none where it is not."""
    import importlib.util

    from fusedrl import cuda_backend, triton_backend

    assert cuda_backend._from_triton("TWO_ROWS") is triton_backend.TWO_ROWS
    assert cuda_backend._from_triton("sampled_set") is triton_backend.sampled_set
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert cuda_backend._from_triton("TWO_ROWS") is None
    assert cuda_backend._from_triton("sampled_set") is None
