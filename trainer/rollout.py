"""vLLM in-process rollouts: G samples per prompt with the sampler's own log-probs, weight sync.

The engine runs in the trainer's process (colocated), so the weight sync is a tensor copy, not a
network transfer. `logprobs_mode="processed_logprobs"` makes vLLM report log-probs after the
temperature, which is what the trainer computes from logits / T: the two agree up to kernel
numerics (the run logs the gap as `logp_diff_rollout`).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .distributed import whole_logits, world_size


@dataclass
class Sample:
    prompt_index: int  # into the PromptSet
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # vLLM's processed log-prob of each completion token
    truncated: bool  # hit max_tokens without finishing


def full_state(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) pairs of a model, gathering FSDP2 shards (DTensor) as needed."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


class VLLMEngine:
    def __init__(
        self,
        model_path: str,
        cfg,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        distributed: bool,
    ) -> None:
        # In-process engine core: the trainer and vLLM share one process and its weights.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM logs every weight reload and cache reset at INFO: once per step, over the bar.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        # The engine's start runs gc.collect() seven times (weight load, KV-cache profiling),
        # each over every object that torch, transformers and vLLM created at import: 2.3 of the
        # 22 CPU-seconds of a 2-step CPU run. Freezing them first skips that; the engine freezes
        # the whole heap itself once it has started (vllm.utils.gc_utils.freeze_gc_heap).
        gc.freeze()

        threads = torch.get_num_threads()
        kwargs = dict(
            model=model_path,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
                dtype
            ],
            max_model_len=max_model_len,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            max_num_seqs=256,
            use_tqdm_on_load=cfg.verbose,
        )
        if device.type == "cuda":
            kwargs.update(
                gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.vllm_sleep
            )
        else:
            # A prefill split over two scheduler steps discards a sampled token and rewinds the
            # request's seeded generator, which a CPU generator cannot do (vLLM raises "CPU
            # Generator does not use offset"): a token budget that holds max_num_seqs whole
            # sequences keeps every prefill in one step.
            kwargs.update(
                kv_cache_memory_bytes=int(cfg.vllm_kv_cache_gb * 2**30),
                enforce_eager=True,
                max_num_batched_tokens=max(8192, kwargs["max_num_seqs"] * max_model_len),
            )
        if distributed:
            # One engine per rank inside torchrun's process group (TRL's colocate mode).
            kwargs.update(distributed_executor_backend="external_launcher")
        self.llm = LLM(**kwargs)
        # An in-place reload keeps the rotary cos/sin cache (a buffer, not in the state dict)
        # and warns that it "failed to load" it, every step. Set after the engine starts: vLLM
        # re-applies its logging config then, which resets child loggers' levels.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        # vLLM may lower torch's thread count for serving; training wants them back. (Its CPU
        # worker replaces torch.set_num_threads by a warning once it has bound its threads.)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.sleep_enabled = device.type == "cuda" and cfg.vllm_sleep
        self.asleep = False
        self._sync_path: str | None = None

    def generate(
        self, prompts: list[list[int]], indices: list[int], seeds: list[int], cfg
    ) -> list[list[Sample]]:
        """G samples per prompt; `seeds[i]` makes prompt i's samples reproducible."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=cfg.group_size,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=-1,
                max_tokens=cfg.max_tokens,
                logprobs=0,
                seed=seed,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        groups = []
        for index, prompt, output in zip(indices, prompts, outputs):
            group = []
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logps = [step[token].logprob for step, token in zip(completion.logprobs, ids)]
                truncated = completion.finish_reason == "length"
                group.append(Sample(index, prompt, ids, logps, truncated))
            groups.append(group)
        return groups

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the trainer's weights into the engine in place, then drop stale KV prefixes."""
        weights = list(weights)
        if self._sync_path in (None, "reload_weights"):
            try:
                # vLLM >= 0.11: in-place reload that also re-runs weight post-processing.
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                self._sync_path = "reload_weights"
            except (AttributeError, NotImplementedError, TypeError):
                if self._sync_path == "reload_weights":
                    raise
                self._sync_path = "load_weights"
        if self._sync_path == "load_weights":
            # vLLM 0.10: the driver worker's model is reachable in-process (TRL's colocate path).
            executor = self.llm.llm_engine.model_executor
            executor.driver_worker.worker.model_runner.model.load_weights(weights)
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now, while the process group it joined still exists.

        vLLM's own exit hook would otherwise run after the trainer destroyed the group and fail
        on the stale subgroups. The shutdown is idempotent (vLLM detaches its finalizer).
        """
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None and hasattr(client, "shutdown"):
            client.shutdown()

    def sleep(self) -> None:
        """Release vLLM's GPU memory (weights offloaded, KV cache dropped) for the update."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


