"""pytest plugin for TRL's tests/test_grpo_trainer.py, offline: a few prompts in place of the
`trl-internal-testing/zen` dataset, Liger-Kernel hidden, and with FUSED=1 FusedGRPOTrainer in
place of GRPOTrainer."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

PROMPTS = [
    "The sky is",
    "Two plus two is",
    "Once upon a time",
    "The capital of France",
    "Water boils at",
    "A cat sat",
    "In the beginning",
    "My favorite color",
    "The quick brown fox",
    "Rain falls",
    "Numbers go",
    "Music makes",
    "The ocean is",
    "Cold winds",
    "A small town",
    "Bright stars",
    "The old man",
    "Green hills",
]
TRAIN = 15  # the rest is the test split


def zen(name, config=None, split=None, **kwargs):
    """`load_dataset` for the two prompt-only configs of trl-internal-testing/zen."""
    from datasets import Dataset, DatasetDict

    if name != "trl-internal-testing/zen":
        pytest.skip(f"dataset {name} has no offline stand-in")
    if config == "standard_prompt_only":
        prompts = PROMPTS
    elif config == "conversational_prompt_only":
        prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    else:
        pytest.skip(f"zen config {config!r} has no offline stand-in")
    data = DatasetDict(
        train=Dataset.from_dict({"prompt": prompts[:TRAIN]}),
        test=Dataset.from_dict({"prompt": prompts[TRAIN:]}),
    )
    return data if split is None else data[split]


def _hide_liger() -> None:
    """Liger patches transformers' modules process-wide (its Triton RMSNorm), which breaks every
    later test of the process on a CPU: both runs go as if it were not installed."""
    for name in (
        "trl.import_utils",
        "trl.trainer.grpo_trainer",
        "transformers.utils.import_utils",
        "transformers.utils",
        "transformers.trainer",
        "transformers.training_args",
    ):
        module = importlib.import_module(name)
        if hasattr(module, "is_liger_kernel_available"):
            module.is_liger_kernel_available = lambda *args, **kwargs: False


def _older_names() -> None:
    """Helpers a newer or older tests/testing_utils.py imports from trl.import_utils that this
    TRL lacks: absent, as the optional packages they probe."""
    module = importlib.import_module("trl.import_utils")
    for name in ("is_joblib_available",):
        if not hasattr(module, name):
            setattr(module, name, lambda *args, **kwargs: False)


_hide_liger()
_older_names()


def pytest_collection_modifyitems(session, config, items):
    module = sys.modules.get("tests.test_grpo_trainer")
    if module is None:
        return
    module.load_dataset = zen
    if os.environ.get("FUSED") == "1":
        from fusedrl.integrations.trl import FusedGRPOTrainer

        module.GRPOTrainer = FusedGRPOTrainer
