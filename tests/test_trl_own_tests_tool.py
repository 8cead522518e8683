"""tools/trl_own_tests (TRL's own GRPO tests run with FusedGRPOTrainer, offline): its stand-in
hub loads through transformers' offline cache lookup under TRL's model ids, and its comparison
names a test whose outcome differs (and fails), else passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "trl_own_tests"
CASE = (
    '<testcase classname="tests.test_grpo_trainer.TestGRPOTrainer" name="{name}">{body}</testcase>'
)


def _junit(path: Path, cases: dict[str, str]) -> str:
    bodies = {"passed": "", "failed": '<failure message="boom"/>', "skipped": "<skipped/>"}
    rows = "".join(CASE.format(name=n, body=bodies[state]) for n, state in cases.items())
    path.write_text(f"<testsuites><testsuite>{rows}</testsuite></testsuites>")
    return str(path)


def _compare(tmp_path, trl: dict, fused: dict) -> subprocess.CompletedProcess:
    args = [_junit(tmp_path / "trl.xml", trl), _junit(tmp_path / "fused.xml", fused)]
    return subprocess.run(
        [sys.executable, str(TOOL / "compare.py"), *args], capture_output=True, text=True
    )


def test_the_comparison_names_a_differing_test(tmp_path):
    same = _compare(tmp_path, {"a": "passed", "b": "failed"}, {"a": "passed", "b": "failed"})
    assert same.returncode == 0 and "0 tests differ" in same.stdout
    differs = _compare(tmp_path, {"a": "passed", "b": "skipped"}, {"a": "failed", "b": "skipped"})
    assert differs.returncode == 1
    assert "DIFFERS TestGRPOTrainer::a: GRPOTrainer passed, FusedGRPOTrainer failed boom" in (
        differs.stdout
    )


def test_a_stand_in_loads_offline_under_trl_ids(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    sys.path.insert(0, str(TOOL))
    try:
        import build_hub
    finally:
        sys.path.remove(str(TOOL))
    name = "tiny-Qwen2ForCausalLM-2.5"  # one stand-in of the tool's list, to keep it quick
    one = {name: build_hub.stand_ins()[name]}
    monkeypatch.setattr(build_hub, "stand_ins", lambda: one)
    build_hub.build(tmp_path / "hub")
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "name = 'trl-internal-testing/tiny-Qwen2ForCausalLM-2.5'\n"
        "m = AutoModelForCausalLM.from_pretrained(name)\n"
        "t = AutoTokenizer.from_pretrained(name)\n"
        "assert m.config.vocab_size == len(t) and t.chat_template\n"
        "print('loaded', type(m).__name__)\n"
    )
    env = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded Qwen2ForCausalLM" in run.stdout
