"""Every Triton launch runs on the device of the tensors it reads, not on the current device.

Triton launches on the current CUDA device (and that device's current stream), while the
launchers size their grids from the tensor's device (`persistent_programs`). With logits on
cuda:1 and device 0 current, the kernel would run on device 0 with pointers into device 1: an
illegal address, or silent peer traffic. torch's own ops switch to their inputs' device; each
launcher does it here, through this one guard (tests/test_launchers.py checks that every launch
happens inside it, so it is the only place to change).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes `device` current for the launch (and restores the previous one after). A no-op off
    CUDA: CPU tensors only reach a kernel through the interpreter, which has no device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def launches_on(param: str) -> Callable[[F], F]:
    """Decorates a launcher: it runs under `device_guard` of its tensor argument `param`."""

    def decorate(launcher: F) -> F:
        names = list(inspect.signature(launcher).parameters)
        if param not in names:  # at import, not on a GPU at the first call
            raise TypeError(f"{launcher.__qualname__} has no argument {param!r} to launch on")
        position = names.index(param)

        @functools.wraps(launcher)
        def on_device(*args, **kwargs):
            tensor = args[position] if position < len(args) else kwargs[param]
            if tensor.device.type != "cuda":  # (no device to switch: a context costs 0.5 us)
                return launcher(*args, **kwargs)
            # `device_guard` is looked up at each call, so that a test can watch it.
            with device_guard(tensor.device):
                return launcher(*args, **kwargs)

        return on_device  # type: ignore[return-value]

    return decorate
