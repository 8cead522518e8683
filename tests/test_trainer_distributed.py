"""Data and tensor parallelism on CPU (2 processes, gloo).

Data parallel (FSDP2): the gradient equals the single-process one. Each rank takes a different,
uneven share of the same minibatch (4 and 3 sequences, micro-batches of one sequence, so rank 1
also runs a padding micro-batch to keep FSDP's collectives in step). The all-reduced normaliser
makes the sum of the ranks' losses the loss of the whole minibatch.

Tensor parallel (`fusedrl-train --tp 2`, the LM head split over the vocabulary): whole runs of the
trainer, whose first step's loss and gradient norm equal the one-process run's; a resumed run.
"""

from __future__ import annotations

import os

import pytest
import torch

import fusedrl
from fusedrl.advantages import SmoothAdvantageStandardizer
from fusedrl.trainer.advantages import step_advantages
from fusedrl.trainer.distributed import DistEnv, shard
from fusedrl.trainer.logger import read_metrics
from fusedrl.trainer.loop import TINY_LR
from fusedrl.trainer.step import accumulate_gradients

from .test_trainer_units import _tiny_batch, _tiny_model
from .worlds import free_port, run_world, start_world

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


# Advantages over 3 steps of 5 prompts x 3 completions, the prompts split over the ranks as the
# trainer splits them (positions[rank::world]: 3 and 2), each prompt key at most once a step
# and seen again in later steps (SAS's history), one unscorable reward.
G = 3
ESTIMATORS = ("grpo", "lite_ppo", "reinforce_pp", "reinforce_pp_baseline", "dcpo_sas")


def _advantage_steps() -> list[tuple[torch.Tensor, list[int]]]:
    gen = torch.Generator().manual_seed(11)
    steps = []
    for keys in ([0, 1, 2, 3, 4], [2, 5, 0, 1, 6], [6, 2, 3, 0, 5]):
        rewards = torch.randint(0, 3, (5 * G,), generator=gen).float() / 2
        steps.append((rewards, keys))
    steps[1][0][4] = float("nan")
    return steps


def _advantages(rank: int, world: int) -> dict:
    """Each estimator's advantages on this rank's prompts, step by step, and SAS's state."""
    env = DistEnv(rank, world, torch.device("cpu"))
    out = {}
    for name in ESTIMATORS:
        sas = SmoothAdvantageStandardizer() if name == "dcpo_sas" else None
        steps = []
        for rewards, keys in _advantage_steps():
            mine = list(range(len(keys)))[rank::world]
            rows = rewards.view(-1, G)[mine].reshape(-1)
            steps.append(step_advantages(name, rows, [keys[i] for i in mine], G, env, sas))
        out[name] = (steps, None if sas is None else sas.state_dict())
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
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
    results["advantages"] = _advantages(rank, world)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # (trainer.distributed.teardown's reason)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_world_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp"))
    per_rank = run_world(_worker, 2, (2, free_port(), out), out, 300, "the FSDP2 world of 2")
    return per_rank  # (every rank holds the full gradients: full_tensor())


