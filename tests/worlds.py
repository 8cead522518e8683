"""torch.distributed worlds for the multi-process tests: each rank saves what it computed to
`rank{r}.pt` in one folder; the parent waits with a deadline (a hung collective fails the test
instead of hanging the suite) and loads every rank's file.

Ranks are forked from multiprocessing's fork server, a fresh interpreter (not the test process,
whose threads a fork would copy) that imported torch, fusedrl and the trainer once per test
worker: a spawned rank spent seconds importing them, on two cores shared by every rank."""

from __future__ import annotations

import contextlib
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


# What the fork server imports before its first fork (each rank then imports only its test module).
PRELOAD = (
    "torch",
    "torch.distributed",
    "fusedrl",
    "fusedrl.trainer.loop",
    "transformers",
    "tests.worlds",
)


def start_world(worker: Callable, args: tuple, world: int, interpret_triton: bool = True):
    """torch.multiprocessing's `start_processes(worker, args, world)`. `interpret_triton`: the
    ranks run the Triton kernels interpreted on CPU tensors (TRITON_INTERPRET=1); False: they
    inherit this process's setting.

    Ranks are forked from the fork server, whose environment (and imports) are fixed when it
    starts: where this process interprets Triton (tests/conftest.py sets it without a GPU), every
    world is forked; elsewhere a world whose setting differs is spawned with it. numpy's OpenBLAS
    starts a thread pool at import: the server imports it with one BLAS thread, so that it forks
    as a single thread."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret_triton and not interpreting:
        with _environment(TRITON_INTERPRET="1"):
            return mp.start_processes(worker, args, world, join=False, start_method="spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    with _environment(OPENBLAS_NUM_THREADS="1"):  # read by the server once, when it starts
        return mp.start_processes(worker, args, world, join=False, start_method="forkserver")


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def run_world(
    worker: Callable, world: int, args: tuple, out_dir: str, deadline_s: float, what: str
) -> list:
    """`worker(rank, *args)` on `world` processes (`start_world`); each writes `out_dir/rank{r}.pt`.
    A world still running after `deadline_s` is terminated and fails the test, named by `what`."""
    ctx = start_world(worker, args, world)
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
    cache: dict[int, list | str] = {}

    def get(world: int) -> list:
        if world not in cache:
            out = str(tmp_path_factory.mktemp(f"world{world}"))
            args = (world, free_port(), out)
            try:
                cache[world] = run_world(worker, world, args, out, deadline_s, f"{what} of {world}")
            except pytest.fail.Exception as failure:  # (a hung world: once, not once a test)
                cache[world] = str(failure)
                raise
        if isinstance(cache[world], str):
            pytest.fail(f"(earlier in this module) {cache[world]}")
        return cache[world]

    return get


def named_results(per_rank: list[dict], name: str) -> list[dict]:
    """Each rank's result `name`, failing on a rank that saved a crash there."""
    results = [rank_results[name] for rank_results in per_rank]
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
    return results
