"""The fusedrl training loop: GRPO-family RL with in-process vLLM rollouts and the fused loss.

What one step does, in order (DESIGN §7):

1. **Sample prompts.** `prompts_per_step` prompts from a seeded epoch stream (data-parallel ranks
   take disjoint slices). vLLM generates `group_size` completions per prompt with
   `SamplingParams(n=G, temperature, top_p, no top-k, max_tokens, logprobs=0)` and reports its
   processed log-probs (after the temperature). Each prompt's samples get their own seed, so a
   run is reproducible and a resumed run generates what the uninterrupted one would have.
2. **Rewards.** The weighted sum of the reward functions (`--reward`), plus DAPO's soft overlong
   punishment when `--overlong-buffer` > 0.
3. **Filters.** DAPO dynamic sampling drops groups whose rewards are all equal and generates more
   (up to `max_num_gen_batches` rounds, then trains on what it kept); DUPO instead refills the
   batch by duplicating kept groups; `--overlong-filter` masks truncated completions.
4. **Advantages** from `fusedrl.advantages` (one per sequence, broadcast over its tokens).
5. **Old / reference log-probs** with fusedrl's no-grad kernel: old log-probs only when the batch
   is reused (`ppo_epochs` > 1 or several minibatches; otherwise the loss uses logp.detach(),
   which is exact on-policy), reference log-probs only when beta > 0 (a frozen copy of the
   initial policy).
6. **Update.** `ppo_epochs` passes over `minibatches` contiguous minibatches (groups stay
   together); each minibatch accumulates micro-batch gradients of `fusedrl.policy_loss` (the
   preset's loss, ratio, clipping, KL and the train/inference IS correction from vLLM's
   log-probs) normalised by the global token or sequence count, clips the gradient norm and
   takes one AdamW step (linear warmup, then constant LR).
7. **Sync** the new weights into vLLM in place, reset its prefix cache; log; checkpoint.

Simplifications, on purpose: no value model (the family is critic-free), no reward model (rule
rewards), minibatches are not shuffled, and batch-level advantage statistics (LitePPO's and
REINFORCE++'s std) are per rank under data parallelism.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import json
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import fusedrl.advantages as adv
import fusedrl.backends
import fusedrl.trainer.checkpoint as checkpoint
from fusedrl import LossConfig
from fusedrl.entropy_control import AdaptiveEntropy
from fusedrl.linear import lm_head_of
from fusedrl.logit_transform import model_logit_transform

from .advantages import step_advantages
from .config import LOSS_OVERRIDES, TrainConfig
from .data import PromptSet, build_prompt_set, task_rows
from .distributed import (
    DistEnv,
    average_replicated_grads,
    broadcast_in_tp_group,
    check_tensor_parallel,
    clip_grad_norm,
    max_over_ranks,
    setup,
    shard,
    sum_over_ranks,
    teardown,
)
from .logger import MetricsLogger, plot
from .quiet import native_stderr_hidden
from .rewards import NEED_ANSWERS, exact_match, parse_rewards, score
from .rollout import HFEngine, Sample, VLLMEngine, full_state, vllm_available
from .step import (
    Batch,
    Distill,
    accumulate_gradients,
    collate,
    token_logprobs,
)

TINY_LR = 2e-4
# The rollout engines as the run summary names them.
ROLLOUT_NAMES = {"vllm": "vLLM", "hf": "transformers generate"}
# Without a terminal, a progress line every this many warm-start steps (--progress).
WARM_START_LINES_EVERY = 50
MODEL_LR = 1e-6


# What a run writes into its directory (and --overwrite removes; nothing else is touched).
RUN_ARTIFACTS = (
    "config.yaml",
    "metrics.jsonl",
    "checkpoints",
    "tensorboard",
    "final_model",
    "plots.png",
    "base_model",
)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _remove(run_dir: Path, names, ignore_errors: bool = False) -> None:
    """Delete these entries of a run directory (and nothing else in it)."""
    for name in names:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=ignore_errors)
        elif path.exists():
            path.unlink()


def _set_aside(run_dir: Path, names, aside: Path) -> None:
    """Move these entries of a run directory into `aside`, a hidden folder of it (renames:
    nothing is copied), whence `_put_back` restores them or `shutil.rmtree` drops them."""
    for name in names:
        if (run_dir / name).exists():
            (run_dir / name).rename(aside / name)


def _put_back(run_dir: Path, aside: Path) -> None:
    """The entries `_set_aside` moved, back in place of whatever took their names since."""
    for entry in aside.iterdir():
        _remove(run_dir, (entry.name,), ignore_errors=True)
        entry.rename(run_dir / entry.name)
    aside.rmdir()


OVERWRITTEN = ".overwritten-"


def recover_overwritten(run_dir: Path) -> list[str]:
    """Old runs an --overwrite had set aside when its process was killed (SIGKILL, the OOM
    killer) before its start finished: put back, in place of what that start had written (it
    trained no step: the folder goes as soon as the start succeeds). Their folder names."""
    found = sorted(run_dir.glob(OVERWRITTEN + "*"), key=lambda p: p.stat().st_mtime)
    if found:  # (every artifact of the old run was set aside: what is here, the start wrote)
        _remove(run_dir, (*RUN_ARTIFACTS, ".base_model.tmp"), ignore_errors=True)
    for aside in found:
        _put_back(run_dir, aside)
    return [p.name for p in found]


def claim_run_dir(run_dir: Path, cfg: TrainConfig) -> list[str]:
    """Never write over a run by accident: an --out that holds one is refused unless this is
    that run resumed (--resume pointing into it) or --overwrite replaces it. Returns what
    --overwrite sets aside while the new run starts, and removes once it has started
    (`Trainer._start`): a run that fails its start leaves the old one as it was."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file, not a directory")
    present = [name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    if not present:
        return []
    if cfg.resume:
        resumed = Path(cfg.resume)
        own = _same_dir(resumed, run_dir) or _same_dir(resumed.parent.parent, run_dir)
        if own:
            return []
    if not cfg.overwrite:
        saved = (run_dir / "checkpoints").is_dir() and checkpoint.checkpoints(
            run_dir / "checkpoints"
        )
        resume = f"pass --resume {run_dir} to continue it, " if saved else ""
        what = "a run" if saved else "a run that saved no checkpoint"
        raise ValueError(
            f"--out {run_dir} holds {what} ({', '.join(present)}): {resume}--overwrite to "
            "replace it, or another --out"
        )
    if cfg.model is not None and Path(cfg.model).exists():
        inside = [
            name
            for name in present
            if Path(cfg.model).resolve().is_relative_to((run_dir / name).resolve())
        ]
        if inside:
            raise ValueError(
                f"--model {cfg.model} is inside {run_dir / inside[0]}, which --overwrite would "
                "remove: copy the model out of the run first, or use another --out"
            )
    return present


# Held (flock) by the fusedrl-train writing a run directory, for as long as it runs: the kernel
# drops it when the process ends, however it ends, so a stale lock never blocks a later run.
LOCK_NAME = ".fusedrl-train.lock"


def lock_run_dir(run_dir: Path):
    """An exclusive lock on --out, or a ValueError when another fusedrl-train holds it (two runs
    into one directory would write, and on a failed start delete, each other's files)."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_NAME, "a")  # noqa: SIM115 - held until the trainer closes
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ValueError(
            f"--out {run_dir}: another fusedrl-train is writing to it (it holds {LOCK_NAME}): "
            "wait for it to end, or use another --out"
        ) from None
    return handle


def resumed_base_model(cfg: TrainConfig) -> Path | None:
    """The base model of the run `--resume` continues (checkpoints/step_N/ -> its run), if any."""
    if not cfg.resume or cfg.model is not None:
        return None
    ckpt = Path(cfg.resume)
    for run in (ckpt, ckpt.parent.parent):
        if (run / "base_model" / "config.json").exists():
            return run / "base_model"
    return None


def prepare_model(cfg: TrainConfig, run_dir: Path, rows: list[dict]) -> str:
    """The model path: `--model`, or the tiny Llama + char tokenizer built once in the run dir
    (warm-started on `rows`, the built-in task's, when that is the task: trainer/warmstart.py).
    A run resumed into another --out copies the resumed run's base model (the KL reference is
    that model, and the warm start need not run again)."""
    if cfg.model is not None:
        return cfg.model
    path = run_dir / "base_model"
    source = resumed_base_model(cfg)
    if not (path / "config.json").exists() and source is not None and source != path:
        tmp = run_dir / ".base_model.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        tmp.rename(path)
    if not (path / "config.json").exists():
        _build_base_model(cfg, run_dir, rows)
    return str(path)


def _build_base_model(cfg: TrainConfig, run_dir: Path, rows: list[dict]) -> None:
    """OUT/base_model: the tiny Llama + char tokenizer, warm-started on the built-in task, or
    copied from the warm-start cache when the same job fitted it before (trainer/warmstart.py)."""
    from fusedrl.tiny import char_tokenizer, tiny_llama

    from .data import render_prompt
    from .warmstart import cached, copy_cached, store, warm_start

    tokenizer = char_tokenizer()
    shape = dict(hidden_size=128, max_position_embeddings=128)
    tmp = run_dir / ".base_model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # The warm start (and its cache) serves the built-in task alone: a --dataset run's rows are
    # neither rendered nor keyed here.
    warm = cfg.dataset is None and cfg.warmstart_steps > 0
    hit = None
    if warm:
        prompts = [render_prompt(tokenizer, r["prompt"], cfg.system_prompt) for r in rows]
        answers = [r["answer"] for r in rows]
        settings = {
            "prompts": prompts,
            "answers": answers,
            "vocab": len(tokenizer),
            "model": shape,
            "steps": cfg.warmstart_steps,
            "noise": cfg.warmstart_noise,
            "seed": cfg.seed,
        }
        said = (
            f"fusedrl-train: warm start: {cfg.warmstart_steps} supervised steps on the sum task "
            f"({cfg.warmstart_noise:.0%} of the answers run on)"
        )
        hit = cached(settings)
        if hit is not None and not copy_cached(hit[0], tmp):
            hit = None  # fitted here instead
    if hit is not None:
        entry, stats = hit
        print(
            f"{said}, from the cache {entry} (fitted in {stats['seconds']:.0f} s, "
            f"loss {stats['loss']:.2f})"
        )
    else:
        model = tiny_llama(len(tokenizer), **shape, seed=cfg.seed)
        if warm:
            terminal = sys.stderr.isatty()
            stats = warm_start(
                model,
                tokenizer,
                prompts,
                answers,
                steps=cfg.warmstart_steps,
                noise=cfg.warmstart_noise,
                seed=cfg.seed,
                progress=cfg.progress and terminal,
                lines_every=WARM_START_LINES_EVERY if cfg.progress and not terminal else 0,
                said=said,
            )
            print(f"{said} in {stats['seconds']:.0f} s, loss {stats['loss']:.2f}")
        with checkpoint.writing(tmp):
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        if warm:
            store(tmp, settings, stats)
    tmp.rename(run_dir / "base_model")


def _sampling_failed(step: int, exc: RuntimeError, lr: float) -> Exception:
    """transformers' generate on a policy whose logits overflow (finite weights far out of
    range after an update: vLLM samples garbage and the update's loss is NaN, generate raises):
    the run's non-finite error naming the step, else the error as it was."""
    if "probability tensor contains" not in str(exc):
        return exc
    return NonFiniteError(
        f"step {step + 1}: sampling met non-finite probabilities: the policy's logits overflow "
        f"(its weights after the last update are finite but far out of range; --lr {lr:g}); no "
        "non-finite weights were saved"
    )


def _unloadable(ckpt: Path, model_path: str, exc: BaseException) -> str:
    """Why a checkpoint did not load: a file that cannot be read (cut short by a kill or a full
    disk, or corrupt: then the checkpoint before it is named) or one that does not fit."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    unreadable = isinstance(exc, (EOFError, pickle.UnpicklingError, json.JSONDecodeError)) or any(
        sign in first for sign in ("PytorchStreamReader", "failed finding central directory")
    )
    if "Weights only load failed" in str(exc):  # (a class torch.load refuses: not corrupt)
        unreadable = False
    if not unreadable:
        return f"--resume {ckpt}: the checkpoint does not fit the model {model_path} ({first})"
    step = checkpoint.step_of(ckpt) or 0
    earlier = [c for c in checkpoint.checkpoints(ckpt.parent) if checkpoint.step_of(c) < step]
    instead = f"; the one before it is complete: --resume {earlier[-1]}" if earlier else ""
    return (
        f"--resume {ckpt}: a file of the checkpoint cannot be read: it is truncated or corrupt "
        f"({first}){instead}"
    )


def check_teacher_dir(path: str) -> None:
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"--distill-teacher {path}: not a model directory (no config.json)")


# OSErrors of the machine, not of the model's name: raised as they are.
_MACHINE_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EACCES, errno.EROFS, errno.EDQUOT)


@contextlib.contextmanager
def _loading(option: str, path: str):
    """transformers' OSError for a model it cannot load (no such folder or hub id, no network,
    a folder without weights) as one error line naming the option; a full disk, an I/O or a
    permission error stays what it is."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _MACHINE_ERRNOS:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{option} {path}: cannot be loaded as a local model folder or a hub id ({first})"
        ) from None


