"""`fusedrl-train`'s options: typed from YAML and the command line, rejected with the option's
name before any model or engine starts, and documented one sentence each in --help."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fusedrl.trainer.config import HELP, TrainConfig, coerce, parse_config

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_take_the_field_types(tmp_path):
    """PyYAML reads 1e-6 as a string and "false" as a (truthy) string: both mean what they say."""
    cfg = parse_config(
        [
            "--config",
            _yaml(
                tmp_path,
                'lr: 1e-6\nmax_steps: "8"\n'
                'dynamic_sampling: "false"\nbeta: 0\ntemperature: 1\nprogress: no\n',
            ),
        ]
    )
    assert cfg.lr == 1e-6 and type(cfg.lr) is float
    assert cfg.max_steps == 8 and type(cfg.max_steps) is int
    assert cfg.dynamic_sampling is False and cfg.progress is False
    assert type(cfg.beta) is float and type(cfg.temperature) is float


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_steps: 2.5\n", "--max-steps: expected an integer, got 2.5"),
        ("lr: fast\n", "--lr: expected a number, got 'fast'"),
        ("dupo: maybe\n", "--dupo: expected true or false, got 'maybe'"),
        ("model: 123\n", "--model: expected text, got int 123"),
        ("group_size: null\n", "--group-size: a value is required"),
        ("dynamic_sampling: [1]\n", "--dynamic-sampling: expected true or false"),
    ],
)
def test_bad_yaml_values_name_the_option(tmp_path, text, message):
    with pytest.raises(ValueError, match="--config .*run.yaml: " + message.replace("[", r"\[")):
        parse_config(["--config", _yaml(tmp_path, text)])


def test_boolean_flags():
    assert parse_config(["--dynamic-sampling"]).dynamic_sampling is True
    assert parse_config(["--dynamic-sampling", "false"]).dynamic_sampling is False
    assert parse_config(["--no-progress"]).progress is False
    assert parse_config(["--progress", "yes"]).progress is True


@pytest.mark.parametrize("flags", [["--max-steps", "2.5"], ["--lr", "abc"], ["--dupo", "maybe"]])
def test_bad_flags_exit_with_usage(flags, capsys):
    with pytest.raises(SystemExit) as info:
        parse_config(flags)
    assert info.value.code == 2
    assert f"argument {flags[0]}:" in capsys.readouterr().err


def test_coerce_round_trips_every_default():
    for f in dataclasses.fields(TrainConfig):
        assert coerce(f.name, f.default) == f.default


def test_every_option_has_a_sentence_and_help_shows_the_choices():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(HELP) == names
    assert all(text.endswith(".") and len(text) > 15 for text in HELP.values())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "fusedrl.trainer", "--help"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    out = " ".join(out.split())
    for needle in (
        "'dapo'",
        "'grpo'",
        "'rloo'",
        "'token-mean'",
        "'k3'",
        "'bfloat16'",
        "'triton'",
        "1e-6 with --model, 2e-4 for the built-in tiny model",
        "--no-dynamic-sampling",
        "--skip-nonfinite-steps",
    ):
        assert needle in out, needle


def test_bad_options_fail_before_anything_is_written(tmp_path, monkeypatch):
    """An error line, before the warm start (no base model) and before any directory is made:
    bad values, a backend the machine cannot run (no CUDA, no interpreter), a model that does
    not load, a teacher that is no model directory, a --config that is missing or no YAML.
    Through the command line (no traceback) for one error of the parse and one of the start."""
    from fusedrl.trainer.loop import Trainer

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for flags, message in (
        (["--max-steps", "2.5"], "--max-steps: expected an integer"),
        (["--model", str(tmp_path / "nope")], "--model .*nope: cannot be loaded as a local model"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "fusedrl.trainer", "--out", str(tmp_path / "r"), *flags],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode == 2 and "fusedrl-train: error:" in proc.stderr, proc.stderr
        assert re.search(message, proc.stderr), (message, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and "warm start" not in proc.stdout
        assert not (tmp_path / "r").exists()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the suite's, on CPU)
    (tmp_path / "broken.yaml").write_text("max_steps: 3\n  lr: 1\n")
    out = ["--out", str(tmp_path / "r")]
    cases = [
        (["--backend", "jax"], ValueError, "--backend"),
        (["--config", "nope.yaml"], FileNotFoundError, "--config nope.yaml: no such file"),
        (["--config", str(tmp_path / "broken.yaml")], ValueError, r"not valid YAML \(line 2"),
        (["--distill-teacher", "nope"], ValueError, "--distill-teacher nope: not a model dir"),
    ]
    if not torch.cuda.is_available():  # a backend this machine cannot run
        cases.append(
            (["--backend", "triton"], ValueError, "--backend triton: backend='triton' needs CUDA")
        )
    for flags, error, message in cases:
        with pytest.raises(error, match=message):
            Trainer(parse_config([*out, *flags]))
        assert not (tmp_path / "r").exists()
    # --overwrite: a model that does not load leaves the old run as it was
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    replace = ["--out", str(old), "--overwrite", "--model", str(tmp_path / "nope")]
    with pytest.raises(ValueError, match="--model .*nope: cannot be loaded"):
        Trainer(parse_config(replace))
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_machine_error_while_loading_is_not_called_a_bad_model():
    """A full disk (or an I/O or permission error) while a model loads stays an OSError; a
    model that is not there is an error line naming the option."""
    import errno

    from fusedrl.trainer.loop import _loading

    with pytest.raises(OSError, match="No space left") as info:
        with _loading("--model", "m"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(ValueError, match="--model m: cannot be loaded .*no such repo"):
        with _loading("--model", "m"):
            raise OSError("no such repo")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kl", "full", "--tp", "2"], "--kl: 'full' .* has no tensor-parallel path"),
        (["--kl", "k4"], "--kl: one of"),
        (["--distill-kind", "kl"], "--distill-kind: one of"),
        (["--distill-beta", "1.5"], r"--distill-beta: must be in \[0, 1\]"),
        (["--distill-coef", "-1"], "--distill-coef: must be >= 0"),
        (["--distill-teacher", "t", "--tp", "2"], "--distill-teacher: .* no tensor-parallel"),
        (["--decoupled", "--is-correction", "token_truncate"], "--decoupled: decoupled PPO's"),
        (["--decoupled-is-cap", "2"], "--decoupled-is-cap: is read by --decoupled only"),
        (["--decoupled", "--tp", "2"], "--decoupled: the proximal log-probs .* tensor-parallel"),
        (["--decoupled", "--preset", "gmpo"], "--decoupled: gmpo weighs whole sequences"),
        (["--decoupled", "--decoupled-is-cap", "0.5"], "decoupled_is_cap must be > 1"),
        (["--loss", "ppo", "--kl-tau", "0.1"], "kl_tau=0.1 is DPPO's trust-region KL"),
    ],
)
def test_the_exact_kl_and_distillation_options_are_checked(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_config(flags).validate()


def test_a_teacher_that_is_no_model_or_has_another_vocabulary_is_named(tmp_path):
    from fusedrl.tiny import tiny_qwen2
    from fusedrl.trainer.loop import load_teacher

    student = tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32)
    with pytest.raises(ValueError, match="--distill-teacher .*: not a model directory"):
        load_teacher(str(tmp_path), student)
    tiny_qwen2(41, hidden_size=32, num_layers=1, num_heads=1, head_dim=32).save_pretrained(
        tmp_path / "other"
    )
    with pytest.raises(ValueError, match="its head has 41 tokens but the policy's has 37"):
        load_teacher(str(tmp_path / "other"), student)
    tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32).save_pretrained(
        tmp_path / "same"
    )
    teacher = load_teacher(str(tmp_path / "same"), student)
    assert teacher.get_output_embeddings().weight.shape[0] == 37


def test_the_exact_kl_on_the_cuda_backend_needs_triton(monkeypatch):
    from fusedrl.trainer import config

    parse_config(["--kl", "full", "--backend", "cuda"]).validate()  # triton is installed here
    monkeypatch.setattr(config, "_triton_installed", lambda: False)
    with pytest.raises(ValueError, match="--kl: 'full' with --backend cuda runs Triton's"):
        parse_config(["--kl", "full", "--backend", "cuda"]).validate()


# ------------------------------------------------------------------------------------ data
@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "bad.jsonl",
            '{"prompt": "a", "answer": "1"}\n\n{"prompt": "b" "answer": "2"}\n',
            r"bad.jsonl: line 3, column 16: Expecting ',' delimiter",
        ),
        (
            "bad.json",
            '[\n  {"prompt": "a", "answer": "1"},\n  {"prompt": "b",,}\n]',
            r"bad.json: line 3, column 18: Expecting property name",
        ),
        (
            "dict.json",
            '{"prompt": "a", "answer": "1"}',
            r"dict.json: expected a JSON list of rows \(objects\), got a dict at the top level",
        ),
        ("numbers.jsonl", "1\n2\n", r"numbers.jsonl: line 1: expected an object with a 'prompt'"),
        (
            "missing.jsonl",
            '{"prompt": "a", "answer": "1"}\n{"answer": "2"}\n',
            r"missing.jsonl: line 2: missing column 'prompt' \(it has \['answer'\]\); "
            r"set --prompt-column",
        ),
        (
            "number.jsonl",
            '{"prompt": 12, "answer": "1"}\n',
            r"number.jsonl: line 1: column 'prompt' must be text or a list of role/content "
            r"messages, got int 12",
        ),
        ("none.json", '[{"prompt": null, "answer": "1"}]', r"none.json: row 0: .* got NoneType"),
        (
            "chat.jsonl",
            '{"prompt": [{"role": "user"}], "answer": "1"}\n',
            r"chat.jsonl: line 1: column 'prompt' is a list, but message 0 is not a",
        ),
        ("dictprompt.jsonl", '{"prompt": {"text": "a"}, "answer": "1"}\n', r"got dict"),
    ],
)
def test_data_errors_name_the_file_line_and_column(tmp_path, name, text, message):
    from fusedrl.trainer.data import load_rows

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_rows(str(path), "prompt", "answer")


def test_data_without_answers(tmp_path):
    """An empty --answer-column: rows without answers load (None: no accuracy is logged); a
    built-in reward that compares with the answer is refused before anything starts."""
    from fusedrl.trainer.data import load_rows
    from fusedrl.trainer.loop import Trainer

    path = tmp_path / "open.jsonl"
    path.write_text('{"prompt": "Write a haiku."}\n{"prompt": "Name a prime."}\n')
    rows = load_rows(str(path), "prompt", "")
    assert [row["answer"] for row in rows] == [None, None]
    with pytest.raises(ValueError, match="missing column 'answer'"):
        load_rows(str(path), "prompt", "answer")
    with pytest.raises(ValueError, match="missing column ''"):  # the prompt is never optional
        load_rows(str(path), "", "")
    out = ["--out", str(tmp_path / "r"), "--dataset", str(path), "--answer-column", ""]
    with pytest.raises(ValueError, match="--reward math compares each completion with the answer"):
        Trainer(parse_config([*out, "--reward", "format,math"]))
    assert not (tmp_path / "r").exists()


def test_chat_prompts_and_text_prompts_load(tmp_path):
    from fusedrl.trainer.data import load_rows

    path = tmp_path / "ok.jsonl"
    path.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n'
        '{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}\n'
    )
    rows = load_rows(str(path), "prompt", "answer")
    assert rows[0]["prompt"] == "1+1=" and rows[1]["prompt"][0]["content"] == "2+2="


def test_bad_data_is_an_error_line_not_a_traceback(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": [1, 2], "answer": "2"}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusedrl.trainer",
            "--out",
            str(tmp_path / "r"),
            "--dataset",
            str(data),
            "--progress",
            "false",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fusedrl-train: error: --dataset" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # a failed start leaves nothing (no base_model)


def test_the_console_script_imports_rewards_from_the_working_directory(tmp_path):
    script = Path(sys.executable).parent / "fusedrl-train"
    if not script.exists():
        pytest.skip("fusedrl-train is not installed in this environment")
    (tmp_path / "myrewards.py").write_text(
        "def other(prompts, completions, **_):\n    return [0.0] * len(prompts)\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [
            str(script),
            "--out",
            str(tmp_path / "r"),
            "--reward",
            "myrewards:fn",
            "--progress",
            "false",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    # Found (the module was imported from the working directory), then the missing name named.
    assert "module 'myrewards'" in proc.stderr and "has no 'fn'" in proc.stderr, proc.stderr


def test_vllm_rollouts_need_vllm(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_vllm(name, *args):
        return None if name == "vllm" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_vllm)
    with pytest.raises(ValueError, match="--rollout: vllm is not installed"):
        parse_config(["--rollout", "vllm"]).validate()
    parse_config(["--rollout", "auto"]).validate()


def test_the_saved_config_keeps_the_job_not_the_command(tmp_path):
    """--overwrite, --resume and --verbose are not saved: a resumed run is quiet unless its own
    command asks (a saved verbose: true brought back the libraries' notices on every resume)."""
    cfg = parse_config(["--verbose", "--overwrite", "--seed", "3"])
    assert cfg.verbose and cfg.overwrite
    saved = yaml.safe_load(cfg.to_yaml())
    assert saved["seed"] == 3 and not {"verbose", "overwrite", "resume"} & set(saved)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml() + "verbose: true\n")  # an older run's
    resumed = parse_config(["--resume", str(run)])
    assert not resumed.verbose and resumed.seed == 3
    assert parse_config(["--resume", str(run), "--verbose"]).verbose


