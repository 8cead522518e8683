"""`fusedrl-train --rollout hf`: rollouts with transformers' generate, where vLLM is not installed
(a GPU image without vLLM, a laptop). Runs the CLI as a user would, in a process of its own
(forked from one that imported the trainer once: tests/trainer_cli.py), on CPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedrl.trainer.logger import read_metrics

from .trainer_cli import TrainerCLI

ROOT = Path(__file__).resolve().parents[1]
TIMES = ("step_time", "gen_time", "train_time")


# Every run here is forked from one process that imported the trainer once (tests/trainer_cli.py).
_CLI: list[TrainerCLI] = []


@pytest.fixture(scope="module", autouse=True)
def _trainer_cli():
    _CLI.append(TrainerCLI({**os.environ, "PYTHONPATH": str(ROOT)}, with_vllm=False))
    yield _CLI[0]
    _CLI.pop().close()


def fusedrl_train(*args: str) -> subprocess.CompletedProcess:
    proc = _cli("--rollout", "hf", *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "hf"
    proc = fusedrl_train("--out", str(out), "--max-steps", "20", "--save-every", "10")
    (out.parent / "hf.stdout").write_text(proc.stdout)
    return out


def test_hf_rollouts_learn_the_default_task(hf_run):
    rows = read_metrics(hf_run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first = sum(r["accuracy"] for r in rows[:5]) / 5
    last = sum(r["accuracy"] for r in rows[-5:]) / 5
    assert last - first >= 0.1, (first, last)
    assert (hf_run / "final_model" / "config.json").exists()
    compute = "compute    cpu, float32, loss backend torch, rollouts transformers generate\n"
    assert compute in (hf_run.parent / "hf.stdout").read_text()


def test_hf_rollouts_resume_exactly(hf_run, tmp_path):
    out = tmp_path / "resumed"
    fusedrl_train(
        "--out",
        str(out),
        "--max-steps",
        "13",
        "--save-every",
        "10",
        "--resume",
        str(hf_run / "checkpoints" / "step_000010"),
    )
    resumed = read_metrics(out)
    reference = read_metrics(hf_run)[10:13]
    assert [r["step"] for r in resumed] == [11, 12, 13]
    for got, want in zip(resumed, reference):
        assert {k: v for k, v in got.items() if k not in TIMES} == {
            k: v for k, v in want.items() if k not in TIMES
        }


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _CLI[0].run("--progress", "false", *args)


def test_resume_continues_the_same_job_and_says_so(hf_run, tmp_path):
    """Only --resume and --out: the job (rollout hf, its preset, seed, ...) comes from the run's
    own config.yaml, not from the defaults."""
    out = tmp_path / "more"
    proc = _cli(
        "--resume",
        str(hf_run / "checkpoints" / "step_000010"),
        "--out",
        str(out),
        "--max-steps",
        "11",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fusedrl-train: resumed from step 10" in proc.stdout
    # the resumed run's base model (the KL reference) is copied, not warm-started again
    assert "warm start:" not in proc.stdout
    base = sorted(p.name for p in (hf_run / "base_model").iterdir())
    assert base == sorted(p.name for p in (out / "base_model").iterdir())
    for name in base:
        copied, original = out / "base_model" / name, hf_run / "base_model" / name
        assert copied.read_bytes() == original.read_bytes(), name
    assert "rollout: hf" in (out / "config.yaml").read_text()
    want = read_metrics(hf_run)[10]
    got = read_metrics(out)[0]
    assert {k: v for k, v in got.items() if k not in TIMES} == {
        k: v for k, v in want.items() if k not in TIMES
    }


def test_resume_refuses_a_job_change_and_a_finished_run(hf_run):
    proc = _cli("--resume", str(hf_run), "--preset", "grpo", "--group-size", "4")
    assert proc.returncode == 2
    assert (
        "--preset 'dapo' -> 'grpo', --group-size 8 -> 4 would change the job this run "
        "trains; pass --allow-job-change"
    ) in proc.stderr, proc.stderr[-2000:]
    proc = _cli("--resume", str(hf_run))  # its last checkpoint is its last step
    assert proc.returncode == 2
    assert "the checkpoint is at step 20, --max-steps is 20: nothing left to train" in proc.stderr


def test_resume_finishes_a_run_that_lost_its_final_model(hf_run, tmp_path):
    """A run killed (or out of disk) after its last checkpoint, before the export: --resume
    writes the final model from that checkpoint, trains nothing and keeps the metrics."""
    import shutil

    run = tmp_path / "unexported"
    shutil.copytree(hf_run, run, ignore=shutil.ignore_patterns("final_model", "tensorboard"))
    proc = _cli("--resume", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 20" in proc.stdout and "writing its final model" in proc.stdout
    assert (run / "final_model" / "config.json").exists()
    assert read_metrics(run) == read_metrics(hf_run)
    exported = (run / "final_model" / "model.safetensors").read_bytes()
    assert exported == (hf_run / "final_model" / "model.safetensors").read_bytes()


def test_resume_refuses_another_warm_start(hf_run):
    """The run's base model was warm-started with its options: another value on resume would
    not change that model, and config.yaml would say it did."""
    proc = _cli("--resume", str(hf_run), "--warmstart-steps", "0", "--max-steps", "21")
    assert proc.returncode == 2
    assert "--warmstart-steps" in proc.stderr and "-> 0 would change the job" in proc.stderr


@pytest.mark.parametrize(
    "lr, says",
    [
        # finite weights whose logits overflow: transformers' generate raised a RuntimeError
        ("1e30", "step 2: sampling met non-finite probabilities"),
        # AdamW's own step overflows fp32 (a RuntimeError of torch's)
        ("1e38", "step 1: the optimizer's step overflows fp32"),
    ],
)
def test_a_diverging_run_stops_naming_the_step(lr, says, tmp_path):
    """A finite loss and gradient norm times a huge --lr: the run stops with exit status 1 and
    one line naming the step, never a traceback (the vLLM path: the next update's NaN loss)."""
    out = tmp_path / "diverged"
    proc = _cli("--rollout", "hf", "--out", str(out), "--warmstart-steps", "0", "--lr", lr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"fusedrl-train: error: {says}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_resume_into_another_architecture_is_a_clear_error(hf_run, tmp_path):
    from fusedrl.tiny import char_tokenizer, tiny_qwen2

    other = tmp_path / "wider"
    tokenizer = char_tokenizer()
    tiny_qwen2(len(tokenizer), hidden_size=96, max_position_embeddings=128).save_pretrained(other)
    tokenizer.save_pretrained(other)
    proc = _cli(
        "--resume",
        str(hf_run / "checkpoints" / "step_000010"),
        "--out",
        str(tmp_path / "r"),
        "--model",
        str(other),
        "--allow-job-change",
        "--max-steps",
        "12",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the checkpoint does not fit the model" in proc.stderr and "Traceback" not in proc.stderr


def test_the_exact_kl_to_the_reference(hf_run, tmp_path):
    """--kl full: the reference's logits made a micro-batch at a time beside the policy's, the
    exact KL over the vocabulary in the loss. It starts at 0 (the reference is the initial
    policy), grows as the policy moves, and the run stays finite."""
    out = tmp_path / "kl"
    fusedrl_train(
        "--out",
        str(out),
        "--model",
        str(hf_run / "base_model"),
        "--kl",
        "full",
        "--beta",
        "0.05",
        # --model's default lr (1e-6) moves the policy by ~1e-6 in KL in two steps: too close to
        # the float noise of step 1's zero to tell apart
        "--lr",
        "1e-4",
        "--max-steps",
        "3",
        "--micro-batch-size",
        "32",
        "--warmstart-steps",
        "0",
        "--tensorboard",
        "false",
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["kl"]) < 1e-6 < rows[2]["kl"]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert "kl: full" in (out / "config.yaml").read_text()


def test_a_warm_started_teacher_lifts_a_fresh_student(hf_run, tmp_path):
    """--distill-teacher: a randomly initialised student (no warm start), the warm-started tiny
    model as its teacher, forward KL over the vocabulary on the student's own samples beside the
    RL loss. It starts at accuracy 0 and the teacher lifts it within 50 steps; without the
    teacher the same run stays at 0 for 100 steps (docs/trainer.md gives both runs), because a
    random student's groups never hold an exact answer for RL to reinforce."""
    out = tmp_path / "distill"
    proc = fusedrl_train(
        "--out",
        str(out),
        "--warmstart-steps",
        "0",
        "--max-steps",
        "50",
        "--distill-teacher",
        str(hf_run / "base_model"),
        "--distill-kind",
        "forward_kl",
        "--lr",
        "2e-3",
        "--tensorboard",
        "false",
    )
    assert "teacher" in proc.stdout and "forward_kl x 1" in proc.stdout
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 51))
    assert all(r["accuracy"] == 0 for r in rows[:5])
    late = sum(r["accuracy"] for r in rows[-20:]) / 20
    assert late >= 0.02, [r["accuracy"] for r in rows]
    assert sum(r["distill"] for r in rows[-5:]) / 5 < rows[0]["distill"] / 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)


