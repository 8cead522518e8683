"""verl 0.9.1's real actor update, in-process on CPU: a helper for tests (runs in .venv-verl).

`run_actor_update(engine_cls, ...)` runs `verl.workers.engine_workers.TrainingWorker
.train_mini_batch` - the call `ActorRolloutRefWorker.update_actor` makes - with no Ray and no
GPU, on a tiny random-weight LlamaForCausalLM, and returns the gradient accumulated just before
the engine's `optimizer_step` plus the metrics verl returned. A test runs it twice, once with
verl's own `FSDPEngineWithLMHead` and once with another engine class, and compares.

What is real verl: the Hydra config (`trainer/config/ppo_trainer.yaml` composed with overrides,
then `omega_conf_to_dataclass` as `ActorRolloutRefWorker.init_model` does), `TrainingWorker`
and its engine built and reset the way `init_model` builds them, `ppo_loss`, FSDP2 wrapping, the
driver's batch preparation (`RayPPOTrainer._update_actor`: `DataProto.to_tensordict`,
`left_right_2_no_padding`, the same non-tensor keys), the mini-batch iterator, micro-batching,
loss scaling and the metric reduction.

Import this module before anything from `verl.workers.engine` (it imports those itself, after
selecting the platform). It needs, besides verl's own imports, `peft`, `accelerate`, `psutil`,
`pillow`, `uvicorn` and `fastapi` (verl requirements its engine modules import; the Makefile's
.venv-verl recipe installs them).

The shims, and why each exists:

* `PlatformCPU`: verl 0.9.1 has no CPU platform; with no GPU its auto-detection falls back to
  "nvidia" (device "cuda"). We register one under "cpu" and select it with `set_platform` on
  import, before `verl.workers.engine.fsdp` reads `device_name` at module level (patched too if
  that module was imported first). Not `VERL_PLATFORM=cpu`: subprocesses inherit the
  environment, and one importing verl without this module would fail on an unknown platform.
  `current_device()` is "cpu", so the engine's `.to(get_device_id())` calls are no-ops;
  `device_module` is `torch.cpu` plus what verl calls on it that `torch.cpu` lacks: memory
  counters (zero), `get_device_name`, RNG state, cache no-ops.
* `datasets` and `pandas` stand-ins: `verl.workers.engine.fsdp` imports `verl.utils.dataset`,
  whose dataset classes import both at module level. The actor update never uses them and both
  are heavy (pyarrow, ...), so where absent, placeholders sit in `sys.modules` for the duration
  of that one import (`_import_verl_engine`) and are removed after it.
* Engine registry: `EngineRegistry.register` asserts on a duplicate (device, backend) key, so a
  second class could not be registered for "cpu" through it. `_select_engine` writes the
  registry entry for the "cpu" key directly on every call, so each call picks its own class.
* Process group: a single-process gloo group (RANK 0, WORLD_SIZE 1, a free port), made once per
  process; `TrainingWorker` then finds it initialised and skips its own `init_process_group`.
* Config overrides a GPU run would not need: `attn_implementation=sdpa` (flash_attention_2 is
  not installed), strategy fsdp2 (FSDP1 refuses CPU parameters), no torch.compile, fp32
  mixed precision (verl's default bf16 would autocast even on CPU), no weight decay, a fixed lr.
* Nothing for trl: `apply_monkey_patch` imports its value-head class only when trl is installed.

The model (LlamaForCausalLM: 2 layers, hidden 64, 4 heads of 16, vocab 128, random weights) and
tokenizer (`fusedrl.tiny.char_tokenizer`) are saved once per process to a temp dir
that `HFModelConfig` loads by path; each call rebuilds the worker from those weights, so calls are
independent and can be repeated in one process with different engine classes.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
import types
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from verl.plugin.platform import (
    PlatformBase,
    PlatformRegistry,
    get_platform,
    platform_manager,
    set_platform,
)

__all__ = ["run_actor_update", "model_dir", "PlatformCPU"]

VOCAB_SIZE = 128  # >= the char tokenizer's ~96 ids
PROMPT_LENS = (3, 5, 2, 4)  # left-padded
RESPONSE_LENS = (6, 2, 5, 1)  # right-padded; one single-token response
MASKED_TOKEN = (0, 2)  # (sequence, response position): a 0 in response_mask inside a response
LR = 1e-3


# --------------------------------------------------------------------------- platform


class _CPUDeviceModule(types.ModuleType):
    """`torch.cpu` plus the `torch.cuda` calls verl makes on its device module."""

    def __init__(self):
        super().__init__("verl_cpu_device_module")

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None):
        return "CPU"  # flops_counter looks it up in its table of peak FLOPS (CPU: none)

    @staticmethod
    def memory_allocated(device=None):
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device=None):
        return 0, 0

    @staticmethod
    def empty_cache():
        pass

    ipc_collect = empty_cache

    @staticmethod
    def set_per_process_memory_fraction(fraction, device=None):
        pass

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


_DEVICE_MODULE = _CPUDeviceModule()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl platform for a CPU-only process (verl 0.9.1 ships none)."""

    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _DEVICE_MODULE)

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # only chosen explicitly, never by auto-detection

    def current_device(self):
        return "cpu"  # used as `.to(get_device_id())` and `torch.device(get_device_id())`

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _select_cpu_platform() -> None:
    # set_platform, not VERL_PLATFORM=cpu: subprocesses inherit the environment, and one that
    # imports verl without this module would fail on an unknown platform.
    if not isinstance(platform_manager._current_platform, PlatformCPU):
        set_platform(PlatformCPU())
    # Imported before us (the platform was then resolved as "nvidia"): fix its module constant.
    fsdp_impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if fsdp_impl is not None:
        fsdp_impl.device_name = "cpu"