def test_a_config_file_cannot_change_the_job_it_resumes(tmp_path):
    """--config with --resume: the file's job options are checked against the run's own
    config.yaml, as flags are (it continued a different job silently)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(TrainConfig(out=str(run), seed=1).to_yaml())
    other = tmp_path / "other.yaml"
    other.write_text("seed: 7\nreward: format\n")
    with pytest.raises(ValueError, match=r"--reward 'arith' -> 'format', --seed 1 -> 7 would"):
        parse_config(["--config", str(other), "--resume", str(run)])
    assert parse_config(["--config", str(other), "--resume", str(run), "--allow-job-change"])
    same = tmp_path / "same.yaml"
    same.write_text("seed: 1\nmax_steps: 9\n")
    cfg = parse_config(["--config", str(same), "--resume", str(run)])
    # a file that names no --out continues the run in its own directory, as --resume alone
    assert cfg.max_steps == 9 and cfg.out == str(run)
    checkpoint = str(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "trainer_state.json").write_text("{}")
    assert parse_config(["--config", str(same), "--resume", checkpoint]).out == str(run)
    elsewhere = tmp_path / "elsewhere"
    named = parse_config(["--config", str(same), "--resume", str(run), "--out", str(elsewhere)])
    assert named.out == str(elsewhere)
    same.write_text(f"seed: 1\nout: {elsewhere}\n")
    assert parse_config(["--config", str(same), "--resume", str(run)]).out == str(elsewhere)
    # the warm start's options are the built-in task's job alone
    with pytest.raises(ValueError, match="--warmstart-steps 300 -> 0 would change the job"):
        parse_config(["--resume", str(run), "--warmstart-steps", "0"])
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (run / "config.yaml").write_text(TrainConfig(out=str(run), seed=1, dataset=str(data)).to_yaml())
    assert parse_config(["--resume", str(run), "--warmstart-steps", "0"]).warmstart_steps == 0


def test_a_mistyped_flag_gets_a_suggestion(capsys):
    """argparse alone says "unrecognized arguments"; the closest flag is named beside it."""
    with pytest.raises(SystemExit):
        parse_config(["--max-stps", "3", "--group-sise=4", "--zzz"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --max-stps 3 --group-sise=4 --zzz" in err
    assert "--max-stps -> did you mean --max-steps?" in err
    assert "--group-sise -> did you mean --group-size?" in err
    assert "--zzz ->" not in err  # nothing close: no guess
    with pytest.raises(SystemExit):  # a prefix is not taken for the flag
        parse_config(["--max-step", "3"])
    assert "--max-step -> did you mean --max-steps?" in capsys.readouterr().err


def test_local_paths_are_kept_absolute_so_a_run_resumes_from_anywhere(tmp_path, monkeypatch):
    """--model (a local folder), --dataset and --distill-teacher given relative, from a flag or
    a --config file: config.yaml holds them absolute, so --resume from another working
    directory finds them and the same file named absolutely is the same job. A hub id (no
    such local folder) stays as typed."""
    (tmp_path / "tinymodel").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "math.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    flags = ["--model", "tinymodel", "--dataset", "data/math.jsonl"]
    cfg = parse_config([*flags, "--distill-teacher", "tinymodel", "--out", "run"])
    assert cfg.model == cfg.distill_teacher == str(tmp_path / "tinymodel")
    assert cfg.dataset == str(tmp_path / "data" / "math.jsonl")
    (tmp_path / "job.yaml").write_text("model: tinymodel\ndataset: data/math.jsonl\n")
    assert parse_config(["--config", "job.yaml"]).dataset == cfg.dataset
    assert parse_config(["--model", "Qwen/Qwen2.5-0.5B"]).model == "Qwen/Qwen2.5-0.5B"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = parse_config(["--resume", str(run), "--dataset", cfg.dataset])
    assert (resumed.model, resumed.dataset) == (cfg.model, cfg.dataset)
    assert Path(resumed.dataset).exists() and Path(resumed.model).is_dir()
    # a run saved before paths were kept absolute, resumed from its own directory with the
    # same relative flags: the same job
    monkeypatch.chdir(tmp_path)
    old = dataclasses.replace(cfg, model="tinymodel", dataset="data/math.jsonl")
    (run / "config.yaml").write_text(old.to_yaml())
    again = parse_config(["--resume", str(run), *flags])
    assert (again.model, again.dataset) == (cfg.model, cfg.dataset)
    with pytest.raises(ValueError, match="--dataset 'data/math.jsonl' -> .* would change"):
        parse_config(["--resume", str(run), "--dataset", str(elsewhere)])
    # a file named like a hub id is no model folder
    (tmp_path / "gpt2").write_text("")
    assert parse_config(["--model", "gpt2"]).model == "gpt2"
