"""Spawned torch.distributed worlds for the multi-process tests: each rank saves what it computed
to `rank{r}.pt` in one folder; the parent waits with a deadline (a hung collective fails the test
instead of hanging the suite) and loads every rank's file."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(
    worker: Callable, world: int, args: tuple, out_dir: str, deadline_s: float, what: str
) -> list:
    """`worker(rank, *args)` on `world` spawned processes; each writes `out_dir/rank{r}.pt`.
    A world still running after `deadline_s` is terminated and fails the test, named by `what`.
    The children run the Triton kernels interpreted on CPU tensors (TRITON_INTERPRET=1, which
    they inherit)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
    deadline = time.monotonic() + deadline_s
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.terminate()
            pytest.fail(f"{what} hung past {deadline_s:g} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def worlds_by_size(tmp_path_factory, worker: Callable, what: str, deadline_s: float) -> Callable:
    """world size -> the per-rank results of `worker(rank, world, port, out_dir)`, each size
    spawned once (for a module-scoped fixture)."""
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            out = str(tmp_path_factory.mktemp(f"world{world}"))
            args = (world, free_port(), out)
            cache[world] = run_world(worker, world, args, out, deadline_s, f"{what} of {world}")
        return cache[world]

    return get


def named_results(per_rank: list[dict], name: str) -> list[dict]:
    """Each rank's result `name`, failing on a rank that saved a crash there."""
    results = [rank_results[name] for rank_results in per_rank]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
    return results
