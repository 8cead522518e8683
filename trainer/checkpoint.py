"""Atomic checkpoints: a run can be killed at any instant and resumed exactly.

A checkpoint is a directory `checkpoints/step_NNNNNN/` with the full model weights, the optimizer
state and `trainer_state.json` (step, data cursor, advantage-estimator state). It is written under
a temporary name and renamed into place; `checkpoints/latest` (a one-line file, itself replaced
atomically) names the newest complete one. A crash mid-write leaves a `.tmp-*` directory that is
ignored and cleaned up next time. A checkpoint being replaced (a resumed run saving a step it had
saved before) is renamed aside first and deleted only after its successor is in place, so a
kill -9 at any instant leaves either checkpoint complete; and should `latest` ever name a missing
or incomplete checkpoint, `resolve` falls back to the newest complete one, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"
FILES = ("model.pt", "optimizer.pt", "extra.pt", "trainer_state.json")
_STEP = re.compile(r"step_(\d+)$")


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _full_state_dicts(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Full (unsharded) tensors on CPU: a checkpoint does not depend on the world size it came from.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def save(
    run_dir: Path, step: int, model, optimizer, state: dict, extra: dict, keep_last: int
) -> Path | None:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep_last`.

    `state` is JSON (step counters, cursor); `extra` holds tensors (estimator statistics).
    """
    model_state, optim_state = _full_state_dicts(model, optimizer)
    if not _is_main():
        return None
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    with writing(final):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
        try:
            torch.save(model_state, tmp / "model.pt")
            torch.save(optim_state, tmp / "optimizer.pt")
            torch.save(extra, tmp / "extra.pt")
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}))
            for file in tmp.iterdir():
                _fsync(file)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # no half-written checkpoint left behind
            raise
    _normal_permissions(tmp)
    old = _move_in(tmp, final)
    _write_atomic(root / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep_last)
    return final


def _move_in(tmp: Path, final: Path) -> Path | None:
    """Rename `tmp` to `final`. An existing `final` is renamed aside first, not deleted, so that
    a kill between the two renames leaves it complete; the caller deletes the returned copy once
    nothing points at it any more."""
    old = None
    if final.exists():
        old = final.with_name(f".tmp-replaced-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    return old


class WriteError(OSError):
    """Writing a checkpoint, the model or the metrics failed; the message names the path."""


@contextlib.contextmanager
def writing(path: Path):
    """Turn a failed write into one error that names `path`, and says "no space left on device"
    when that is the cause (torch.save's zip writer reports a full disk as "unexpected pos")."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise WriteError(errno.ENOSPC, f"writing {path}: no space left on device") from exc
        raise WriteError(exc.errno, f"writing {path}: {exc.strerror or exc}") from exc
    except RuntimeError as exc:
        if disk_nearly_full(path) or "unexpected pos" in str(exc):
            raise WriteError(
                errno.ENOSPC,
                f"writing {path}: no space left on device ({str(exc).splitlines()[0][:200]})",
            ) from exc
        raise
    except Exception as exc:  # safetensors' writer (save_pretrained) raises its own error type
        if type(exc).__name__ != "SafetensorError":
            raise
        full = disk_nearly_full(path) or "No space left" in str(exc)
        reason = "no space left on device" if full else str(exc).splitlines()[0][:200]
        raise WriteError(errno.ENOSPC if full else errno.EIO, f"writing {path}: {reason}") from exc


def disk_nearly_full(path: Path) -> bool:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free < 64 * 2**20
    except OSError:
        return False


def _normal_permissions(directory: Path) -> None:
    """mkdtemp makes 0700 directories: give checkpoints the user's usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


def step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under `root` (checkpoints/), oldest step first."""
    found = [
        p
        for p in root.glob("step_*")
        if p.is_dir() and step_of(p) is not None and all((p / name).exists() for name in FILES)
    ]
    return sorted(found, key=step_of)


def _prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints by step number (not by name)."""
    for old in checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def set_aside_after(root: Path, step: int) -> list[Path]:
    """A run resumed from step N in its own directory starts a new timeline: the checkpoints
    after N belong to the old one. They are renamed `superseded-step_M-<time>` (kept, never
    resumed from or pruned automatically) so that `latest` and pruning only see this timeline."""
    moved = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in list(root.glob("step_*")):
        if (step_of(path) or 0) > step:
            target = root / f"superseded-{path.name}-{stamp}"
            os.rename(path, target)
            moved.append(target)
    return moved


def export_model(run_dir: Path, model, tokenizer, name: str = "final_model") -> Path | None:
    """The trained policy as a Hugging Face directory (`from_pretrained`-ready), atomically."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not _is_main():
        return None
    final = Path(run_dir) / name
    with writing(final):
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=run_dir))
        try:
            model.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _normal_permissions(tmp)
    old = _move_in(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest) or a checkpoint directory."""
    path = Path(path)
    if (path / "trainer_state.json").exists():
        missing = [name for name in FILES if not (path / name).exists()]
        if missing:
            raise FileNotFoundError(f"--resume {path}: incomplete checkpoint, missing {missing}")
        return path
    root = path / "checkpoints"
    latest = root / LATEST
    named = latest.read_text().strip() if latest.exists() else None
    if named and all((root / named / name).exists() for name in FILES):
        return root / named
    complete = checkpoints(root) if root.is_dir() else []
    if complete:
        why = f"names {named!r}, which is missing or incomplete" if named else "is missing"
        warnings.warn(
            f"--resume {path}: checkpoints/{LATEST} {why}; resuming from the newest complete "
            f"checkpoint, {complete[-1].name}",
            stacklevel=2,
        )
        return complete[-1]
    raise FileNotFoundError(
        f"--resume {path}: neither a checkpoint (no trainer_state.json) nor a run directory "
        f"with a complete checkpoint under checkpoints/"
    )


def load(ckpt: Path, model, optimizer) -> tuple[dict, dict]:
    """Restore model and optimizer in place; returns the trainer state and the extras."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    optim_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )
    extra = torch.load(ckpt / "extra.pt", map_location="cpu", weights_only=True)
    return json.loads((ckpt / "trainer_state.json").read_text()), extra
