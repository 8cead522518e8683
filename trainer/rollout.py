"""vLLM in-process rollouts: G samples per prompt with the sampler's own log-probs, weight sync.

The engine runs in the trainer's process (colocated), so the weight sync is a tensor copy, not a
network transfer. `logprobs_mode="processed_logprobs"` makes vLLM report log-probs after the
temperature, which is what the trainer computes from logits / T: the two agree up to kernel
numerics (the run logs the gap as `logp_diff_vllm`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


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
    def __init__(self, model_path: str, cfg, max_model_len: int, dtype: torch.dtype,
                 device: torch.device, distributed: bool) -> None:
        # In-process engine core: the trainer and vLLM share one process and its weights.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM logs every weight reload and cache reset at INFO: once per step, over the bar.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM


        threads = torch.get_num_threads()
        kwargs = dict(
            model=model_path,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                   torch.float16: "float16"}[dtype],
            max_model_len=max_model_len,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            max_num_seqs=256,
        )
        if device.type == "cuda":
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization,
                          enable_sleep_mode=cfg.vllm_sleep)
        else:
            kwargs.update(kv_cache_memory_bytes=int(cfg.vllm_kv_cache_gb * 2**30),
                          enforce_eager=True)
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

    def generate(self, prompts: list[list[int]], indices: list[int], seeds: list[int],
                 cfg) -> list[list[Sample]]:
        """G samples per prompt; `seeds[i]` makes prompt i's samples reproducible."""
        from vllm import SamplingParams

        params = [
            SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                           top_k=-1, max_tokens=cfg.max_tokens, logprobs=0, seed=seed)
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
