"""Warm start of the built-in tiny model: a few seconds of supervised steps on a noisy task corpus.

RL starts from a pretrained model in practice. A randomly initialised one almost never emits an
exact answer, so nearly every group's rewards tie, the group-relative advantages are 0 and the
policy gradient with them. The built-in job therefore first fits the tiny model, by plain
next-token cross-entropy on the completion tokens, to a corpus of the `sum` task: each prompt as
the trainer renders it, then the answer, then <eos>. With probability `noise` the answer runs on
("7 =", "7+", ...), so the model learns the sums but stops right after the answer only about
(1 - noise) of the time: the exact-match accuracy RL starts from, and lifts. (Wrong sums as the
noise do not work here: RL would have to correct a hundred facts one by one, and the tiny model
does not get there within a few minutes; stopping is one behaviour shared by every prompt.)

The result is saved as OUT/base_model and reused by --resume; a run with --model skips all this.
It is also kept in a cache (`cache_root`: ~/.cache/fusedrl/warmstart/ by default) under a key of
every setting it depends on (`cache_key`: the task rows, the model and tokenizer, the steps, noise
and seed, and the fusedrl, torch and transformers versions), so that the next run of the same
job starts from it instead of fitting it again: the same bits as the first run's, which a fit on
this machine with the same threads would reproduce.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from .checkpoint import WriteError, disk_nearly_full
from .step import collate

# What a rambling sample appends to the answer. No digits: a ramble that repeated the answer would
# put the answer's own digits into samples RL must discourage, and a tiny model then unlearns
# the digits along with the ramble (it collapsed to one-digit answers that way).
RAMBLES = ("+", "=", " =", " +", "?", " ?")


def noisy_answer(answer: str, noise: float, rng: random.Random) -> str:
    """The answer, or with probability `noise` the answer followed by a ramble (never exact)."""
    if rng.random() >= noise:
        return answer
    return answer + rng.choice(RAMBLES)


def warm_start(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    answers: list[str],
    *,
    steps: int,
    noise: float,
    seed: int,
    lr: float = 3e-3,
    batch_size: int = 128,
    progress: bool = False,
    lines_every: int = 0,
    said: str = "warm start",
) -> dict:
    """Fit `model` in place; returns {steps, seconds, loss (last step)}. `progress`: a bar (a
    terminal); `lines_every`: else a line `said: step N/M, loss L` every that many steps (a log
    file sees the minutes of a fit on a busy machine go by).

    AdamW with a 20-step linear warm-up and a cosine decay to 0, by plain cross-entropy on the
    completion tokens (<eos> included)."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1.0 + math.cos(math.pi * s / steps))
    )
    model.train()
    start, loss = time.perf_counter(), torch.zeros(())
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="warm start", unit="step", dynamic_ncols=True, leave=False)
    for done in range(1, steps + 1):
        picks = [rng.randrange(len(prompt_ids)) for _ in range(batch_size)]
        completions = [
            tokenizer.encode(noisy_answer(answers[i], noise, rng), add_special_tokens=False) + [eos]
            for i in picks
        ]
        # The RL update's own layout (trainer/step.py): prompts left-padded to P, completions
        # right-padded; the logits at P - 1 + t predict completion token t.
        batch = collate(
            [prompt_ids[i] for i in picks],
            completions,
            torch.zeros(len(picks)),
            torch.ones(len(picks), dtype=torch.bool),
            None,
            pad,
        )
        width, first = batch.labels.shape[1], batch.prompt_len - 1
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        targets = batch.labels.masked_fill(batch.mask == 0, -100)
        loss = torch.nn.functional.cross_entropy(
            logits[:, first : first + width].reshape(-1, logits.shape[-1]).float(),
            targets.reshape(-1),
            ignore_index=-100,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if bar is not None:
            bar.update(1)
        elif lines_every and done % lines_every == 0 and done < steps:
            print(f"{said}: step {done}/{steps}, loss {loss.item():.2f}", flush=True)
    if bar is not None:
        bar.close()
    model.eval()
    return {"steps": steps, "seconds": time.perf_counter() - start, "loss": float(loss.detach())}


# FUSEDRL_CACHE_DIR: where fusedrl keeps what it can make again (here: warm-started base models);
# "off" keeps nothing. Unset: $XDG_CACHE_HOME/fusedrl, else ~/.cache/fusedrl.
CACHE_ENV = "FUSEDRL_CACHE_DIR"
# Written last into a cache entry (the fit's stats): an entry without it is not complete.
STATS_FILE = "warmstart.json"
CACHE_FORMAT = 1


def cache_root() -> Path | None:
    """The cache folder, or None when FUSEDRL_CACHE_DIR says "off"."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusedrl"


def cache_key(settings: dict) -> str:
    """A digest of `settings` (JSON values: what the fit depends on) and of the versions whose
    code computes it."""
    import transformers

    import fusedrl

    payload = {
        **settings,
        "format": CACHE_FORMAT,
        "fusedrl": fusedrl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _entry(settings: dict) -> Path | None:
    root = cache_root()
    return None if root is None else root / "warmstart" / cache_key(settings)


def cached(settings: dict) -> tuple[Path, dict] | None:
    """(the cached base model's folder, the stats of its fit), or None: no cache, no entry, or
    an incomplete or unreadable one."""
    entry = _entry(settings)
    if entry is None:
        return None
    try:
        stats = json.loads((entry / STATS_FILE).read_text())
        float(stats["seconds"]), float(stats["loss"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (entry / "config.json").exists():
        return None
    return entry, stats


def store(model_dir: Path, settings: dict, stats: dict) -> Path | None:
    """Copy the saved base model `model_dir` into the cache, whole or not at all (a temporary
    folder renamed into place); another process storing the same entry at once wins or loses
    the rename, either is fine. A cache that cannot be written is not the run's failure: None."""
    entry = _entry(settings)
    if entry is None or cached(settings) is not None:
        return None
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_dir, tmp)
        (tmp / STATS_FILE).write_text(json.dumps(stats))
        if entry.exists() and cached(settings) is None:  # an incomplete entry left by a crash
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)  # fails where another run's entry is in place now: theirs stays
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    return entry


def copy_cached(entry: Path, destination: Path) -> bool:
    """The cached base model into `destination` (its stats file left behind); False, and nothing
    left there, if it could not be read whole (another run replacing the entry at that moment)."""
    try:
        shutil.copytree(entry, destination, ignore=shutil.ignore_patterns(STATS_FILE))
    except OSError as exc:
        shutil.rmtree(destination, ignore_errors=True)
        if disk_nearly_full(destination):  # (fitting it again would fail to save it too)
            message = f"writing {destination}: no space left on device"
            raise WriteError(errno.ENOSPC, message) from exc
        return False
    return True
