"""FusedGRPOTrainer under several processes, as `accelerate launch` runs it: a gloo world of 2
(accelerate's MULTI_CPU: the model wrapped in DistributedDataParallel), each rank its own batch.

The fused LM head (the default) runs inside the wrapped model's forward, so DDP all-reduces its
gradients: on every rank the loss, every parameter's gradient and the logged metrics equal
GRPOTrainer's in the same world, and the gradients are the same on both ranks although their
batches (and losses) differ. A PEFT (LoRA) policy takes the same route: its adapter runs inside
the body; a real two-step `train()` of both trainers ends with the same weights on every rank.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from .worlds import free_port, run_world

pytest.importorskip("trl")

WORLD = 2
CASES = (("dapo", 0.0), ("grpo", 0.04))


def _world_env(rank: int, port: int) -> None:
    """What `accelerate launch` / torchrun set: accelerate reads them (with use_cpu=True) as a
    MULTI_CPU world on gloo."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TRITON_INTERPRET="1",
    )


def _loss_grads_metrics(trainer, inputs) -> dict:
    """One `_compute_loss` through the DDP-wrapped model and `backward()` (DDP's hooks all-reduce
    on the gradients' accumulation, which torch.autograd.grad would skip)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = trainer.accelerator.prepare(trainer.model)
    assert isinstance(wrapped, DistributedDataParallel)
    wrapped.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(wrapped, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return {"loss": loss.detach(), "grads": grads, "metrics": dict(trainer._metrics["train"])}


def _parity(rank: int, model_dir: str, out_dir: str, peft: bool) -> dict:
    """GRPOTrainer and FusedGRPOTrainer on this rank's batch, per case."""
    from accelerate.utils import DistributedType
    from trl import GRPOTrainer

    import fusedrl
    from fusedrl.integrations.trl import FusedGRPOTrainer
    from fusedrl.tiny import char_tokenizer

    from .test_trl_integration import _args, _inputs, _trainer

    ran = []
    real = fusedrl.linear_policy_loss
    fusedrl.linear_policy_loss = lambda *a, **k: ran.append(1) or real(*a, **k)
    tokenizer = char_tokenizer()
    extra = {}
    if peft:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    results = {}
    for loss_type, beta in CASES:
        args = _args(f"{out_dir}/{loss_type}", loss_type=loss_type, beta=beta)
        if beta:
            args.use_bias_correction_kl = False
        trainers = [
            _trainer(cls, model_dir, tokenizer, args, **extra)
            for cls in (GRPOTrainer, FusedGRPOTrainer)
        ]
        state = trainers[1].accelerator.state
        assert state.distributed_type == DistributedType.MULTI_CPU and state.num_processes == WORLD
        assert trainers[1].fused_lm_head
        inputs = _inputs(trainers[0].model, loss_type, beta, seed=10 + rank)
        ran.clear()
        results[loss_type] = [_loss_grads_metrics(t, inputs) for t in trainers]
        assert ran, "the fused head's loss did not run"
    return results


def _training_run(rank: int, model_dir: str, out_dir: str) -> dict:
    """`train()` for two steps with gradient accumulation and a KL to the reference model: the
    weights each trainer ends with."""
    from trl import GRPOTrainer

    from fusedrl.integrations.trl import FusedGRPOTrainer
    from fusedrl.tiny import char_tokenizer

    from .test_trl_integration import _args, _trainer

    tokenizer = char_tokenizer()
    weights = {}
    for cls in (GRPOTrainer, FusedGRPOTrainer):
        args = _args(
            f"{out_dir}/{cls.__name__}",
            loss_type="dapo",
            beta=0.04,  # the reference model's log-probs through the fused head too
            per_device_train_batch_size=2,
            num_generations=4,
            gradient_accumulation_steps=2,
            seed=3,
        )
        trainer = _trainer(cls, model_dir, tokenizer, args)
        weights["initial"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        torch.manual_seed(3)
        trainer.train()
        weights[cls.__name__] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return weights


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    _world_env(rank, port)
    torch.set_num_threads(1)
    try:
        result = {
            "plain": _parity(rank, model_dir, f"{out_dir}/plain{rank}", peft=False),
            "peft": _parity(rank, model_dir, f"{out_dir}/peft{rank}", peft=True),
            "train": _training_run(rank, model_dir, f"{out_dir}/train{rank}"),
        }
    except Exception:
        result = {"crash": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    pytest.importorskip("peft")
    from fusedrl.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer()
    model_dir = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = str(tmp_path_factory.mktemp("trl-world"))
    results = run_world(_worker, WORLD, (free_port(), str(model_dir), out), out, 400, "the world")
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"
    return results


def _assert_close_grads(grads: dict, expected: dict) -> None:
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 0
    assert grads.keys() == expected.keys()
    for name, ref in expected.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("policy", ["plain", "peft"])
@pytest.mark.parametrize("loss_type", [case[0] for case in CASES])
def test_the_fused_head_under_ddp_equals_trl(ranks, policy, loss_type):
    """Per rank: loss, gradients and metrics equal GRPOTrainer's; both ranks hold the same
    (all-reduced) gradients, their own batches giving different losses."""
    for rank, result in enumerate(ranks):
        trl_run, fused_run = result[policy][loss_type]
        torch.testing.assert_close(fused_run["loss"], trl_run["loss"], rtol=1e-5, atol=1e-7)
        _assert_close_grads(fused_run["grads"], trl_run["grads"])
        assert sorted(fused_run["metrics"]) == sorted(trl_run["metrics"]), rank
        for name, values in trl_run["metrics"].items():
            torch.testing.assert_close(
                torch.tensor(fused_run["metrics"][name]),
                torch.tensor(values),
                rtol=1e-5,
                atol=1e-6,
                equal_nan=True,
                msg=name,
            )
    first, second = (result[policy][loss_type][1] for result in ranks)
    assert not torch.allclose(first["loss"], second["loss"])  # each rank its own batch
    for name, grad in first["grads"].items():  # ... and one all-reduced gradient
        torch.testing.assert_close(second["grads"][name], grad, rtol=0, atol=0, msg=name)


def test_a_training_run_under_ddp_equals_trl(ranks):
    """Two optimizer steps (gradient accumulation 2, generation on every rank): the fused
    trainer's weights equal GRPOTrainer's, and every rank holds the same weights."""
    for result in ranks:
        fused, trl_weights = result["train"]["FusedGRPOTrainer"], result["train"]["GRPOTrainer"]
        initial = result["train"]["initial"]
        assert fused.keys() == trl_weights.keys() == initial.keys()
        for name, value in trl_weights.items():
            torch.testing.assert_close(fused[name], value, rtol=1e-4, atol=1e-6, msg=name)
        assert any(not torch.equal(fused[n], initial[n]) for n in initial)  # it trained
    for name, value in ranks[0]["train"]["FusedGRPOTrainer"].items():
        torch.testing.assert_close(ranks[1]["train"]["FusedGRPOTrainer"][name], value, msg=name)
