"""The code images of the CUDA extension's fatbinary (cubins and PTX), what each holds of the
one-read cluster kernel, and which image a CUDA driver loads on a given GPU.

Shared by tests/test_cuda_build.py (objects compiled on the CPU machine) and tests/test_gpu.py (the
extension a GPU process loaded). Only cuobjdump is needed: no GPU, no driver.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
CLUSTER_KERNEL = "fused_token_loss_cluster_kernel"


def cluster_arch() -> int:
    """FUSEDRL_CLUSTER_ARCH of csrc/fused_loss.cu: the oldest virtual architecture whose code has
    the cluster kernel's body (the kernel's #if and its host-side choice both use it)."""
    text = (CSRC / "fused_loss.cu").read_text()
    return int(re.search(r"#define FUSEDRL_CLUSTER_ARCH (\d+)", text).group(1))


def find_cuobjdump(nvcc: str | None = None) -> str | None:
    """The toolkit's cuobjdump (beside the real nvcc, which may hide behind a wrapper script),
    else one on PATH, else the one Triton ships; None if there is none."""
    candidates = []
    if nvcc is not None:
        candidates.append(Path(nvcc).resolve().parent / "cuobjdump")
        text = Path(nvcc).resolve().read_bytes()[:4096]
        if match := re.search(rb"exec\s+(\S+/)nvcc\b", text):
            candidates.append(Path(match.group(1).decode()) / "cuobjdump")
    if shutil.which("cuobjdump"):
        candidates.append(Path(shutil.which("cuobjdump")))
    if importlib.util.find_spec("triton") is not None:
        triton_dir = Path(importlib.util.find_spec("triton").origin).parent
        candidates.append(triton_dir / "backends" / "nvidia" / "bin" / "cuobjdump")
    return next((str(path) for path in candidates if path.exists()), None)


@dataclass(frozen=True)
class Image:
    kind: str  # "cubin" (SASS) or "ptx"
    arch: int  # a cubin's SASS target, or the PTX's virtual architecture (90 = sm_90)
    virtual: int  # the virtual architecture its code was compiled from: __CUDA_ARCH__ / 10
    cluster_body: bool  # the cluster kernel has its body here (else it is the __trap())


def _run(cuobjdump: str, flag: str, path: Path) -> str:
    return subprocess.run(
        [cuobjdump, flag, str(path)], capture_output=True, text=True, check=True
    ).stdout


def _one(values: set, what: str):
    assert len(values) == 1, f"{what}: expected one value for every dtype, got {values}"
    return values.pop()


def _ptx_entry_body(text: str, start: int) -> list[str]:
    """The statements of the PTX function whose header starts at `start` (brace-matched)."""
    open_at = text.index("{", text.index(")", start))
    depth, i = 0, open_at
    while True:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    lines = (line.strip() for line in text[open_at + 1 : i].splitlines())
    return [line for line in lines if line and not line.startswith("//") and line not in ("{", "}")]


def images(path: Path, cuobjdump: str) -> list[Image]:
    """Every image of the fatbinary(ies) in an object file or shared library.

    A cubin's virtual architecture is the EF_CUDA_VIRTUAL_SM of its SASS header; its cluster
    kernel has the body when it can exit (the trap version is BPT.TRAP and a branch to itself).
    PTX is its own virtual architecture; the trap version's body is `trap; ret;`."""
    found = []
    for section in _run(cuobjdump, "-sass", path).split("Fatbin elf code:")[1:]:
        arch = int(re.search(r"arch = sm_(\d+)", section).group(1))
        kernels = [
            text
            for text in re.split(r"\n\s*Function : ", section)[1:]
            if CLUSTER_KERNEL in text.split("\n", 1)[0]
        ]
        if not kernels:
            continue  # a fatbinary of another translation unit
        virtual = {int(v) for k in kernels for v in re.findall(r"VIRTUAL_SM\(EF_CUDA_SM(\d+)", k)}
        body = {bool(re.search(r"\bEXIT\b", k)) for k in kernels}
        found.append(
            Image("cubin", arch, _one(virtual, f"sm_{arch} virtual arch"), _one(body, "body"))
        )
    for section in _run(cuobjdump, "-ptx", path).split("Fatbin ptx code:")[1:]:
        entries = list(re.finditer(rf"\.entry\s+\S*{CLUSTER_KERNEL}\S*\(", section))
        if not entries:
            continue
        arch = int(re.search(r"\.target\s+sm_(\d+)", section).group(1))
        body = {
            any(s not in ("trap;", "ret;") for s in _ptx_entry_body(section, m.start()))
            for m in entries
        }
        found.append(Image("ptx", arch, arch, _one(body, f"compute_{arch} body")))
    return found


@dataclass(frozen=True)
class Loaded:
    image: Image
    ptx_version: int  # what cudaFuncGetAttributes reports for the loaded code
    binary_version: int


def loaded_image(found: list[Image], device_arch: int) -> Loaded | None:
    """The image a CUDA driver runs on a GPU of compute capability `device_arch` (90 = 9.0), by
    the compatibility rules of the CUDA programming guide: a cubin runs on GPUs of its major
    version and a minor version at least its own, the newest such cubin first; else the newest PTX
    of a virtual architecture no newer than the GPU's, JIT-compiled for it (its binary version is
    then the GPU's, its PTX version the PTX's). None: nothing runs there."""
    major = device_arch // 10
    cubins = [
        i for i in found if i.kind == "cubin" and i.arch // 10 == major and i.arch <= device_arch
    ]
    if cubins:
        best = max(cubins, key=lambda i: i.arch)
        return Loaded(best, best.virtual, best.arch)
    ptx = [i for i in found if i.kind == "ptx" and i.arch <= device_arch]
    if ptx:
        best = max(ptx, key=lambda i: i.arch)
        return Loaded(best, best.virtual, device_arch)
    return None