def _placeholder_module(name: str) -> types.ModuleType:
    """A stand-in for an absent package: any public attribute is a class that refuses to be
    instantiated (enough for module-level imports and annotations, nothing more)."""

    def missing(*args, **kwargs):
        raise ModuleNotFoundError(f"{name} is not installed (tests/verl_cpu.py stand-in)")

    def getattr_(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {"__init__": missing, "__module__": name})

    module = types.ModuleType(name)
    module.__getattr__ = getattr_
    return module


def _import_verl_engine() -> None:
    """Import verl's engine modules, standing in for `datasets` and `pandas` if absent.

    `verl.workers.engine.fsdp` imports `verl.utils.dataset`, whose dataset classes import both
    at module level; the actor update never uses them, and both are heavy (pyarrow, ...). The
    stand-ins are only in `sys.modules` during this import: later imports see the truth."""
    absent = [name for name in ("datasets", "pandas") if importlib.util.find_spec(name) is None]
    for name in absent:
        sys.modules[name] = _placeholder_module(name)
    try:
        import verl.utils.dataset  # noqa: F401
        import verl.workers.engine.fsdp  # noqa: F401
        import verl.workers.engine_workers  # noqa: F401
    finally:
        for name in absent:
            sys.modules.pop(name, None)


_select_cpu_platform()
_import_verl_engine()


# --------------------------------------------------------------------------- process-wide setup


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_process_group() -> None:
    """A single-process gloo world (once per process); `Worker.__init__` reads these env vars."""
    import torch.distributed as dist

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "run_actor_update needs a single-process world"
        os.environ.setdefault("MASTER_PORT", "0")  # read, never used, by Worker.__init__
        return
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group(backend="gloo", rank=0, world_size=1)


