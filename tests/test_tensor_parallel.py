"""Tensor parallelism (fusedrl/tp, issue 25) on CPU: gloo worlds of 2 and 3 processes.

Each world is spawned once (process start-up dominates) and runs every case below; each rank
saves what it computed, and the tests compare it with the single-process call on the whole
logits (run by rank 0 in the same world, same backend) and with fusedrl.reference:

- loss, logp, entropy and metrics on every rank, each rank's gradient slice (padding: zeros),
  for policy_loss / token_logprobs on logit slices and DTensor logits, and for the LM-head forms
  on the head's rows (d/dhidden summed over the group, or left in parts on request);
- the outputs are the same bits on every rank;
- the collectives: forward = the header + one all-gather of 3 fp32 per token; backward none
  (the LM-head forms: one all-reduce of d/dhidden);
- a group of one gives the single-process result bit for bit;
- bad input raises the same error on every rank, and the world goes on to the next case (no
  hang: the process group has a timeout, the parent a deadline).

The vocab is split unevenly (1031 = 400 + 331 + 300, and 600 + 431), by explicit vocab_start in
a permuted order, with padding columns holding NaN / huge values that must not count, and with a
rank whose slice is only padding. Triton runs under the interpreter on a small vocab (67).
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
from datetime import timedelta

import pytest
import torch

import fusedrl
import fusedrl.tp
from fusedrl import LossConfig, reference
from fusedrl.tp.header import FIELDS

from .conftest import make_batch
from .worlds import named_results, worlds_by_size

WORLDS = (2, 3)
SPLITS = {  # uneven slices of the true vocabulary
    (2, 1031): (600, 431),
    (3, 1031): (400, 331, 300),
    (2, 67): (40, 27),
    (3, 67): (30, 20, 17),
}
PADDING = 9  # columns Megatron-style padding adds to the last rank ("padded" layout)
DEADLINE_S = 420  # for a whole world; a hang shows up as the gloo timeout first
GLOO_TIMEOUT_S = 60
MESH: list = []  # the worker's 1-D device mesh over its world (for the DTensor cases)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str = "loss"  # "loss" | "logprobs" | "tp1" | "bad"
    backend: str = "torch"
    preset: str = "dapo"
    overrides: tuple = ()  # LossConfig overrides, as (key, value) pairs
    layout: str = "uneven"  # "uneven" | "start" | "padded" | "padded_rank"
    batch: int = 3
    time: int = 7
    dtype: torch.dtype = torch.float32
    flat: bool = False
    inplace: bool = False
    return_entropy: bool = False
    temperature: float = 1.0
    nan_padding: bool = False  # masked tokens hold NaN logits (make_batch)
    per_token_adv: bool = False
    inputs: str = ""  # a named change to the inputs (see _edit_inputs)
    expect_error: str = ""  # "bad" cases: the error's type name
    oracle: bool = True  # the single-process call gives the same numbers (not so for a random pick)
    sampling: tuple = ()  # token_logprobs' top_k / top_p / min_p, as (key, value) pairs
    row_temps: bool = False  # per-token temperatures (`temperature=` a [B, T] tensor)
    softcap: float | None = None  # the model's soft cap (logits: raw ones; LM head: after it)
    skip_masked_rows: bool = False  # the LM-head loss: logits for the live rows alone
    grad_scale: float | None = None  # the loss's factor before backward (`grad_scale=`)
    packed: bool = False  # [N, V] rows of packed sequences with `cu_seqlens` (`packed_bounds`)

    def sampling_filters(self) -> dict:
        """The sampling mask replayed (the config's for the losses), {} when none."""
        if self.kind in ("loss", "linear") or self.inputs == "linear":
            cfg = self.config()
            filters = {"top_k": cfg.top_k, "top_p": cfg.top_p, "min_p": cfg.min_p}
            return {k: v for k, v in filters.items() if v is not None}
        return dict(self.sampling)

    @property
    def vocab(self) -> int:
        return 67 if self.backend == "triton" else 1031

    def config(self) -> LossConfig:
        return LossConfig.preset(self.preset, **dict(self.overrides))


TRITON = dict(backend="triton", batch=2, time=4)
# GSPO's bounds (3e-4, 4e-4) clip every sequence of these inputs (their log-ratios are ~0.1):
# the gradient would be 0 and any slice's gradient would match it. Wider ones keep some open.
GSPO_OPEN = (("eps_low", 0.2), ("eps_high", 0.3))
CASES = [
    # token-level, sequence-level and clip_cov-style selections, with the corrections on
    Case("dapo"),
    # per-token temperatures (each rank divides its slice's rows by them) with the KL and the
    # entropy bonus; a number elsewhere (logprobs, the sampling cases, linear_logprobs)
    Case(
        "grpo_kl_entropy_row_temps",
        preset="grpo",
        return_entropy=True,
        per_token_adv=True,
        row_temps=True,
        overrides=(("entropy_coef", 0.01),),
    ),
    Case(
        "gspo_sequence_is",
        preset="gspo",
        overrides=(*GSPO_OPEN, ("is_correction", "sequence_truncate"), ("is_cap", 1.2)),
    ),
    Case(
        "clip_cov",
        overrides=(
            ("loss", "clip_cov"),
            ("clip_cov_seed", 7),
            ("clip_cov_ratio", 0.3),
            ("clip_cov_lb", -1.0),
        ),
    ),
    Case(
        "kl_cov_rejection_is",
        overrides=(
            ("loss", "kl_cov"),
            ("kl_cov_ratio", 0.3),
            ("rejection", "token_k1"),
            ("rejection_threshold", "0.75_1.3"),
            ("is_correction", "token_truncate"),
        ),
    ),
    # vocab layouts
    Case("dapo_vocab_start", layout="start"),
    Case(
        "grpo_padded_nan_rows",
        preset="grpo",
        layout="padded",
        nan_padding=True,
        overrides=(("entropy_coef", 0.01),),
    ),
    Case("dapo_padding_only_rank", layout="padded_rank", return_entropy=True),
    # input forms
    Case("grpo_dtensor", preset="grpo", layout="dtensor", return_entropy=True),
    # per-token temperatures as a replicated DTensor (taken as their local values)
    Case("grpo_dtensor_row_temps", preset="grpo", layout="dtensor", row_temps=True),
    Case(
        "logprobs_dtensor_row_temps",
        kind="logprobs",
        layout="dtensor",
        row_temps=True,
        return_entropy=True,
    ),
    Case("logprobs_dtensor", kind="logprobs", layout="dtensor", return_entropy=True),
    # int32 labels (vLLM's, tokenizers'), as one process takes them, on every entry point
    Case("dapo_flat_int32_labels", flat=True, per_token_adv=True, inputs="int32_labels"),
    Case("dapo_inplace", inplace=True),
    # the gradient written at the loss's factor (token-mean; seq-mean on a DTensor)
    Case("dapo_grad_scale", grad_scale=0.25),
    Case(
        "grpo_dtensor_grad_scale",
        preset="grpo",
        layout="dtensor",
        grad_scale=0.5,
        return_entropy=True,
    ),
    Case(
        "gspo_dtensor_inplace", preset="gspo", layout="dtensor", inplace=True, overrides=GSPO_OPEN
    ),
    Case("dapo_bf16", dtype=torch.bfloat16),
    Case("all_masked", inputs="all_masked", overrides=(("entropy_coef", 0.01),)),
    Case("logprobs", kind="logprobs", return_entropy=True, temperature=0.7),
    Case(
        "logprobs_padded_int32_labels",
        kind="logprobs",
        layout="padded",
        return_entropy=True,
        inputs="int32_labels",
    ),
    Case(
        "logprobs_row_temps_flat", kind="logprobs", row_temps=True, return_entropy=True, flat=True
    ),
    # degenerate rows: a slice of only -inf (drops out), a whole row of -inf (NaN)
    Case("logprobs_dead_slices", kind="logprobs", return_entropy=True, inputs="dead"),
    # clip_cov's random pick with no seed: every rank must still pick the same tokens
    Case(
        "clip_cov_unseeded",
        oracle=False,
        overrides=(("loss", "clip_cov"), ("clip_cov_ratio", 0.3), ("clip_cov_lb", -1.0)),
    ),
    # sampling-mask replay: the sets found by radix selects summed over the group
    Case(
        "dapo_top_k_top_p",
        return_entropy=True,
        overrides=(("top_k", 40), ("top_p", 0.9), ("temperature", 0.8)),
    ),
    Case(
        "grpo_top_p_min_p_padded_row_temps",
        preset="grpo",
        layout="padded",
        nan_padding=True,
        row_temps=True,
        overrides=(("top_p", 0.7), ("min_p", 0.02), ("entropy_coef", 0.01)),
    ),
    Case("gspo_top_k_inplace", preset="gspo", inplace=True, overrides=(("top_k", 5),)),
    Case("dapo_top_p_dtensor", layout="dtensor", overrides=(("top_p", 0.8),)),
    Case(
        "dapo_top_k_padding_only_rank",
        layout="padded_rank",
        overrides=(("top_k", 20), ("top_p", 0.95)),
    ),
    # bf16 rows tie often: top_k keeps the ties with the k-th (top_p at a tie is the one place
    # where vLLM's unstable sort, and so the reference, keep an arbitrary part of them)
    Case("dapo_sampling_bf16", dtype=torch.bfloat16, overrides=(("top_k", 30), ("min_p", 0.05))),
    Case(
        "logprobs_sampling_row_temps",
        kind="logprobs",
        return_entropy=True,
        row_temps=True,
        sampling=(("top_k", 50), ("top_p", 0.85), ("min_p", 0.01)),
    ),
    # Triton (interpreter): small rows in several vocab tiles
    Case(
        "triton_dapo_is_entropy",
        **TRITON,
        return_entropy=True,
        overrides=(("entropy_coef", 0.01), ("is_correction", "token_truncate"), ("is_cap", 1.2)),
    ),
    Case(
        "triton_gspo_row_temps",
        **TRITON,
        preset="gspo",
        row_temps=True,
        overrides=(("eps_low", 0.9), ("eps_high", 9.0)),
    ),  # (ratios at other temperatures)
    Case("triton_grpo_padded_inplace", **TRITON, preset="grpo", layout="padded", inplace=True),
    Case(
        "triton_kl_cov_vocab_start",
        **TRITON,
        layout="start",
        overrides=(
            ("loss", "kl_cov"),
            ("kl_cov_ratio", 0.3),
            ("rejection", "token_k1"),
            ("rejection_threshold", "0.75_1.3"),
        ),
    ),
    Case("triton_logprobs", **TRITON, kind="logprobs", return_entropy=True),
    Case(
        "triton_logprobs_dead_slices", **TRITON, kind="logprobs", return_entropy=True, inputs="dead"
    ),
    Case(
        "triton_dapo_sampling",
        **TRITON,
        return_entropy=True,
        overrides=(("top_k", 12), ("top_p", 0.9)),
    ),
    Case("triton_logprobs_sampling", **TRITON, kind="logprobs", sampling=(("top_p", 0.8),)),
    # read through each rank's floors (no masked copy): in place, per-token temperatures, bf16,
    # padding columns and NaN in masked rows; under a soft cap, through a masked copy
    Case(
        "triton_grpo_sampling_inplace_padded_row_temps_bf16",
        **TRITON,
        preset="grpo",
        dtype=torch.bfloat16,
        layout="padded",
        nan_padding=True,
        inplace=True,
        row_temps=True,
        return_entropy=True,
        overrides=(("top_p", 0.85), ("min_p", 0.02), ("entropy_coef", 0.01)),
    ),
    Case(
        "triton_dapo_sampling_padding_only_rank",
        **TRITON,
        layout="padded_rank",
        overrides=(("top_k", 12), ("min_p", 0.02)),
    ),
    Case(
        "triton_logprobs_sampling_padding_only_rank",
        **TRITON,
        kind="logprobs",
        layout="padded_rank",
        return_entropy=True,
        sampling=(("top_p", 0.8),),
    ),
    Case(
        "triton_logprobs_sampling_softcap",
        **TRITON,
        kind="logprobs",
        softcap=2.5,
        return_entropy=True,
        sampling=(("top_k", 10),),
    ),
    # a soft cap on raw logits: each rank caps its slice as it reads it (the sets: the capped
    # logits')
    Case(
        "dapo_softcap_sampling_padded_row_temps",
        layout="padded",
        nan_padding=True,
        row_temps=True,
        softcap=3.0,
        return_entropy=True,
        overrides=(("top_k", 40), ("min_p", 0.02), ("entropy_coef", 0.01)),
    ),
    Case(
        "logprobs_softcap_sampling",
        kind="logprobs",
        return_entropy=True,
        softcap=3.0,
        temperature=0.7,
        sampling=(("top_p", 0.85),),
    ),
    Case("triton_gspo_softcap_inplace", **TRITON, preset="gspo", softcap=2.5, inplace=True),
    # the LM-head forms: weight / bias are the rank's rows, hidden is replicated
    Case(
        "linear_dapo_softcap_int32_labels",
        kind="linear",
        return_entropy=True,
        softcap=3.0,
        inputs="int32_labels",
    ),
    Case(
        "linear_gspo_padded_row_temps",
        kind="linear",
        preset="gspo",
        layout="padded",
        row_temps=True,
        overrides=(("entropy_coef", 0.01),),
    ),
    Case(
        "linear_gspo_padded_row_temps_skip",
        kind="linear",
        preset="gspo",
        layout="padded",
        row_temps=True,
        skip_masked_rows=True,
        overrides=(("entropy_coef", 0.01),),
    ),
    Case("linear_no_input_reduce", kind="linear", inputs="no_input_reduce"),
    Case(
        "linear_grpo_grad_scale", kind="linear", preset="grpo", return_entropy=True, grad_scale=0.25
    ),
    Case(
        "linear_logprobs_int32_labels",
        kind="linear_logprobs",
        return_entropy=True,
        temperature=0.7,
        inputs="int32_labels",
    ),
    Case("linear_logprobs_start_row_temps", kind="linear_logprobs", layout="start", row_temps=True),
    Case(
        "linear_dapo_sampling_row_temps",
        kind="linear",
        return_entropy=True,
        row_temps=True,
        overrides=(("top_k", 40), ("top_p", 0.9)),
    ),
    Case(
        "linear_gspo_sampling_padding_only_rank_skip",
        kind="linear",
        preset="gspo",
        layout="padded_rank",
        skip_masked_rows=True,
        overrides=(("top_p", 0.8), ("min_p", 0.02)),
    ),
    # top_k 2-3 of V = 1031 over 2-3 ranks: most rows hold no token of their set on some rank,
    # whose slice then has no mass (p = 0 there, not NaN)
    Case("linear_dapo_top_k_3", kind="linear", overrides=(("top_k", 3),)),
    Case(
        "linear_logprobs_top_k_2",
        kind="linear_logprobs",
        return_entropy=True,
        sampling=(("top_k", 2),),
    ),
    Case(
        "linear_logprobs_sampling_softcap",
        kind="linear_logprobs",
        return_entropy=True,
        softcap=3.0,
        sampling=(("top_k", 25), ("top_p", 0.9)),
    ),
    # the LM-head forms with Triton: cuBLAS chunks read by the Triton row kernels
    Case(
        "triton_linear_dapo_row_temps",
        **TRITON,
        kind="linear",
        return_entropy=True,
        row_temps=True,
        overrides=(("entropy_coef", 0.01),),
    ),
    Case(
        "triton_linear_gspo_sampling_padded_softcap",
        **TRITON,
        kind="linear",
        preset="gspo",
        layout="padded",
        softcap=2.5,
        overrides=(("top_k", 12), ("top_p", 0.9)),
    ),
    Case(
        "triton_linear_gspo_sampling_padded_softcap_skip",
        **TRITON,
        kind="linear",
        preset="gspo",
        layout="padded",
        softcap=2.5,
        skip_masked_rows=True,
        overrides=(("top_k", 12), ("top_p", 0.9)),
    ),
    Case(
        "triton_linear_sampling_padding_only_rank",
        **TRITON,
        kind="linear",
        layout="padded_rank",
        overrides=(("top_p", 0.8), ("min_p", 0.02)),
    ),
    Case(
        "triton_linear_sampling_padding_only_rank_skip",
        **TRITON,
        kind="linear",
        layout="padded_rank",
        skip_masked_rows=True,
        overrides=(("top_p", 0.8), ("min_p", 0.02)),
    ),
    Case(
        "triton_linear_logprobs_sampling_row_temps",
        **TRITON,
        kind="linear_logprobs",
        return_entropy=True,
        row_temps=True,
        sampling=(("top_k", 20), ("top_p", 0.85)),
    ),
    # a group of one: the single-process result, bit for bit
    # packed sequences (cu_seqlens): token-level (the plain call), a sequence mean (its weights
    # per sequence) with the engine's log-probs for the metrics, sequence-level ratios (the
    # log-prob pass and the terms on the padded layout), on logits, DTensor logits and a head
    Case("packed_dapo_inplace", packed=True, inplace=True, return_entropy=True),
    Case("packed_grpo_dtensor", packed=True, preset="grpo", layout="dtensor"),
    Case("packed_gspo", packed=True, preset="gspo", overrides=GSPO_OPEN, return_entropy=True),
    Case("triton_packed_gspo", **TRITON, packed=True, preset="gspo", overrides=GSPO_OPEN),
    Case("packed_logprobs", kind="logprobs", packed=True, return_entropy=True),
    Case("packed_linear_grpo", kind="linear", packed=True, preset="grpo"),
    Case("packed_linear_gspo", kind="linear", packed=True, preset="gspo", overrides=GSPO_OPEN),
    Case("tp1_dapo", kind="tp1", return_entropy=True),
    Case("tp1_padded", kind="tp1", layout="padded", preset="grpo"),
    Case("tp1_triton_gspo", kind="tp1", **TRITON, preset="gspo"),
    Case("tp1_triton_dapo", kind="tp1", **TRITON, return_entropy=True),  # the fused kernel
    Case("tp1_logprobs", kind="tp1", inputs="logprobs"),
    Case("tp1_triton_softcap", kind="tp1", **TRITON, softcap=2.5, return_entropy=True),
    Case("tp1_linear_padded", kind="tp1", inputs="linear", layout="padded", preset="grpo"),
    Case("tp1_dapo_sampling", kind="tp1", overrides=(("top_k", 30), ("top_p", 0.9))),
    Case("tp1_logprobs_sampling", kind="tp1", inputs="logprobs", sampling=(("top_p", 0.8),)),
    # bad input: the same error on every rank, and the world goes on
    Case(
        "bad_cu_seqlens_differs",
        kind="bad",
        packed=True,
        preset="gspo",
        overrides=GSPO_OPEN,
        inputs="cu_seqlens_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(  # the sequence-level route: the log-prob pass's header compares the loss's inputs
        "bad_packed_gspo_advantages_differs",
        kind="bad",
        packed=True,
        preset="gspo",
        overrides=GSPO_OPEN,
        inputs="advantages_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_cu_seqlens_last_rank",
        kind="bad",
        packed=True,
        inputs="cu_seqlens_last_rank",
        expect_error="local",
    ),
    Case(
        "bad_label_on_one_rank",
        kind="bad",
        inputs="label_too_big_rank0",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_negative_label",
        kind="bad",
        inputs="label_negative",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_labels_differ",
        kind="bad",
        inputs="labels_differ",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_vocab_size_too_big",
        kind="bad",
        inputs="vocab_size_too_big",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_vocab_start_overlap",
        kind="bad",
        inputs="start_overlap",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_vocab_start_gap",
        kind="bad",
        inputs="start_gap",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_vocab_start_some_ranks",
        kind="bad",
        inputs="start_rank0_only",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_batch_differs",
        kind="bad",
        inputs="batch_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_time_differs",
        kind="bad",
        inputs="time_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_config_differs",
        kind="bad",
        inputs="config_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_row_temps_rank0_only",
        kind="bad",
        inputs="row_temps_rank0_only",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_softcap_differs",
        kind="bad",
        inputs="softcap_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_logprobs_label",
        kind="bad",
        inputs="logprobs_label_too_big",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_local_error_on_last_rank",
        kind="bad",
        inputs="advantages_shape_last_rank",
        expect_error="local",
    ),
    Case("bad_backend_cuda", kind="bad", inputs="backend_cuda", expect_error="NotImplementedError"),
    # one rank's argument refused before its header: it joins the header with the failure
    Case("bad_softcap_on_last_rank", kind="bad", inputs="softcap_last_rank", expect_error="local"),
    Case(
        "bad_top_k_on_last_rank",
        kind="bad",
        inputs="logprobs_top_k_last_rank",
        expect_error="local",
    ),
    Case(
        "bad_labels_permuted",
        kind="bad",
        inputs="labels_permuted",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_mask_weights_differ",
        kind="bad",
        inputs="mask_weights_differ",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_linear_reduce_differs",
        kind="bad",
        inputs="linear_reduce_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_linear_hidden_size_differs",
        kind="bad",
        inputs="linear_hidden_size_differs",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_linear_label",
        kind="bad",
        inputs="linear_label_too_big_rank0",
        expect_error="TensorParallelInputError",
    ),
    Case(
        "bad_linear_head_transposed_on_last_rank",
        kind="bad",
        inputs="linear_head_transposed_last_rank",
        expect_error="local",
    ),
    # replicated inputs that differ on one rank: each compared by a hash of its bits
    Case(
        "bad_labels_collide",
        kind="bad",
        inputs="labels_collide",
        expect_error="TensorParallelInputError",
    ),
    *[
        Case(
            f"bad_{name}_differs",
            kind="bad",
            inputs=f"{name}_differs",
            expect_error="TensorParallelInputError",
        )
        for name in (
            "advantages",
            "old_logp",
            "ref_logp",
            "rollout_logp",
            "is_weights",
            "normalizer",
            "row_temps",
            "logprobs_row_temps",
            "linear_advantages",
        )
    ],
]
BY_NAME = {case.name: case for case in CASES}
assert len(BY_NAME) == len(CASES)


# ------------------------------------------------------------------------------ the layouts
def layout(case: Case, world: int) -> tuple[list[int], list[int], dict]:
    """(starts, sizes) of every rank's slice, and the vocab keywords of the call."""
    split = list(SPLITS[(world, case.vocab)])
    if case.layout == "dtensor":  # torch's Shard(-1): torch.chunk's sizes
        sizes = [c.numel() for c in torch.arange(case.vocab).chunk(world)]
        return [sum(sizes[:r]) for r in range(world)], sizes, {}
    if case.layout == "uneven":
        return [sum(split[:r]) for r in range(world)], split, {}
    if case.layout == "start":  # rank r holds block world-1-r: slices out of rank order
        sizes = split[::-1]
        starts = [sum(split[: world - 1 - r]) for r in range(world)]
        return starts, sizes, {"vocab_start": "per rank"}
    if case.layout == "padded":
        sizes = split[:-1] + [split[-1] + PADDING]
    elif case.layout == "padded_rank":  # the last rank holds only padding
        sizes = split[:-2] + [split[-2] + split[-1], PADDING]
    else:
        raise AssertionError(case.layout)
    return [sum(sizes[:r]) for r in range(world)], sizes, {"vocab_size": case.vocab}


def rank_slice(full: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Columns [start, start + size) of the vocab-padded logits: past the true vocabulary,
    garbage (NaN and 1e4) that would poison or dominate any row it leaked into."""
    real = full[..., start : start + size]
    pad = size - real.shape[-1]
    if pad == 0:
        return real.clone()
    garbage = torch.full((*full.shape[:-1], pad), 1e4, dtype=full.dtype)
    garbage[..., ::2] = float("nan")
    return torch.cat([real, garbage], dim=-1)


def case_inputs(case: Case) -> dict:
    data = make_batch(
        batch=case.batch,
        time=case.time,
        vocab=case.vocab,
        dtype=case.dtype,
        seed=11,
        per_token_adv=case.per_token_adv or case.flat or case.packed,
        with_nan_padding=case.nan_padding,
    )
    if case.inputs == "all_masked":
        data["mask"] = torch.zeros_like(data["mask"])
    if case.inputs == "int32_labels":
        data["labels"] = data["labels"].int()
    if case.flat or case.packed:
        data = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items()}
    if case.packed and not _logprobs_kind(case):
        data["cu_seqlens"] = packed_bounds(case)
    return data


def packed_bounds(case: Case) -> torch.Tensor:
    """The boundaries of a packed case's rows: four sequences of the batch's tokens, one of
    them empty, the others counting different numbers of tokens (so a sequence mean is not the
    token mean); int32, flash-attention's convention."""
    tokens = case.batch * case.time
    return torch.tensor([0, tokens // 7, tokens // 7, tokens // 2, tokens], dtype=torch.int32)


def dead_rows(whole: dict, data: dict, world: int, case: Case) -> tuple[dict, dict]:
    """Row (0, 0): rank 0's slice all -inf, the label elsewhere; (0, 1): every logit -inf;
    (0, 2): rank 0's slice all -inf and the label in it (its logp is -inf)."""
    starts, sizes, _ = layout(case, world)
    logits, labels = whole["logits"].clone(), data["labels"].clone()
    first = slice(starts[0], starts[0] + sizes[0])
    logits[0, 0, first] = float("-inf")
    labels[0, 0] = case.vocab - 1
    logits[0, 1] = float("-inf")
    logits[0, 2, first] = float("-inf")
    labels[0, 2] = starts[0] + 5
    return {"logits": logits}, dict(data, labels=labels)


# ------------------------------------------------------------------------------ the worker
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveLog:
    """Counts the calls of torch.distributed's collectives (the outermost, when one calls
    another), with the dtype and size of the tensors each was given."""

    def __init__(self) -> None:
        self.calls: list = []
        self._depth = 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._counted(name, getattr(dist, name)))

    def _counted(self, name, fn):
        def counted(*args, **kwargs):
            if self._depth == 0:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                self.calls.append((name, [(str(t.dtype), t.numel()) for t in tensors]))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _count_masked_writes() -> list:
    """The sets' masked writes of a slice (tp/sampling.py's `mask_slice`), one entry a call."""
    import fusedrl.tp.loss as tp_loss
    import fusedrl.tp.sampling as tp_sampling

    calls = []
    real = tp_sampling.mask_slice

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    tp_loss.mask_slice = tp_sampling.mask_slice = counted
    return calls


def _detached(out) -> dict:
    return {
        "loss": out.loss.detach(),
        "logp": out.logp,
        "entropy": out.entropy,
        "metrics": {k: v.detach() for k, v in out.metrics.items()},
    }


def _upstream(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    shape = data["labels"].shape
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _temperature(case: Case, data: dict):
    """The call's temperature: per token in [0.4, 1.6) (replicated: the same seed on every
    rank), else the case's number."""
    if not case.row_temps:
        return case.temperature
    gen = torch.Generator().manual_seed(17)
    return 0.4 + 1.2 * torch.rand(data["labels"].shape, generator=gen)


def _logprobs_kind(case: Case) -> bool:
    return case.kind in ("logprobs", "linear_logprobs") or case.inputs == "logprobs"


def _linear_kind(case: Case) -> bool:
    return case.kind.startswith("linear") or case.inputs == "linear"


def _call(fn, case: Case, inputs: dict, data: dict, log: CollectiveLog | None, **tp):
    """Run `fn` (a policy_loss or token_logprobs form, fused or reference) on leaf copies of
    `inputs` ({"logits"} or {"hidden", "weight", "bias"}); return its outputs, the gradients of
    `inputs` and the collectives of the forward and of the backward."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    head = [leaves["logits"]] if "logits" in leaves else [leaves["hidden"], leaves["weight"]]
    if "bias" in leaves:
        tp["bias"] = leaves["bias"]
    args = {k: v for k, v in data.items() if k != "logits"}
    temperature = _temperature(case, data)
    if tp.pop("replicated_temperature", False):  # a replicated DTensor, as FSDP / TP code has
        from torch.distributed.tensor import Replicate, distribute_tensor

        temperature = distribute_tensor(temperature, MESH[0], [Replicate()])
        log.take()  # distributing is the test's doing
    if _logprobs_kind(case):
        logp, entropy = fn(
            *head, args["labels"], temperature, case.return_entropy, **dict(case.sampling), **tp
        )
        fwd = log.take() if log else []
        up_logp, up_entropy = _upstream(data)
        total = (logp * up_logp).sum() + (0 if entropy is None else (entropy * up_entropy).sum())
        out = {"logp": logp.detach(), "entropy": None if entropy is None else entropy.detach()}
    else:
        if case.inplace and fn is not reference.policy_loss:
            tp["inplace"] = True
        if case.row_temps:
            tp["temperature"] = temperature
        result = fn(*head, config=case.config(), return_entropy=case.return_entropy, **args, **tp)
        fwd = log.take() if log else []
        total, out = result.loss * (case.grad_scale or 1.0), _detached(result)
    grads = dict(zip(leaves, torch.autograd.grad(total, list(leaves.values()))))
    for name, grad in grads.items():
        if fusedrl.tp.dtensor.is_dtensor(grad):
            assert grad.placements == leaves[name].placements
            grads[name] = grad.to_local()
    return out, grads, fwd, (log.take() if log else [])


def _fused(case: Case):
    linear = _linear_kind(case)
    if _logprobs_kind(case):
        fn = fusedrl.linear_token_logprobs if linear else fusedrl.token_logprobs
    else:
        fn = fusedrl.linear_policy_loss if linear else fusedrl.policy_loss

    def call(*args, **kwargs):
        if case.softcap is not None:
            kwargs["softcap"] = case.softcap
        if case.skip_masked_rows:
            kwargs["skip_masked_rows"] = True
        if case.grad_scale is not None:  # (the gradient written at the factor `_call` applies)
            kwargs["grad_scale"] = case.grad_scale
        if case.packed and _logprobs_kind(case):  # (the losses have it in their inputs)
            kwargs["cu_seqlens"] = packed_bounds(case)
        return fn(*args, backend=case.backend, **kwargs)

    return call


def _reference(case: Case):
    fn = reference.token_logprobs if _logprobs_kind(case) else reference.policy_loss
    if not _linear_kind(case):
        if case.softcap is None:
            return fn
        return lambda *args, **kwargs: fn(*args, softcap=case.softcap, **kwargs)

    def call(hidden, weight, *args, bias=None, **kwargs):
        logits = torch.nn.functional.linear(hidden, weight, bias)
        if case.softcap is not None:  # Gemma's: c tanh(z / c)
            logits = case.softcap * torch.tanh(logits / case.softcap)
        return fn(logits, *args, **kwargs)

    return call


def _tp_keywords(case: Case, world: int, rank: int, group) -> dict:
    starts, _, extra = layout(case, world)
    keywords = {"tp_group": group}
    if "vocab_start" in extra:
        keywords["vocab_start"] = starts[rank]
    if "vocab_size" in extra:
        keywords["vocab_size"] = extra["vocab_size"]
    if case.inputs == "no_input_reduce":
        keywords["reduce_input_grad"] = False
    return keywords


HIDDEN = 16


def whole_inputs(case: Case) -> tuple[dict, dict]:
    """(the whole {"logits"} or LM head {"hidden", "weight", "bias"}, the per-token inputs)."""
    data = case_inputs(case)
    logits = data.pop("logits")
    if not _linear_kind(case):
        return {"logits": logits}, data
    gen = torch.Generator().manual_seed(13)
    rows = (case.batch * case.time,) if case.flat or case.packed else (case.batch, case.time)
    head = {
        "hidden": torch.randn(*rows, HIDDEN, generator=gen),
        "weight": 0.5 * torch.randn(case.vocab, HIDDEN, generator=gen),
        "bias": 0.1 * torch.randn(case.vocab, generator=gen),
    }
    with torch.no_grad():  # old / ref / rollout near this head's log-probs, as make_batch does
        made = torch.nn.functional.linear(head["hidden"], head["weight"], head["bias"])
        logp, _ = reference.token_logprobs(made, data["labels"])
    data["old_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    data["ref_logp"] = logp + 0.2 * torch.randn(logp.shape, generator=gen)
    data["rollout_logp"] = data["old_logp"] + 0.3 * torch.randn(logp.shape, generator=gen)
    return head, data


def rank_inputs(whole: dict, start: int, size: int) -> dict:
    """This rank's part: its logits columns, or its LM-head rows (hidden is replicated)."""
    if "logits" in whole:
        return {"logits": rank_slice(whole["logits"], start, size)}
    return {
        "hidden": whole["hidden"],
        "weight": rank_slice(whole["weight"].t(), start, size).t().contiguous(),
        "bias": rank_slice(whole["bias"], start, size),
    }


def unfiltered_logp(case: Case, whole: dict, data: dict) -> torch.Tensor:
    """The reference's logp over the whole vocabulary (no sampling mask), 0 where not counted."""
    if "logits" in whole:
        logits = whole["logits"].float()
        if case.softcap is not None:
            logits = reference._model_logits(logits, None, case.softcap)
    else:
        logits = torch.nn.functional.linear(whole["hidden"], whole["weight"], whole["bias"])
        if case.softcap is not None:
            logits = case.softcap * torch.tanh(logits / case.softcap)
    temperature = case.temperature if _logprobs_kind(case) else case.config().temperature
    if case.row_temps:
        temperature = _temperature(case, data)
    logp, _ = reference.token_logprobs(logits, data["labels"].clamp_min(0), temperature)
    return torch.where(data["mask"].bool(), logp, 0.0) if "mask" in data else logp


def run_parallel(case: Case, world: int, rank: int, group, log: CollectiveLog) -> dict:
    whole, data = whole_inputs(case)
    if case.inputs == "dead":
        whole, data = dead_rows(whole, data, world, case)
    starts, sizes, _ = layout(case, world)
    if case.name == "clip_cov_unseeded":
        torch.manual_seed(1000 + rank)  # ranks' generators differ, as they may in a real job
    mine = rank_inputs(whole, starts[rank], sizes[rank])
    keywords = _tp_keywords(case, world, rank, group)
    if case.layout == "dtensor":  # no tp_group: the DTensor's mesh says it
        from torch.distributed.tensor import Shard, distribute_tensor

        mine = {"logits": distribute_tensor(whole["logits"], MESH[0], [Shard(-1)])}
        assert mine["logits"].to_local().shape[-1] == sizes[rank]
        keywords = {"replicated_temperature": True} if case.row_temps else {}
        log.take()  # distributing is the test's doing
    out, grads, fwd, bwd = _call(_fused(case), case, mine, data, log, **keywords)
    result = dict(out, grads=grads, fwd=fwd, bwd=bwd, start=starts[rank], size=sizes[rank])
    result["case"] = case.name
    if rank == 0 and case.sampling_filters():  # what the filters change
        result["unfiltered_logp"] = unfiltered_logp(case, whole, data)
    if rank == 0 and case.oracle:  # the single-process truth, once
        result["single"] = _call(_fused(case), case, whole, data, None)[:2]
        as_fp32 = {k: v.float() for k, v in whole.items()}
        result["reference"] = _call(_reference(case), case, as_fp32, data, None)[:2]
    return result


def run_group_of_one(case: Case, rank: int, groups: list) -> dict:
    """The same call with a group of one (this rank alone) and without any group."""
    whole, data = whole_inputs(case)
    keywords = {"tp_group": groups[rank]}
    alone = whole
    if case.layout == "padded":  # padding on the single rank, vocab_size says so
        alone = rank_inputs(whole, 0, case.vocab + PADDING)
        keywords["vocab_size"] = case.vocab
    alone_out = _call(_fused(case), case, alone, data, None, **keywords)[:2]
    plain_out = _call(_fused(case), case, whole, data, None)[:2]
    return {"alone": alone_out, "plain": plain_out}


def _bad_call(case: Case, world: int, rank: int, group) -> None:
    """A dapo call on the standard inputs with one thing wrong (case.inputs)."""
    data = case_inputs(case)
    starts, sizes, _ = layout(case, world)
    what = case.inputs
    if what == "batch_differs" and rank == world - 1:
        data = {k: v[:-1] for k, v in data.items()}
    if what == "time_differs" and rank == world - 1:
        data = {k: v[:, :-1] if v.dim() > 1 else v for k, v in data.items()}
    if what.endswith("label_too_big_rank0") and rank == 0:
        data["labels"] = data["labels"].clone()
        data["labels"][0, 0] = case.vocab  # a counted token (mask[0, 0] is set)
    if what == "cu_seqlens_differs" and rank == 1:  # another valid cut of the same tokens
        data["cu_seqlens"] = data["cu_seqlens"] + torch.tensor([0, 1, 1, 0, 0], dtype=torch.int32)
    if what == "cu_seqlens_last_rank" and rank == world - 1:  # ends short of the tokens
        data["cu_seqlens"] = data["cu_seqlens"] - torch.tensor([0, 0, 0, 0, 1], dtype=torch.int32)
    if what == "label_negative":
        data["labels"] = data["labels"].clone()
        data["labels"][0, 0] = -7
    if what == "labels_differ" and rank == 1:
        data["labels"] = data["labels"].clone()
        data["labels"][0, 0] = (data["labels"][0, 0] + 1) % case.vocab
    if what == "advantages_shape_last_rank" and rank == world - 1:
        data["advantages"] = data["advantages"][:-1]
    if what == "labels_permuted" and rank == 1:  # the same sum and count, moved between tokens
        data["labels"] = data["labels"].flip(-1)
        data["mask"] = data["mask"].flip(-1)
    if what == "mask_weights_differ":  # the same tokens counted, another weight on rank 1
        data["mask"] = data["mask"].float() * (0.5 if rank == 1 else 1.0)
    if what == "labels_collide" and rank == 1:  # a position-weighted sum keeps this change
        data["labels"] = _colliding_labels(data["labels"], data["mask"], case.vocab)
    changed = what.removeprefix("linear_").removesuffix("_differs")
    if changed in ("advantages", "old_logp", "ref_logp", "rollout_logp") and rank == 1:
        data[changed] = _one_counted_token_changed(data[changed], data["mask"])
    if what in ("is_weights_differs", "normalizer_differs"):
        data["is_weights"] = torch.ones(data["labels"].shape)
        data["normalizer"] = torch.tensor(11.0)
        if what == "is_weights_differs" and rank == 1:
            data["is_weights"] = _one_counted_token_changed(data["is_weights"], data["mask"])
        if what == "normalizer_differs" and rank == 1:
            data["normalizer"] = torch.tensor(11.0).nextafter(torch.tensor(12.0))
    keywords = {"tp_group": group}
    if what == "softcap_last_rank":
        keywords["softcap"] = -1.0 if rank == world - 1 else 3.0
    if what == "vocab_size_too_big":
        keywords["vocab_size"] = case.vocab + 5
    if what == "start_overlap":
        keywords["vocab_start"] = starts[rank] - (1 if rank == world - 1 else 0)
    if what == "start_gap":
        keywords["vocab_start"] = starts[rank] + (1 if rank == world - 1 else 0)
    if what == "start_rank0_only" and rank == 0:
        keywords["vocab_start"] = 0
    mine = rank_slice(data["logits"], starts[rank], sizes[rank])
    if what == "logprobs_label_too_big":
        labels = data["labels"].clone()
        labels[-1, -1] = case.vocab + 3
        fusedrl.token_logprobs(mine, labels, backend="torch", **keywords)
        return
    if what == "logprobs_row_temps_differs":
        temps = torch.full(data["labels"].shape, 0.7)
        temps = _one_counted_token_changed(temps, None) if rank == 1 else temps
        fusedrl.token_logprobs(mine, data["labels"], temps, backend="torch", **keywords)
        return
    if what == "logprobs_top_k_last_rank":
        top_k = -2 if rank == world - 1 else 5  # (0 and -1: vLLM's "off", taken)
        fusedrl.token_logprobs(mine, data["labels"], backend="torch", top_k=top_k, **keywords)
        return
    if what.startswith("linear"):
        head = whole_inputs(Case("head", inputs="linear"))[0]
        part = rank_inputs(head, starts[rank], sizes[rank])
        hidden, weight = part["hidden"], part["weight"]
        if what == "linear_hidden_size_differs" and rank == 1:  # a head of another width
            hidden, weight = hidden[..., :-1], weight[:, :-1]
        hidden = hidden.detach().requires_grad_(True)
        if what == "linear_head_transposed_last_rank" and rank == world - 1:
            weight = weight.T
        if what == "linear_reduce_differs":
            keywords["reduce_input_grad"] = rank != 1
        args = {k: v for k, v in data.items() if k != "logits"}
        fusedrl.linear_policy_loss(
            hidden, weight, bias=part["bias"], backend="torch", **args, **keywords
        )
        return
    config = case.config()
    if what == "config_differs" and rank == 1:
        config = config.replace(eps_high=0.3)
    if what == "row_temps_rank0_only" and rank == 0:  # the others divide by 1: refused alike
        keywords["temperature"] = torch.full(data["labels"].shape, 0.7)
    if what == "row_temps_differs":
        temps = torch.full(data["labels"].shape, 0.7)
        keywords["temperature"] = (
            _one_counted_token_changed(temps, data["mask"]) if rank == 1 else temps
        )
    if what == "softcap_differs":  # rank 1 caps at another value: refused alike
        keywords["softcap"] = 3.0 if rank == 1 else 2.0
    backend = "cuda" if what == "backend_cuda" else case.backend
    args = {k: v for k, v in data.items() if k != "logits"}
    fusedrl.policy_loss(mine, config=config, backend=backend, **args, **keywords)


def _counted_positions(mask: torch.Tensor | None, shape) -> list[int]:
    flat = torch.ones(shape, dtype=torch.bool) if mask is None else mask.bool()
    return flat.reshape(-1).nonzero().flatten().tolist()


def _one_counted_token_changed(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`values` with the last counted token's (or sequence's, for [B] advantages) value moved by
    one ulp (of fp32)."""
    if mask is not None and values.shape != mask.shape:
        mask = mask.reshape(values.shape[0], -1).bool().any(-1)
    out = values.clone().reshape(-1)
    last = _counted_positions(mask, values.shape)[-1]
    out[last] = torch.nextafter(out[last], torch.tensor(float("inf")))
    return out.view(values.shape)


def _colliding_labels(labels: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Labels changed by (+1, -2, +1) at three neighbouring counted tokens: the position-weighted
    sum p1 + ... of the old checksum is unchanged (1 p - 2 (p + 1) + 1 (p + 2) = 0)."""
    counted = _counted_positions(mask, labels.shape)
    flat = labels.clone().reshape(-1)
    for p in counted:
        run = [p, p + 1, p + 2]
        if (
            all(q in counted for q in run)
            and flat[p + 1] >= 2
            and flat[p] < vocab - 1
            and flat[p + 2] < vocab - 1
        ):
            weighted = sum((q + 1) * int(flat[q]) for q in run)
            flat[run[0]] += 1
            flat[run[1]] -= 2
            flat[run[2]] += 1
            assert sum((q + 1) * int(flat[q]) for q in run) == weighted  # the old sum is fooled
            return flat.view(labels.shape)
    raise AssertionError("no three neighbouring counted tokens to change")


def run_bad(case: Case, world: int, rank: int, group, log: CollectiveLog) -> dict:
    try:
        _bad_call(case, world, rank, group)
        error = None
    except Exception as err:
        error = (type(err).__name__, str(err))
    return {"error": error, "calls": log.take()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT_S)
    )
    from fusedrl.kernels import launch

    launch.MAX_BLOCK_V_INTERPRETED = 16  # rows of several tiles and a partial last one
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    from torch.distributed.device_mesh import init_device_mesh

    MESH.append(init_device_mesh("cpu", (world,)))
    log = CollectiveLog()
    log.install()
    masked_writes = _count_masked_writes()
    results = {}
    for case in CASES:
        try:
            if case.kind == "bad":
                results[case.name] = run_bad(case, world, rank, dist.group.WORLD, log)
            elif case.kind == "tp1":
                results[case.name] = run_group_of_one(case, rank, groups)
            else:
                results[case.name] = run_parallel(case, world, rank, dist.group.WORLD, log)
                results[case.name]["masked_writes"] = len(masked_writes)
        except Exception:
            results[case.name] = {"crash": traceback.format_exc()}
        log.take()
        masked_writes.clear()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # every rank done before any leaves (a gloo exit abort otherwise)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the parent
@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return worlds_by_size(tmp_path_factory, _worker, "the tensor-parallel world", DEADLINE_S)


def _results(worlds, world: int, name: str) -> list[dict]:
    return named_results(worlds(world), name)


def _cases(*kinds: str, oracle: bool | None = None) -> list:
    return [
        pytest.param(c.name, id=c.name)
        for c in CASES
        if c.kind in kinds and (oracle is None or c.oracle == oracle)
    ]


PARALLEL = _cases("loss", "logprobs", "linear", "linear_logprobs")
ORACLE_CASES = _cases("loss", "logprobs", "linear", "linear_logprobs", oracle=True)


def _tolerances(case: Case) -> dict:
    if case.dtype == torch.bfloat16:  # both sides round the same fp32 values to bf16
        return dict(atol=1e-5, rtol=1e-2)
    return dict(atol=1e-5, rtol=1e-4)


def _assert_outputs_close(ours: dict, truth: dict, tol: dict, what: str) -> None:
    for key in ("loss", "logp", "entropy"):
        if key not in truth or truth[key] is None:
            assert ours.get(key) is None, f"{what}: {key} should be None"
            continue
        torch.testing.assert_close(
            ours[key], truth[key], equal_nan=True, **tol, msg=lambda m, k=key: f"{what} {k}: {m}"
        )
    for key, value in truth.get("metrics", {}).items():
        torch.testing.assert_close(
            ours["metrics"][key],
            value,
            equal_nan=True,
            **tol,
            msg=lambda m, k=key: f"{what} metric {k}: {m}",
        )


def _grad_slice(full_grad: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """The single-process gradient of a rank's columns; its padding columns get 0."""
    part = full_grad[..., start : start + size]
    pad = size - part.shape[-1]
    return torch.cat([part, part.new_zeros(*part.shape[:-1], pad)], dim=-1) if pad else part


def _rank_grad(name: str, full: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """A rank's share of the single-process gradient of input `name`: its logits columns, its
    LM-head rows, or all of hidden's (replicated: each rank gets the sum over the group)."""
    if name == "weight":
        return _grad_slice(full.t(), start, size).t()
    return full if name == "hidden" else _grad_slice(full, start, size)


def _assert_grads_close(per_rank: list, truth: dict, tol: dict, what: str) -> None:
    for name, full in truth.items():
        mine = [result["grads"][name] for result in per_rank]
        if name == "hidden" and BY_NAME[per_rank[0]["case"]].inputs == "no_input_reduce":
            mine = [sum(mine)] * len(mine)  # each rank holds its part: the caller sums them
        for rank, (result, grad) in enumerate(zip(per_rank, mine)):
            expected = _rank_grad(name, full, result["start"], result["size"])
            torch.testing.assert_close(
                grad.float(),
                expected.float(),
                equal_nan=True,
                **tol,
                msg=lambda m, r=rank, n=name: f"rank {r} d/d{n} vs {what}: {m}",
            )


@pytest.mark.parametrize("name", ORACLE_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_matches_single_process_and_reference(worlds, world, name):
    case = BY_NAME[name]
    per_rank = _results(worlds, world, name)
    single_out, single_grads = per_rank[0]["single"]
    ref_out, ref_grads = per_rank[0]["reference"]
    tol = _tolerances(case)
    grad_tol = dict(atol=1e-6, rtol=1e-4) if case.dtype == torch.float32 else tol
    if _linear_kind(case) and case.dtype == torch.float32:  # d/dhidden sums V terms that cancel
        grad_tol = dict(atol=1e-5, rtol=1e-4)
    # the oracle agrees with the single-process call, so the comparisons below mean something
    _assert_outputs_close(single_out, ref_out | {"metrics": {}}, tol, "single vs reference")
    # ... and the gradients compared are not all 0 (a case whose every token is clipped or
    # masked would pass any gradient of 0)
    if case.inputs != "all_masked":
        assert any(torch.nan_to_num(g.float()).abs().sum() > 0 for g in ref_grads.values()), name
    for key, grad in single_grads.items():
        torch.testing.assert_close(grad.float(), ref_grads[key], equal_nan=True, **grad_tol)
    for truth, grads, what in ((single_out, single_grads, "single"), (ref_out, ref_grads, "ref")):
        truth = truth if what == "single" else truth | {"metrics": {}}
        for rank, result in enumerate(per_rank):
            _assert_outputs_close(result, truth, tol, f"rank {rank} vs {what}")
        _assert_grads_close(per_rank, grads, grad_tol, what)


@pytest.mark.parametrize("name", PARALLEL)
@pytest.mark.parametrize("world", WORLDS)
def test_outputs_are_the_same_bits_on_every_rank(worlds, world, name):
    per_rank = _results(worlds, world, name)
    first = per_rank[0]
    for rank, result in enumerate(per_rank[1:], start=1):
        for key in ("loss", "logp", "entropy"):
            if first.get(key) is None:
                assert result.get(key) is None
                continue
            assert torch.equal(result[key].nan_to_num(), first[key].nan_to_num()), (rank, key)
            assert torch.equal(result[key].isnan(), first[key].isnan()), (rank, key)
        for key, value in first.get("metrics", {}).items():
            assert torch.equal(result["metrics"][key], value), (rank, key)


def _sampling_collectives(case: Case, tokens: int) -> list:
    """The all-reduces of the sets' radix selects (tp/sampling.py), one block of rows: the row
    max (min_p, top_p), 4 passes of 256 counters (top_k; fp32 keys), the candidates' mass and 4
    passes of 256 masses (top_p)."""
    filters = case.sampling_filters()
    top_p = filters.get("top_p", 1.0) < 1
    passes = [("all_reduce", [("torch.float32", fusedrl.tp.sampling.DIGITS * tokens)])] * 4
    calls = []
    if top_p or filters.get("min_p", 0.0) > 0:
        calls.append(("all_reduce", [("torch.float32", tokens)]))
    if filters.get("top_k", case.vocab) < case.vocab:
        calls += passes
    if top_p:
        calls += [("all_reduce", [("torch.float32", tokens)])] + passes
    return calls


@pytest.mark.parametrize("name", PARALLEL)
@pytest.mark.parametrize("world", WORLDS)
def test_one_collective_forward_none_backward(worlds, world, name):
    """Forward: the header (len(FIELDS) int64) and one all-gather of PARTIALS fp32 per token (with a
    sampling mask, the selects' all-reduces of at most 256 fp32 per token between them).
    Backward: nothing, except the LM-head forms' one all-reduce of the [N, H] input gradient."""
    case = BY_NAME[name]
    for rank, result in enumerate(_results(worlds, world, name)):
        tokens = result["logp"].numel()
        header, *sampling, data = result["fwd"]
        selected = tokens
        if case.skip_masked_rows:  # the selects run over the live rows alone: the skip acted
            selected = int(case_inputs(case)["mask"].sum())
            assert selected < tokens
        assert sampling == _sampling_collectives(case, selected), (rank, result["fwd"])
        assert header[1][-1] == ("torch.int64", len(FIELDS)), (rank, header)
        assert data[1][-1] == ("torch.float32", fusedrl.tp.PARTIALS * tokens), (rank, data)
        assert fusedrl.tp.PARTIALS <= 4
        expected_bwd = []
        if _linear_kind(case) and case.inputs != "no_input_reduce":
            expected_bwd = [("all_reduce", [("torch.float32", tokens * HIDDEN)])]
        assert result["bwd"] == expected_bwd, (rank, result["bwd"])
        assert "loss" not in result or torch.isfinite(result["loss"])


SAMPLING_CASES = [c.name for c in CASES if c.kind != "bad" and c.sampling_filters()]


@pytest.mark.parametrize("name", [n for n in SAMPLING_CASES if BY_NAME[n].kind != "tp1"])
def test_sampling_replay_acts(worlds, name):
    """The sets leave tokens out: logp over them is above logp over the whole vocabulary (the
    reference without the filters) on most counted tokens."""
    per_rank = _results(worlds, 2, name)
    result = per_rank[0]
    full = result["unfiltered_logp"]
    counted = full != 0
    assert counted.any()
    assert (result["logp"].float()[counted] > full[counted] + 1e-3).float().mean() > 0.5
    # The Triton kernels read the slice (the LM head's chunks too) through each rank's floors:
    # no masked copy; a soft cap's sets on raw logits (the capped logits') and the torch backend
    # read a masked one. (The torch LM head masks its own fp32 blocks as it makes them.)
    case = BY_NAME[name]
    if _linear_kind(case) and case.backend == "torch":
        return
    through_floors = case.backend == "triton" and (case.softcap is None or _linear_kind(case))
    for rank, mine in enumerate(per_rank):
        assert (mine["masked_writes"] == 0) == through_floors, (rank, mine["masked_writes"])


def test_padding_and_degenerate_rows_behave(worlds):
    """What the comparisons above take for granted: padding gets exactly 0, an all-masked batch
    gives loss 0 and a zero gradient, a slice of only -inf drops out, a row of only -inf gives
    NaN, and clip_cov really picks tokens."""
    for world in WORLDS:
        for result in _results(worlds, world, "grpo_padded_nan_rows"):
            width = 1031 - result["start"]
            assert not result["grads"]["logits"][..., width:].any()
        for result in _results(worlds, world, "linear_gspo_padded_row_temps_skip"):
            width = 1031 - result["start"]
            assert not result["grads"]["weight"][width:].any()
            assert not result["grads"]["bias"][width:].any()
        only_padding = _results(worlds, world, "dapo_padding_only_rank")[-1]
        assert not only_padding["grads"]["logits"].any()
        for result in _results(worlds, world, "all_masked"):
            assert result["loss"] == 0 and not result["grads"]["logits"].any()
        dead = [*_results(worlds, world, "logprobs_dead_slices")]
        dead += _results(worlds, world, "triton_logprobs_dead_slices")
        for result in dead:
            logp, entropy = result["logp"][0], result["entropy"][0]
            assert torch.isfinite(logp[0]) and torch.isfinite(entropy[0])
            assert logp[1].isnan() and entropy[1].isnan()
            assert logp[2] == float("-inf") and torch.isfinite(entropy[2])
        for result in _results(worlds, world, "clip_cov"):
            assert 0 < result["metrics"]["clipfrac"] < 1


@pytest.mark.parametrize("name", _cases("tp1"))
def test_group_of_one_is_single_process_bit_for_bit(worlds, name):
    for result in _results(worlds, 2, name):
        (alone, alone_grads), (plain, plain_grads) = result["alone"], result["plain"]
        for key in ("loss", "logp", "entropy"):
            if plain.get(key) is None:
                assert alone.get(key) is None
                continue
            assert torch.equal(alone[key], plain[key]), key
        for key, value in plain.get("metrics", {}).items():
            assert torch.equal(alone["metrics"][key], value), key
        for key, plain_grad in plain_grads.items():  # padding columns / rows get 0
            width = plain_grad.shape[0 if key == "weight" else -1]
            rows = alone_grads[key].t() if key == "weight" else alone_grads[key]
            plain_rows = plain_grad.t() if key == "weight" else plain_grad
            assert torch.equal(rows[..., :width], plain_rows), key
            assert not rows[..., width:].any(), key


@pytest.mark.parametrize("name", _cases("bad"))
@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_raises_alike_on_every_rank(worlds, world, name):
    case = BY_NAME[name]
    per_rank = _results(worlds, world, name)
    errors = [result["error"] for result in per_rank]
    assert all(error is not None for error in errors), errors
    calls = [result["calls"] for result in per_rank]
    if case.expect_error == "local":  # its own error there, a pointer to it everywhere else
        named = {
            "advantages_shape_last_rank": "advantages",
            "softcap_last_rank": "softcap",
            "logprobs_top_k_last_rank": "top_k",
            "linear_head_transposed_last_rank": "a transposed [H, V] head",
            "cu_seqlens_last_rank": "end at the token count",
        }[case.inputs]
        assert errors[-1][0] == "ValueError" and named in errors[-1][1], errors
        for error in errors[:-1]:
            assert error[0] == "TensorParallelInputError", errors
            assert f"rank(s) [{world - 1}] rejected their inputs" in error[1], errors
    else:
        assert {error for error in errors} == {errors[0]}, errors  # the same on every rank
        assert errors[0][0] == case.expect_error, errors
    if case.inputs == "backend_cuda":  # every rank refuses it, in the header
        assert "backend='triton'" in errors[0][1], errors
    # the header, and nothing after it (but, where the settings differ, the two gathers that
    # name them: every rank takes that path alike)
    gathers = 3 if "disagree on the settings" in errors[0][1] else 1
    assert all(len(c) == gathers for c in calls), calls


def test_bad_input_messages_name_the_problem(worlds):
    expected = {
        "bad_label_on_one_rank": "labels must be global token ids in [0, 1031) where mask is set",
        "bad_negative_label": "found -7",
        "bad_labels_differ": "disagree on labels",
        "bad_cu_seqlens_differs": "disagree on cu_seqlens",
        "bad_packed_gspo_advantages_differs": "disagree on advantages",
        "bad_labels_collide": "disagree on labels",
        "bad_advantages_differs": "disagree on advantages",
        "bad_old_logp_differs": "disagree on old_logp",
        "bad_ref_logp_differs": "disagree on ref_logp",
        "bad_rollout_logp_differs": "disagree on rollout_logp",
        "bad_is_weights_differs": "disagree on is_weights",
        "bad_normalizer_differs": "disagree on normalizer",
        "bad_row_temps_differs": "disagree on temperature",
        "bad_logprobs_row_temps_differs": "disagree on temperature",
        "bad_linear_advantages_differs": "disagree on advantages",
        "bad_vocab_size_too_big": "but vocab_size is 1036",
        "bad_vocab_start_overlap": "overlap",
        "bad_vocab_start_gap": "leave a gap",
        "bad_vocab_start_some_ranks": "give it on every rank or on none",
        "bad_batch_differs": "disagree on the token shape",
        "bad_time_differs": "disagree on the token shape",
        "bad_config_differs": "on the settings: eps_high (rank 0: 0.28, rank 1: 0.3, rank 2: 0.28)",
        "bad_row_temps_rank0_only": (
            "on the settings: temperature (rank 0: per-token, rank 1: None, rank 2: None)"
        ),
        "bad_softcap_differs": "on the settings: softcap (rank 0: 2.0, rank 1: 3.0, rank 2: 2.0)",
        "bad_labels_permuted": "disagree on labels",
        "bad_mask_weights_differ": "disagree on mask",
        "bad_linear_reduce_differs": "on the settings: reduce_input_grad (rank 0: ",
        "bad_linear_hidden_size_differs": "on the settings: hidden_size (rank 0: ",
        "bad_logprobs_label": "found 1034",
        "bad_linear_label": "labels must be global token ids in [0, 1031)",
    }
    for name, phrase in expected.items():
        error = _results(worlds, 3, name)[0]["error"]
        assert phrase in error[1], (name, error)


# ------------------------------------------------------------------------------ the merge alone
def _slice_partials(z: torch.Tensor, labels: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[world, N, 3] partials of fp64 rows split at `bounds`, as each rank would send them."""
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        piece = z[:, lo:hi]
        lse = torch.logsumexp(piece, -1)
        log_p = piece - lse[:, None]
        entropy = -torch.where(log_p.exp() > 0, log_p.exp() * log_p, 0.0).sum(-1)
        local = (labels - lo).clamp(0, hi - lo - 1)
        logp = log_p.gather(-1, local[:, None]).squeeze(-1)
        parts.append(fusedrl.tp.merge.pack(logp, lse, entropy))
    return torch.stack(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_floors_hold_each_set_exactly(monkeypatch, dtype):
    """`slice_floors(raw=True)`: a logit of the slice is at or above its row's raw floor iff its
    scaled value reaches the row's floor (the set), whatever the rounding of x / T: ties at the
    floor, neighbours that x / T rounds together, NaN (in no set: the kernels keep it apart),
    +-inf, a row of only -inf, per-token temperatures. One rank (the reduce is the identity)."""
    from fusedrl.sampling import SamplingMask
    from fusedrl.tp import sampling as tp_sampling
    from fusedrl.tp.shard import VocabShard

    monkeypatch.setattr(tp_sampling, "group_reduce", lambda group: lambda tensor, op: None)
    gen = torch.Generator().manual_seed(11)
    logits = (2.0 * torch.randn(2, 5, 67, generator=gen)).to(dtype)
    logits[0, 0, :20] = logits[0, 0].max()  # 20 ties at the top: top_k keeps all of them
    logits[0, 1, 3], logits[0, 1, 4] = math.nan, math.inf
    logits[0, 2] = -math.inf
    logits[0, 3, ::3] = -math.inf
    logits[1, 0] = torch.linspace(1.0, 1.0 + 66 * 2**-7, 67).to(dtype)  # x / 3 rounds some together
    temperature = torch.full((2, 5), 0.7)
    temperature[1, 0] = 3.0
    shard = VocabShard(rank=0, starts=(0,), sizes=(67,), vocab_size=67)
    for mask in (SamplingMask(top_k=9), SamplingMask(top_p=0.8, min_p=0.05)):
        floors = tp_sampling.slice_floors(logits, temperature, mask, shard, None)
        raw = tp_sampling.slice_floors(logits, temperature, mask, shard, None, raw=True)
        assert raw.dtype == torch.float32
        scaled = logits.float() / temperature[..., None]
        in_set = scaled >= floors.view(2, 5, 1)
        above = logits.float() >= raw.view(2, 5, 1)
        number = ~logits.isnan()
        assert torch.equal(above & number, in_set & number), mask
        counts = in_set.sum(-1).flatten().tolist()
        assert counts[0] == 21 and 1 < counts[5] < 67, counts  # the ties kept; a partial set


def test_merge_of_slices_is_the_whole_row():
    gen = torch.Generator().manual_seed(3)
    z = (3.0 * torch.randn(9, 50, generator=gen, dtype=torch.float64)) + 40.0
    labels = torch.randint(0, 50, (9,), generator=gen)
    z[1, 20:35] = float("-inf")  # the middle slice holds no mass: it drops out
    z[2, :] = float("-inf")  # no distribution at all: NaN
    z[3, 7] = float("inf")  # NaN, as single-process
    z[4, 40] = float("nan")
    z[5, labels[5]] = float("-inf")  # a label of probability 0: logp -inf
    bounds = [0, 20, 35, 50]
    owners = torch.bucketize(labels, torch.tensor(bounds[1:-1]), right=True)
    logp, lse, entropy = fusedrl.tp.merge.merge(_slice_partials(z, labels, bounds), owners)
    log_p = torch.log_softmax(z, -1)
    want_entropy = -torch.where(log_p.exp() > 0, log_p.exp() * log_p, 0.0).sum(-1)
    want_logp = log_p.gather(-1, labels[:, None]).squeeze(-1)
    for row in (2, 3, 4):
        want_logp[row] = want_entropy[row] = float("nan")
    torch.testing.assert_close(logp, want_logp.float(), equal_nan=True, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy, want_entropy.float(), equal_nan=True, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(lse[[0, 1, 5, 6]], torch.logsumexp(z, -1)[[0, 1, 5, 6]].float())


def test_merge_of_one_slice_is_that_slice_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    logp, lse, entropy = (torch.randn(40, generator=gen) for _ in range(3))
    gathered = fusedrl.tp.merge.pack(logp, lse, entropy)[None]
    merged = fusedrl.tp.merge.merge(gathered, torch.zeros(40, dtype=torch.long))
    for got, want in zip(merged, (logp, lse, entropy)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------ the header's hash
def test_replicated_hash_sees_bits_and_positions_not_masked_tokens():
    from fusedrl.tp.header import replicated_hash

    def digest(value, counted=None):
        return int(replicated_hash(value, counted, torch.device("cpu")))

    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 9, generator=gen)
    counted = torch.rand(4, 9, generator=gen) > 0.3
    base = digest(values, counted)
    assert base == digest(values.clone(), counted)  # deterministic
    hidden = values.clone()
    hidden[~counted] = float("nan")  # what a masked token holds never counts
    assert digest(hidden, counted) == base
    moved = values.clone()
    spot = counted.nonzero()[0].tolist()
    moved[tuple(spot)] = torch.nextafter(moved[tuple(spot)], torch.tensor(9.0))
    assert digest(moved, counted) != base  # one ulp at one counted token
    zero, negative_zero = torch.zeros(5), torch.zeros(5)
    negative_zero[2] = -0.0
    assert digest(zero) != digest(negative_zero)  # bit-exact: -0.0 is not 0.0
    ids = torch.arange(10, 19)
    collided = ids.clone()
    collided[3:6] += torch.tensor([1, -2, 1])  # fools any position-weighted sum
    assert digest(ids) != digest(collided)
    assert digest(ids) != digest(ids.flip(0))  # positions count
    assert digest(torch.tensor(7.0)) == digest(7.0)  # a scalar tensor is its number
    assert digest(None) != digest(0.0)
    assert digest(torch.ones(3, dtype=torch.bfloat16)) != digest(torch.ones(3))  # its dtype's bits
