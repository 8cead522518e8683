"""The trainer's parts without vLLM: config, data, rewards, batching, gradients, checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fusedrl
from fusedrl.linear import plain_lm_head
from fusedrl.tiny import tiny_qwen2
from fusedrl.trainer import checkpoint
from fusedrl.trainer.config import TrainConfig, parse_config
from fusedrl.trainer.data import PromptSet, load_rows, sum_task
from fusedrl.trainer.rewards import (
    arith_reward,
    final_answer,
    format_reward,
    math_reward,
    parse_rewards,
    score,
)
from fusedrl.trainer.step import (
    accumulate_gradients,
    collate,
    loss_normalizer,
    token_logprobs,
)


# --- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--preset", "nope"], "--preset: unknown preset 'nope'"),
        (["--group-size", "1"], "--group-size: must be >= 2"),
        (["--advantage", "ppo"], "--advantage: unknown advantage"),
        (["--max-tokens", "0"], "--max-tokens: must be >= 1"),
        (["--overlong-buffer", "9", "--max-tokens", "4"], "--overlong-buffer: must be <="),
        (["--dupo", "true", "--dynamic-sampling", "true"], "--dupo"),
        (["--preset", "gmpo", "--is-correction", "token_mask"], "loss options (--preset gmpo"),
        (["--top-p", "0"], "--top-p"),
        (["--reward", " "], "--reward"),
        (["--pack", "true", "--kl", "full", "--preset", "gspo"], "--pack: not with --kl full"),
        (["--max-tokens-per-microbatch", "64"], "token budget: needs --pack"),
        (["--pack", "--max-tokens-per-microbatch", "0"], "token budget: must be >= 1, got 0"),
        (["--loss", "ppo", "--dro-beta", "0.1"], "dro_beta=0.1 is DRO's penalty"),
    ],
)
def test_bad_config_names_the_option(argv, needle):
    with pytest.raises(ValueError, match=None) as info:
        parse_config(argv)
    assert needle in str(info.value)


def test_yaml_config_with_cli_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: grpo\nlr: 1.0e-6\ngroup_size: 4\nbeta: 0.0\n")
    cfg = parse_config(["--config", str(path), "--group-size", "6", "--eps-high", "0.3"])
    assert (cfg.preset, cfg.lr, cfg.group_size, cfg.eps_high) == ("grpo", 1e-6, 6, 0.3)
    loss = cfg.loss_config()
    assert loss.agg == "seq-mean-token-mean" and loss.eps_high == 0.3 and loss.beta == 0.0
    assert TrainConfig(**__import__("yaml").safe_load(cfg.to_yaml())) == cfg
    path.write_text("presett: grpo\n")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['presett'\]"):
        parse_config(["--config", str(path)])


def test_dr_grpo_normalises_by_the_generation_budget():
    cfg = parse_config(["--preset", "dr_grpo", "--max-tokens", "12"])
    assert cfg.loss_config().norm_constant == 12.0


def test_cli_rejects_bad_values(capsys):
    from fusedrl.trainer.cli import main

    assert main(["--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--group-size", "two"])


# --- data -------------------------------------------------------------------------------------
def test_prompt_stream_is_a_seeded_epoch_permutation():
    prompts = PromptSet(
        rows=[{"prompt": str(i)} for i in range(7)], token_ids=[[i] for i in range(7)]
    )
    first = prompts.take(0, 7, seed=3)
    assert sorted(first) == list(range(7))  # one epoch visits every prompt once
    assert prompts.take(0, 10, seed=3)[:7] == first
    assert prompts.take(5, 4, seed=3) == prompts.take(0, 9, seed=3)[5:]  # cursor addressing
    assert prompts.take(0, 7, seed=4) != first


def test_sum_task_answers_are_right():
    for row in sum_task(50):
        a, b = row["prompt"].rstrip("=").split("+")
        assert int(row["answer"]) == int(a) + int(b)


def test_dataset_files_and_missing_columns(tmp_path):
    rows = [
        {"question": "1+1", "solution": "2", "level": 1},
        {"question": "2+3", "solution": "5", "level": 2},
    ]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    loaded = load_rows(str(jsonl), "question", "solution")
    assert [r["prompt"] for r in loaded] == ["1+1", "2+3"] and loaded[1]["level"] == 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    assert load_rows(str(parquet), "question", "solution")[0]["answer"] == "2"
    with pytest.raises(ValueError, match="missing column 'prompt'"):
        load_rows(str(jsonl), "prompt", "solution")
    with pytest.raises(FileNotFoundError, match="--dataset"):
        load_rows(str(tmp_path / "nope.jsonl"), "prompt", "answer")


# --- rewards ----------------------------------------------------------------------------------
def test_builtin_rewards():
    assert final_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert final_answer("it is 3, no 42") == "42" and final_answer("none") is None
    assert math_reward(["p"] * 3, [r"\boxed{0.5}", "the answer is 7", "8"], ["1/2", "7", "7"]) == [
        1.0,
        1.0,
        0.0,
    ]
    assert format_reward(["p"] * 3, [r"x \boxed{1}", r"\boxed{1}\boxed{2}", "1"]) == [1.0, 0.0, 0.0]
    assert arith_reward(["p"] * 6, ["7", "7 7", "78", "8", "zz", " 12\n"], ["7"] * 5 + ["12"]) == [
        1.0,
        0.5,
        0.25,
        0.25,
        0.0,
        1.0,
    ]  # exact > the answer, running on > wrong digits > none


def bad_reward(prompts, completions, **_):
    if any("boom" in p for p in prompts):
        raise KeyError("no such thing")
    return [1.0] * len(prompts)


def half_reward(prompts, completions, **_):
    return [None if p == "skip" else 0.5 for p in prompts]


def test_weighted_rewards_and_none():
    rewards = parse_rewards("arith=2,tests.test_trainer_units:half_reward=0.5")
    assert [(r.name, r.weight) for r in rewards] == [
        ("arith", 2.0),
        ("tests.test_trainer_units:half_reward", 0.5),
    ]
    total, means = score(rewards, ["a", "skip"], ["7", "x"], {"answer": ["7", "7"]})
    assert total == [2.0 + 0.25, 0.0]  # None leaves the function out for that sample
    assert means == {"arith": 0.5, "tests.test_trainer_units:half_reward": 0.5}


def test_a_failing_reward_names_the_function_and_the_prompt():
    rewards = parse_rewards("tests.test_trainer_units:bad_reward")
    with pytest.raises(
        RuntimeError,
        match=r"'tests.test_trainer_units:bad_reward' raised "
        r"KeyError.*prompt: 'boom here'",
    ):
        score(rewards, ["fine", "boom here"], ["1", "2"], {})


def test_malformed_rewards_are_errors():
    with pytest.raises(ValueError, match="unknown"):
        parse_rewards("nope")
    with pytest.raises(ValueError, match="module 'tests.test_trainer_units' .* has no 'missing'"):
        parse_rewards("tests.test_trainer_units:missing")
    with pytest.raises(ValueError, match="weight 'x'"):
        parse_rewards("math=x")
    short = parse_rewards("tests.test_trainer_units:_short")
    with pytest.raises(RuntimeError, match="returned 1 values for 2 completions"):
        score(short, ["a", "b"], ["1", "2"], {})
    nan = parse_rewards("tests.test_trainer_units:_nan")
    with pytest.raises(RuntimeError, match="not a finite number.*prompt 'a'"):
        score(nan, ["a"], ["1"], {})


def _short(prompts, completions, **_):
    return [1.0]


def _all_none(prompts, completions, **_):
    return [None] * len(prompts)


def _numpy_and_torch(prompts, completions, **_):
    import numpy as np

    return [np.float32(0.5), torch.tensor(0.25), np.int64(1)][: len(prompts)]


def test_reward_numbers_of_numpy_and_torch_are_accepted():
    rewards = parse_rewards("tests.test_trainer_units:_numpy_and_torch")
    total, means = score(rewards, ["a", "b", "c"], ["1", "2", "3"], {})
    assert total == [0.5, 0.25, 1.0]


def test_a_reward_that_applies_to_no_sample_is_an_error():
    rewards = parse_rewards("tests.test_trainer_units:_all_none")
    with pytest.raises(RuntimeError, match="returned None for all 2 completions of this step"):
        score(rewards, ["a", "b"], ["1", "2"], {})


def test_reward_modules_from_the_working_directory_and_their_errors(tmp_path, monkeypatch):
    """The console script finds `module:function` in the working directory, as `python -m`
    does; a module that fails to import is named with its error."""
    (tmp_path / "my_rewards_ok.py").write_text(
        "def fn(prompts, completions, **_):\n    return [1.0] * len(prompts)\n"
    )
    (tmp_path / "my_rewards_broken.py").write_text("def fn(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (reward,) = parse_rewards("my_rewards_ok:fn")
    assert reward.fn(["a"], ["b"]) == [1.0]
    with pytest.raises(
        ValueError, match="importing module 'my_rewards_broken' failed: SyntaxError"
    ):
        parse_rewards("my_rewards_broken:fn")


def _nan(prompts, completions, **_):
    return [float("nan")]


# --- batching and gradients -------------------------------------------------------------------
def _tiny_batch(n=6, seed=0, vocab=37):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 6, (n,), generator=g)
    ]
    completions = [
        torch.randint(3, vocab, (int(k),), generator=g).tolist()
        for k in torch.randint(0, 5, (n,), generator=g)
    ]
    advantages = torch.randn(n, generator=g)
    logps = [(-torch.rand(len(c), generator=g)).tolist() for c in completions]
    rows = torch.ones(n, dtype=torch.bool)
    rows[1] = False  # e.g. an overlong-filtered completion
    return collate(prompts, completions, advantages, rows, logps, pad_id=0), prompts, completions


def test_collate_layout():
    batch, prompts, completions = _tiny_batch()
    P = batch.prompt_len
    for i, (p, c) in enumerate(zip(prompts, completions)):
        assert batch.input_ids[i, P - len(p) : P].tolist() == p
        assert batch.labels[i, : len(c)].tolist() == c
        assert batch.attention_mask[i].sum() == len(p) + len(c)
        expected = len(c) if i != 1 else 0
        assert batch.mask[i].sum() == expected
        assert batch.loss_tokens[i] == expected  # the host's count, for the LM head's skip
    sub = batch.rows(slice(2, 4))
    assert sub.labels.shape[1] == max(len(c) for c in completions[2:4]) or sub.labels.shape[1] == 1


def _tiny_model(vocab=37):
    from fusedrl.tiny import tiny_qwen2

    return tiny_qwen2(vocab, hidden_size=32, num_layers=1, num_heads=1, head_dim=32)


@pytest.mark.parametrize("preset", ["dapo", "grpo", "dr_grpo", "gspo"])
def test_micro_batches_sum_to_the_minibatch_gradient(preset):
    extra = {"norm_constant": 4.0} if preset == "dr_grpo" else {}
    cfg = fusedrl.LossConfig.preset(preset, beta=0.0, kl=None, **extra)
    batch, _, _ = _tiny_batch(n=7)
    grads = []
    for micro in (0, 2):
        model = _tiny_model()
        accumulate_gradients(model, batch, cfg, micro, None, "torch")
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("lm_head", [False, True])
def test_the_adaptive_coefficient_reaches_the_loss(lm_head):
    """accumulate_gradients(entropy_coef=<device scalar>) is the number in the config: same
    gradients, on the logits path and the fused LM head, micro-batched; and not the plain loss."""
    batch, _, _ = _tiny_batch(n=5, seed=3)
    cfg = fusedrl.LossConfig.preset("dapo")
    grads = []
    for config, coef in (
        (cfg.replace(entropy_coef=0.5), None),
        (cfg, torch.tensor(0.5)),
        (cfg, None),
    ):
        model = _tiny_model()
        accumulate_gradients(
            model, batch, config, 2, None, "torch", lm_head=lm_head, entropy_coef=coef
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    assert (grads[2] - grads[0]).abs().max() > 1e-4  # the bonus acted


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_fused_lm_head_equals_the_logits_path(preset, monkeypatch):
    """--fused-lm-head (hidden states + head, no logits) gives the logits path's gradients of
    every parameter, its metrics and its old / ref log-probs, with micro-batches; its head makes
    logits for the loss tokens alone, counted on the host (live_rows)."""
    from fusedrl import linear_torch

    counts = []
    real = linear_torch.live_row_indices

    def spied(valid, count=None):
        counts.append((int(valid.sum()), count))
        return real(valid, count)

    monkeypatch.setattr(fusedrl.linear_single_process, "live_row_indices", spied)
    cfg = fusedrl.LossConfig.preset(preset, beta=0.0, kl=None, entropy_coef=0.01)
    batch, _, _ = _tiny_batch(n=5)
    grads, metrics, logps = [], [], []
    for lm_head in (False, True):
        model = _tiny_model()
        assert plain_lm_head(model) is model.lm_head
        logps.append(token_logprobs(model, batch, cfg, 2, None, "torch", lm_head=lm_head))
        metrics.append(accumulate_gradients(model, batch, cfg, 2, None, "torch", lm_head=lm_head))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(logps[1], logps[0], rtol=1e-5, atol=1e-6)
    for key, value in metrics[0].items():
        torch.testing.assert_close(metrics[1][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert grads[0].abs().sum() > 0
    # one skip per micro-batch of the loss, each with the host's count of its live rows
    assert len(counts) == 3 and all(live == count for live, count in counts)
    assert sum(live for live, _ in counts) == batch.mask.sum() < batch.mask.numel()


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("kind", ["forward_kl", "jsd", "sampled_reverse_kl"])
def test_the_teacher_term_on_every_path(kind):
    """--distill-teacher: the logits path, micro-batches and the fused LM head
    (linear_distill_loss / linear_policy_loss), padded and packed (--pack), all give the
    gradient of the whole batch's
    policy loss + coef x the divergence, computed here by the oracle on materialised logits
    (sampled_reverse_kl: the policy loss on A - coef (log pi - log pi_teacher))."""
    from fusedrl import reference
    from fusedrl.trainer.step import Distill, completion_logits

    cfg = fusedrl.LossConfig.preset("dapo", entropy_coef=0.01)
    batch, _, _ = _tiny_batch(n=5)
    teacher = tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32, seed=3)
    with torch.no_grad():  # a teacher far from the near-uniform random student
        teacher.lm_head.weight.mul_(30.0)
    distill = Distill(kind, 0.7, 0.3)
    grads, metrics = [], []
    paths = ((False, 0, False), (False, 2, False), (True, 2, False), (False, 2, True))
    for lm_head, micro, pack in (*paths, (True, 2, True)):
        model = _tiny_model()
        metrics.append(
            accumulate_gradients(
                model,
                batch,
                cfg,
                micro,
                None,
                "torch",
                lm_head=lm_head,
                teacher=teacher,
                distill=distill,
                pack=pack,
            )
        )
        grads.append(_flat_grads(model))
    model = _tiny_model()
    logits = completion_logits(model, batch, None)
    with torch.no_grad():
        teacher_logits = completion_logits(teacher, batch, None)
    rows = dict(rollout_logp=batch.rollout_logp, config=cfg)
    if kind == "sampled_reverse_kl":
        with torch.no_grad():
            own = reference.token_logprobs(logits, batch.labels)[0]
            taught = reference.token_logprobs(teacher_logits, batch.labels)[0]
        shifted = batch.advantages[:, None] - 0.7 * torch.where(batch.mask > 0, own - taught, 0)
        total = reference.policy_loss(logits, batch.labels, shifted, batch.mask, **rows).loss
    else:
        divergence = reference.distill_loss(
            logits, teacher_logits, batch.labels, batch.mask, kind=kind, beta=0.3
        ).loss
        policy = reference.policy_loss(logits, batch.labels, batch.advantages, batch.mask, **rows)
        total = policy.loss + 0.7 * divergence
    total.backward()
    want = _flat_grads(model)
    for got in grads:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert all(m["distill"].abs() > 0.05 for m in metrics)  # the teacher term acted
    plain = _tiny_model()
    accumulate_gradients(plain, batch, cfg, 0, None, "torch")
    assert (_flat_grads(plain) - want).abs().max() > 1e-4


@pytest.mark.parametrize("lm_head", [False, True])
def test_the_exact_kl_on_both_paths(lm_head):
    """--kl full: the reference's logits (or hidden states and head, linear_policy_loss's
    ref_weight) beside the policy's give the oracle's gradient."""
    from fusedrl import reference
    from fusedrl.trainer.step import completion_logits

    cfg = fusedrl.LossConfig.preset("gspo", kl="full", beta=0.2)
    batch, _, _ = _tiny_batch(n=5)
    ref_model = tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32, seed=4)
    model = _tiny_model()
    accumulate_gradients(model, batch, cfg, 2, None, "torch", lm_head=lm_head, ref_model=ref_model)
    got = _flat_grads(model)
    model = _tiny_model()
    with torch.no_grad():
        ref_logits = completion_logits(ref_model, batch, None)
    reference.policy_loss(
        completion_logits(model, batch, None),
        batch.labels,
        batch.advantages,
        batch.mask,
        rollout_logp=batch.rollout_logp,
        config=cfg,
        ref_logits=ref_logits,
    ).loss.backward()
    torch.testing.assert_close(got, _flat_grads(model), rtol=1e-4, atol=1e-6)


def test_plain_lm_head_refuses_scaled_logits():
    model = _tiny_model()
    model.config.final_logit_softcapping = 30.0
    assert plain_lm_head(model) is None
    assert plain_lm_head(torch.nn.Linear(3, 2)) is None


def test_all_masked_minibatch_gives_zero_gradient():
    batch, _, _ = _tiny_batch(n=4)
    batch.mask.zero_()
    model = _tiny_model()
    metrics = accumulate_gradients(
        model, batch, fusedrl.LossConfig.preset("dapo"), 2, None, "torch"
    )
    assert torch.isfinite(metrics["loss"]) and metrics["loss"] == 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.parameters())


def test_loss_normalizer_follows_the_aggregation():
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert loss_normalizer(fusedrl.LossConfig.preset("dapo"), mask) == 3
    assert loss_normalizer(fusedrl.LossConfig.preset("grpo"), mask) == 2  # non-empty sequences
    assert loss_normalizer(fusedrl.LossConfig.preset("dr_grpo"), mask) == 3  # every sequence
    assert loss_normalizer(fusedrl.LossConfig.preset("gmpo"), mask) == 3


# --- checkpoints ------------------------------------------------------------------------------
def _model_and_optimizer():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_checkpoint_round_trip_and_pruning(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {"cursor": 10 * step}, {"x": step}, 2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000002", "step_000003"]
    fresh, fresh_opt = torch.nn.Linear(3, 2), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state, extra = checkpoint.load(checkpoint.resolve(tmp_path), fresh, fresh_opt)
    assert state == {"step": 3, "cursor": 30} and extra == {"x": 3}
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)
    exp_avg = optimizer.state[model.weight]["exp_avg"]
    torch.testing.assert_close(fresh_opt.state[fresh.weight]["exp_avg"], exp_avg, rtol=0, atol=0)


def test_a_crash_mid_write_never_corrupts_latest(tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    checkpoint.save(tmp_path, 1, model, optimizer, {"cursor": 1}, {}, 3)
    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, model, optimizer, {"cursor": 2}, {}, 3)
    monkeypatch.setattr(torch, "save", real_save)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert checkpoint.resolve(tmp_path).name == "step_000001"
    # A failed write removes its temp folder (a kill -9 would leave one: the next save removes
    # it, see tests/test_trainer_rundir.py).
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    (root / ".tmp-step_000002-killed").mkdir()
    checkpoint.save(tmp_path, 3, model, optimizer, {"cursor": 3}, {}, 3)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # cleaned up
    with pytest.raises(FileNotFoundError, match="--resume"):
        checkpoint.resolve(Path(tmp_path) / "nothing")


def test_the_documented_yaml_config_is_valid(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "run.yaml").write_text(block)
    cfg = parse_config(["--config", str(tmp_path / "run.yaml")])
    assert cfg.preset == "dapo" and cfg.dynamic_sampling and cfg.overlong_buffer == 256


def test_distillation_on_the_cuda_backend_takes_tritons_two_row_kernels(monkeypatch):
    """csrc has no two-row kernel: the trainer hands distill_loss backend="triton" when the run
    says --backend cuda (config.py checks that triton is installed); the policy loss keeps
    "cuda". Recorded on CPU, each call then run on the torch backend."""
    from fusedrl.trainer.step import Distill

    seen = {}
    real_distill, real_policy = fusedrl.distill_loss, fusedrl.policy_loss

    def distill(*args, backend, **kwargs):
        seen["distill"] = backend
        return real_distill(*args, backend="torch", **kwargs)

    def policy(*args, backend, **kwargs):
        seen["policy"] = backend
        return real_policy(*args, backend="torch", **kwargs)

    monkeypatch.setattr(fusedrl, "distill_loss", distill)
    monkeypatch.setattr(fusedrl, "policy_loss", policy)
    batch, _, _ = _tiny_batch(n=3)
    teacher = tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32, seed=3)
    accumulate_gradients(
        _tiny_model(),
        batch,
        fusedrl.LossConfig.preset("dapo"),
        0,
        None,
        "cuda",
        teacher=teacher,
        distill=Distill("jsd", 1.0, 0.5),
    )
    assert seen == {"distill": "triton", "policy": "cuda"}


def test_decoupled_ppo_takes_the_recomputed_log_probs_as_the_proximal_policy():
    """--decoupled: batch.old_logp (recomputed before the update) is pi_prox, the engine's
    rollout_logp pi_behav: the gradient of the oracle's decoupled loss on the whole batch."""
    from fusedrl import reference
    from fusedrl.trainer.step import completion_logits

    cfg = fusedrl.LossConfig.preset("dapo", decoupled_is_cap=1.5)
    batch, _, _ = _tiny_batch(n=5)
    batch.old_logp = batch.rollout_logp + 0.4 * torch.randn(
        batch.rollout_logp.shape, generator=torch.Generator().manual_seed(2)
    )
    model = _tiny_model()
    accumulate_gradients(model, batch, cfg, 2, None, "torch", decoupled=True)
    got = _flat_grads(model)
    model = _tiny_model()
    reference.policy_loss(
        completion_logits(model, batch, None),
        batch.labels,
        batch.advantages,
        batch.mask,
        old_logp=batch.rollout_logp,
        prox_logp=batch.old_logp,
        config=cfg,
    ).loss.backward()
    torch.testing.assert_close(got, _flat_grads(model), rtol=1e-4, atol=1e-6)
    plain = _tiny_model()
    accumulate_gradients(plain, batch, cfg.replace(decoupled_is_cap=None), 2, None, "torch")
    assert (_flat_grads(plain) - got).abs().max() > 1e-5


