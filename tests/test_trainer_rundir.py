"""Run directories are never overwritten or lost: refusal, pruning by step, `latest` fallback,
a kill -9 at every point of a checkpoint save, torn metrics lines."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fusedrl.trainer import checkpoint
from fusedrl.trainer.config import TrainConfig
from fusedrl.trainer.logger import MetricsLogger
from fusedrl.trainer.loop import claim_run_dir, lock_run_dir

ROOT = Path(__file__).resolve().parents[1]


def _fusedrl_train(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "fusedrl.trainer", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)


class Killed(BaseException):
    """Stands in for kill -9: nothing after the point runs, no handler sees it."""


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(run, step, model, optimizer, keep_last=3):
    return checkpoint.save(run, step, model, optimizer, {"cursor": step}, {}, keep_last)


def _resumes(run) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt = checkpoint.resolve(run)
    model, optimizer = _model_and_optimizer(seed=1)
    state, _ = checkpoint.load(ckpt, model, optimizer)
    return state["step"]


# (what is killed, which call of it) -> the steps the run may resume from afterwards
KILL_POINTS = {
    "torch.save of the model": ("save", 1, {1, 2}),
    "torch.save of the optimizer": ("save", 2, {1, 2}),
    "rename of the old checkpoint aside": ("rename", 1, {1, 2}),
    "rename of the new checkpoint into place": ("rename", 2, {1, 2}),
    "replace of latest": ("replace", 1, {1, 2}),
    "delete of the replaced checkpoint": ("rmtree", 1, {1, 2}),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_kill_at_any_point_of_a_save_leaves_a_run_that_resumes(point, tmp_path, monkeypatch):
    """Re-saving step 2 (a run resumed from step 1 into its own directory reaches step 2 again):
    the most fragile save, since a checkpoint is replaced."""
    run = tmp_path / "run"
    model, optimizer = _model_and_optimizer()
    _save(run, 1, model, optimizer)
    _save(run, 2, model, optimizer)
    what, nth, allowed = KILL_POINTS[point]
    targets = {
        "save": (torch, "save"),
        "rename": (os, "rename"),
        "replace": (os, "replace"),
        "rmtree": (checkpoint.shutil, "rmtree"),
    }
    module, name = targets[what]
    real = getattr(module, name)
    calls = {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise Killed(point)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, dying)
    with pytest.raises(Killed):
        _save(run, 2, model, optimizer)
    monkeypatch.setattr(module, name, real)
    assert _resumes(run) in allowed
    _save(run, 3, model, optimizer)  # and the next save cleans up after the crash
    assert _resumes(run) == 3
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_latest_naming_a_missing_checkpoint_falls_back_with_a_warning(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (1, 2):
        _save(tmp_path, step, model, optimizer)
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    with pytest.warns(
        UserWarning,
        match="names 'step_000009', which is missing or incomplete; "
        "resuming from the newest complete checkpoint, step_000002",
    ):
        assert checkpoint.resolve(tmp_path).name == "step_000002"
    (tmp_path / "checkpoints" / "step_000002" / "optimizer.pt").unlink()  # incomplete
    (tmp_path / "checkpoints" / "latest").unlink()
    with pytest.warns(UserWarning, match="step_000001"):
        assert checkpoint.resolve(tmp_path).name == "step_000001"


def test_pruning_keeps_the_newest_steps_by_number(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (999_998, 999_999, 1_000_000):  # by name, step_1000000 sorts first
        _save(tmp_path, step, model, optimizer, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_1000000", "step_999999"]


def test_resuming_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (1, 2, 3):
        _save(tmp_path, step, model, optimizer)
    moved = checkpoint.set_aside_after(tmp_path / "checkpoints", 1)
    assert sorted(p.name.split("-")[1] for p in moved) == ["step_000002", "step_000003"]
    _save(tmp_path, 2, model, optimizer)
    assert checkpoint.resolve(tmp_path).name == "step_000002"
    assert len(list((tmp_path / "checkpoints").glob("superseded-*"))) == 2  # kept


def test_checkpoints_get_normal_permissions(tmp_path):
    model, optimizer = _model_and_optimizer()
    final = _save(tmp_path, 1, model, optimizer)
    umask = os.umask(0)
    os.umask(umask)
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask  # mkdtemp would leave 0700


def test_an_existing_run_is_refused_without_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "notes.txt").write_text("mine")
    # nothing to resume yet: --resume is not offered
    with pytest.raises(
        ValueError,
        match=f"--out {run} holds a run that saved no checkpoint \\(metrics.jsonl\\): "
        "--overwrite to replace it, or another --out",
    ):
        claim_run_dir(run, TrainConfig(out=str(run)))
    _save(run, 1, *_model_and_optimizer())
    with pytest.raises(
        ValueError,
        match=f"--out {run} holds a run \\(metrics.jsonl, checkpoints\\): pass "
        f"--resume {run} to continue it, --overwrite to replace it",
    ):
        claim_run_dir(run, TrainConfig(out=str(run)))
    assert claim_run_dir(run, TrainConfig(out=str(run), resume=str(run))) == []  # its own
    # --overwrite names what goes, removed only once the new run's start has passed its checks
    assert claim_run_dir(run, TrainConfig(out=str(run), overwrite=True)) == [
        "metrics.jsonl",
        "checkpoints",
    ]
    assert (run / "metrics.jsonl").exists() and (run / "notes.txt").read_text() == "mine"
    (run / "final_model").mkdir()
    inside = TrainConfig(out=str(run), overwrite=True, model=str(run / "final_model"))
    with pytest.raises(ValueError, match="--model .* is inside .*final_model, which --overwrite"):
        claim_run_dir(run, inside)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        claim_run_dir(tmp_path / "a-file", TrainConfig(out=str(tmp_path / "a-file")))


def test_one_run_directory_takes_one_trainer_at_a_time(tmp_path):
    """A second fusedrl-train into a directory another one is writing is refused (they wrote,
    and on a failed start deleted, each other's files); the lock goes with its holder."""
    held = lock_run_dir(tmp_path / "run")
    with pytest.raises(ValueError, match="another fusedrl-train is writing to it"):
        lock_run_dir(tmp_path / "run")
    held.close()
    lock_run_dir(tmp_path / "run").close()


def test_overwrite_and_resume_are_the_command_lines_not_the_saved_jobs(tmp_path):
    """A config.yaml read back by --config or --resume never overwrites or resumes anything by
    itself: the two are not saved, and an older file's are ignored."""
    cfg = TrainConfig(out=str(tmp_path / "r"), overwrite=True, resume=str(tmp_path / "old"))
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    keys = {line.split(":")[0] for line in saved.read_text().splitlines()}
    assert "out" in keys and not keys & {"overwrite", "resume"}, keys
    saved.write_text(saved.read_text() + "overwrite: true\nresume: somewhere\n")  # an old file
    loaded = TrainConfig.from_yaml(saved)
    assert not loaded.overwrite and loaded.resume is None and loaded.out == cfg.out


def test_a_failed_start_with_overwrite_keeps_the_old_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "fusedrl.trainer",
        "--out",
        str(run),
        "--overwrite",
        "--reward",
        "no_such_module:fn",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "no_such_module" in proc.stderr, proc.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_a_start_that_fails_after_overwrite_set_the_old_run_aside_puts_it_back(tmp_path):
    """--overwrite moves the old run aside before the new one writes its base model; a check
    that fails after that (prompt plus --max-tokens past the model's positions) puts it back as
    it was, and leaves no trace of the new one."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "model.pt").write_bytes(b"old weights")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "base_model").mkdir()
    (run / "base_model" / "config.json").write_text("{}")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = _fusedrl_train(
        "--out", str(run), "--overwrite", "--warmstart-steps", "0", "--max-tokens", "200"
    )
    assert proc.returncode == 2 and "max_position_embeddings" in proc.stderr, proc.stderr
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    after.pop(Path(".fusedrl-train.lock"), None)
    assert after == before
    assert not list(run.glob(".overwritten-*"))


def test_set_aside_and_put_back_restore_the_entries_over_new_ones(tmp_path):
    from fusedrl.trainer.loop import _put_back, _set_aside

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "x").write_text("old")
    (tmp_path / "metrics.jsonl").write_text("old")
    aside = tmp_path / ".overwritten-1"
    aside.mkdir()
    _set_aside(tmp_path, ["checkpoints", "metrics.jsonl", "plots.png"], aside)
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
    (tmp_path / "metrics.jsonl").write_text("new")  # what the new run wrote meanwhile
    (tmp_path / "base_model").mkdir()
    _put_back(tmp_path, aside)
    assert (tmp_path / "metrics.jsonl").read_text() == "old"
    assert (tmp_path / "checkpoints" / "x").read_text() == "old" and not aside.exists()


def test_a_run_set_aside_by_a_killed_overwrite_is_put_back(tmp_path):
    """An --overwrite killed (SIGKILL) after it set the old run aside, before its start
    finished: the next fusedrl-train on that --out puts the old run back, over what the killed
    start wrote (it trained nothing), and then treats it as any existing run."""
    from fusedrl.trainer.loop import recover_overwritten

    run = tmp_path / "run"
    aside = run / ".overwritten-k7x2"
    (aside / "checkpoints" / "step_000003").mkdir(parents=True)
    (aside / "metrics.jsonl").write_text('{"step": 3}\n')
    (run / "base_model").mkdir()  # the killed start's
    (run / "config.yaml").write_text("seed: 9\n")
    assert recover_overwritten(run) == [".overwritten-k7x2"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    (aside / "checkpoints").mkdir(parents=True)  # another killed one, seen by the CLI
    (aside / "checkpoints" / "kept").write_text("old")
    proc = _fusedrl_train("--out", str(run))
    assert "put back the run" in proc.stdout and ".overwritten-k7x2" in proc.stdout, proc.stdout
    assert proc.returncode == 2 and "--overwrite to replace it" in proc.stderr, proc.stderr
    assert (run / "checkpoints" / "kept").read_text() == "old" and not aside.exists()


def test_the_cli_restores_the_callers_sigterm_handler():
    """main() turns SIGTERM into an unwinding exception while the start runs; an in-process
    caller gets its own handler back afterwards."""
    import signal

    from fusedrl.trainer.cli import main

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["--preset", "no-such-preset"]) == 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_cli_refuses_an_existing_run_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 7\n")
    proc = _fusedrl_train("--out", str(run))
    assert proc.returncode == 2, proc.stderr
    assert "holds a run that saved no checkpoint (config.yaml)" in proc.stderr, proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    assert (run / "config.yaml").read_text() == "seed: 7\n"


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    # steps 1-3 logged, the 4th torn; resumed from the checkpoint after step 2: 1 and 2 stay
    rows = [json.dumps({"step": i, "loss": 0.1 * i}) for i in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 4, "lo')
    MetricsLogger(tmp_path, tensorboard=False, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert "line 4 is torn" in capsys.readouterr().out


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 7680 vs 7572"),
    ],
)
def test_a_full_disk_names_the_path_and_leaves_no_temp_folder(failure, tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    _save(tmp_path, 1, model, optimizer)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(
        checkpoint.WriteError, match="writing .*step_000002: no space left on device"
    ):
        _save(tmp_path, 2, model, optimizer)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert checkpoint.resolve(tmp_path).name == "step_000001"


def test_safetensors_own_write_error_is_a_write_error(tmp_path):
    """save_pretrained's writer raises safetensors' SafetensorError (no OSError) on a full
    disk: the same WriteError as torch.save's, naming the path."""
    SafetensorError = type("SafetensorError", (Exception,), {})  # noqa: N806 (its class name)
    target = tmp_path / "final_model"
    with pytest.raises(checkpoint.WriteError, match="writing .*final_model: no space left"):
        with checkpoint.writing(target):
            raise SafetensorError("Error while serializing: IoError(No space left on device)")
    with pytest.raises(checkpoint.WriteError, match="writing .*final_model: Error while"):
        with checkpoint.writing(target):
            raise SafetensorError("Error while serializing: IoError(Input/output error)")
    with pytest.raises(KeyError):  # anything else passes through
        with checkpoint.writing(target):
            raise KeyError("other")


def test_an_unreadable_checkpoint_is_named_with_the_one_before_it(tmp_path):
    from fusedrl.trainer.loop import _unloadable

    model, optimizer = _model_and_optimizer()
    for step in (1, 2, 10):
        _save(tmp_path, step, model, optimizer)
    newest = tmp_path / "checkpoints" / "step_000010"
    (newest / "model.pt").write_bytes((newest / "model.pt").read_bytes()[:100])
    with pytest.raises(Exception) as caught:
        checkpoint.load(newest, *_model_and_optimizer(seed=1))
    message = _unloadable(newest, "base_model", caught.value)
    assert "a file of the checkpoint cannot be read: it is truncated or corrupt" in message
    assert message.endswith(f"the one before it is complete: --resume {newest.parent}/step_000002")
    mismatch = _unloadable(newest, "base_model", RuntimeError("size mismatch for weight"))
    assert "does not fit the model base_model (size mismatch" in mismatch
    state = _unloadable(newest, "base_model", json.JSONDecodeError("Expecting value", "", 0))
    assert "cannot be read: it is truncated or corrupt (Expecting value" in state
    refused = pickle.UnpicklingError("Weights only load failed. ... GLOBAL x.Y was not allowed")
    assert "does not fit the model" in _unloadable(newest, "base_model", refused)


def test_a_failed_metrics_write_names_the_file(tmp_path, monkeypatch):
    logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=None)
    real_open = open

    def full_open(path, *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and args and args[0] == "a":
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(checkpoint.WriteError, match="metrics.jsonl: no space left on device"):
        logger.log({"step": 0, "loss": 1.0})
