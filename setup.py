"""Build script. Everything declarative lives in pyproject.toml (the version, the packages, csrc/
shipped as the package data `fusedrl/csrc/`); this file only adds the optional CUDA extension
(csrc/ -> fusedrl._C), built when FUSEDRL_BUILD_CUDA=1 so that a plain `pip install` never needs
nvcc:

    FUSEDRL_BUILD_CUDA=1 pip wheel --no-build-isolation .   # or pip install --no-build-isolation .

It needs the CUDA torch the extension will run with, and nvcc: the extension is built against that
torch's headers and ABI, hence `--no-build-isolation` (pip's isolated build environment has no
torch, and would install whichever torch PyPI has, not yours). TORCH_CUDA_ARCH_LIST picks the
architectures (torch's default: the visible GPU's, else a list of its own)."""

import os
from pathlib import Path

from setuptools import setup

CSRC = Path("csrc")  # relative: setuptools wants sources relative to this file's folder

ext_modules = []
cmdclass = {}
if os.environ.get("FUSEDRL_BUILD_CUDA", "0") == "1":
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as exc:
        raise RuntimeError(
            "FUSEDRL_BUILD_CUDA=1 builds fusedrl._C against the installed torch, and this build "
            f"environment has none ({exc}): install a CUDA torch, then build with "
            "`pip wheel --no-build-isolation .` (or `pip install --no-build-isolation .`)"
        ) from exc
    if torch.version.cuda is None or CUDA_HOME is None:
        raise RuntimeError(
            f"FUSEDRL_BUILD_CUDA=1 needs a CUDA build of torch and the CUDA toolkit (nvcc): torch "
            f"{torch.__version__} has CUDA {torch.version.cuda}, CUDA_HOME is {CUDA_HOME}"
        )
    sources = sorted(str(p) for p in CSRC.glob("*.c*") if p.suffix in (".cpp", ".cu"))
    if not sources:
        raise RuntimeError("FUSEDRL_BUILD_CUDA=1 but csrc/ has no .cpp/.cu sources to build")
    ext_modules.append(
        CUDAExtension(
            name="fusedrl._C",
            sources=sources,
            include_dirs=[str(CSRC.resolve())],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
    )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
