"""Build script. Everything declarative lives in pyproject.toml; this file only adds the optional
CUDA extension (csrc/ -> fusedrl._C), built when FUSEDRL_BUILD_CUDA=1 so that a plain
`pip install` never needs nvcc."""

import os
from pathlib import Path

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("FUSEDRL_BUILD_CUDA", "0") == "1":
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(str(p) for p in Path("csrc").glob("*.c*") if p.suffix in (".cpp", ".cu"))
    if not sources:
        raise RuntimeError("FUSEDRL_BUILD_CUDA=1 but csrc/ has no .cpp/.cu sources to build")
    ext_modules.append(
        CUDAExtension(
            name="fusedrl._C",
            sources=sources,
            include_dirs=[str(Path("csrc").resolve())],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
    )
    cmdclass["build_ext"] = BuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