def _trl_adaptive_entropy(entropies, coef, target, delta, low, high):
    """TRL 1.16's adaptive entropy control written out (GRPOTrainer._compute_loss): the
    coefficient applied in a step (gated on the last window's entropy, inf before the first),
    then its update from this step's entropy."""
    applied, coefs, last = [], [], float("inf")
    for world_entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        if world_entropy <= target:
            coef = min(coef + delta, high)
        else:
            coef = max(coef - delta, low)
        coefs.append(coef)
        last = world_entropy
    return applied, coefs


def test_adaptive_entropy_follows_trls_rule():
    from fusedrl.entropy_control import AdaptiveEntropy

    gen = torch.Generator().manual_seed(0)
    # Around the target, so that both branches and both bounds act.
    entropies = (0.2 + 0.15 * torch.randn(40, generator=gen)).tolist()
    entropies[5:15] = [0.05] * 10  # a long dip: the coefficient climbs to its cap
    entropies[20:30] = [0.9] * 10  # a long rise: it falls to its floor
    args = dict(coef=0.01, target=0.2, delta=0.004, low=0.002, high=0.03)
    control = AdaptiveEntropy(
        args["target"], args["delta"], args["low"], args["high"], args["coef"]
    )
    ours, our_coefs = [], []
    for entropy in entropies:
        ours.append(control.applied())
        control.update(entropy)
        our_coefs.append(control.coef)
    want, want_coefs = _trl_adaptive_entropy(entropies, **args)
    assert ours == pytest.approx(want) and our_coefs == pytest.approx(want_coefs)
    assert max(want) == pytest.approx(args["high"]) and 0.0 in want  # cap and gate acted
    assert min(want_coefs) == pytest.approx(args["low"])  # floor acted
    restored = AdaptiveEntropy(0.2, 0.004, 0.002, 0.03, 0.0)
    restored.load_state_dict(control.state_dict())
    assert restored.applied() == control.applied() and restored.coef == control.coef