def load_teacher(path: str, student):
    """The distillation teacher at `path` (a local model directory, fp32 like the policy's
    master weights), checked against the student: the same vocabulary, so that their next-token
    distributions are over the same ids."""
    from transformers import AutoModelForCausalLM

    check_teacher_dir(path)
    with _loading("--distill-teacher", path):
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = student.get_output_embeddings().weight.shape[0]
    teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
    if teacher_vocab != vocab:
        raise ValueError(
            f"--distill-teacher {path}: its head has {teacher_vocab} tokens but the policy's has "
            f"{vocab}: the teacher must share the policy's vocabulary (tokenizer)"
        )
    teacher.config.use_cache = False
    return teacher


def _dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.env: DistEnv = setup(cfg.tp)
        if cfg.prompts_per_step < self.env.dp_size:
            raise ValueError(
                f"--prompts-per-step {cfg.prompts_per_step} is below the number of data-parallel "
                f"ranks ({self.env.dp_size}): every rank needs at least one prompt"
            )
        self.run_dir = Path(cfg.out)
        self.replaced: list[str] = []  # what --overwrite replaces
        # where --overwrite moved the old run while the new one starts: put back if the start
        # fails (any check, a Ctrl-C in the warm start), deleted once it has succeeded
        self.set_aside: Path | None = None
        self._lock = None
        existed = self.run_dir.exists()
        if self.env.is_main:
            if self.run_dir.is_dir() and any(self.run_dir.glob(OVERWRITTEN + "*")):
                self._lock = lock_run_dir(self.run_dir)  # (recovered under the lock)
                recovered = recover_overwritten(self.run_dir)
                print(
                    f"fusedrl-train: put back the run in {self.run_dir} that an interrupted "
                    f"--overwrite had set aside ({', '.join(recovered)})"
                )
            try:
                self.replaced = claim_run_dir(self.run_dir, cfg)
            except ValueError:
                self._unlock()
                raise
            if self._lock is None:
                self._lock = lock_run_dir(self.run_dir)
        fresh = not any((self.run_dir / name).exists() for name in RUN_ARTIFACTS)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            # A failed start leaves nothing behind: no base model or config of a run that never
            # ran (a fresh --out, or one whose old run --overwrite had set aside: that run is
            # put back as it was; a resumed run's directory is left as it was).
            if self.env.is_main and (fresh or self.set_aside is not None):
                _remove(self.run_dir, (*RUN_ARTIFACTS, ".base_model.tmp"), ignore_errors=True)
                if self.set_aside is not None:
                    _put_back(self.run_dir, self.set_aside)
                elif not existed:
                    _remove(self.run_dir, (LOCK_NAME,), ignore_errors=True)
                    if not any(self.run_dir.iterdir()):
                        self.run_dir.rmdir()
            self._unlock()
            raise
        if self.set_aside is not None:  # the new run has started: the old one goes
            shutil.rmtree(self.set_aside, ignore_errors=True)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # (closing the file drops its flock)
            self._lock = None

    def _start(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        # Everything that can be wrong with the data, the rewards, the backend or the teacher
        # fails here, before the base model (a warm start of seconds to minutes) is built.
        rows = task_rows(cfg)
        self.rewards = parse_rewards(cfg.reward)
        if cfg.dataset is not None and not cfg.answer_column:
            compared = [r.name for r in self.rewards if r.name in NEED_ANSWERS]
            if compared:
                raise ValueError(
                    f"--reward {compared[0]} compares each completion with the answer column, "
                    "and --answer-column is empty (no answers): name the column, or use rewards "
                    "that need none"
                )
        fusedrl.backends.check_runnable(cfg.backend, self.env.device, f"--backend {cfg.backend}")
        if cfg.distill_teacher:
            check_teacher_dir(cfg.distill_teacher)
        if self.replaced:  # --overwrite: out of the new run's way, back if its start fails
            self.set_aside = Path(tempfile.mkdtemp(prefix=OVERWRITTEN, dir=self.run_dir))
            _set_aside(self.run_dir, self.replaced, self.set_aside)
            self.replaced = []
        model_path = prepare_model(cfg, self.run_dir, rows) if self.env.is_main else None
        if self.env.world_size > 1:
            import torch.distributed as dist

            box = [model_path]
            dist.broadcast_object_list(box)
            model_path = box[0]
        # (without --model, the base model this run built: its failure is no bad flag's)
        option = "--model" if cfg.model is not None else "the base model"
        with _loading(option, model_path):
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.prompts: PromptSet = build_prompt_set(cfg, self.tokenizer, rows)
        self.loss_cfg: LossConfig = cfg.loss_config()
        self.compute_dtype = _dtype(cfg, self.env.device)
        # Master weights stay fp32; the forward runs under autocast in the compute dtype, so the
        # logits the fused loss reads are bf16 on a GPU.
        with _loading(option, model_path):
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        max_len = max(len(ids) for ids in self.prompts.token_ids) + cfg.max_tokens
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(
                f"--max-tokens {cfg.max_tokens} plus the longest prompt "
                f"({max_len - cfg.max_tokens} tokens) exceed the model's "
                f"max_position_embeddings={limit}"
            )
        model.config.use_cache = False
        check_tensor_parallel(model, cfg.tp, self.env.dp_size)
        self.ref_model = None
        if self.loss_cfg.beta > 0 or self.loss_cfg.full_kl:  # full: the "kl" metric at beta 0
            self.ref_model = shard(copy.deepcopy(model).to(self.env.device).eval(), self.env)
            self.ref_model.requires_grad_(False)
        self.teacher, self.distill, teacher = None, None, None
        if cfg.distill_teacher is not None:
            teacher = load_teacher(cfg.distill_teacher, model)
            self.teacher = shard(teacher.to(self.env.device).eval(), self.env)
            self.teacher.requires_grad_(False)
            self.distill = Distill(cfg.distill_kind, cfg.distill_coef, cfg.distill_beta)
        self.model = shard(model.to(self.env.device), self.env)
        # Under FSDP the head's forward hooks gather its weight: the loss must call the head.
        # Under --tp alone (one data-parallel rank) each rank holds its rows of the head: the
        # fused loss takes them with the tp group. A teacher's head must be plain too.
        # A soft cap or logit scale after the head (Gemma, Cohere) is applied by the loss (the
        # library's tensor-parallel head takes it too; under --tp the trainer keeps materialised
        # logits for such models until a run tests it); a teacher's head must be plain too.
        transformed = any(v is not None for v in model_logit_transform(model).values())
        self.lm_head = (
            cfg.fused_lm_head
            and self.env.dp_size == 1
            and lm_head_of(model) is not None
            and not (transformed and cfg.tp > 1)
            and (teacher is None or lm_head_of(teacher) is not None)
        )
        self.lr = cfg.lr if cfg.lr is not None else (TINY_LR if cfg.model is None else MODEL_LR)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.lr, weight_decay=cfg.weight_decay
        )
        self.sas = adv.SmoothAdvantageStandardizer() if cfg.advantage == "dcpo_sas" else None
        self.entropy_control = None
        if cfg.entropy_target is not None:
            self.entropy_control = AdaptiveEntropy(
                cfg.entropy_target, *cfg.entropy_control(), cfg.initial_entropy_coef()
            )
            # One device scalar for the run, refilled before each optimizer step: the loss
            # reads it on the device (no recompile, no host sync when it changes).
            self.entropy_coef = torch.zeros((), device=self.env.device)
        self.start_step, self.cursor = 0, 0
        self.skipped_nonfinite = 0
        resume_step = None
        if cfg.resume:
            ckpt = checkpoint.resolve(cfg.resume)
            try:
                state, extra = checkpoint.load(ckpt, self.model, self.optimizer)
            except (RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError) as exc:
                raise ValueError(_unloadable(ckpt, model_path, exc)) from None
            self.start_step, self.cursor = state["step"], state["cursor"]
            self.skipped_nonfinite = state.get("skipped_nonfinite", 0)
            resume_step = self.start_step
            # A run that reached --max-steps but never wrote its final model (killed, or the
            # disk full, after the last checkpoint) is finished: no step, the export.
            exported = (self.run_dir / "final_model" / "config.json").exists()
            if self.start_step > cfg.max_steps or (self.start_step == cfg.max_steps and exported):
                raise ValueError(
                    f"--resume {ckpt}: the checkpoint is at step {self.start_step}, "
                    f"--max-steps is {cfg.max_steps}: nothing left to train; pass a "
                    "larger --max-steps"
                )
            if self.env.is_main:
                finishing = (
                    ": it reached --max-steps; writing its final model"
                    if self.start_step == cfg.max_steps
                    else ""
                )
                print(f"fusedrl-train: resumed from step {self.start_step} ({ckpt}){finishing}")
            if self.sas is not None and extra.get("sas") is not None:
                self.sas.load_state_dict(extra["sas"])
            if self.entropy_control is not None and extra.get("entropy_control") is not None:
                self.entropy_control.load_state_dict(extra["entropy_control"])
        self.rollout_engine = (
            "hf"
            if cfg.rollout == "hf" or (cfg.rollout == "auto" and not vllm_available())
            else "vllm"
        )
        if self.env.is_main:
            resolved = self.resolved_config()
            chosen = " (auto)" if cfg.rollout == "auto" else ""
            compute = (
                f"{self.env.device.type}, {resolved.dtype}, loss backend {resolved.backend}, "
                f"rollouts {ROLLOUT_NAMES[self.rollout_engine]}{chosen}"
            )
            print(
                run_summary(
                    cfg,
                    self.loss_cfg,
                    model_path,
                    len(self.prompts),
                    self.lr,
                    self.run_dir,
                    compute,
                )
            )
        if self.rollout_engine == "hf":
            self.engine = HFEngine(self.model, self.tokenizer, self.compute_dtype, self.env.device)
        else:
            with native_stderr_hidden(cfg.verbose):
                self.engine = VLLMEngine(
                    model_path,
                    cfg,
                    max_len,
                    self.compute_dtype,
                    self.env.device,
                    distributed=self.env.world_size > 1,
                )
        # Only now that everything has started does the run directory change: a start that
        # fails (an engine without memory, say) leaves a resumed run as it was.
        if self.env.is_main:
            if resume_step is not None and _same_dir(ckpt.parent.parent, self.run_dir):
                for moved in checkpoint.set_aside_after(ckpt.parent, self.start_step):
                    print(
                        f"fusedrl-train: {moved.name}: a later checkpoint of the run this "
                        f"one resumes from step {self.start_step}, set aside"
                    )
            (self.run_dir / "config.yaml").write_text(self.resolved_config().to_yaml())
        if resume_step is not None:
            self.engine.sync_weights(full_state(self.model))
        self.logger = (
            MetricsLogger(self.run_dir, cfg.tensorboard, resume_step) if self.env.is_main else None
        )
        if self.logger is not None and resume_step is None:
            self.logger.log_config(dataclasses.asdict(self.resolved_config()))

    def resolved_config(self) -> TrainConfig:
        """The options as this run resolved them (config.yaml, TensorBoard's hparams): the
        learning rate, the loss's settings the preset filled in, the compute dtype, the loss
        backend and the rollout engine, where "auto" / unset stood; a --resume of the run
        continues with the same."""
        cfg, lcfg = self.cfg, self.loss_cfg
        losses = {name: getattr(lcfg, name) for name in LOSS_OVERRIDES}
        if cfg.entropy_target is not None:  # (the loss's 0: the controller's scalar stands in)
            losses["entropy_coef"] = cfg.initial_entropy_coef()
        backend = fusedrl.backends.resolve(cfg.backend, self.env.device).__name__
        return dataclasses.replace(
            cfg,
            **losses,
            lr=self.lr,
            dtype=str(self.compute_dtype).removeprefix("torch."),
            backend=backend.rsplit(".", 1)[-1].removesuffix("_backend"),
            rollout=self.rollout_engine,
        )
        self.last_samples: list[tuple[str, str, float]] = []

    # --- 1-3: rollouts, rewards, filters -------------------------------------------------
    def _prompt_slice(self) -> list[int]:
        """This rank's stream positions for one generation round."""
        cfg, env = self.cfg, self.env
        positions = range(self.cursor, self.cursor + cfg.prompts_per_step)
        self.cursor += cfg.prompts_per_step
        return list(positions)[env.dp_rank :: env.dp_size]  # the "tp" ranks share a slice

    def _generate_round(self) -> tuple[list[list[Sample]], torch.Tensor, dict, list[bool]]:
        cfg = self.cfg
        positions = self._prompt_slice()
        indices = [self.prompts.take(pos, 1, cfg.seed)[0] for pos in positions]
        seeds = [(cfg.seed * 1_000_003 + pos) * cfg.group_size for pos in positions]
        groups = self.engine.generate(
            [self.prompts.token_ids[i] for i in indices], indices, seeds, cfg
        )
        samples = [s for g in groups for s in g]
        rows = [self.prompts.rows[s.prompt_index] for s in samples]
        texts = self.tokenizer.batch_decode(
            [s.completion_ids for s in samples], skip_special_tokens=True
        )
        columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
        values, per_fn = score(self.rewards, [row["prompt"] for row in rows], texts, columns)
        answers = columns.get("answer")
        correct = (
            [exact_match(t, a) for t, a in zip(texts, answers) if a is not None]
            if answers is not None
            else []
        )
        rewards = torch.tensor(values, dtype=torch.float32)
        if cfg.overlong_buffer > 0:
            lengths = torch.tensor([len(s.completion_ids) for s in samples])
            rewards = rewards + cfg.overlong_penalty_factor * adv.soft_overlong_punishment(
                lengths, cfg.max_tokens, cfg.overlong_buffer
            )
        # A few of the round's completions for TensorBoard's text tab (the first of each group).
        self.last_samples = [
            (str(rows[i]["prompt"]), texts[i], float(rewards[i]))
            for i in range(0, len(samples), cfg.group_size)
        ][:8]
        # --tp: the ranks of a "tp" group must train on the same batch (the loss checks that the
        # labels agree). Their engines sample the same prompts with the same seeds, but nothing
        # makes two GPUs' samples or a user's reward function bit-identical: tp-rank 0's round
        # is everyone's.
        result = (groups, rewards, per_fn, correct, self.last_samples)
        groups, rewards, per_fn, correct, self.last_samples = broadcast_in_tp_group(
            result, self.env
        )
        return groups, rewards, per_fn, correct

    def rollout(self) -> tuple[list[Sample], torch.Tensor, dict]:
        """Samples and rewards of the batch to train on, and the generation metrics."""
        cfg, G = self.cfg, self.cfg.group_size
        wanted = len(range(self.env.dp_rank, cfg.prompts_per_step, self.env.dp_size))
        kept_groups: list[list[Sample]] = []
        kept_rewards: list[torch.Tensor] = []
        all_rewards, all_samples, per_fn_means, all_correct = [], [], {}, []
        max_rounds = cfg.max_num_gen_batches if cfg.dynamic_sampling else 1
        rounds = 0
        while True:
            groups, rewards, per_fn, correct = self._generate_round()
            all_correct += correct
            rounds += 1
            all_rewards.append(rewards)
            all_samples += [s for g in groups for s in g]
            for name, value in per_fn.items():
                per_fn_means.setdefault(name, []).append(value)
            if cfg.dynamic_sampling:
                keep = adv.dynamic_sampling_filter(rewards, G).tolist()
                kept_groups += [g for g, k in zip(groups, keep) if k]
                kept_rewards += [r for r, k in zip(rewards.view(-1, G), keep) if k]
            else:
                kept_groups, kept_rewards = groups, list(rewards.view(-1, G))
            short = len(kept_groups) < wanted and rounds < max_rounds
            if max_over_ranks(int(short)) == 0:
                break
        if not kept_groups:  # nothing had signal: train on the last round (zero advantages)
            kept_groups, kept_rewards = groups, list(rewards.view(-1, G))
        kept_groups, kept_rewards = kept_groups[:wanted], kept_rewards[:wanted]
        rewards = torch.stack(kept_rewards)
        if cfg.dupo:
            keep = adv.dynamic_sampling_filter(rewards.reshape(-1), G)
            if bool(keep.any()):
                order = adv.dupo_fill(keep, len(kept_groups)).tolist()
                kept_groups = [kept_groups[i] for i in order]
                rewards = rewards[order]
        everything = torch.cat(all_rewards)
        lengths = torch.tensor([len(s.completion_ids) for s in all_samples], dtype=torch.float32)
        stats = {
            "reward_mean": everything.mean(),
            "reward_std": everything.std() if everything.numel() > 1 else torch.zeros(()),
            "frac_zero_std": (~adv.dynamic_sampling_filter(everything, G)).float().mean(),
            "response_len_mean": lengths.mean(),
            "truncated_frac": torch.tensor([s.truncated for s in all_samples]).float().mean(),
            "gen_rounds": torch.tensor(float(rounds)),
        }
        if all_correct:  # the share of completions that solve the task exactly
            stats["accuracy"] = torch.tensor(sum(all_correct) / len(all_correct))
        for name, values in per_fn_means.items():
            stats[f"reward/{name}"] = torch.tensor(sum(values) / len(values))
        return [s for g in kept_groups for s in g], rewards.reshape(-1), stats

    # --- 4: advantages ---------------------------------------------------------------------
    def advantages(self, samples: list[Sample], rewards: torch.Tensor) -> torch.Tensor:
        """One per sequence, over the whole step's rewards (every data-parallel rank's)."""
        G = self.cfg.group_size
        keys = [samples[i].prompt_index for i in range(0, len(samples), G)]
        return step_advantages(self.cfg.advantage, rewards, keys, G, self.env, self.sas)

    # --- 5-6: old/ref log-probs and the update ---------------------------------------------
    def _autocast(self) -> torch.dtype | None:
        return None if self.compute_dtype == torch.float32 else self.compute_dtype

    def update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        cfg, lcfg = self.cfg, self.loss_cfg
        mb = cfg.micro_batch_size
        # Decoupled PPO's proximal policy is the one before this update: recomputed as for reuse.
        reuse = cfg.ppo_epochs > 1 or cfg.minibatches > 1 or cfg.decoupled
        self.model.eval()  # no dropout: the ratio is exactly 1 on-policy
        metrics: dict[str, torch.Tensor] = {}
        # (the micro-batches, precision, backend, head and packing of the update itself)
        layout = (mb, self._autocast(), cfg.backend, self.lm_head, cfg.pack)
        layout += (cfg.max_tokens_per_microbatch,)
        if reuse:
            batch.old_logp = token_logprobs(self.model, batch, lcfg, *layout)
            if batch.rollout_logp is not None:
                diff = (batch.old_logp - batch.rollout_logp).abs() * batch.mask
                metrics["logp_diff_rollout"] = diff.sum() / batch.mask.sum().clamp_min(1)
        if self.ref_model is not None and not lcfg.full_kl:
            batch.ref_logp = token_logprobs(self.ref_model, batch, lcfg, *layout)
        warmup = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * warmup
        n = len(batch)
        # Dynamic sampling can keep fewer sequences than --minibatches: an empty minibatch would
        # take an optimizer step with no gradient (and no entropy to steer by). As many
        # minibatches as the fullest rank has sequences, at most --minibatches (a collective:
        # every rank steps alike).
        count = max(1, min(cfg.minibatches, max_over_ranks(n)))
        bounds = [round(i * n / count) for i in range(count + 1)]
        sums: dict[str, torch.Tensor] = {}
        updates = 0
        for _ in range(cfg.ppo_epochs):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                self.optimizer.zero_grad(set_to_none=True)
                mini = batch.rows(slice(lo, hi))
                entropy_coef = None
                if self.entropy_control is not None:
                    entropy_coef = self.entropy_coef.fill_(self.entropy_control.applied())
                step_metrics = accumulate_gradients(
                    self.model,
                    mini,
                    lcfg,
                    mb,
                    self._autocast(),
                    cfg.backend,
                    lm_head=self.lm_head,
                    dp_group=self.env.dp_group,
                    ref_model=self.ref_model if lcfg.full_kl else None,
                    teacher=self.teacher,
                    distill=self.distill,
                    decoupled=cfg.decoupled,
                    entropy_coef=entropy_coef,
                    pack=cfg.pack,
                    max_tokens=cfg.max_tokens_per_microbatch,
                )
                average_replicated_grads(self.model, self.env)
                clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
                step_metrics["grad_norm"] = clip_grad_norm(self.model.parameters(), clip)
                if not self._finite_update(step, step_metrics):
                    self.optimizer.zero_grad(set_to_none=True)
                    continue  # skipped (--skip-nonfinite-steps): no optimizer step
                try:
                    self.optimizer.step()
                except RuntimeError as exc:  # AdamW's lr / (1 - beta1^t) past fp32 (lr ~3e37)
                    if "without overflow" not in str(exc):
                        raise
                    raise NonFiniteError(
                        f"step {step + 1}: the optimizer's step overflows fp32 (--lr "
                        f"{self.lr:g}) part way through the update: the weights in memory are "
                        "not to be trusted, and none were saved (the last checkpoint is intact)"
                    ) from None
                if self.entropy_control is not None:
                    step_metrics["entropy_coef"] = entropy_coef.clone()
                    self._steer_entropy(mini, step_metrics)
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value.detach().float()
                updates += 1
        for key, value in sums.items():
            metrics[key] = value / max(updates, 1)
        metrics["lr"] = torch.tensor(self.lr * warmup)
        metrics["skipped_nonfinite"] = torch.tensor(float(self.skipped_nonfinite))
        return metrics

    def _steer_entropy(self, mini: Batch, step_metrics: dict[str, torch.Tensor]) -> None:
        """Adaptive entropy control after an optimizer step: the step's mean token entropy over
        every data-parallel rank (token-weighted, as the step's metrics) moves the coefficient
        for the next step. One host read per optimizer step."""
        count = mini.mask.sum().float()
        totals = torch.stack([step_metrics["entropy"].detach().float() * count, count])
        totals = sum_over_ranks(totals, self.env.dp_group)
        self.entropy_control.update(float(totals[0] / totals[1].clamp_min(1.0)))

    def _finite_update(self, step: int, step_metrics: dict[str, torch.Tensor]) -> bool:
        """(`step`: the loop's index, from 0; the message numbers it from 1, as the logs.)
        Whether this optimizer step may be applied: loss and gradient norm finite. One scalar
        host read per optimizer step (the loss kernels themselves never sync). A non-finite one
        stops the run naming the step, or is skipped and counted under --skip-nonfinite-steps."""
        watched = {k: step_metrics[k] for k in ("loss", "grad_norm") if k in step_metrics}
        values = torch.stack([v.detach().float().reshape(()) for v in watched.values()])
        finite = torch.isfinite(sum_over_ranks(values)).tolist()  # every rank decides alike
        if all(finite):
            return True
        bad = ", ".join(
            f"{name} = {float(v)}" for (name, v), ok in zip(watched.items(), finite) if not ok
        )
        self.skipped_nonfinite += 1
        allowed = self.cfg.skip_nonfinite_steps
        if self.skipped_nonfinite > allowed:
            advice = (
                "Pass --skip-nonfinite-steps N to skip up to N such updates."
                if allowed == 0
                else f"More than --skip-nonfinite-steps={allowed} updates were non-finite."
            )
            raise NonFiniteError(
                f"step {step + 1}: {bad}; the update was not applied and no non-finite weights "
                f"were saved (the last checkpoint is intact). " + advice
            )
        return False

    def _check_weights(self, step: int, what: str) -> None:
        """Never write non-finite weights (a checkpoint, the final model)."""
        for name, param in self.model.named_parameters():
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            if not bool(torch.isfinite(tensor).all()):
                raise NonFiniteError(
                    f"step {step + 1}: parameter {name!r} holds non-finite values; {what} was not "
                    "written (the last checkpoint is intact)"
                )

    def close(self, finished: bool = False) -> None:
        """vLLM first (it tears down the process groups it uses), then our own group
        (`finished`: the run ended normally on every rank)."""
        self.engine.close()
        teardown(self.env, finished)
        self._unlock()

    # --- the loop ------------------------------------------------------------------------
    def train(self) -> Path:
        cfg = self.cfg
        bar = None
        # A terminal gets a progress bar; a log file (CI, nohup, a cluster job) a line every
        # --log-every steps instead of a redrawn bar's control characters.
        lines = self.env.is_main and cfg.progress and not sys.stderr.isatty()
        if cfg.progress and self.env.is_main and not lines:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.max_steps,
                initial=self.start_step,
                desc="fusedrl-train",
                unit="step",
                dynamic_ncols=True,
            )
        self._install_stop_handlers()
        for step in range(self.start_step, cfg.max_steps):
            t0 = time.perf_counter()
            self.engine.wake_up()
            try:
                samples, rewards, gen_stats = self.rollout()
            except RuntimeError as exc:
                error = _sampling_failed(step, exc, self.lr)
                if error is exc:
                    raise
                raise error from None
            self.engine.sleep()
            t1 = time.perf_counter()
            advantages = self.advantages(samples, rewards)
            truncated = torch.tensor([s.truncated for s in samples])
            loss_rows = ~truncated if cfg.overlong_filter else torch.ones_like(truncated)
            batch = collate(
                [s.prompt_ids for s in samples],
                [s.completion_ids for s in samples],
                advantages,
                loss_rows,
                [s.logprobs for s in samples],
                self.pad_id,
            )
            batch = batch.to(self.env.device)
            self.model.train()
            train_metrics = self.update(batch, step)
            self.engine.wake_up()
            self.engine.sync_weights(full_state(self.model))
            t2 = time.perf_counter()
            # Steps are numbered from 1 everywhere: the console's N/M, metrics.jsonl, TensorBoard,
            # the checkpoint step_N after them, the stop message.
            record = self._record(step + 1, gen_stats, train_metrics, advantages, t0, t1, t2)
            if self.logger is not None:
                self.logger.log(record)
                if step % cfg.log_every == 0:
                    self.logger.log_samples(step + 1, self.last_samples)
            if bar is not None:  # the postfix first: the update draws this step's numbers
                bar.set_postfix_str(progress_line(record), refresh=False)
                bar.update(1)
            elif lines and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.max_steps):
                print(
                    f"fusedrl-train: step {step + 1}/{cfg.max_steps} {progress_line(record)}",
                    flush=True,
                )
            stop = max_over_ranks(int(self.stop_signal is not None)) > 0  # every rank alike
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.max_steps or stop:
                self._check_weights(step, "the checkpoint")
                extra = {
                    "sas": self.sas.state_dict() if self.sas is not None else None,
                    "entropy_control": None
                    if self.entropy_control is None
                    else self.entropy_control.state_dict(),
                }
                state = {"cursor": self.cursor, "skipped_nonfinite": self.skipped_nonfinite}
                checkpoint.save(
                    self.run_dir, step + 1, self.model, self.optimizer, state, extra, cfg.keep_last
                )
            if stop and step + 1 < cfg.max_steps:
                if bar is not None:
                    bar.close()
                if self.logger is not None:
                    self.logger.close()
                    plot(self.run_dir)
                raise Stopped(step + 1, self.stop_signal or signal.SIGTERM, self.run_dir)
        if bar is not None:
            bar.close()
        self._check_weights(cfg.max_steps - 1, "final_model")
        checkpoint.export_model(self.run_dir, self.model, self.tokenizer)
        if self.logger is not None:
            self.logger.close()
            plot(self.run_dir)
        return self.run_dir

    def _install_stop_handlers(self) -> None:
        """SIGINT / SIGTERM: finish the current step, checkpoint it, stop (Stopped). A second
        one aborts at once; the last checkpoint on disk is complete either way."""
        self.stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            name = signal.Signals(signum).name
            if self.stop_signal is not None:
                print(
                    f"\nfusedrl-train: {name} again: aborting now; the last checkpoint in "
                    f"{self.run_dir / 'checkpoints'} is complete",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(128 + signum)
            self.stop_signal = signum
            print(
                f"\nfusedrl-train: {name}: stopping after the current step (send it again to "
                "abort now)",
                file=sys.stderr,
                flush=True,
            )

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_stop)

    def _record(self, step, gen_stats, train_metrics, advantages, t0, t1, t2) -> dict:
        values = {**gen_stats, **train_metrics, "advantage_abs_mean": advantages.abs().mean()}
        # One host transfer per device for every metric of the step (the only sync of the update).
        by_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        for name, value in values.items():
            value = torch.as_tensor(value).float().reshape(())
            by_device.setdefault(value.device, {})[name] = value
        record = {"step": step}
        for group in by_device.values():
            stacked = torch.stack(list(group.values()))
            # Under data parallelism every rank logs the mean over ranks (equal shares of prompts;
            # the "tp" ranks of a data-parallel rank hold the same values).
            stacked = sum_over_ranks(stacked) / self.env.world_size
            record.update(zip(group, stacked.tolist()))
        if "loss" in record:  # each data-parallel rank's loss is its share of the global loss
            record["loss"] *= self.env.dp_size
        for key in (
            "kl",
            "clipfrac",
            "clip_low",
            "clip_high",
            "is_weight_mean",
            "entropy",
            "logp_diff_rollout",
        ):
            record.setdefault(key, 0.0 if key != "is_weight_mean" else 1.0)
        record.update(step_time=t2 - t0, gen_time=t1 - t0, train_time=t2 - t1)
        return record


