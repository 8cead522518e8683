"""The built-in job's warm start and its accuracy metric."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from fusedrl.tiny import char_tokenizer, tiny_llama  # noqa: E402
from fusedrl.trainer.data import render_prompt, sum_task  # noqa: E402
from fusedrl.trainer.rewards import exact_match  # noqa: E402
from fusedrl.trainer.warmstart import noisy_answer, warm_start  # noqa: E402


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("7", "7", True),
        (" 7\n", 7, True),
        ("17", "7", False),
        ("7 7", "7", False),
        ("so \\boxed{42}.", "42", True),
        ("\\boxed{4}2", "42", False),
        ("", "0", False),
        ("\\boxed{ 3 }", "3", True),
        ("\\boxed{2} then \\boxed{3}", "3", True),
    ],
)
def test_exact_match(completion, answer, expected):
    assert exact_match(completion, answer) is expected


def test_noisy_answers_run_on_at_the_given_rate():
    rng = random.Random(0)
    draws = [noisy_answer("12", 0.6, rng) for _ in range(4000)]
    noisy = [d for d in draws if d != "12"]
    assert 0.56 < len(noisy) / len(draws) < 0.64
    for text in noisy:  # the answer, then no digit: a ramble, never another number
        assert text.startswith("12") and not any(ch.isdigit() for ch in text[2:])
        assert not exact_match(text, "12")
    assert noisy_answer("5", 0.0, rng) == "5"


def test_warm_start_fits_the_task_corpus(capsys):
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), max_position_embeddings=128)
    rows = sum_task(num_rows=40)
    prompts = [render_prompt(tokenizer, r["prompt"], None) for r in rows]
    answers = [r["answer"] for r in rows]
    before = warm_start(model, tokenizer, prompts, answers, steps=1, noise=0.0, seed=0, lr=0.0)
    after = warm_start(
        model, tokenizer, prompts, answers, steps=40, noise=0.0, seed=0, lines_every=15, said="w"
    )
    assert after["steps"] == 40 and after["loss"] < 0.5 * before["loss"]
    assert not model.training
    # without a terminal: a line every 15 steps (the last one is the caller's summary)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in lines] == ["w: step 15/40", "w: step 30/40"], lines
    assert all(re.fullmatch(r"w: step \d+/40, loss \d+\.\d\d", line) for line in lines)


def test_the_warm_start_is_fitted_once_per_job_and_kept(tmp_path, monkeypatch, capsys):
    """The built-in job's base model comes from the cache when the same job fitted it before:
    the same files, bit for bit, as the fit that made them and as a fit made again; another
    setting is another entry; an incomplete entry is fitted again and replaced; "off" keeps
    nothing."""
    import dataclasses

    from fusedrl.trainer import warmstart
    from fusedrl.trainer.config import TrainConfig
    from fusedrl.trainer.loop import prepare_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("FUSEDRL_CACHE_DIR", str(cache))
    rows = sum_task(num_rows=20)
    job = TrainConfig(warmstart_steps=3)

    def base_model(name: str, cfg=job) -> tuple[dict, str]:
        run = tmp_path / name
        run.mkdir()
        path = prepare_model(cfg, run, rows)
        files = {f.name: f.read_bytes() for f in sorted(Path(path).iterdir())}
        return files, capsys.readouterr().out

    def entries() -> list:
        return sorted((cache / "warmstart").iterdir())

    fitted, said = base_model("first")
    assert "warm start: 3 supervised steps" in said and "from the cache" not in said
    assert "model.safetensors" in fitted and len(entries()) == 1
    reused, said = base_model("second")
    assert "warm start: 3 supervised steps" in said and "from the cache" in said
    assert reused == fitted  # (the cache's stats file stays in the cache)
    _, said = base_model("other seed", dataclasses.replace(job, seed=job.seed + 1))
    assert "from the cache" not in said and len(entries()) == 2
    (entries()[0] / "warmstart.json").unlink()
    (entries()[1] / "warmstart.json").unlink()  # both incomplete now
    again, said = base_model("after a crash")
    assert "from the cache" not in said and again == fitted
    assert "from the cache" in base_model("then kept")[1]
    (entries()[0] / "warmstart.json").write_text("{}")  # not the stats of a fit
    (entries()[1] / "warmstart.json").write_text("{}")
    assert "from the cache" not in base_model("unreadable stats")[1]
    real_copy = warmstart.shutil.copytree
    calls = []

    def copy_then_fail(source, destination, **kwargs):  # the entry replaced while being read
        calls.append(source)
        real_copy(source, destination, **kwargs)
        if len(calls) == 1:
            raise OSError("gone")
        return destination

    monkeypatch.setattr(warmstart.shutil, "copytree", copy_then_fail)
    refitted, said = base_model("entry replaced while read")
    assert "from the cache" not in said and refitted == fitted and len(calls) == 1
    monkeypatch.setattr(warmstart.shutil, "copytree", real_copy)
    monkeypatch.setenv("FUSEDRL_CACHE_DIR", "off")
    refit, said = base_model("no cache")
    assert "from the cache" not in said and refit == fitted and len(entries()) == 2
