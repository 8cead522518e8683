"""DTensor logits sharded on the vocab axis (what torch's `ColwiseParallel` LM head yields with
its output kept sharded): the local shard and the mesh's group make an ordinary tp call."""

from __future__ import annotations

import sys

import torch


def _dtensor_type():
    # A DTensor exists only once its module is loaded: no import (and no cost) otherwise.
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


class _LocalShard(torch.autograd.Function):
    """A DTensor's local shard, whose gradient comes back as a DTensor with its placements, as
    `DTensor.to_local()`'s does. to_local() returns a view made inside a custom Function, and
    autograd forbids using such a view after an in-place write, which `inplace=True` does (it
    writes the gradient into the logits): this shard is an alias of the storage, not a view."""

    @staticmethod
    def forward(ctx, dtensor):
        ctx.spec = (dtensor.device_mesh, dtensor.placements, dtensor.shape, dtensor.stride())
        return dtensor.to_local().detach()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(
            grad, mesh, placements, run_check=False, shape=shape, stride=stride
        )


def is_dtensor(x: object) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def wants_tensor_parallel(logits: object, tp_group, vocab_start, vocab_size) -> bool:
    """Whether a call takes the tensor-parallel path."""
    given = tp_group is not None or vocab_start is not None or vocab_size is not None
    return given or is_dtensor(logits)


def unwrap_logits(logits: object, tp_group) -> tuple[object, object]:
    """(this rank's shard, its group) of DTensor logits sharded on the last dim; anything else
    as given. The shard is taken differentiably: the gradient comes back as a DTensor with the
    logits' placements (no collective)."""
    if not is_dtensor(logits):
        return logits, tp_group
    from torch.distributed.tensor import Replicate, Shard

    if tp_group is not None:
        raise ValueError("logits is a DTensor: its device mesh gives the group; pass no tp_group")
    vocab_dims = [
        dim
        for dim, placement in enumerate(logits.placements)
        if isinstance(placement, Shard) and placement.dim in (-1, logits.dim() - 1)
    ]
    others = [
        p for d, p in enumerate(logits.placements) if d not in vocab_dims and p != Replicate()
    ]
    if len(vocab_dims) != 1 or others:
        raise ValueError(
            f"DTensor logits must be sharded on the vocab (last) dimension over one mesh "
            f"dimension and replicated over the others, got placements {logits.placements}"
        )
    return _LocalShard.apply(logits), logits.device_mesh.get_group(vocab_dims[0])


def local_value(x: object) -> object:
    """A replicated DTensor per-token input (labels, mask, ...) as a plain tensor."""
    if is_dtensor(x):
        from torch.distributed.tensor import Replicate

        if any(p != Replicate() for p in x.placements):
            raise ValueError(
                f"per-token inputs must be replicated over the tensor-parallel group, got a "
                f"DTensor with placements {x.placements}"
            )
        return x.to_local()
    return x
