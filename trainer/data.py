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
    """Rows of a .jsonl/.json/.parquet file; the prompt column is renamed to "prompt"."""
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"--dataset {path}: no such file")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    elif suffix == ".json":
        rows = json.loads(file.read_text())
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(file).to_pylist()
    else:
        raise ValueError(f"--dataset {path}: expected a .jsonl, .json or .parquet file")
    if not rows:
        raise ValueError(f"--dataset {path}: the file holds no rows")
    for column in (prompt_column, answer_column):
        if column not in rows[0]:
            raise ValueError(
                f"--dataset {path}: missing column {column!r} (columns: {sorted(rows[0])}); "
                f"set --prompt-column / --answer-column"
            )
    return [{**row, "prompt": row[prompt_column], "answer": row[answer_column]} for row in rows]


def render_prompt(tokenizer, prompt, system_prompt: str | None) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one."""
    if isinstance(prompt, list):  # already a conversation
        messages = list(prompt)
    else:
        messages = [{"role": "user", "content": str(prompt)}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def build_prompt_set(cfg, tokenizer) -> PromptSet:
    rows = (
        load_rows(cfg.dataset, cfg.prompt_column, cfg.answer_column)
        if cfg.dataset
        else sum_task()
    )
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
