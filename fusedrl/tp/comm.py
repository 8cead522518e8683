"""The collectives of the tensor-parallel path: all of them go through this module."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(tp_group) -> int:
    """Ranks in the group (1 without one)."""
    return 1 if tp_group is None else group_rank_and_size(tp_group)[1]


def group_rank_and_size(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tp_group was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first (or pass tp_group=None)"
        )
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(
            "tp_group does not contain this process (torch.distributed rank "
            f"{dist.get_rank()}): pass the tensor-parallel group this rank is in"
        )
    return rank, world


def all_gather(tensor: torch.Tensor, group, world: int) -> torch.Tensor:
    """[*shape] on each rank -> [world, *shape], the same bits on every rank."""
    flat = tensor.contiguous().view(-1)
    out = torch.empty(world * flat.numel(), dtype=tensor.dtype, device=tensor.device)
    # torch >= 2.10 calls it all_gather_single (all_gather_into_tensor is kept, deprecated).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=group)
    return out.view(world, *tensor.shape)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """`tensor` reduced over the group in place (sampling-mask replay's histograms and maxima):
    NCCL and gloo give every rank the same bits."""
    dist.all_reduce(tensor, op=op, group=group)


def header_device(group, like: object) -> torch.device:
    """Where the header goes: with the logits when they are a tensor; NCCL needs a CUDA tensor
    even when a rank's logits are malformed (the header must still be exchanged)."""
    if isinstance(like, torch.Tensor):
        return like.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _SumGradOverGroup(torch.autograd.Function):
    """The identity, whose backward sums the gradient over the group (Megatron's "copy to the
    tensor-parallel region"): each rank's input gradient through its vocab slice of the LM head
    is a part of the whole."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group) -> torch.Tensor:
    return _SumGradOverGroup.apply(x, group)
