"""`backend="cuda"` on CPU tensors: the CUDA extension's own row functions, built for the host.

tests/cuda_host_kernels.cu runs csrc/fused_loss.cu's two-sweep kernels (their row functions, as
one block of one thread) on the CPU. `HostKernels` wraps it as the four ops of a fused backend,
converting the arguments as csrc/bindings.cpp does (its loss and KL codes are read from
bindings.cpp itself), so that `fusedrl.policy_loss(..., backend="cuda")` drives the extension's
kernel code through the same Python path as on a GPU (`fusedrl.fused_backend`) and the tests can
hold it to `fusedrl.reference`. The `cuda_on_the_host` fixture of tests/conftest.py routes
backend="cuda" here; `CUDA_ON_THE_HOST` is the parameter that asks for it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
HARNESS = Path(__file__).with_name("cuda_host_kernels.cu")
NVCC = shutil.which("nvcc")


def build(cache_root: Path) -> Path:
    """The harness, compiled once per state of its sources into `cache_root` (shared by the
    xdist workers and later runs: the first builds it under a lock, the others reuse it)."""
    digest = hashlib.sha256()
    for path in (HARNESS, CSRC / "fused_loss.cu", CSRC / "fused_loss.h"):
        digest.update(path.read_bytes())
    folder = cache_root / f"cuda-host-kernels-{digest.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "cuda_host_kernels"
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            # The device half is built (as PTX alone: no ptxas) but never runs.
            cmd = [
                NVCC,
                "-O2",
                "-std=c++17",
                "-Werror",
                "all-warnings",
                "-I",
                str(CSRC),
                "-gencode",
                "arch=compute_80,code=compute_80",
                str(HARNESS),
                "-o",
                f"{exe}.tmp",
            ]
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, result.stderr[-4000:]
            os.replace(f"{exe}.tmp", exe)
    return exe


def _codes(function: str) -> dict[str, int]:
    """{name: code} of one of bindings.cpp's string -> int mappings (loss_code, kl_code)."""
    text = (CSRC / "bindings.cpp").read_text()
    body = re.search(rf"int {function}\(.*?\n}}\n", text, re.S).group(0)
    # the codes are fused_loss.h's enumerators (LossCode, KlCode), by name
    header = (CSRC / "fused_loss.h").read_text()
    values = {name: int(value) for name, value in re.findall(r"\b(k\w+) = (\d+)", header)}
    codes = {}
    for condition, code in re.findall(r"if \((.*?)\) return (\w+);", body):
        for name in re.findall(r'"([^"]+)"', condition):
            codes[name] = values[code] if code in values else int(code)
    assert codes, function
    return codes


