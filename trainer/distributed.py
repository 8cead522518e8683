"""torchrun data parallelism: one process per device, FSDP2 (`fully_shard`) over the policy."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # vLLM creates a 1-process group of its own: never ours to destroy

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup() -> DistEnv:
    """Join torchrun's process group when launched by it (NCCL on GPUs, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistEnv(rank=rank, world_size=world, device=device, owns_group=owns_group)


def shard(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """FSDP2: each decoder layer is a unit (its params gathered just in time), then the root."""
    if env.world_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    # NCCL reduces device tensors only; gloo takes host tensors.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(value: int) -> int:
    """The largest of an integer across ranks (a host value: loop counts, sizes)."""
    if world_size() == 1:
        return value
    t = torch.tensor(float(value), device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def sum_over_ranks(values: torch.Tensor) -> torch.Tensor:
    if world_size() == 1:
        return values
    out = values.to(_collective_device(), copy=True)
    dist.all_reduce(out)
    return out.to(values.device)


def teardown(env: DistEnv) -> None:
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
