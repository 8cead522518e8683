"""Context parallelism (fusedrl/context_parallel.py) on CPU: gloo worlds of 2 and 3 processes.

The packed batch of tests/test_packed.py (25 tokens in six sequences, one empty, masked tokens
holding NaN logits) is cut into contiguous chunks, one a rank in rank order, unevenly, so that
sequences cross ranks. Each world is spawned once and runs every case; each rank saves what it
computed, and the tests compare it with the single-process packed call on the whole batch (run
by rank 0 in the same world): the loss and metrics on every rank, each rank's log-probs,
entropy and gradient its chunk of the single call's; and bad input raising on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import traceback

import pytest
import torch

import fusedrl
from fusedrl import LossConfig, reference

from .test_packed import VOCAB, _batch
from .worlds import named_results, worlds_by_size

WORLDS = (2, 3)
CHUNKS = {2: (12, 13), 3: (7, 10, 8)}  # of the 25 packed tokens; sequence 3 crosses ranks
DEADLINE_S = 240


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: LossConfig
    backend: str = "torch"
    per_token_adv: bool = False
    rollout: bool = False  # the engine's log-probs given (metrics, or the IS correction)
    row_temps: bool = False
    lm_head: bool = False  # hidden states [N, H] and the head (linear_policy_loss)
    bad: str = ""  # a named defect (see `_bad_arguments`), raised on every rank
    # 25 sequences of the 25 tokens, one empty: per-token advantages [N_r] that a single call's
    # 1-D [N] could not tell from per-sequence ones (it refuses them): the oracle judges
    n_equals_s: bool = False


GSPO_OPEN = {"eps_low": 0.2, "eps_high": 0.3}
# Refused before the call reaches its header, on one rank: it joins the header (the others raised
# nothing and would wait for it in their all-gather).
JOINS = (
    "softcap_last_rank",
    "sum_pi_squared_last_rank",
    "no_cu_seqlens_last_rank",
    "config_str_last_rank",
    "old_logp_int_last_rank",
)
# Whole values each rank gives: compared in the header, as the config.
COMPARED = (
    "advantages_values_differ",
    "is_weights_differ",
    "entropy_coef_differs",
    "entropy_coef_nan_on_one_rank",
    "temperature_0d_differs",
)
CASES = [
    # sequence ratios, crossing ranks; the mismatch metrics count sequences
    Case("gspo", LossConfig.preset("gspo", **GSPO_OPEN), rollout=True),
    Case("gspo_triton", LossConfig.preset("gspo", **GSPO_OPEN), backend="triton"),
    Case(
        "sequence_is_entropy_bonus",
        LossConfig.preset("grpo", is_correction="sequence_truncate", is_cap=1.5, entropy_coef=0.02),
        rollout=True,
    ),
    Case("grpo_kl_row_temps", LossConfig.preset("grpo", beta=0.1), row_temps=True),
    Case("dapo_per_token_adv", LossConfig.preset("dapo"), per_token_adv=True),
    # the LM-head form: each rank its chunk's hidden states, the head replicated
    Case("gspo_lm_head", LossConfig.preset("gspo", **GSPO_OPEN), lm_head=True, rollout=True),
    Case("grpo_lm_head_triton", LossConfig.preset("grpo"), backend="triton", lm_head=True),
    Case("bad_mask_shape_last_rank", LossConfig.preset("dapo"), bad="mask_shape_last_rank"),
    Case("bad_cu_seqlens_differ", LossConfig.preset("dapo"), bad="cu_seqlens_differ"),
    Case("bad_no_cu_seqlens", LossConfig.preset("dapo"), bad="no_cu_seqlens"),
    # found by the log-prob pass, after the local checks: still before any collective
    Case("bad_label_last_rank", LossConfig.preset("dapo"), bad="label_last_rank"),
    # [S] could be per token on a rank whose chunk holds S tokens: [S, 1] is asked for
    Case("bad_advantages_per_sequence_1d", LossConfig.preset("dapo"), bad="advantages_1d"),
    Case("bad_advantages_layout_differs", LossConfig.preset("dapo"), bad="advantages_layout"),
    Case("bad_config_differs", LossConfig.preset("dapo"), bad="config_differs"),
    *(Case(f"bad_{bad}", LossConfig.preset("dapo"), bad=bad) for bad in JOINS + COMPARED),
    Case(
        "gspo_n_equals_s",
        LossConfig.preset("gspo", **GSPO_OPEN),
        per_token_adv=True,
        n_equals_s=True,
    ),
]
BY_NAME = {case.name: case for case in CASES}


def _inputs(case: Case) -> dict:
    data = _batch(seed=31, per_token_adv=case.per_token_adv)
    flat = dict(data["packed"], cu_seqlens=data["cu_seqlens"])
    if case.n_equals_s:
        tokens = flat["labels"].shape[0]
        flat["cu_seqlens"] = torch.tensor([0, 2, 2, *range(3, tokens + 1)], dtype=torch.int32)
    if not case.per_token_adv:  # one per sequence: [S, 1] under cp_group
        flat["advantages"] = flat["advantages"][:, None]
    if not case.rollout:
        flat.pop("rollout_logp")
    if case.row_temps:
        gen = torch.Generator().manual_seed(3)
        flat["temperature"] = 0.5 + torch.rand(flat["labels"].shape, generator=gen)
    if case.lm_head:  # the head's own log-probs, moved a little, as the rollout's
        gen = torch.Generator().manual_seed(5)
        tokens = flat["labels"].shape[0]
        flat["logits"] = torch.randn(tokens, HIDDEN, generator=gen)  # (the hidden states)
        flat["weight"] = 0.5 * torch.randn(VOCAB, HIDDEN, generator=gen)
        with torch.no_grad():
            logits = flat["logits"] @ flat["weight"].T
            labels = flat["labels"].clamp_min(0)[:, None]
            now = torch.log_softmax(logits, -1).gather(-1, labels)[:, 0]
        for name, scale in (("old_logp", 0.3), ("ref_logp", 0.2), ("rollout_logp", 0.5)):
            if name in flat:
                flat[name] = now + scale * torch.randn(tokens, generator=gen)
    return flat


HIDDEN = 16


def _call(case: Case, inputs: dict, function=fusedrl.policy_loss, **extra) -> dict:
    """The loss of `inputs` (logits, or hidden states in "logits" and the head in "weight"),
    with the gradients of the rows ("grad") and of the head ("weight_grad")."""
    leaves = [inputs["logits"].detach().clone().requires_grad_(True)]
    if case.lm_head:
        leaves.append(inputs["weight"].detach().clone().requires_grad_(True))
        function = fusedrl.linear_policy_loss
    args = {k: v for k, v in inputs.items() if k not in ("logits", "weight")}
    out = function(
        *leaves, **args, config=case.config, backend=case.backend, return_entropy=True, **extra
    )
    grads = torch.autograd.grad(out.loss, leaves)
    return {
        "loss": out.loss.detach(),
        "logp": out.logp,
        "entropy": out.entropy,
        "grad": grads[0],
        "weight_grad": grads[1] if case.lm_head else None,
        "metrics": {k: v.detach() for k, v in out.metrics.items()},
    }


def _chunk(inputs: dict, mine: slice, tokens: int) -> dict:
    """This rank's part: every [N, ...] tensor's rows `mine`; per-sequence ones and the
    boundaries as they are."""
    return {
        k: v[mine] if k != "cu_seqlens" and v.dim() >= 1 and v.shape[0] == tokens else v
        for k, v in inputs.items()
    }


def _bad_arguments(case: Case, mine_inputs: dict, rank: int, world: int) -> dict:
    if case.bad == "mask_shape_last_rank" and rank == world - 1:
        mine_inputs["mask"] = mine_inputs["mask"][:-1]
    if case.bad == "cu_seqlens_differ" and rank == 1:
        bounds = mine_inputs["cu_seqlens"].clone()
        bounds[2] += 1  # another valid cut of the same tokens
        mine_inputs["cu_seqlens"] = bounds
    if case.bad == "no_cu_seqlens":
        mine_inputs.pop("cu_seqlens")
    if case.bad == "label_last_rank" and rank == world - 1:
        labels = mine_inputs["labels"].clone()
        labels[mine_inputs["mask"].nonzero()[0, 0]] = 10_000  # a counted token's
        mine_inputs["labels"] = labels
    if case.bad == "advantages_1d":
        mine_inputs["advantages"] = mine_inputs["advantages"][:, 0]
    if case.bad == "advantages_layout" and rank == 1:  # per token here, per sequence elsewhere
        mine_inputs["advantages"] = torch.zeros(mine_inputs["labels"].shape)
    last = rank == world - 1
    if case.bad == "softcap_last_rank" and last:
        mine_inputs["softcap"] = -1.0
    if case.bad == "sum_pi_squared_last_rank" and last:
        mine_inputs["return_sum_pi_squared"] = True
    if case.bad == "no_cu_seqlens_last_rank" and last:
        mine_inputs.pop("cu_seqlens")
    if case.bad == "old_logp_int_last_rank" and last:  # (gathered as fp32, it passed)
        mine_inputs["old_logp"] = mine_inputs["old_logp"].long()
    one = 1 if rank == 1 else 0  # rank 1's value differs
    if case.bad == "advantages_values_differ":
        mine_inputs["advantages"] = mine_inputs["advantages"] + one
    if case.bad == "is_weights_differ":
        mine_inputs["is_weights"] = torch.ones_like(mine_inputs["advantages"]) + one
    if case.bad == "entropy_coef_differs":
        mine_inputs["entropy_coef"] = torch.tensor(0.01 + one)
    if case.bad == "entropy_coef_nan_on_one_rank":
        mine_inputs["entropy_coef"] = torch.tensor(float("nan") if one else 0.01)
    if case.bad == "temperature_0d_differs":
        mine_inputs["temperature"] = torch.tensor(0.7 + one)
    return mine_inputs


def _run(case: Case, world: int, rank: int, group) -> dict:
    inputs = _inputs(case)
    tokens = inputs["labels"].shape[0]
    sizes = CHUNKS[world]
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    mine_inputs = _bad_arguments(case, _chunk(inputs, mine, tokens), rank, world)
    result = {"mine": (mine.start, mine.stop)}
    if case.bad:
        if case.bad == "config_differs" and rank == 1:
            case = dataclasses.replace(case, config=case.config.replace(eps_high=0.3))
        if case.bad == "config_str_last_rank" and rank == world - 1:
            case = dataclasses.replace(case, config="dapo")
        try:
            _call(case, mine_inputs, cp_group=group)
            result["error"] = None
        except Exception as err:
            result["error"] = (type(err).__name__, str(err))
        return result
    result.update(_call(case, mine_inputs, cp_group=group))
    if rank == 0:
        function = reference.policy_loss if case.n_equals_s else fusedrl.policy_loss
        result["single"] = _call(case, inputs, function)
    return result


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    for case in CASES:
        try:
            results[case.name] = _run(case, world, rank, dist.group.WORLD)
        except Exception:
            results[case.name] = {"crash": traceback.format_exc()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return worlds_by_size(tmp_path_factory, _worker, "the context-parallel world", DEADLINE_S)


def _results(worlds, world: int, name: str) -> list[dict]:
    return named_results(worlds(world), name)


GOOD = [case.name for case in CASES if not case.bad and not case.n_equals_s]


@pytest.mark.parametrize("name", GOOD)
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_gets_the_single_process_result(worlds, world, name):
    """The loss and metrics on every rank are the single call's on the whole batch; each
    rank's log-probs, entropy and gradient are its chunk of the single call's."""
    per_rank = _results(worlds, world, name)
    single = per_rank[0]["single"]
    assert single["grad"].nan_to_num().abs().sum() > 0
    for rank, result in enumerate(per_rank):
        mine = slice(*result["mine"])
        torch.testing.assert_close(result["loss"], single["loss"], atol=1e-6, rtol=1e-5)
        assert result["metrics"].keys() == single["metrics"].keys(), rank
        for key, value in single["metrics"].items():
            torch.testing.assert_close(result["metrics"][key], value, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["logp"], single["logp"][mine], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["entropy"], single["entropy"][mine])
        torch.testing.assert_close(
            result["grad"], single["grad"][mine], atol=1e-6, rtol=1e-5, equal_nan=True
        )
        # the whole batch's loss, the same bits on every rank
        assert torch.equal(result["loss"], per_rank[0]["loss"]), rank
    if single["weight_grad"] is not None:  # the head's: each rank its chunk's part, summed
        summed = sum(result["weight_grad"] for result in per_rank)
        torch.testing.assert_close(summed, single["weight_grad"], atol=1e-6, rtol=1e-5)
        assert single["weight_grad"].abs().sum() > 0


@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_raises_on_every_rank(worlds, world):
    """One rank's bad mask: its own error there, a pointer on the others; boundaries that
    differ across ranks, or none: the same error everywhere. Nobody hangs."""
    errors = [r["error"] for r in _results(worlds, world, "bad_mask_shape_last_rank")]
    assert errors[-1][0] == "ValueError" and "mask shape" in errors[-1][1], errors
    for error in errors[:-1]:
        assert error[0] == "ContextParallelInputError", errors
        assert f"rank(s) [{world - 1}] rejected" in error[1], errors
    errors = [r["error"] for r in _results(worlds, world, "bad_label_last_rank")]
    assert errors[-1][0] == "ValueError" and "labels must be in" in errors[-1][1], errors
    assert all(e[0] == "ContextParallelInputError" for e in errors[:-1]), errors
    for name, error_type, phrase in (
        ("bad_softcap_last_rank", "ValueError", "softcap must be"),
        ("bad_sum_pi_squared_last_rank", "NotImplementedError", "return_sum_pi_squared"),
        ("bad_no_cu_seqlens_last_rank", "ValueError", "cp_group takes packed"),
        ("bad_config_str_last_rank", "TypeError", "config must be a fusedrl.LossConfig"),
        ("bad_old_logp_int_last_rank", "TypeError", "old_logp must be a floating tensor"),
    ):
        errors = [r["error"] for r in _results(worlds, world, name)]
        assert errors[-1][0] == error_type and phrase in errors[-1][1], (name, errors)
        for error in errors[:-1]:
            assert error[0] == "ContextParallelInputError", (name, errors)
            assert f"rank(s) [{world - 1}] rejected" in error[1], (name, errors)
    for name, phrase in (
        ("bad_cu_seqlens_differ", "disagree on cu_seqlens"),
        ("bad_config_differs", "the config"),
        ("bad_advantages_layout_differs", "which are per token"),
        *(
            (f"bad_{bad}", "the per-sequence [S, 1] advantages / is_weights, a 0-dim")
            for bad in COMPARED
        ),
    ):
        errors = [r["error"] for r in _results(worlds, world, name)]
        assert {e for e in errors} == {("ContextParallelInputError", errors[0][1])}, errors
        assert phrase in errors[0][1], (name, errors)
    for name, phrase in (
        ("bad_no_cu_seqlens", "cp_group takes packed"),
        ("bad_advantages_per_sequence_1d", "or [6, 1] (one per sequence"),
    ):
        errors = [r["error"] for r in _results(worlds, world, name)]
        assert all(e[0] == "ValueError" and phrase in e[1] for e in errors), (name, errors)


@pytest.mark.parametrize("world", WORLDS)
def test_per_token_values_of_a_batch_with_as_many_sequences_as_tokens(worlds, world):
    """Each rank's [N_r] advantages are per token (a rank gives [S, 1] for per sequence): the
    whole batch's gathered column is not the ambiguous 1-D [S] of a single call, and was refused
    as one. Against the oracle's packed call (the gradient too)."""
    per_rank = _results(worlds, world, "gspo_n_equals_s")
    truth = per_rank[0]["single"]
    assert truth["grad"].nan_to_num().abs().sum() > 0
    for result in per_rank:
        mine = slice(*result["mine"])
        torch.testing.assert_close(result["loss"], truth["loss"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result["logp"], truth["logp"][mine], atol=1e-6, rtol=1e-5)
        grad = torch.nan_to_num(result["grad"])
        torch.testing.assert_close(grad, truth["grad"][mine].nan_to_num(), atol=1e-6, rtol=1e-5)


def test_the_cases_act():
    """What the comparisons take for granted: sequences cross ranks in both worlds, and the
    sequence-level branches act on these inputs."""
    bounds = _inputs(BY_NAME["gspo"])["cu_seqlens"].tolist()
    for sizes in CHUNKS.values():
        cuts = [sum(sizes[: r + 1]) for r in range(len(sizes) - 1)]
        assert any(lo < cut < hi for cut in cuts for lo, hi in zip(bounds, bounds[1:]))
    out = _call(BY_NAME["sequence_is_entropy_bonus"], _inputs(BY_NAME["sequence_is_entropy_bonus"]))
    assert out["metrics"]["is_weight_mean"] < out["metrics"]["is_weight_max"] == 1.5