def test_the_2026_objectives_through_the_cli(hf_run, tmp_path):
    """--decoupled (the recomputed log-probs as the proximal policy), --m2po-tau,
    --trust-region-delta, DPPO's --kl-tau and adaptive entropy (--entropy-target) in one run:
    the options reach the loss (their metrics are logged) and the run stays finite; the entropy
    controller follows TRL's rule and resumes where it stopped."""
    out = tmp_path / "objectives"
    fusedrl_train(
        "--out",
        str(out),
        "--model",
        str(hf_run / "base_model"),
        "--max-steps",
        "2",
        "--loss",
        "dppo_tv",
        "--kl-tau",
        "0.001",
        "--decoupled",
        "--decoupled-is-cap",
        "3",
        "--m2po-tau",
        "0.05",
        "--trust-region-delta",
        "1.0",
        "--entropy-target",
        "100",
        "--entropy-coef",
        "0.01",
        "--entropy-coef-delta",
        "0.02",
        "--warmstart-steps",
        "0",
        "--tensorboard",
        "false",
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("m2po_masked", "rs_tr_max_k2_masked", "dppo_kl_term", "is_weight_mean"):
        assert all(r.get(key) is not None and math.isfinite(r[key]) for r in rows), key
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    text = (out / "config.yaml").read_text()
    assert "decoupled: true" in text and "m2po_tau: 0.05" in text
    # The entropy (~ log of the vocabulary for this model) is far below the target of 100: no
    # bonus before the first measurement, then the coefficient grows by delta after each step.
    assert all(0 < r["entropy"] <= 100 for r in rows)
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.0, 0.03])
    resumed = tmp_path / "objectives-resumed"
    fusedrl_train(
        "--out",
        str(resumed),
        "--max-steps",
        "3",
        "--resume",
        str(out / "checkpoints" / "step_000002"),
    )
    (row,) = read_metrics(resumed)
    assert row["step"] == 3 and row["entropy_coef"] == pytest.approx(0.05)  # not 0: restored