class HostKernels:
    """The four ops of `fusedrl.fused_backend.FusedOps`, signatures as csrc/bindings.cpp's."""

    def __init__(self, exe: Path):
        self.exe = exe
        self.loss_codes = _codes("loss_code")
        self.kl_codes = _codes("kl_code")
        self.calls: list[str] = []  # the ops run, in order (the tests check which path ran)

    def ops(self):
        """The FusedOps that `fusedrl.cuda_backend` makes of the extension's ops, made of these
        four: the select, two-row and [B, T] terms kernels are Triton's there too (here
        through the interpreter)."""
        from fusedrl.cuda_backend import fused_ops

        return fused_ops(
            self.logprobs_fwd,
            self.logits_grad,
            self.fused_token_loss,
            self.fused_token_loss_inplace,
        )

    # ------------------------------------------------------------------ the ops
    def logprobs_fwd(self, logits, labels, valid, temperature, *, row_temps=None, cap=None):
        arrays = {"labels": labels}
        if valid is not None:
            arrays["valid"] = valid.to(torch.int8)
        out = self._run("logprobs", logits, None, arrays, temperature, row_temps, cap)
        return out["logp"], out["lse"], out["entropy"]

    def logits_grad(
        self,
        logits,
        labels,
        lse,
        entropy,
        dlogp,
        dentropy,
        temperature,
        out,
        *,
        row_temps=None,
        cap=None,
    ):
        arrays = {"labels": labels, "lse": lse, "entropy": entropy, "dlogp": dlogp}
        if dentropy is not None:
            arrays["dentropy"] = dentropy
        self._run("grad", logits, out, arrays, temperature, row_temps, cap)

    def fused_token_loss(
        self,
        logits,
        grad,
        labels,
        valid,
        advantages,
        old_logp,
        ref_logp,
        is_weight,
        agg_weight,
        low,
        high,
        temperature,
        loss,
        dual_clip_c,
        delta,
        tau_pos,
        tau_neg,
        kl,
        beta,
        entropy_coef,
        *,
        row_temps=None,
        cap=None,
        entropy_coef_tensor=None,
    ):
        arrays = {
            "labels": labels,
            "valid": valid.to(torch.int8),
            "advantages": advantages,
            "agg_weight": agg_weight,
        }
        if entropy_coef_tensor is not None:
            if entropy_coef_tensor.numel() != 1:
                raise RuntimeError("fusedrl: entropy_coef_tensor must hold one value")
            arrays["entropy_coef_tensor"] = entropy_coef_tensor
        for name, value in [
            ("old_logp", old_logp),
            ("ref_logp", ref_logp),
            ("is_weight", is_weight),
            ("low", low),
            ("high", high),
        ]:
            if value is not None:
                arrays[name] = value
        kl_code = 0 if kl is None or beta <= 0 else self.kl_codes[kl]
        if kl_code and ref_logp is None:
            raise RuntimeError("fusedrl: ref_logp is required when beta > 0")
        params = {
            "loss": self.loss_codes[loss],
            "dual_clip": int(dual_clip_c is not None),
            "dual_clip_c": dual_clip_c or 0.0,
            "has_delta": int(delta is not None),
            "delta": delta or 0.0,
            "tau_pos": tau_pos,
            "tau_neg": tau_neg,
            "kl": kl_code,
            "beta": beta,
            "entropy_coef": entropy_coef,
        }
        out = self._run("fused", logits, grad, arrays, temperature, row_temps, cap, params)
        return out["logp"], out["entropy"]

    def fused_token_loss_inplace(self, logits, *args, **kwargs):
        return self.fused_token_loss(logits, logits, *args, **kwargs)

    # ------------------------------------------------------------------ the harness
    def _run(self, op, logits, out, arrays, temperature, row_temps, cap, params=None) -> dict:
        self.calls.append(op)
        batch, time, vocab = logits.shape
        in_place = out is not None and out.data_ptr() == logits.data_ptr()
        settings = {
            "rows": batch * time,
            "time": time,
            "vocab": vocab,
            "dtype": _DTYPES[logits.dtype],
            "inv_temperature": 1.0 / temperature,
            "cap": 0.0 if cap is None else cap,
            "in_place": int(in_place),
            **(params or {}),
        }
        if row_temps is not None:
            arrays = {**arrays, "row_temps": row_temps}
        with tempfile.TemporaryDirectory(prefix="fusedrl-host-") as folder:
            folder = Path(folder)
            _write(folder / "logits", logits)
            for name, value in arrays.items():
                _write(folder / name, value)
            lines = [f"{name} {float(value)!r}" for name, value in settings.items()]
            (folder / "params.txt").write_text("\n".join(lines) + "\n")
            result = subprocess.run(
                [str(self.exe), op, str(folder)], capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, result.stderr[-2000:]
            found = {}
            for name in ("logp", "lse", "entropy"):
                if (folder / name).exists():
                    values = np.fromfile(folder / name, dtype=np.float32)
                    found[name] = torch.from_numpy(values).reshape(batch, time)
            if out is not None:
                bits = np.float32 if logits.dtype == torch.float32 else np.int16
                written = torch.from_numpy(np.fromfile(folder / "out", dtype=bits))
                out.copy_(written.view(logits.dtype).reshape(out.shape))
        return found


# fusedrl::DType of csrc/fused_loss.h (the bindings' dtype_of)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _write(path: Path, tensor: torch.Tensor) -> None:
    """The tensor's values, contiguous, as the kernels take them: per-token arrays in fp32 (the
    bindings' `per_token`), labels int64, valid int8, logits' bits in their own dtype."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    elif tensor.dtype not in (torch.int64, torch.int8, torch.float32):
        tensor = tensor.float()
    tensor.numpy().tofile(path)