def describe_loss(lcfg: LossConfig) -> str:
    """The loss in one line: variant, ratio level, clip range, aggregation, KL, extras."""
    parts = [lcfg.loss + (" (sequence ratio)" if lcfg.ratio_level == "sequence" else "")]
    if lcfg.loss in ("ppo", "luspo", "cispo", "dcpo", "gmpo", "clip_cov"):
        parts.append(f"clip {lcfg.eps_low:g}/{lcfg.eps_high:g}")
    if lcfg.loss == "clip_cov":
        parts.append(f"cov ({lcfg.clip_cov_lb:g}, {lcfg.clip_cov_ub:g}) x {lcfg.clip_cov_ratio:g}")
    if lcfg.loss == "kl_cov":
        parts.append(f"|log r| x {lcfg.kl_cov_coef:g} on top {lcfg.kl_cov_ratio:g} by cov")
    if lcfg.loss in ("dppo_tv", "dppo_kl"):
        region = f"{lcfg.eps_low:g}/{lcfg.eps_high:g}"
        parts.append(f"trust region {region}, cap {lcfg.dppo_ratio_cap:g}")
    if lcfg.loss == "dro":
        parts.append(f"beta {lcfg.dro_beta:g}")
    if lcfg.dual_clip_c is not None:
        parts.append(f"dual clip {lcfg.dual_clip_c:g}")
    parts.append(lcfg.agg)
    parts.append(f"KL {lcfg.kl} x {lcfg.beta:g}" if lcfg.beta > 0 else "no KL")
    if lcfg.entropy_coef:
        parts.append(f"entropy bonus {lcfg.entropy_coef:g}")
    if lcfg.is_correction:
        parts.append(f"IS {lcfg.is_correction} cap {lcfg.is_cap:g}")
    if lcfg.kl_bias_correction and lcfg.beta > 0:
        parts.append("KL x ratio")
    if lcfg.off_policy_mask is not None:
        parts.append(f"off-policy mask {lcfg.off_policy_mask:g}")
    if lcfg.rejection is not None:
        parts.append(f"rejection {lcfg.rejection} @ {lcfg.rejection_threshold}")
    if lcfg.trust_region_delta is not None:
        parts.append(
            f"trust-region mask {lcfg.trust_region_mode} |log r| <= {lcfg.trust_region_delta:g}"
        )
    if lcfg.sampling is not None:
        parts.append(f"log-probs over the sampled set (top_p {lcfg.top_p:g})")
    if lcfg.top_entropy_quantile < 1:
        parts.append(f"top {lcfg.top_entropy_quantile:g} entropy tokens")
    return ", ".join(parts)