@functools.cache
def model_dir() -> str:
    """A tiny random LlamaForCausalLM and the char tokenizer, saved once per process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fusedrl.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).float()
    path = tempfile.mkdtemp(prefix="fusedrl-verl-cpu-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _select_engine(engine_cls) -> None:
    """Make `EngineRegistry.new("language_model", "fsdp"/"fsdp2")` build `engine_cls` on "cpu".

    `EngineRegistry.register` asserts that a (device, vendor) key is new, so a second class
    cannot be registered for "cpu" through it; the entry is written directly instead, every
    call, which is what the decorator would store (after the same subclass check)."""
    from verl.workers.engine import BaseEngine, EngineRegistry

    assert issubclass(engine_cls, BaseEngine), engine_cls
    engines = EngineRegistry._engines.setdefault("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        registry = engines.setdefault(backend, {})
        registry.pop(("cpu", get_platform().vendor_name), None)  # the (device, vendor) key wins
        registry["cpu"] = engine_cls


# --------------------------------------------------------------------------- config


def _compose(
    *, use_remove_padding, loss_mode, loss_agg_mode, entropy_coeff, use_kl_loss, temperature, micro
):
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    arr = "actor_rollout_ref"
    actor = f"{arr}.actor"
    overrides = [
        f"{arr}.model.path={model_dir()}",
        f"{arr}.model.use_remove_padding={use_remove_padding}",
        f"+{arr}.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy=fsdp2",
        f"{actor}.use_torch_compile=False",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"+{actor}.fsdp_config.mixed_precision="
        "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"{actor}.ppo_mini_batch_size={len(PROMPT_LENS)}",
        f"{actor}.ppo_micro_batch_size_per_gpu={micro}",
        f"{actor}.use_dynamic_bsz=False",
        f"{actor}.ppo_epochs=1",
        f"{actor}.shuffle=False",
        f"{actor}.policy_loss.loss_mode={loss_mode}",
        f"{actor}.loss_agg_mode={loss_agg_mode}",
        f"{actor}.entropy_coeff={entropy_coeff}",
        f"{actor}.use_kl_loss={use_kl_loss}",
        f"{actor}.kl_loss_coef=0.01",
        f"{actor}.kl_loss_type=low_var_kl",
        f"{actor}.optim.lr={LR}",
        f"{actor}.optim.weight_decay=0.0",
        f"{actor}.optim.lr_warmup_steps=0",
        f"{actor}.optim.lr_warmup_steps_ratio=0.0",
        f"{actor}.optim.total_training_steps=1",
        f"{arr}.rollout.n=1",
        f"{arr}.rollout.temperature={temperature}",
        f"{arr}.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"{arr}.rollout.log_prob_use_dynamic_bsz=False",
    ]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def _build_worker(config):
    """`ActorRolloutRefWorker.init_model`'s actor branch (verl/workers/engine_workers.py)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    arr = config.actor_rollout_ref
    model_config: HFModelConfig = omega_conf_to_dataclass(arr.model)
    actor_config = omega_conf_to_dataclass(arr.actor)
    actor_config.model_config = model_config
    training_config = TrainingWorkerConfig(
        model_type=actor_config.model_config.get("model_type", "language_model"),
        model_config=actor_config.model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
        profiler_config=None,
    )
    engine_config = training_config.engine_config
    engine_config.use_dynamic_bsz = arr.actor.use_dynamic_bsz
    engine_config.infer_max_token_len_per_gpu = arr.rollout.log_prob_max_token_len_per_gpu
    engine_config.infer_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = arr.actor.ppo_max_token_len_per_gpu
    engine_config.micro_batch_size_per_gpu = arr.actor.ppo_micro_batch_size_per_gpu
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)

    worker = TrainingWorker(config=training_config)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor_config))
    return worker


# --------------------------------------------------------------------------- batch


