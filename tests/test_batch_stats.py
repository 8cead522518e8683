"""Batch statistics over a process group (fusedrl/batch_stats.py): the top-entropy quantile
taken over every rank's counted tokens, as TRL takes it under several processes.

A gloo world of 2, each rank its own batch: inside `fusedrl.batch_statistics_over(group)` each
rank's loss and gradient equal the oracle's with the tokens above the threshold of both ranks'
counted entropies (computed here from both batches, which every rank can rebuild: seeded);
outside the block, the rank's own quantile.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .conftest import make_batch, run_loss
from .worlds import free_port, run_world

WORLD = 2
CONFIG = LossConfig.preset("grpo", top_entropy_quantile=0.3, beta=0.05)
BACKENDS = ("torch", "triton")
FORMS = (*BACKENDS, "linear")  # the logits loss on each backend, the LM-head form


def _batch(rank: int) -> dict:
    """Rank 1's rows flatter (higher entropies): the group's threshold is not either rank's."""
    data = make_batch(batch=4, time=9 + rank, vocab=67, seed=60 + rank, per_token_adv=True)
    data["logits"] = data["logits"] * (0.9 if rank == 1 else 1.0)
    return data


def _threshold() -> torch.Tensor:
    """The (1 - rho) quantile of both ranks' counted tokens' entropies."""
    values = []
    for rank in range(WORLD):
        data = _batch(rank)
        _, entropy = reference.token_logprobs(data["logits"], data["labels"], return_entropy=True)
        values.append(entropy[data["mask"].bool()])
    return torch.quantile(torch.cat(values).float(), 1 - CONFIG.top_entropy_quantile)


def _fused(data: dict, backend: str) -> tuple:
    """(the loss, its gradient in the logits) of this backend's call."""
    out, grad = run_loss(
        lambda *a, **k: fusedrl.policy_loss(*a, backend=backend, **k), data, CONFIG
    )
    return out.loss.detach(), grad


def _linear(data: dict) -> tuple:
    """linear_policy_loss with the logits as hidden states and the identity as the head."""
    hidden = data["logits"].detach().clone().requires_grad_(True)
    head = torch.eye(hidden.shape[-1])
    args = {k: v for k, v in data.items() if k != "logits"}
    out = fusedrl.linear_policy_loss(hidden, head, **args, config=CONFIG, backend="torch")
    (grad,) = torch.autograd.grad(out.loss, hidden)
    return out.loss.detach(), grad


def _run(rank: int, group) -> dict:
    data = _batch(rank)
    results = {}
    for backend in BACKENDS:
        with fusedrl.batch_statistics_over(group):
            results[backend] = _fused(data, backend)
    with fusedrl.batch_statistics_over(group):  # the LM-head form: an identity head
        results["linear"] = _linear(data)
    results["own"] = _fused(data, "torch")  # outside the block: this rank's quantile
    return results


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        result = _run(rank, dist.group.WORLD)
    except Exception:
        result = {"crash": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("stats"))
    results = run_world(_worker, WORLD, (free_port(), out), out, 180, "the world")
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
    return results


@pytest.mark.parametrize("form", FORMS)
def test_the_quantile_is_taken_over_every_rank(ranks, form):
    """Each rank's loss and gradient: the oracle's with the policy term on the tokens at or
    above the group's threshold (the KL on every token, as TRL weighs them); the threshold
    differs from each rank's own, so the selection changed."""
    threshold = _threshold()
    plain = CONFIG.replace(top_entropy_quantile=1.0)
    for rank, result in enumerate(ranks):
        data = _batch(rank)
        _, entropy = reference.token_logprobs(data["logits"], data["labels"], return_entropy=True)
        keep = ((entropy >= threshold) & data["mask"].bool()).float()
        want, want_grad = run_loss(reference.policy_loss, data, plain, is_weights=keep)
        loss, grad = result[form]
        torch.testing.assert_close(loss, want.loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
        assert want_grad.abs().sum() > 0 and 0 < keep.sum() < data["mask"].sum()
        own, _ = result["own"]
        assert not torch.allclose(own, loss), rank  # the group's threshold acted
        own_ref, _ = run_loss(reference.policy_loss, data, CONFIG)
        torch.testing.assert_close(own, own_ref.loss, atol=1e-6, rtol=1e-5)


def test_outside_a_process_group_it_is_refused_by_name():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        with fusedrl.batch_statistics_over(object()):
            pass