def test_adaptive_entropy_options():
    cfg = TrainConfig(entropy_target=0.3, entropy_coef=0.02).validate()
    assert cfg.loss_config().entropy_coef == 0.0  # the coefficient is the controller's tensor
    assert cfg.initial_entropy_coef() == 0.02
    assert cfg.entropy_control() == (0.005, 0.0, 1.0)  # TRL's defaults
    assert TrainConfig(
        entropy_target=0.3, entropy_coef_min=0.01, entropy_coef=0.02
    ).validate().entropy_control() == (0.005, 0.01, 1.0)
    assert TrainConfig(entropy_coef=0.02).loss_config().entropy_coef == 0.02
    bad = [
        (dict(entropy_target=0.3, tp=2), "--entropy-target: .*--tp 1"),
        (
            dict(entropy_target=0.3, entropy_coef_min=0.5, entropy_coef_max=0.4),
            "--entropy-coef-min: must be in",
        ),
        (dict(entropy_target=0.3, entropy_coef=2.0), "--entropy-coef: the adaptive coefficient"),
        (dict(entropy_target=-1.0), "--entropy-target: must be >= 0"),
        (dict(entropy_target=0.3, entropy_coef_delta=0.0), "--entropy-coef-delta: must be > 0"),
        (dict(entropy_target=0.3, entropy_coef_max=-1.0), "--entropy-coef-max: must be >= 0"),
        (dict(entropy_coef_delta=0.01), "--entropy-coef-delta: is read by --entropy-target"),
        (dict(entropy_coef_max=0.5), "--entropy-coef-max: is read by --entropy-target"),
    ]
    for options, match in bad:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**options).validate()


