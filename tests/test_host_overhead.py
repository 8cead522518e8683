"""The host's share of a loss call: how many aten ops policy_loss launches around its kernel.

On a GPU every small [B, T] op around the fused kernel is a kernel launch and some microseconds
of Python: at N = 4096, V = 32000 the H100 run of 2026-11-26 measured the fused loss at 3.3 ms
against a 0.17 ms memory floor (bench/results/2026-11-26-nvidia-h100-80gb-hbm3-bench_loss.log),
host-bound, where Liger's loss took 0.75 ms. These budgets keep the op count from creeping back:
a change that adds ops to the hot path must raise a budget here, on purpose.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fusedrl
from fusedrl import LossConfig

from .conftest import make_batch, needs_interpreter

BENCH = Path(__file__).resolve().parents[1] / "bench" / "host_overhead.py"


def _bench():
    """bench/host_overhead.py: its split of the ops (what launches a kernel on a GPU, what is a
    view or an allocation, what syncs), its op recorder and its count of the Triton launches;
    the budgets count what the benchmark reports."""
    spec = importlib.util.spec_from_file_location("_bench_host_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Kernel-running ops per forward + backward: aten ops that launch on a GPU plus the Triton
# launches (which the driver calls directly in eager mode), measured when set (2026-11-28,
# third session). dapo 50, grpo 66, gspo 83 on 2026-11-27; 5, 5, 7 earlier on 2026-11-28.
# token-mean presets (dapo, cispo): the fused kernel (it weighs the mask itself:
# AGG_FROM_MASK), the one program that adds up its sums (the loss, the metrics and the count of
# counted labels outside the vocabulary: the labels' range check), and autograd's seed
# gradient; backward's check of the upstream gradient is a host read on CPU (on CUDA: the
# scaling kernel, which returns at once when it is 1). grpo (seq-mean-token-mean) adds the
# weights kernel. Sequence-level presets: the weights, pass 1, the terms kernel
# (kernels/sequence_terms.py), their sums, pass 2, and the seed. The inputs reach the kernels
# as given: no masking, no float copy of a bool mask.
BUDGET = {"dapo": 3, "cispo": 3, "grpo": 4, "gspo": 6, "gspo_token": 6}


@needs_interpreter
@pytest.mark.parametrize("preset", sorted(BUDGET))
def test_forward_and_backward_launch_few_ops(preset):
    cfg = LossConfig.preset(preset)
    data = make_batch(batch=3, time=9, vocab=131, seed=5)
    data.pop("rollout_logp")  # the benchmark's inputs: old (and ref) log-probs, no rollout's
    if cfg.beta == 0:
        data.pop("ref_logp")
    leaf = data.pop("logits").requires_grad_(True)

    def step():
        out = fusedrl.policy_loss(leaf, config=cfg, backend="triton", **data)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        return out, grad

    out, grad = step()  # compile / first-call work stays out of the count
    bench = _bench()
    with bench._Launches(stub=False) as launches, bench._Ops(launches) as counter:
        out, grad = step()
    assert torch.isfinite(grad).all() and torch.isfinite(out.loss)
    assert launches.count >= 2, counter.ops  # the count saw the kernels: it counted the real call
    kinds = bench.classify(counter.ops)
    running = kinds.get("launching", 0) + kinds.get("custom", 0) + launches.count
    assert running <= BUDGET[preset], (
        f"{preset}: {running} kernel-running ops per forward + backward ({launches.count} "
        f"Triton launches), budget {BUDGET[preset]}:\n" + "\n".join(counter.ops)
    )


# token_logprobs without a gradient (old / ref log-probs): the labels' range check (one
# reduction) and the log-prob kernel.
LOGPROBS_BUDGET = 3


@needs_interpreter
def test_token_logprobs_without_grad_launch_few_ops():
    data = make_batch(batch=3, time=9, vocab=131, seed=6)
    with torch.no_grad():
        fusedrl.token_logprobs(data["logits"], data["labels"], backend="triton")
        bench = _bench()
        with bench._Launches(stub=False) as launches, bench._Ops(launches) as counter:
            logp, _ = fusedrl.token_logprobs(data["logits"], data["labels"], backend="triton")
    assert launches.count == 1 and torch.isfinite(logp).all()
    kinds = bench.classify(counter.ops)
    running = kinds.get("launching", 0) + launches.count
    assert running <= LOGPROBS_BUDGET, "\n".join(counter.ops)