def _make_batch(config, *, seed: int, use_kl_loss: bool, rollout_is_weights: bool = False):
    """The padded batch the driver holds at `_update_actor`, then what that method does to it."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    bsz, max_p, max_r = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
    pad_id = 0
    prompts = torch.full((bsz, max_p), pad_id, dtype=torch.long)
    responses = torch.full((bsz, max_r), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(bsz, max_p, dtype=torch.long)
    response_attn = torch.zeros(bsz, max_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        prompts[i, max_p - p :] = torch.randint(3, VOCAB_SIZE, (p,), generator=g)
        prompt_mask[i, max_p - p :] = 1
        responses[i, :r] = torch.randint(3, VOCAB_SIZE, (r,), generator=g)
        response_attn[i, :r] = 1
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
    response_mask = response_attn.clone()
    response_mask[MASKED_TOKEN] = 0

    # old_log_probs near the model's own (so some ratios clip), like a rollout's.
    with torch.no_grad():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir(), torch_dtype=torch.float32)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=compute_position_id_with_mask(attention_mask),
        ).logits[:, max_p - 1 : -1]
        temperature = float(config.actor_rollout_ref.rollout.temperature)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        logp = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    old_log_probs = (logp + 0.3 * torch.randn(logp.shape, generator=g)) * response_attn
    advantages = torch.randn(bsz, max_r, generator=g) * response_attn
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "old_log_probs": old_log_probs,
        "advantages": advantages,
        "returns": advantages.clone(),
    }
    if use_kl_loss:
        ref_noise = 0.1 * torch.randn(logp.shape, generator=g)
        tensors["ref_log_prob"] = (logp + ref_noise) * response_attn
    if rollout_is_weights:  # the trainer's train / inference IS weights (decoupled mode)
        weights = 0.5 + torch.rand(logp.shape, generator=g)
        tensors["rollout_is_weights"] = weights * response_attn
    batch = DataProto.from_single_dict(
        tensors, meta_info={"global_token_num": attention_mask.sum(-1).tolist()}
    )

    # RayPPOTrainer._update_actor
    arr = config.actor_rollout_ref
    batch.meta_info["multi_turn"] = arr.rollout.multi_turn.enable
    batch.meta_info["temperature"] = arr.rollout.temperature
    td = left_right_2_no_padding(batch.to_tensordict())
    mini = arr.actor.ppo_mini_batch_size * arr.rollout.n
    tu.assign_non_tensor(
        td,
        calculate_entropy=arr.actor.calculate_entropy or arr.actor.entropy_coeff != 0.0,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=arr.actor.ppo_epochs,
        seed=arr.actor.data_loader_seed,
        dataloader_kwargs={"shuffle": arr.actor.shuffle},
        compute_loss=True,
    )
    return td


# --------------------------------------------------------------------------- entry point


def _plain(value):
    """Metric values as plain python (verl returns per-mini-batch lists of floats)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def run_actor_update(
    engine_cls,
    *,
    use_remove_padding: bool,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    temperature: float = 1.0,
    micro_batch_size: int = 2,
    seed: int = 0,
    rollout_is_weights: bool = False,
) -> dict:
    """One `TrainingWorker.train_mini_batch` (4 sequences, one mini-batch) with `engine_cls`.

    `engine_cls` is verl's `FSDPEngineWithLMHead` or a subclass; the other arguments set
    actor.policy_loss.loss_mode, actor.loss_agg_mode, actor.entropy_coeff, actor.use_kl_loss
    (coef 0.01, low_var_kl), rollout.temperature and actor.ppo_micro_batch_size_per_gpu; `seed`
    draws the batch (same seed, same batch, whatever the engine); `rollout_is_weights` adds
    per-token train / inference IS weights to it, as the trainer's decoupled mode does.

    Returns {'grads': {param_name: fp32 gradient accumulated just before optimizer_step},
    'metrics': the metrics dict train_mini_batch returned, as plain python values / lists}.
    """
    _select_cpu_platform()
    _init_process_group()
    _select_engine(engine_cls)

    config = _compose(
        use_remove_padding=use_remove_padding,
        loss_mode=loss_mode,
        loss_agg_mode=loss_agg_mode,
        entropy_coeff=entropy_coeff,
        use_kl_loss=use_kl_loss,
        temperature=temperature,
        micro=micro_batch_size,
    )
    td = _make_batch(
        config, seed=seed, use_kl_loss=use_kl_loss, rollout_is_weights=rollout_is_weights
    )
    torch.manual_seed(seed)  # clip_cov / kl_cov draw with torch's RNG
    worker = _build_worker(config)
    engine = worker.engine
    assert type(engine) is engine_cls, (type(engine), engine_cls)

    grads: dict[str, torch.Tensor] = {}
    module, optimizer_step = engine.module, engine.optimizer_step

    def snapshot_then_step():
        for name, param in module.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            if hasattr(grad, "full_tensor"):  # FSDP2 shards are DTensors
                grad = grad.full_tensor()
            grads[name] = grad.detach().to(torch.float32).clone()
        return optimizer_step()

    engine.optimizer_step = snapshot_then_step
    output = worker.train_mini_batch(td)
    assert grads, "optimizer_step was never called"

    from verl.utils import tensordict_utils as tu

    metrics = {k: _plain(v) for k, v in tu.get(output, "metrics").items()}
    return {"grads": grads, "metrics": metrics}