def test_verbose_restores_the_warnings_whatever_the_filters_hold():
    """--verbose drops the quiet filter again; a filter whose module is a plain str (from -W,
    PYTHONWARNINGS or a library's own) crashed every verbose run with an AttributeError."""
    import warnings

    from fusedrl.trainer.quiet import NOISY_MODULES, quiet_environment, quiet_libraries

    with warnings.catch_warnings():
        warnings.filters.insert(0, ("ignore", None, Warning, "some_library", 0))  # a str module
        quiet_environment()
        assert any(getattr(f[3], "pattern", None) == NOISY_MODULES for f in warnings.filters)
        quiet_libraries(verbose=True)
        patterns = [getattr(f[3], "pattern", f[3]) for f in warnings.filters]
        assert NOISY_MODULES not in patterns and "some_library" in patterns


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("lm_head", [False, True])
def test_packed_micro_batches_equal_the_padded_ones(preset, attn, lm_head):
    """--pack: each micro-batch as one padding-free row (block-diagonal attention, logits or
    hidden states at the loss rows alone, cu_seqlens into the loss) gives the padded path's
    gradients of every parameter, its metrics and its old / ref log-probs, with empty
    completions and a filtered row."""
    cfg = fusedrl.LossConfig.preset(preset, beta=0.0, kl=None, entropy_coef=0.01)
    batch, _, completions = _tiny_batch(n=7, seed=4)
    assert 0 in [len(c) for c in completions]  # an empty completion rides along
    assert batch.lengths[1] > 0 == batch.loss_tokens[1]  # a filtered one is left out of the pack
    grads, metrics, logps = [], [], []
    for pack in (False, True):
        model = _tiny_model()
        model.config._attn_implementation = attn
        logps.append(token_logprobs(model, batch, cfg, 3, None, "torch", lm_head, pack))
        metrics.append(
            accumulate_gradients(model, batch, cfg, 3, None, "torch", lm_head=lm_head, pack=pack)
        )
        grads.append(_flat_grads(model))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    # the log-probs of every token with a loss weight; 0 elsewhere (the padded pass leaves its
    # padding's and the filtered rows' values, which no loss reads)
    counted = batch.mask > 0
    torch.testing.assert_close(logps[1][counted], logps[0][counted], rtol=1e-5, atol=1e-5)
    assert (logps[1][~counted] == 0).all()
    assert grads[0].abs().sum() > 0
    for key, value in metrics[0].items():
        torch.testing.assert_close(metrics[1][key], value, rtol=1e-4, atol=1e-6, msg=key)