def test_packed_micro_batches_through_the_cli(hf_run, tmp_path):
    """--pack: the same seeded step with and without padding-free micro-batches (the rollouts
    are the same samples; two minibatches, so the old log-probs are recomputed) gives the same
    loss and gradient norm; config.yaml records it."""
    rows = []
    for pack in ("false", "true"):
        out = tmp_path / f"pack-{pack}"
        fusedrl_train(
            "--out",
            str(out),
            "--model",
            str(hf_run / "base_model"),
            "--max-steps",
            "1",
            "--micro-batch-size",
            "3",
            "--minibatches",  # two updates: the old log-probs recomputed (packed too)
            "2",
            "--pack",
            pack,
            "--warmstart-steps",
            "0",
            "--tensorboard",
            "false",
        )
        (row,) = read_metrics(out)
        rows.append(row)
    assert f"pack: {pack}" in (out / "config.yaml").read_text()
    for key in ("loss", "grad_norm", "entropy", "clipfrac"):
        assert rows[1][key] == pytest.approx(rows[0][key], rel=1e-4, abs=1e-6), key
    assert rows[0]["grad_norm"] > 0


def test_a_forked_run_is_a_fresh_process_to_the_command_line(tmp_path):
    """The runs of this file are forked from a process that imported the trainer
    (tests/trainer_cli.py): one that fails and one that succeeds give the same exit code and output
    as `python -m fusedrl.trainer` in a new interpreter."""
    cli = _CLI[0]
    if sys.platform == "linux":  # /proc tells the server that it has a single thread
        assert cli.forked
    for args, code in (
        (("--max-stps", "3", "--out", str(tmp_path / "a")), 2),
        (("--help",), 0),
    ):
        forked = cli.run(*args, cwd=tmp_path)
        fresh = subprocess.run(
            [sys.executable, "-m", "fusedrl.trainer", *args],
            capture_output=True,
            text=True,
            env=cli.env,
            cwd=tmp_path,
            timeout=300,
        )
        assert (forked.returncode, fresh.returncode) == (code, code)
        assert forked.stdout == fresh.stdout and forked.stderr == fresh.stderr