class HFEngine:
    """Rollouts with transformers' `generate` on the policy itself, for machines without vLLM.

    Same sampling as the vLLM engine: G samples per prompt at the run's temperature and top_p
    (no top-k), at most max_tokens, stopping at the model's end-of-sequence token. A round is one
    batched call, reproducible from its prompts and seeds (a forked RNG, so the trainer's own
    stream is left alone); unlike vLLM, a prompt's samples depend on the round it is in. Its
    log-probs are those of the processed distribution (after temperature and top_p), like vLLM's
    `processed_logprobs`. The engine generates with the trainer's model, so there are no weights
    to sync. Slower than vLLM (no paged KV cache, padding): for a GPU image without vLLM, a
    laptop, or a test.
    """

    def __init__(self, model, tokenizer, compute_dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.device = model, device
        self.autocast = compute_dtype if compute_dtype != torch.float32 else None
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else (self.eos_ids[0] if self.eos_ids else 0)
        )

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], indices: list[int], seeds: list[int], cfg
    ) -> list[list[Sample]]:
        """One batched `generate` for the round: prompts left-padded, G samples each, the RNG
        seeded from the round's first seed (the same prompts give the same samples). Under --tp
        the LM head's vocabulary-sharded logits are gathered for sampling."""
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor(
            [[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device
        )
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seeds[0])
                with (
                    torch.autocast(
                        self.device.type, dtype=self.autocast, enabled=self.autocast is not None
                    ),
                    whole_logits(self.model),
                ):
                    out = self.model.generate(
                        input_ids,
                        attention_mask=attention_mask,
                        do_sample=True,
                        temperature=cfg.temperature,
                        top_p=cfg.top_p,
                        top_k=0,
                        max_new_tokens=cfg.max_tokens,
                        num_return_sequences=cfg.group_size,
                        eos_token_id=self.eos_ids or None,
                        pad_token_id=self.pad_id,
                        output_scores=True,
                        return_dict_in_generate=True,
                        use_cache=True,
                        # Every forward is collective under FSDP or --tp: a rank whose samples
                        # all ended keeps stepping until every rank's have.
                        synced_gpus=world_size() > 1,
                    )
                logps = self.model.compute_transition_scores(
                    out.sequences, out.scores, normalize_logits=True
                )
        finally:
            self.model.train(was_training)
        new_tokens = out.sequences[:, width:].tolist()
        logps = logps.float().tolist()
        groups = []
        for p, (index, prompt) in enumerate(zip(indices, prompts)):
            group = []
            for row in range(p * cfg.group_size, (p + 1) * cfg.group_size):
                tokens = new_tokens[row]
                end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), None)
                ids = tokens if end is None else tokens[:end]
                truncated = end is None and len(ids) >= cfg.max_tokens
                group.append(Sample(index, prompt, ids, logps[row][: len(ids)], truncated))
            groups.append(group)
        return groups

    def sync_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: the engine samples from the trainer's model."""

    def close(self) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass


def _eos_ids(model, tokenizer) -> list[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
