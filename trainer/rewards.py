"""Reward functions: built-in `math`, `format`, `arith`, and user `module:function`s with weights.

A reward function has the signature ``(prompts, completions, **columns) -> list[float | None]``
(the dataset's other columns arrive as lists, `answer` among them). ``None`` means "does not
apply to this sample": it is left out of the weighted sum, as TRL does. A function that raises or
returns something malformed fails the step with an error naming the function and the prompt;
it never turns into a silent 0.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

RewardFn = Callable[..., list]

_BOXED = re.compile(r"\\boxed\{")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def final_answer(text: str) -> str | None:
    """The last \\boxed{} answer, else the last number in the completion."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def exact_match(completion: str, answer) -> bool:
    """The completion solves the task exactly: its whole text, or its last \\boxed{}, is the
    answer (surrounding whitespace aside). The run's `accuracy`: stricter than partial credit."""
    gold = str(answer).strip()
    if completion.strip() == gold:
        return True
    boxed = _last_boxed(completion)
    return boxed is not None and boxed.strip() == gold


def math_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 when math-verify finds the final (boxed, else last numeric) answer equal to `answer`."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - a dependency of the train extra
        raise ImportError("the `math` reward needs math-verify: pip install math-verify") from exc
    scores = []
    for completion, gold in zip(completions, answer):
        predicted = final_answer(completion)
        if predicted is None:
            scores.append(0.0)
            continue
        gold_parsed = parse(f"${gold}$" if "$" not in str(gold) else str(gold))
        scores.append(1.0 if verify(gold_parsed, parse(f"${predicted}$")) else 0.0)
    return scores


def format_reward(prompts, completions, **_) -> list[float]:
    """1.0 when the completion ends with exactly one \\boxed{...} final answer."""
    scores = []
    for completion in completions:
        boxed = _BOXED.findall(completion)
        ok = len(boxed) == 1 and _last_boxed(completion) is not None
        scores.append(1.0 if ok else 0.0)
    return scores


def arith_reward(prompts, completions, answer, **_) -> list[float]:
    """The built-in task's reward: 1 for exactly the answer; 0.5 for the answer followed by
    anything else; otherwise a quarter of the share of digit characters.

    Ordered so that no shortcut pays: the right number that runs on earns more than any wrong
    number, so learning to stop never trades against being right, and digits earn a little so
    that even a random model gets a gradient toward numeric answers.
    """
    scores = []
    for completion, gold in zip(completions, answer):
        text, gold = completion.strip(), str(gold).strip()
        if text == gold:
            scores.append(1.0)
        elif text.startswith(gold) and not text[len(gold)].isdigit():
            scores.append(0.5)
        else:
            digits = sum(ch.isdigit() for ch in text)
            scores.append(0.25 * digits / max(len(text), 1))
    return scores


BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "format": format_reward,
    "arith": arith_reward,
}
# The built-in rewards that compare with the answer column.
NEED_ANSWERS = ("math", "arith")


class RewardError(RuntimeError):
    """A reward function raised, or returned no finite number where one was due."""


@dataclass
class Reward:
    name: str
    fn: RewardFn
    weight: float


def parse_rewards(spec: str) -> list[Reward]:
    """`math,format=0.2,my.module:fn=0.5` -> weighted reward functions (import errors named)."""
    rewards = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, weight_text = item.partition("=")
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            raise ValueError(f"--reward {item!r}: weight {weight_text!r} is not a number") from None
        if not math.isfinite(weight):
            raise ValueError(f"--reward {item!r}: weight {weight_text!r} is not a finite number")
        if name in BUILTIN:
            fn = BUILTIN[name]
        elif ":" in name:
            module_name, _, attr = name.partition(":")
            # The working directory is importable, as under `python -m` (a console script
            # puts only its own bin directory on sys.path).
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - SyntaxError, ImportError, its own errors
                raise ValueError(
                    f"--reward {name!r}: importing module {module_name!r} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            fn = getattr(module, attr, None)
            if fn is None:
                raise ValueError(
                    f"--reward {name!r}: module {module_name!r} "
                    f"({getattr(module, '__file__', '?')}) has no {attr!r}"
                )
            if not callable(fn):
                raise ValueError(f"--reward {name!r} is not callable")
        else:
            raise ValueError(
                f"--reward {name!r}: unknown; use one of {sorted(BUILTIN)} or module:function"
            )
        rewards.append(Reward(name, fn, weight))
    if not rewards:
        raise ValueError("--reward: at least one reward function is required")
    return rewards


def _failing_prompt(fn: RewardFn, prompts, completions, columns) -> str:
    """The first prompt on which `fn` fails alone (the batch call raised)."""
    for i, prompt in enumerate(prompts):
        try:
            fn([prompt], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception:  # noqa: BLE001 - locating the failure, re-raised by the caller
            return prompt
    return prompts[0]


def _as_number(value) -> float | None:
    """A finite reward as a float: Python, numpy and one-element torch numbers; not bool."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # a torch tensor
        if value.numel() != 1 or value.dtype == torch.bool:
            return None
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def score(
    rewards: list[Reward], prompts: list[str], completions: list[str], columns: dict[str, list]
) -> tuple[list[float], dict[str, float]]:
    """Weighted sum of every reward function per sample, and each function's mean."""
    total = [0.0] * len(prompts)
    means = {}
    for reward in rewards:
        try:
            values = reward.fn(prompts, completions, **columns)
        except Exception as exc:
            prompt = _failing_prompt(reward.fn, prompts, completions, columns)
            raise RewardError(
                f"reward function {reward.name!r} raised {type(exc).__name__}: {exc} "
                f"(prompt: {str(prompt)[:200]!r})"
            ) from exc
        values = list(values) if values is not None else None
        if values is None or len(values) != len(prompts):
            got = "None" if values is None else f"{len(values)} values"
            raise RewardError(
                f"reward function {reward.name!r} returned {got} for {len(prompts)} "
                f"completions (prompt: {str(prompts[0])[:200]!r})"
            )
        applied = []
        for i, value in enumerate(values):
            if value is None:
                continue
            number = _as_number(value)
            if number is None:
                raise RewardError(
                    f"reward function {reward.name!r} returned {value!r} (not a finite number) "
                    f"for prompt {str(prompts[i])[:200]!r}"
                )
            total[i] += reward.weight * number
            applied.append(number)
        if not applied and prompts:
            # None means "does not apply to this sample"; for every sample of a step it is a
            # broken function (or the wrong dataset columns), not a reward of 0.
            raise RewardError(
                f"reward function {reward.name!r} returned None for all {len(prompts)} "
                f"completions of this step (prompt: {str(prompts[0])[:200]!r}); check the "
                "function and the dataset columns it reads"
            )
        means[reward.name] = sum(applied) / len(applied)
    return total, means
