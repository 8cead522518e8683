"""tools/mutate.py, the mutation-testing script: its mutant generator on small sources (no test
suite is run here). docs/testing.md has the measured kill rates."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("_mutate_tool", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SOURCE = '''\
"""Module docstring: a < b + 1 is not code."""
import torch
import triton.language as tl

LIMIT: float = 2.0


def f(x: int = 3, *, y: "list[int]" = None) -> float:
    """Docstring with 2 * 3."""
    z = -x * 2  # a comment
    if x < y and x != 0:
        z += torch.minimum(x, y).clamp_min(0.0)
    return tl.where(x >= 1, z / 4, z - 1.5), f"{x + 1}"


if __name__ == "__main__":
    print(f(1 + 2))
'''

EXPECTED = {
    "m.py:5:16:const*1.5": "LIMIT: float = 3.0",
    "m.py:8:16:const+1": 'def f(x: int = 4, *, y: "list[int]" = None) -> float:',
    "m.py:10:9:drop-neg": "z = x * 2  # a comment",
    "m.py:10:12:Mult->Div": "z = -x / 2  # a comment",
    "m.py:10:14:const+1": "z = -x * 3  # a comment",
    "m.py:11:10:Lt->LtE": "if x <= y and x != 0:",
    "m.py:11:14:And->Or": "if x < y or x != 0:",
    "m.py:11:20:NotEq->Eq": "if x < y and x == 0:",
    "m.py:11:23:const+1": "if x < y and x != 1:",
    "m.py:12:11:Add->Sub": "z -= torch.minimum(x, y).clamp_min(0.0)",
    "m.py:12:20:minimum->maximum": "z += torch.maximum(x, y).clamp_min(0.0)",
    "m.py:12:34:clamp_min->clamp_max": "z += torch.minimum(x, y).clamp_max(0.0)",
    "m.py:12:44:const0->1": "z += torch.minimum(x, y).clamp_min(1.0)",
    "m.py:13:15:where-swap": 'return tl.where(x >= 1, z - 1.5, z / 4), f"{x + 1}"',
    "m.py:13:23:GtE->Gt": 'return tl.where(x > 1, z / 4, z - 1.5), f"{x + 1}"',
    "m.py:13:26:const+1": 'return tl.where(x >= 2, z / 4, z - 1.5), f"{x + 1}"',
    "m.py:13:31:Div->Mult": 'return tl.where(x >= 1, z * 4, z - 1.5), f"{x + 1}"',
    "m.py:13:33:const+1": 'return tl.where(x >= 1, z / 5, z - 1.5), f"{x + 1}"',
    "m.py:13:38:Sub->Add": 'return tl.where(x >= 1, z / 4, z + 1.5), f"{x + 1}"',
    "m.py:13:40:const*1.5": 'return tl.where(x >= 1, z / 4, z - 2.25), f"{x + 1}"',
}


def test_operators_ids_and_skips(mutate):
    """Exactly the expected mutants: nothing from the docstrings, annotations, the f-string or the
    __main__ block; each changes one line of the text and nothing else."""
    mutants = mutate.generate(SOURCE, "m.py")
    assert [m.id for m in mutants] == sorted(
        EXPECTED, key=lambda i: tuple(map(int, i.split(":")[1:3]))
    )
    lines = SOURCE.splitlines()
    for m in mutants:
        assert not m.rewritten
        new_lines = m.source.splitlines()
        assert len(new_lines) == len(lines)
        changed = [i for i, (a, b) in enumerate(zip(lines, new_lines)) if a != b]
        assert changed == [m.line - 1], m.id
        assert new_lines[m.line - 1].strip() == EXPECTED[m.id]
        assert m.original == lines[m.line - 1].strip() and m.mutated == EXPECTED[m.id]
        ast.parse(m.source)


def test_ids_are_stable(mutate):
    """The same source gives the same ids; code added below a mutant leaves its id alone."""
    first = [m.id for m in mutate.generate(SOURCE, "m.py")]
    assert first == [m.id for m in mutate.generate(SOURCE, "m.py")]
    longer = [m.id for m in mutate.generate(SOURCE + "\nW = 1 - 2\n", "m.py")]
    assert longer[: len(first)] == first and len(longer) == len(first) + 3


def test_precedence_kept_by_parentheses(mutate):
    """Swapping the outer `|` of `a | b | c` to `&` must not produce `a | b & c`."""
    (_, outer) = [m for m in mutate.generate("m = a | b | c\n", "m.py") if "BitOr" in m.operator]
    expected = ast.parse("m = (a | b) & c\n")
    assert ast.dump(ast.parse(outer.source)) == ast.dump(expected) and not outer.rewritten


def test_clamp_keywords_and_multiline_where(mutate):
    src = (
        "y = torch.clamp(x, min=lo, max=hi)\nz = torch.where(\n    c,\n    a,  # keep\n    b,\n)\n"
    )
    by_op = {m.operator: m for m in mutate.generate(src, "m.py")}
    assert set(by_op) == {"clamp(min<->max)", "where-swap"}
    assert by_op["clamp(min<->max)"].source.splitlines()[0] == "y = torch.clamp(x, max=lo, min=hi)"
    swapped = ast.parse(by_op["where-swap"].source).body[1].value.args
    assert [a.id for a in swapped] == ["c", "b", "a"]
    assert "# keep" in by_op["where-swap"].source  # only the arguments moved


def test_sample_is_even_deterministic_and_ordered(mutate):
    items = list(range(100))
    picked = mutate.sample(items, 10, seed=3)
    assert picked == mutate.sample(items, 10, seed=3) and picked == sorted(picked)
    assert len(set(picked)) == 10 and all(10 * i <= p < 10 * (i + 1) for i, p in enumerate(picked))
    assert mutate.sample(items, 200) == items and mutate.sample(items, None) == items


def test_equivalent_list(mutate, tmp_path):
    path = tmp_path / "eq.txt"
    path.write_text("# comment\n\na.py:3:4:Lt->LtE  ties cannot occur here\nb.py:1:1:const+1\n")
    assert mutate.read_equivalent(path) == {
        "a.py:3:4:Lt->LtE": "ties cannot occur here",
        "b.py:1:1:const+1": "(no reason given)",
    }
    assert mutate.read_equivalent(tmp_path / "missing.txt") == {}


def test_default_targets_generate(mutate):
    """The default files parse and give mutants whose text edits check out (no rewrites)."""
    for name in mutate.DEFAULT_FILES:
        mutants = mutate.generate((ROOT / name).read_text(), name)
        assert mutants and not [m.id for m in mutants if m.rewritten]


def test_summary_counts_equivalents_apart(mutate):
    records = [
        {"id": "a.py:1:1:x", "file": "a.py", "status": "killed"},
        {"id": "a.py:2:1:x", "file": "a.py", "status": "survived"},
        {"id": "a.py:3:1:x", "file": "a.py", "status": "survived"},
        {"id": "b.py:1:1:x", "file": "b.py", "status": "killed"},
    ]
    mutate.apply_equivalent(records, {"a.py:3:1:x": "same value"})
    assert records[2]["status"] == "equivalent" and records[2]["reason"] == "same value"
    summary = mutate.summarize(records, ["a.py", "b.py"])
    assert summary["a.py"] == {
        "mutants": 2,
        "killed": 1,
        "survived": 1,
        "equivalent": 1,
        "kill_rate": 0.5,
    }
    assert summary["total"]["mutants"] == 3 and summary["total"]["kill_rate"] == 0.6667


def test_an_edit_is_checked_on_its_statement_or_the_whole_module(mutate):
    """The generator parses only the edited statement when the edit lies inside its own lines:
    the answer must be the whole module's (same tree, other tree, split statement, unparsable),
    and an edit across statements, or on a line shared with another, goes to the whole module."""
    source = "import os\n\n\n@deco\ndef f(a, b):\n    return a * b + 1\n\nx = 1; y = 2\n"
    text = mutate._Text(source)
    tree = ast.parse(source)
    spans = mutate._statement_spans(tree.body, text)
    lines = mutate._own_lines(spans, text)
    texts = [text.data[start:end] for start, end in spans]
    assert lines[0] == (0, 9) and lines[1][0] == source.index("@") and lines[3] is None
    at = source.index("a * b")

    def parses_to(edits, top, want_source):
        want = ast.dump(ast.parse(want_source).body[top])
        edited = mutate._apply(text.data, edits)
        return mutate._edit_parses_to(edited, edits, lines[top], top, want, texts)

    swapped = source.replace("a * b", "a / b")
    assert parses_to([(at + 2, at + 3, b"/")], 1, swapped)
    assert not parses_to([(at + 2, at + 3, b"-")], 1, swapped)  # another tree
    with pytest.raises(SyntaxError):
        parses_to([(at + 2, at + 3, b"* *")], 1, swapped)
    split = [(at + 8, at + 9, b"1\n\nz = 3")]  # the statement becomes two: not the tree
    assert not parses_to(split, 1, source.replace("+ 1", "+ 1\n\nz = 3"))
    # x = 1; y = 2 shares its line: y's edits are checked on the whole module
    y_at = source.index("y = 2") + 4
    assert parses_to([(y_at, y_at + 1, b"3")], 3, source.replace("y = 2", "y = 3"))
    assert not parses_to([(y_at, y_at + 1, b"3")], 3, source.replace("y = 2", "y = 4"))
