"""Prompts: the built-in `sum` task or a user's jsonl/parquet file, tokenised once.

Prompts are drawn in epochs of a seeded permutation addressed by a single cursor (the number of
prompts consumed so far), so a resumed run that restores the cursor draws exactly the prompts an
uninterrupted run would have drawn.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PromptSet:
    rows: list[dict]  # the dataset's columns, the prompt text under "prompt"
    token_ids: list[list[int]]  # the prompt after the chat template, tokenised

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, cursor: int, count: int, seed: int) -> list[int]:
        """Indices of prompts cursor .. cursor+count-1 of the seeded epoch stream."""
        n = len(self.rows)
        out = []
        for pos in range(cursor, cursor + count):
            epoch, offset = divmod(pos, n)
            perm = _epoch_permutation(n, seed, epoch)
            out.append(perm[offset])
        return out


@functools.lru_cache(maxsize=2)  # a step spans at most two epochs
def _epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


def sum_task(num_rows: int = 200, seed: int = 1234) -> list[dict]:
    """The built-in verifiable task: 'a+b=' with single digits; the answer is the sum.

    Small enough for a random tiny model to make progress on 2 CPU cores (see rewards.arith).
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def load_rows(path: str, prompt_column: str, answer_column: str) -> list[dict]:
    """Rows of a .jsonl/.json/.parquet file; the prompt column is renamed to "prompt".

    Every error names the file and the row's line (jsonl) or index (json / parquet), and the
    column where JSON does not parse: a user fixes data, not tracebacks."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--dataset {path}: no such file")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        rows, where = [], []
        for lineno, line in enumerate(file.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--dataset {path}: line {lineno}, column {exc.colno}: {exc.msg}"
                ) from None
            where.append(f"line {lineno}")
    elif suffix == ".json":
        try:
            rows = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--dataset {path}: line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        if not isinstance(rows, list):
            raise ValueError(
                f"--dataset {path}: expected a JSON list of rows (objects), got a "
                f"{type(rows).__name__} at the top level"
            )
        where = [f"row {i}" for i in range(len(rows))]
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(file).to_pylist()
        where = [f"row {i}" for i in range(len(rows))]
    else:
        raise ValueError(f"--dataset {path}: expected a .jsonl, .json or .parquet file")
    if not rows:
        raise ValueError(f"--dataset {path}: the file holds no rows")
    out = []
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise ValueError(
                f"--dataset {path}: {at}: expected an object with a {prompt_column!r} field, "
                f"got {type(row).__name__} {str(row)[:80]}"
            )
        columns = ((prompt_column, "--prompt-column"), (answer_column, "--answer-column"))
        for column, flag in columns:
            if column not in row and (column or flag == "--prompt-column"):  # no answers: ""
                raise ValueError(
                    f"--dataset {path}: {at}: missing column {column!r} (it has "
                    f"{sorted(row)}); set {flag}"
                )
        problem = _prompt_problem(row[prompt_column])
        if problem:
            raise ValueError(f"--dataset {path}: {at}: column {prompt_column!r} {problem}")
        answer = row[answer_column] if answer_column else None
        out.append({**row, "prompt": row[prompt_column], "answer": answer})
    return out


def _prompt_problem(prompt) -> str | None:
    """Why `prompt` is not a prompt: text, or a chat as a list of {role, content} messages."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                return (
                    f"is a list, but message {i} is not a {{'role': str, 'content': str}} "
                    f"object: {str(message)[:80]}"
                )
        return None
    return (
        f"must be text or a list of role/content messages, got {type(prompt).__name__} "
        f"{str(prompt)[:80]}"
    )


def render_prompt(tokenizer, prompt, system_prompt: str | None) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one."""
    if isinstance(prompt, list):  # already a conversation (load_rows checked its messages)
        messages = list(prompt)
    else:
        messages = [{"role": "user", "content": prompt}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def task_rows(cfg) -> list[dict]:
    """The run's rows: the --dataset file's (checked), or the built-in `sum` task's."""
    if cfg.dataset:
        return load_rows(cfg.dataset, cfg.prompt_column, cfg.answer_column)
    return sum_task()


def build_prompt_set(cfg, tokenizer, rows: list[dict] | None = None) -> PromptSet:
    rows = task_rows(cfg) if rows is None else rows
    token_ids = []
    for i, row in enumerate(rows):
        ids = render_prompt(tokenizer, row["prompt"], cfg.system_prompt)
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(
                f"row {i} of the dataset has a {len(ids)}-token prompt, over "
                f"--max-prompt-tokens={cfg.max_prompt_tokens}: {str(row['prompt'])[:80]!r}"
            )
        token_ids.append(ids)
    return PromptSet(rows=rows, token_ids=token_ids)
