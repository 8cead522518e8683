"""Loader of the optional CUDA extension (csrc/ -> ops `torch.ops.fusedrl.cuda_*`).

`load()` returns the ops, from the first of:
1. `fusedrl._C`, built by `FUSEDRL_BUILD_CUDA=1 pip install --no-build-isolation .` (or `-e .`,
   or a wheel built the same way);
2. a JIT build of the sources (`sources()`) through `torch.utils.cpp_extension.load` into a cache
   directory (`$FUSEDRL_CUDA_CACHE`, default ~/.cache/fusedrl/cuda-<torch version>), reused
   afterwards.
Without a CUDA device (or without nvcc for the JIT build) it raises a RuntimeError that says so.

The sources travel with the package: a wheel or sdist install has them in `fusedrl/csrc/` (package
data, pyproject.toml maps the checkout's csrc/ there); a checkout (editable install) has them in
csrc/ beside kernels/. `CSRC` is the first of the two that exists.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

from .token_args import CUDA_FIELDS, LossVariant


def _find_csrc() -> Path:
    installed = Path(importlib.util.find_spec("fusedrl").origin).parent / "csrc"  # the wheel's
    checkout = Path(__file__).resolve().parents[1] / "csrc"  # <checkout>/kernels/../csrc
    for path in (installed, checkout):
        if path.is_dir():
            return path
    return installed  # neither: the error messages name where the package should have them


CSRC = _find_csrc()
OP_NAMES = (
    "cuda_logprobs_fwd",
    "cuda_logits_grad",
    "cuda_fused_token_loss",
    "cuda_fused_token_loss_inplace",
    "cuda_cluster_kernel_info",
)
# The fields of cuda_cluster_kernel_info (csrc/fused_loss.h, ClusterKernelInfo).
CLUSTER_INFO_FIELDS = (
    "available",
    "ptx_version",
    "binary_version",
    "max_dynamic_smem",
    "attribute_sets",
)


def sources() -> list[Path]:
    """The extension's .cpp/.cu files (their headers sit beside them, in `CSRC`)."""
    if not CSRC.is_dir():
        raise RuntimeError(f"backend='cuda': the CUDA sources are missing (looked in {CSRC})")
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".cu"))


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "fusedrl" / f"cuda-{torch.__version__.replace('+', '-')}"
    path = Path(os.environ.get("FUSEDRL_CUDA_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _registered() -> bool:
    return all(hasattr(torch.ops.fusedrl, name) for name in OP_NAMES)


@functools.cache
def load(verbose: bool = False):
    """The extension's ops, `torch.ops.fusedrl` (built or loaded once per process, their fakes
    registered). `fusedrl.cuda_backend` makes the driver's `FusedOps` of them."""
    if not torch.cuda.is_available():
        raise RuntimeError("backend='cuda' needs a CUDA device; use backend='triton' or 'torch'")
    if not _registered():
        try:
            import fusedrl._C  # noqa: F401  (prebuilt: registers the ops on import)
        except ImportError:
            _jit_build(verbose)
    _register_fakes()
    return torch.ops.fusedrl


def by_name(fused_op, fused_op_inplace) -> tuple:
    """The extension's two fused ops (csrc/bindings.cpp) as `FusedOps.fused_token_loss` and
    `fused_token_loss_inplace`: each takes a TokenLossArgs and passes its CUDA_FIELDS to the op
    by name. (The extension keeps no sums: the driver gives it tensor bounds, and the
    aggregation weights already times grad_scale, `fused_backend.fused_token_args`.)"""

    def fused_token_loss(logits, grad, args):
        _check_takes(args)
        return fused_op(logits, grad, **args.keywords(CUDA_FIELDS))

    def fused_token_loss_inplace(logits, args):
        _check_takes(args)
        return fused_op_inplace(logits, **args.keywords(CUDA_FIELDS))

    return fused_token_loss, fused_token_loss_inplace


# The variant's fields the op drops because the driver hands it their effect otherwise (the
# bounds as tensors, the aggregation weights made), checked by `_check_takes` itself.
_DROPPED_BY_DESIGN = ("agg_from_mask", "low_bound", "high_bound")


@functools.lru_cache(maxsize=256)
def _unknown_numbers(variant: LossVariant) -> tuple[str, ...]:
    """The variant's fields that csrc/ does not take and that are not at their defaults: a
    number of the loss newer than the extension, which it would silently leave out."""
    defaults = LossVariant._field_defaults
    return tuple(
        name
        for name in LossVariant._fields
        if name not in CUDA_FIELDS
        and name not in _DROPPED_BY_DESIGN
        and getattr(variant, name) != defaults[name]
    )


def _check_takes(args) -> None:
    """The fields outside CUDA_FIELDS must be at what the op assumes: one it dropped (a
    grad_scale, the sums' mask or constant bounds, a sum of p^2 buffer, a number of the loss it
    does not know) would be silently lost."""
    variant = args.variant
    unknown = _unknown_numbers(variant)
    if unknown:
        raise NotImplementedError(
            f"backend='cuda': the CUDA extension does not implement {', '.join(unknown)} "
            f"(csrc/ takes {', '.join(n for n in CUDA_FIELDS if n in LossVariant._fields)}); "
            "use backend='triton' or 'torch'"
        )
    if (
        args.mask is not None
        or args.sum_sq is not None
        or args.grad_scale_tensor is not None
        or args.grad_scale != 1.0
        or variant.agg_from_mask
        or variant.low_bound != 0.0
        or variant.high_bound != 0.0
    ):
        raise ValueError(
            "the CUDA extension's fused op keeps no sums: it takes no mask, grad_scale, constant "
            "ratio bounds or sum_sq buffer (fused_backend.fused_token_args(sums=False) builds "
            "its arguments)"
        )


def cluster_kernel_info(device=None, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Which fused kernel `backend="cuda"` can run on `device` (default: the current one) for
    logits of `dtype`: `available` when the loaded code of the one-read cluster kernel was
    compiled for compute_90+ (`ptx_version`, `binary_version`: what the driver reports for that
    code) and the GPU launches clusters; rows whose slices fit `max_dynamic_smem` bytes then take
    it, the others (and every row where it is not available) the two-sweep kernel.
    `attribute_sets` counts the shared-memory attribute settings made for it (one per device)."""
    load()
    device = torch.device("cuda" if device is None else device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    values = torch.ops.fusedrl.cuda_cluster_kernel_info(device, dtype)
    info = dict(zip(CLUSTER_INFO_FIELDS, values, strict=True))
    info["available"] = bool(info["available"])
    return info


def cluster_kernel_available(device=None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the one-read cluster kernel can run on `device` (see `cluster_kernel_info`)."""
    return cluster_kernel_info(device, dtype)["available"]


@functools.cache
def _register_fakes() -> None:
    """Shape functions (torch.compile, FakeTensor) of the extension's four ops, registered
    next to their loading (csrc/bindings.cpp defines them): every output a [B, T] fp32 tensor
    shaped like the labels; the fused ops' third output, the programs' sums, is the Triton
    op's alone."""

    def rows_like(labels: torch.Tensor) -> torch.Tensor:
        return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)

    @torch.library.register_fake("fusedrl::cuda_logprobs_fwd")
    def _(logits, labels, valid, temperature, *row_temps, **cap):
        return rows_like(labels), rows_like(labels), rows_like(labels)

    @torch.library.register_fake("fusedrl::cuda_logits_grad")
    def _(logits, labels, lse, entropy, dlogp, dentropy, temperature, out, *row_temps, **cap):
        return None

    @torch.library.register_fake("fusedrl::cuda_fused_token_loss")
    def _(logits, grad, labels, *per_token_and_variant, **row_temps):  # (token_args.CUDA_FIELDS)
        return rows_like(labels), rows_like(labels)

    @torch.library.register_fake("fusedrl::cuda_fused_token_loss_inplace")
    def _(logits, labels, *per_token_and_variant, **row_temps):
        return rows_like(labels), rows_like(labels)


def _jit_build(verbose: bool) -> None:
    from torch.utils.cpp_extension import load as cpp_load

    if not CSRC.is_dir():
        raise RuntimeError(f"backend='cuda': no prebuilt fusedrl._C and no sources at {CSRC}")
    try:
        cpp_load(
            name="fusedrl_cuda",
            sources=[str(p) for p in sources()],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            build_directory=str(cache_dir()),
            is_python_module=False,
            verbose=verbose,
        )
    except (OSError, RuntimeError) as exc:
        raise RuntimeError(
            f"backend='cuda': building the CUDA extension from {CSRC} failed ({exc}); "
            "prebuild it with FUSEDRL_BUILD_CUDA=1 pip install --no-build-isolation ., or use "
            "backend='triton'"
        ) from exc
