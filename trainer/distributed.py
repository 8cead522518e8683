"""torchrun parallelism: one process per device; FSDP2 (`fully_shard`) over the data-parallel
ranks and, with `--tp N`, torch's tensor parallelism on the LM head.

`--tp N` lays the world out as a 2-D mesh ("dp", "tp") of (world / N) x N ranks; the N ranks of a
"tp" row work on the same data. The LM head is `ColwiseParallel` over "tp" (each rank holds its
rows of the vocabulary; its logits are a DTensor sharded on the vocab, which fusedrl's loss takes
as they are); the rest of the model is replicated over "tp". FSDP2 shards everything over "dp".
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fusedrl.tp.dtensor import is_dtensor


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool = False  # vLLM creates a 1-process group of its own: never ours to destroy
    tp: int = 1  # --tp: ranks that share one batch, the LM head's vocabulary split over them
    mesh: object = None  # the ("dp", "tp") DeviceMesh when tp > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # init_device_mesh lays ranks out row-major: rank = dp_rank * tp + tp_rank.
    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_group(self):
        """The process group of this rank's data-parallel peers (None: the whole world)."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    @property
    def tp_group(self):
        return None if self.mesh is None else self.mesh.get_group("tp")


def setup(tp: int = 1) -> DistEnv:
    """Join torchrun's process group when launched by it (NCCL on GPUs, gloo on CPU); with
    tp > 1, build the ("dp", "tp") mesh."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % tp:
        # Every rank sees the same WORLD_SIZE, so every rank raises this (no rank waits alone).
        raise ValueError(
            f"--tp {tp} must divide the number of processes ({world}; torchrun "
            "--nproc-per-node sets it): the world is laid out as world / tp "
            "data-parallel x tp tensor-parallel ranks"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return DistEnv(
        rank=rank, world_size=world, device=device, owns_group=owns_group, tp=tp, mesh=mesh
    )


def check_tensor_parallel(model: torch.nn.Module, tp: int, dp: int) -> None:
    """What --tp needs of the model, as a clear error (raised alike on every rank: they all load
    the same model) rather than a wrong model or a failure deep inside torch."""
    if tp == 1:
        return
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(
            f"--tp {tp}: the LM head must be a torch.nn.Linear to be split over the "
            f"vocabulary (ColwiseParallel), got {type(head).__name__}"
        )
    embed = model.get_input_embeddings()
    if embed is not None and embed.weight is head.weight:
        raise ValueError(
            f"--tp {tp}: the model ties its LM head to its input embeddings "
            "(tie_word_embeddings): splitting the head would untie them; --tp "
            "supports untied heads only for now"
        )
    # One data-parallel rank: any vocabulary (torch's Shard gives uneven slices torch.chunk's
    # sizes, and the loss takes uneven slices). With FSDP2 over "dp" too, each rank's rows are
    # split again, and torch (2.13) cannot load a checkpoint into an uneven 2-D split of them
    # (an AssertionError in _StridedShard): the rows must split evenly over all dp x tp ranks.
    vocab = head.weight.shape[0]
    if dp > 1 and vocab % (dp * tp):
        raise ValueError(
            f"--tp {tp} with {dp} data-parallel ranks: the LM head's {vocab} rows "
            f"(the vocabulary) must split evenly over the {dp * tp} ranks (FSDP2 "
            "shards each tensor-parallel slice again); use a model whose vocabulary "
            f"is a multiple of {dp * tp}, or --tp {dp * tp}"
        )


def shard(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """--tp: the LM head split over the "tp" ranks. Then FSDP2 over the data-parallel ranks: each
    decoder layer is a unit (its params gathered just in time), then the root."""
    if env.tp > 1:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        # Output kept sharded (a DTensor): no rank ever holds the whole vocabulary's logits.
        style = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        parallelize_module(model.get_output_embeddings(), env.mesh["tp"], style)
    if env.dp_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = (
        env.mesh["dp"]
        if env.mesh is not None
        else init_device_mesh(env.device.type, (env.world_size,))
    )
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tp_sharded(tensor: torch.Tensor) -> bool:
    return is_dtensor(tensor) and "tp" in (tensor.device_mesh.mesh_dim_names or ())


@torch.no_grad()
def average_replicated_grads(model: torch.nn.Module, env: DistEnv) -> None:
    """--tp: average the gradients of the parameters replicated over the "tp" ranks (all but the
    LM head). Each rank computes them from the same data and the same hidden-state gradient (the
    loss sums it over the group), so they are equal up to nondeterministic kernels (on GPU,
    attention backwards that accumulate with atomics); averaging keeps the replicas bitwise
    equal step after step. One in-place all-reduce per parameter, no extra memory."""
    if env.tp == 1:
        return
    for param in model.parameters():
        grad = param.grad
        if grad is None or _tp_sharded(param):
            continue
        local = grad.to_local() if is_dtensor(grad) else grad  # FSDP's shard over "dp"
        dist.all_reduce(local, group=env.tp_group)
        local.div_(env.tp)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (the total norm as a plain tensor), also for parameters on several
    device meshes, which torch's refuses to mix (--tp: the LM head's on the "tp" or ("dp", "tp")
    mesh, the rest plain or on "dp"). Then the norm of each mesh's gradients is made whole (a
    DTensor norm is a partial value) and they are combined; the clip runs per mesh."""
    parameters = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:  # the same order on every rank: the collectives below match
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    if len(by_mesh) <= 1:  # one process, or FSDP alone
        total = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return total.full_tensor() if is_dtensor(total) else total
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for mesh, grads in by_mesh.items():
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate

            grads_coef = DTensor.from_local(coef, mesh, [Replicate()] * mesh.ndim, run_check=False)
        else:
            grads_coef = coef
        torch._foreach_mul_(grads, grads_coef)
    return total


@contextlib.contextmanager
def whole_logits(model: torch.nn.Module):
    """The LM head's output as whole-vocabulary plain logits while in the block (transformers'
    generate samples from them): under --tp the head yields a DTensor sharded on the vocab,
    gathered here (one all-gather over "tp" per forward). Without --tp a no-op."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return

    def gather(module, args, output):
        return output.full_tensor() if is_dtensor(output) else output

    handle = head.register_forward_hook(gather)  # runs after ColwiseParallel's own output hook
    try:
        yield
    finally:
        handle.remove()


def broadcast_in_tp_group(value: object, env: DistEnv) -> object:
    """tp-rank 0's `value` on every rank of its "tp" group (any picklable object)."""
    if env.tp == 1:
        return value
    box = [value]
    group = env.tp_group
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def gather_in_dp_group(value: object, env: DistEnv) -> list:
    """Every data-parallel peer's `value` (any picklable object), in dp-rank order; a "tp"
    group's ranks, which hold the same batch, each gather their own dp peers' alike."""
    group = env.dp_group
    if world_size(group) == 1:
        return [value]
    out = [None] * world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def world_size(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


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


def sum_over_ranks(values: torch.Tensor, group=None) -> torch.Tensor:
    """The sum over the ranks of `group` (None: every rank)."""
    if world_size(group) == 1:
        return values
    out = values.to(_collective_device(), copy=True)
    dist.all_reduce(out, group=group)
    return out.to(values.device)


def teardown(env: DistEnv, finished: bool = False) -> None:
    """Our process group destroyed. `finished`: every rank got here from a finished run, so
    all wait for each other first: a gloo rank that exits while another's connection to it is
    still open aborts there ("terminate called without an active exception", seen on a loaded
    2-core machine after a finished run). Not after a failure: the others may be in another
    collective, and a barrier would wait for them."""
    if env.owns_group and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