@pytest.mark.parametrize("preset", list(CASES))
def test_distributed_gradient_equals_single_process(preset, dp_world_results):
    model = _tiny_model()
    accumulate_gradients(model, _batch(), _config(preset), 0, None, "torch")
    expected = _grads(model)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(dp_world_results[0][preset], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_advantages_over_ranks_equal_one_process(name, dp_world_results):
    """Each rank's advantages are the one-process run's for its prompts: the batch std and SAS's
    per-prompt history are the whole step's (per-rank statistics gave lite_ppo -1.449 for
    -0.600), and SAS's state is the same on every rank (rank 0 saves it)."""
    single, single_state = _advantages(0, 1)[name]
    world = len(dp_world_results)
    for rank, results in enumerate(dp_world_results):
        steps, state = results["advantages"][name]
        for step, (want, got) in enumerate(zip(single, steps)):
            mine = list(range(5))[rank::world]
            want = want.view(-1, G)[mine].reshape(-1)
            torch.testing.assert_close(got, want, msg=f"{name}, rank {rank}, step {step}")
        if state is not None:
            order = [state["keys"].index(key) for key in single_state["keys"]]
            for column in ("visits", "count", "mean", "m2", "min", "max"):
                torch.testing.assert_close(state[column][order], single_state[column])
    assert any(s.abs().sum() > 0 for s in single)


# ------------------------------------------------------------------------------------ --tp
# `fusedrl-train --tp 2` on 2 processes (gloo): one data-parallel rank of 2 tensor-parallel ranks,
# the LM head split over the vocabulary (99 tokens: uneven slices of 50 and 49 rows), against the
# same run in one process. Rollouts with transformers' generate (the head's logits gathered), a
# KL term (the reference model is split too), 2 minibatches (old log-probs, then a second update),
# top_p 0.9 (the loss replays the nucleus over the group).
TP_RUN = (
    "--progress",
    "false",
    "--rollout",
    "hf",
    "--warmstart-steps",
    "0",
    "--seed",
    "3",
    "--max-steps",
    "2",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-tokens",
    "4",
    "--minibatches",
    "2",
    "--beta",
    "0.04",
    "--kl",
    "k3",
    "--save-every",
    "1",
    "--top-p",
    "0.9",
    "--tensorboard",
    "false",
)
RUN_DEADLINE_S = 300  # a hang (mismatched collectives) fails the test instead of the suite


def _cli_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from fusedrl.trainer.cli import main

    code = main(argv)
    if code:
        raise SystemExit(code)


def fusedrl_train(world: int, *argv: str) -> None:
    """`torchrun --nproc-per-node world -m fusedrl.trainer argv`, as forked processes
    (tests/worlds.py's `start_world`)."""
    import time

    ctx = start_world(_cli_worker, (world, free_port(), list(argv)), world, interpret_triton=False)
    deadline = time.monotonic() + RUN_DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            raise AssertionError(f"fusedrl-train {' '.join(argv)} hung ({world} processes)")


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """{name: run directory}: one process (tp = 1), then tp = 2 with the fused LM head (each rank
    its rows of the head, linear_policy_loss with the tp group) and with materialised logits
    (ColwiseParallel's DTensor logits into policy_loss), from the same base model."""
    root = tmp_path_factory.mktemp("tp")
    fusedrl_train(1, *TP_RUN, "--out", str(root / "tp1"))
    same = ("--model", str(root / "tp1" / "base_model"), "--lr", str(TINY_LR))
    fusedrl_train(2, *TP_RUN, *same, "--tp", "2", "--out", str(root / "tp2"))
    fusedrl_train(
        2, *TP_RUN, *same, "--tp", "2", "--no-fused-lm-head", "--out", str(root / "tp2_logits")
    )
    # packed rows (cu_seqlens) on each rank's slice: the head's rows, and DTensor logits
    fusedrl_train(2, *TP_RUN, *same, "--tp", "2", "--pack", "--out", str(root / "tp2_pack"))
    fusedrl_train(
        2,
        *TP_RUN,
        *same,
        "--tp",
        "2",
        "--pack",
        "--no-fused-lm-head",
        "--out",
        str(root / "tp2_logits_pack"),
    )
    return {name: root / name for name in ("tp1", "tp2", "tp2_logits", *TP_PACKED)}


TP_PACKED = ("tp2_pack", "tp2_logits_pack")


@pytest.mark.parametrize("run", ["tp2", "tp2_logits", *TP_PACKED])
def test_tensor_parallel_step_equals_one_process(tp_runs, run):
    single, tp = read_metrics(tp_runs["tp1"]), read_metrics(tp_runs[run])
    assert [r["step"] for r in tp] == [1, 2]
    first, want = tp[0], single[0]
    print(
        f"{run}: loss {first['loss']!r} vs {want['loss']!r}, grad_norm "
        f"{first['grad_norm']!r} vs {want['grad_norm']!r}"
    )
    assert (f"pack: {str(run in TP_PACKED).lower()}") in (tp_runs[run] / "config.yaml").read_text()
    assert first["reward_mean"] == want["reward_mean"]  # the same samples
    assert first["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert first["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert want["grad_norm"] > 0 and want["kl"] > 0
    for key in ("kl", "entropy", "clipfrac", "response_len_mean"):
        assert first[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    # Checkpoints hold whole tensors (the head's 99 rows), resumable at any --tp.
    state = torch.load(tp_runs[run] / "checkpoints" / "step_000002" / "model.pt")
    assert state["lm_head.weight"].shape[0] == 99
    assert (tp_runs[run] / "final_model" / "config.json").exists()


def test_tensor_parallel_run_resumes_exactly(tp_runs, tmp_path):
    """A --tp 2 checkpoint (whole tensors) loaded back into the split head: the resumed step is
    the uninterrupted run's, bit for bit."""
    out = tmp_path / "resumed"
    fusedrl_train(
        2,
        "--progress",
        "false",
        "--out",
        str(out),
        "--resume",
        str(tp_runs["tp2"] / "checkpoints" / "step_000001"),
    )
    times = ("step_time", "gen_time", "train_time")
    resumed, reference = read_metrics(out), read_metrics(tp_runs["tp2"])[1:]
    assert [r["step"] for r in resumed] == [2]
    assert {k: v for k, v in resumed[0].items() if k not in times} == {
        k: v for k, v in reference[0].items() if k not in times
    }


def test_tensor_parallel_flags_fail_clearly(monkeypatch):
    from fusedrl.tiny import tiny_llama
    from fusedrl.trainer.config import parse_config
    from fusedrl.trainer.distributed import check_tensor_parallel, setup

    for argv, message in (
        (["--tp", "0"], "--tp: must be >= 1"),
        (["--tp", "2", "--backend", "cuda"], "--backend cuda"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_config(argv)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"--tp 3 must divide the number of processes \(2;"):
        setup(3)
    model = tiny_llama(99, hidden_size=32, num_layers=1, num_heads=1, head_dim=32)
    check_tensor_parallel(model, 2, 1)  # one data-parallel rank: uneven slices (50 + 49 rows)
    with pytest.raises(ValueError, match="must split evenly over the 4 ranks"):
        check_tensor_parallel(model, 2, 2)
    check_tensor_parallel(
        tiny_llama(100, hidden_size=32, num_layers=1, num_heads=1, head_dim=32), 2, 2
    )
    model.lm_head.weight = model.get_input_embeddings().weight  # tied
    with pytest.raises(ValueError, match="ties its LM head"):
        check_tensor_parallel(model, 2, 1)
