"""Data parallel on CPU (2 processes, gloo, FSDP2): the gradient equals the single-process one.

Each rank takes a different, uneven share of the same minibatch (4 and 3 sequences, micro-batches
of one sequence, so rank 1 also runs a padding micro-batch to keep FSDP's collectives in step).
The all-reduced normaliser makes the sum of the ranks' losses the loss of the whole minibatch.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import fusedrl
from fusedrl.trainer.distributed import DistEnv, shard
from fusedrl.trainer.step import accumulate_gradients

from .test_trainer_units import _tiny_batch, _tiny_model

CASES = {
    "dapo": {},
    "grpo": {"beta": 0.04, "kl": "k3"},
    "gspo": {},
    "dr_grpo": {"norm_constant": 4.0},
}


def _config(preset: str) -> fusedrl.LossConfig:
    return fusedrl.LossConfig.preset(preset, **CASES[preset])


def _batch():
    batch, _, _ = _tiny_batch(n=7, seed=5)
    batch.ref_logp = batch.rollout_logp - 0.1  # a reference policy a little off
    return batch


def _grads(model) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        parts.append(grad.flatten())
    return torch.cat(parts)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for preset in CASES:
        model = shard(_tiny_model(), DistEnv(rank, world, torch.device("cpu")))
        rows = slice(0, 4) if rank == 0 else slice(4, 7)
        accumulate_gradients(model, _batch().rows(rows), _config(preset), 1, None, "torch")
        results[preset] = _grads(model)  # full_tensor() is a collective: every rank calls it
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_grads(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp") / "grads.pt")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("preset", list(CASES))
def test_distributed_gradient_equals_single_process(preset, distributed_grads):
    model = _tiny_model()
    accumulate_gradients(model, _batch(), _config(preset), 0, None, "torch")
    expected = _grads(model)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(distributed_grads[preset], expected, rtol=1e-5, atol=1e-7)