def test_micro_batches_by_a_token_budget():
    """--max-tokens-per-microbatch: consecutive rows while their packed tokens (prompt and
    completion; none for a row without a loss token) fit the budget, a longer row alone."""
    from fusedrl.trainer.step import micro_batches, packed_row_tokens

    batch, prompts, completions = _tiny_batch(n=7, seed=4)
    tokens = packed_row_tokens(batch)
    live = [count > 0 for count in batch.loss_tokens]
    assert tokens == [len(p) + len(c) if k else 0 for p, c, k in zip(prompts, completions, live)]
    assert tokens == [6, 0, 9, 4, 5, 0, 9]
    slices = micro_batches(len(batch), 3, tokens, 8)
    assert [(s.start, s.stop) for s in slices] == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    assert [(s.start, s.stop) for s in micro_batches(7, 3)] == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize("lm_head", [False, True])
@pytest.mark.parametrize("preset", ["grpo", "gspo"])
def test_packed_micro_batches_by_a_token_budget_equal_the_padded_ones(preset, lm_head):
    """--pack --max-tokens-per-microbatch: micro-batches of varying sizes (a row over the
    budget alone) give the padded path's gradients, metrics and old log-probs."""
    cfg = fusedrl.LossConfig.preset(preset, beta=0.0, kl=None)
    batch, _, _ = _tiny_batch(n=7, seed=4)
    grads, metrics, logps = [], [], []
    for pack, budget in ((False, None), (True, 8)):
        model = _tiny_model()
        logps.append(token_logprobs(model, batch, cfg, 3, None, "torch", lm_head, pack, budget))
        metrics.append(
            accumulate_gradients(
                model, batch, cfg, 3, None, "torch", lm_head=lm_head, pack=pack, max_tokens=budget
            )
        )
        grads.append(_flat_grads(model))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    counted = batch.mask > 0
    torch.testing.assert_close(logps[1][counted], logps[0][counted], rtol=1e-5, atol=1e-5)
    assert grads[0].abs().sum() > 0
    for key, value in metrics[0].items():
        torch.testing.assert_close(metrics[1][key], value, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("lm_head", [False, True])
@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_packed_micro_batches_take_the_exact_kl(preset, lm_head):
    """--pack --kl full: the reference's packed logits (or, with the fused head, its packed
    hidden states and head) beside the policy's give the padded path's gradients (the exact KL
    acting: not the gradients without it); the config takes it for a loss that reads packed
    rows once."""
    cfg = fusedrl.LossConfig.preset(preset, kl="full", beta=0.2)
    batch, _, _ = _tiny_batch(n=7, seed=4)
    ref_model = tiny_qwen2(37, hidden_size=32, num_layers=1, num_heads=1, head_dim=32, seed=4)
    plain = fusedrl.LossConfig.preset(preset, kl=None, beta=0.0)
    grads = []
    for config, pack, ref in ((cfg, False, ref_model), (cfg, True, ref_model), (plain, True, None)):
        model = _tiny_model()
        accumulate_gradients(
            model, batch, config, 3, None, "torch", lm_head=lm_head, ref_model=ref, pack=pack
        )
        grads.append(_flat_grads(model))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)
    assert (grads[2] - grads[0]).abs().max() > 1e-5
    TrainConfig(preset=preset, kl="full", beta=0.2, pack=True).validate()