def run_summary(
    cfg: TrainConfig,
    lcfg: LossConfig,
    model_path: str,
    num_prompts: int,
    lr: float,
    run_dir: Path,
    compute: str | None = None,
) -> str:
    """What a person checks before a run: a few lines (config.yaml holds every option).
    `compute`: the device, dtype, loss backend and rollout engine the run resolved."""
    model = (
        f"tiny Llama, warm-started on the task ({model_path})" if cfg.model is None else model_path
    )
    task = "built-in sum task" if cfg.dataset is None else cfg.dataset
    rows = [
        ("model", model),
        ("task", f"{task}, {num_prompts} prompts, reward {cfg.reward}"),
        ("algorithm", f"preset {cfg.preset}: {describe_loss(lcfg)}; advantage {cfg.advantage}"),
        (
            "batch",
            f"{cfg.prompts_per_step} prompts x {cfg.group_size} samples, at most "
            f"{cfg.max_tokens} tokens, temperature {cfg.temperature:g}",
        ),
        ("optimizer", f"AdamW lr {lr:g}, {cfg.max_steps} steps, grad clip {cfg.grad_clip:g}"),
        *([("compute", compute)] if compute else []),
        ("out", f"{run_dir} (every option in config.yaml)"),
    ]
    if cfg.distill_teacher is not None:
        beta = f", beta {cfg.distill_beta:g}" if cfg.distill_kind == "jsd" else ""
        rows.insert(
            3,
            ("teacher", f"{cfg.distill_teacher}: {cfg.distill_kind} x {cfg.distill_coef:g}{beta}"),
        )
    return "fusedrl-train:\n" + "\n".join(f"  {name:<10} {value}" for name, value in rows)


def progress_line(record: dict) -> str:
    """What the progress bar and the log lines show of a step."""
    parts = [f"reward {record['reward_mean']:.3f}"]
    if "accuracy" in record:
        parts.append(f"accuracy {record['accuracy']:.2f}")
    parts += [f"len {record['response_len_mean']:.1f}", f"{record['step_time']:.1f} s/step"]
    return ", ".join(parts)


class Stopped(Exception):
    """The run stopped on a signal after a completed, checkpointed step."""

    def __init__(self, step: int, signum: int, run_dir: Path) -> None:
        """`step`: the last step done, numbered from 1 (its checkpoint is step_<step>)."""
        self.step, self.signum, self.run_dir = step, int(signum), run_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped on {name} after step {step}; checkpoint "
            f"{run_dir}/checkpoints/step_{step:06d}; continue with "
            f"fusedrl-train --resume {run_dir}"
        )


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or weight went NaN / inf: the run stops without saving it."""


def train(cfg: TrainConfig) -> Path:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
