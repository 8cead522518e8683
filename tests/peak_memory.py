"""Peak host memory of one call, measured in a fresh process.

The script handed to `peak_extra_bytes` builds its inputs, then calls `measure(fn)`; `measure`
resets the kernel's high-water mark (`/proc/self/clear_refs` 5) once the inputs exist and prints
VmHWM after `fn()` minus VmRSS before it. Resetting matters: building the inputs can peak higher
than the call itself (randn in bf16 passes through fp32), and ru_maxrss would hide the call under
that earlier peak. Kernels without a resettable peak fall back to ru_maxrss, which can only
undercount.

glibc's malloc raises its mmap threshold each time a large mmapped block is freed, so that a
later block of that size may come from the heap instead and stay resident after it is freed: the
same call then measured 138 or 250 MiB from one run to the next (and 278 under `make test`'s
load, over a 256 MiB bound). A fixed threshold (MALLOC_MMAP_THRESHOLD_) keeps every large block
mmapped, returned when freed: 123 MiB, five runs alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MEASURE = """
import json as _json, resource as _resource

def _status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

def measure(fn):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before, peak = _status_kib("VmRSS"), lambda: _status_kib("VmHWM")
    except OSError:
        peak = lambda: _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
        before = peak()
    result = fn()
    print(_json.dumps({"extra_bytes": (peak() - before) * 1024}))
    return result
"""


def peak_extra_bytes(script: str, *args: str, timeout: int = 600) -> int:
    """Run `script` (which calls `measure(fn)` once) in a fresh process; the call's extra bytes."""
    return peaks_extra_bytes(script, *args, timeout=timeout)[-1]


def peaks_extra_bytes(script: str, *args: str, timeout: int = 600) -> list[int]:
    """Run `script` in a fresh process; the extra bytes of each of its `measure(fn)` calls, in
    order (each resets the high-water mark first, so a call is measured from its own start)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    result = subprocess.run(
        [sys.executable, "-c", MEASURE + script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env=env,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"extra_bytes"')]
    return [json.loads(line)["extra_bytes"] for line in lines]
