"""The built-in job's warm start and its accuracy metric."""

from __future__ import annotations

import random

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


def test_warm_start_fits_the_task_corpus():
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer), max_position_embeddings=128)
    rows = sum_task(num_rows=40)
    prompts = [render_prompt(tokenizer, r["prompt"], None) for r in rows]
    answers = [r["answer"] for r in rows]
    before = warm_start(model, tokenizer, prompts, answers, steps=1, noise=0.0, seed=0, lr=0.0)
    after = warm_start(model, tokenizer, prompts, answers, steps=40, noise=0.0, seed=0)
    assert after["steps"] == 40 and after["loss"] < 0.5 * before["loss"]
    assert not model.training
