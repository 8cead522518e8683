"""Atomic checkpoints: a run can be killed at any instant and resumed exactly.

A checkpoint is a directory `checkpoints/step_NNNNNN/` with the full model weights, the optimizer
state and `trainer_state.json` (step, data cursor, advantage-estimator state). It is written under
a temporary name and renamed into place; `checkpoints/latest` (a one-line file, itself replaced
atomically) names the newest complete one. A crash mid-write leaves a `.tmp-*` directory that is
ignored and cleaned up next time; "latest" only ever points at a finished checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _full_state_dicts(model, optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # Full (unsharded) tensors on CPU: a checkpoint does not depend on the world size it came from.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def save(run_dir: Path, step: int, model, optimizer, state: dict, extra: dict,
         keep_last: int) -> Path | None:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep_last`.

    `state` is JSON (step counters, cursor); `extra` holds tensors (estimator statistics).
    """
    model_state, optim_state = _full_state_dicts(model, optimizer)
    if not _is_main():
        return None
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
    torch.save(model_state, tmp / "model.pt")
    torch.save(optim_state, tmp / "optimizer.pt")
    torch.save(extra, tmp / "extra.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}))
    for file in tmp.iterdir():
        _fsync(file)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_atomic(root / LATEST, final.name + "\n")
    _prune(root, keep_last)
    return final


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def export_model(run_dir: Path, model, tokenizer, name: str = "final_model") -> Path | None:
    """The trained policy as a Hugging Face directory (`from_pretrained`-ready), atomically."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if not _is_main():
        return None
    final = Path(run_dir) / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=run_dir))
    model.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest) or a checkpoint directory."""
    path = Path(path)
    if (path / "trainer_state.json").exists():
        return path
    latest = path / "checkpoints" / LATEST
    if latest.exists():
        ckpt = path / "checkpoints" / latest.read_text().strip()
        if (ckpt / "trainer_state.json").exists():
            return ckpt
    raise FileNotFoundError(
        f"--resume {path}: neither a checkpoint (no trainer_state.json) nor a run directory "
        f"with checkpoints/{LATEST}"
    )


def load(ckpt: Path, model, optimizer) -> tuple[dict, dict]:
    """Restore model and optimizer in place; returns the trainer state and the extras."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_state = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=True)
    optim_state = torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state, options=options)
    extra = torch.load(ckpt / "extra.pt", map_location="cpu", weights_only=True)
    return json.loads((ckpt / "trainer_state.json").read_text()), extra