def test_packing_lays_the_sequences_end_to_end():
    """The packed row: each sequence with a loss token (the filtered and the empty ones left
    out), its real tokens, position ids restarting at 0, the loss rows at the positions that
    predict completion tokens, and an additive mask that lets no token see another sequence or a
    later token (none under flash attention); a micro-batch with no loss token keeps one."""
    from fusedrl.trainer.packing import pack_rows

    batch, prompts, completions = _tiny_batch(n=4, seed=2)
    live = [row for row, count in enumerate(batch.loss_tokens) if count > 0]
    assert live == [0, 2] and batch.lengths[1] > 0  # row 1 filtered, row 3 empty
    packed = pack_rows(batch, "sdpa", torch.float32)
    assert packed.sequences.tolist() == live
    prompts, completions = [prompts[r] for r in live], [completions[r] for r in live]
    expected, keep, start = [], [], 0
    for p, c in zip(prompts, completions):
        expected += p + c
        keep += [start + len(p) - 1 + j for j in range(len(c))]
        start += len(p) + len(c)
    assert packed.input_ids[0].tolist() == expected and packed.keep.tolist() == keep
    assert packed.position_ids[0, : len(prompts[0]) + len(completions[0])].tolist() == list(
        range(len(prompts[0]) + len(completions[0]))
    )
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor([len(c) for c in completions]).cumsum(0)]
    assert packed.tokens(batch.labels).tolist() == [t for c in completions for t in c]
    assert torch.equal(packed.per_sequence(batch.advantages), batch.advantages[live])
    back = packed.padded(packed.tokens(batch.labels))
    assert torch.equal(back, torch.where(packed.completion, batch.labels, 0))
    assert not packed.completion[1].any()  # the filtered row: nothing packed
    allowed = packed.attention_mask[0, 0]  # sdpa's: bool, True where a token may attend
    assert allowed.dtype == torch.bool
    additive = pack_rows(batch, "eager", torch.float32).attention_mask[0, 0]
    assert torch.equal(additive == 0, allowed)  # eager's: added to the scores
    first = len(prompts[0]) + len(completions[0])
    assert allowed[first, first] and not allowed[first, first - 1]  # a new sequence starts
    assert allowed[first - 1, 0] and not allowed[0, 1]  # causal within the first
    assert pack_rows(batch, "flash_attention_2", torch.float32).attention_mask is None
    batch.loss_tokens = [0] * len(batch)  # (an empty micro-batch of a rank: the forward runs)
    assert pack_rows(batch, "sdpa", torch.float32).sequences.tolist() == [0]
