#!/usr/bin/env python3
"""Mutation testing for fusedrl without dependencies: plant one small bug at a time, run the tests.

    python tools/mutate.py [--files F ...] [--max N] [--seed S] [--tests T ...] [--timeout S]
                           [--jobs J] [--json out.json] [--only ID ...] [--list]
                           [--report-from out.json]

docs/testing.md has the measured kill rates and the command that measured them.

Mutants are found with the `ast` module and written back by replacing only the mutated tokens in
the original text (comments, layout and line numbers stay as they are); every mutated text is
parsed again and checked to be exactly the intended AST change, and falls back to `ast.unparse`
of the changed tree if it is not. Operators:

    Lt->LtE, Gt->GtE, Eq->NotEq (and back)       comparisons
    Add->Sub, Mult->Div (and back)               arithmetic, also in `x += y`
    And->Or, BitAnd->BitOr (and back)            boolean `and`/`or` and tensor masks `&`/`|`
    minimum->maximum, clamp_min->clamp_max,      min/max-like calls (torch., tl., methods, builtins)
    amin->amax, min->max (and back); clamp(min<->max) swaps the keyword bounds of clamp/clip
    const+1 (ints), const*1.5 (floats), const0->1 (0.0)
    drop-neg                                     `-x` -> `x`
    where-swap                                   tl.where/torch.where(c, a, b) -> (c, b, a)

Docstrings, f-strings, type annotations and `if __name__ == "__main__":` blocks are not mutated.
A mutant's id is `file:line:col:operator` (1-based line and column of the mutated token), stable
as long as the lines above it do not move. `tools/mutation_equivalent.txt` lists ids judged
equivalent (one per line: the id, then the reason); they are not run and not counted.

Each mutant runs in a temporary copy of fusedrl/, kernels/, trainer/, tests/, pyproject.toml and
setup.py (never in the checkout): `<tmp>/fusedrl/kernels` and `<tmp>/fusedrl/trainer` are links
to `<tmp>/kernels` and `<tmp>/trainer` (the layout the installed package maps), `<tmp>` is first
on PYTHONPATH, and a check at start-up makes sure the copy, not the checkout, is imported. A
mutant is killed when the tests fail, error or time out. Without CUDA, tests/conftest.py runs the
Triton kernels through the interpreter.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = [
    "fusedrl/token_terms.py",
    "fusedrl/reference.py",
    "kernels/rows.py",
    "kernels/token_loss.py",
    "kernels/terms.py",
    "kernels/sequence_terms.py",
    "kernels/logprobs.py",
]
DEFAULT_TESTS = [
    "tests/test_reference.py",
    "tests/test_branches.py",
    "tests/test_backends.py",
    "tests/test_properties.py",
    "tests/test_bad_inputs.py",
    "tests/test_triton_ops.py",
    "tests/test_row_sweeps.py",
    "tests/test_backward.py",
    "tests/test_fused_driver.py",
]
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider"]
COPIED = ["fusedrl", "kernels", "trainer", "tests", "pyproject.toml", "setup.py"]
LINKED = {"fusedrl/kernels": "kernels", "fusedrl/trainer": "trainer"}  # package-dir mapping
EQUIVALENT_FILE = ROOT / "tools" / "mutation_equivalent.txt"

# ------------------------------------------------------------------------------ mutant generation

CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
CMP_SWAP |= {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
CMP_TOKEN = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
BIN_SWAP |= {ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
BIN_TOKEN = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.BitAnd: "&",
    ast.BitOr: "|",
}
BOOL_SWAP = {ast.And: ast.Or, ast.Or: ast.And}
BOOL_TOKEN = {ast.And: "and", ast.Or: "or"}
MINMAX = {"minimum": "maximum", "clamp_min": "clamp_max", "amin": "amax", "min": "max"}
MINMAX |= {v: k for k, v in MINMAX.items()}
CLAMPS = {"clamp", "clip"}
WHERE_MODULES = {"tl", "torch"}


@dataclasses.dataclass
class Mutant:
    file: str  # repo-relative path
    line: int  # 1-based, of the mutated token
    col: int  # 1-based, of the mutated token
    operator: str
    original: str  # the source line(s) touched, stripped
    mutated: str  # the same line(s) after the change
    source: str = dataclasses.field(repr=False, compare=False)  # the whole mutated file
    rewritten: bool = False  # True when the text edit failed its check and ast.unparse was used

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.operator}"


@dataclasses.dataclass
class _Site:
    node: ast.AST
    operator: str
    pos: tuple[int, int]  # (lineno, byte col) of the token that names the mutant
    edits: list[tuple[int, int, bytes]]  # (start, end, replacement) in absolute byte offsets
    make: Callable[[ast.AST], ast.AST]  # the mutated node (a new node; the original is kept)
    alt_edits: list[tuple[int, int, bytes]] | None = None  # tried when `edits` parse otherwise


class _Text:
    """Byte offsets of a source text (ast positions are line numbers and UTF-8 byte columns)."""

    def __init__(self, source: str):
        self.data = source.encode()
        self.line_starts = [0]
        for match in re.finditer(rb"\n", self.data):
            self.line_starts.append(match.end())

    def offset(self, lineno: int, col: int) -> int:
        return self.line_starts[lineno - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def line_of(self, offset: int) -> int:
        lo, hi = 0, len(self.line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    def token_between(self, a: int, b: int, tokens: Iterable[str]) -> tuple[int, str]:
        """(offset, token) of the first operator token in data[a:b], skipping blanks, brackets,
        line continuations and comments."""
        i = a
        while i < b:
            ch = self.data[i : i + 1]
            if ch in b" \t\r\n\f()\\":
                i += 1
            elif ch == b"#":
                i = self.data.find(b"\n", i, b) if b"\n" in self.data[i:b] else b
            else:
                for token in sorted(tokens, key=len, reverse=True):
                    if self.data.startswith(token.encode(), i):
                        return i, token
                break
        raise ValueError(f"no operator token in {self.data[a:b]!r}")


def _is_main_guard(node: ast.If) -> bool:
    test = node.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _with(node: ast.AST, **fields) -> ast.AST:
    new = type(node)(**{name: getattr(node, name) for name in node._fields})
    ast.copy_location(new, node)
    for name, value in fields.items():
        setattr(new, name, value)
    return new


def _new_constant(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, None
    if isinstance(value, int):
        return value + 1, "const+1"
    if value == 0.0:
        return 1.0, "const0->1"
    return value * 1.5, "const*1.5"


class _SiteFinder(ast.NodeVisitor):
    """Every mutation site of a module, skipping docstrings, f-strings, annotations and the
    `if __name__ == "__main__":` block."""

    def __init__(self, text: _Text):
        self.text = text
        self.sites: list[_Site] = []

    # ---- what is skipped
    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # docstring (or a bare string statement)
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if not _is_main_guard(node):
            self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def visit_arg(self, node: ast.arg) -> None:
        return  # a parameter's annotation

    def _visit_function(self, node) -> None:
        for child in (*node.decorator_list, node.args, *node.body):
            self.visit(child)  # not node.returns

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    # ---- what is mutated
    def _add(self, node, operator, pos_offset, edits, make, alt_edits=None) -> None:
        line = self.text.line_of(pos_offset)
        col = pos_offset - self.text.line_starts[line - 1]
        self.sites.append(_Site(node, operator, (line, col), edits, make, alt_edits))

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            swap = CMP_SWAP.get(type(op))
            if swap is None:
                continue
            a, b = self.text.end(operands[i]), self.text.start(operands[i + 1])
            at, token = self.text.token_between(a, b, CMP_TOKEN.values())
            assert token == CMP_TOKEN[type(op)], (token, op)
            name = f"{type(op).__name__}->{swap.__name__}" + (f"#{i}" if i else "")

            def make(n, i=i, swap=swap):
                ops = list(n.ops)
                ops[i] = swap()
                return _with(n, ops=ops)

            edit = (at, at + len(token), CMP_TOKEN[swap].encode())
            self._add(node, name, at, [edit], make)
        self.generic_visit(node)

    def _binop(self, node, op, left, right, augmented: bool) -> None:
        swap = BIN_SWAP.get(type(op))
        if swap is None:
            return
        for side in (left, right):
            if isinstance(side, ast.JoinedStr) or (
                isinstance(side, ast.Constant) and isinstance(side.value, (str, bytes))
            ):
                return  # string concatenation / repetition
        a, b = self.text.end(left), self.text.start(right)
        token = BIN_TOKEN[type(op)] + ("=" if augmented else "")
        at, found = self.text.token_between(a, b, [token])
        new_token = BIN_TOKEN[swap].encode()
        name = f"{type(op).__name__}->{swap.__name__}"
        edits = [(at, at + 1, new_token)]
        # `a | b | c` -> `a | b & c` would bind differently: then parenthesize the operands and
        # the operation.
        parens = []
        for side in (left, right, node):
            parens += [(self.text.start(side), self.text.start(side), b"(")]
            parens += [(self.text.end(side), self.text.end(side), b")")]
        make = lambda n: _with(n, op=swap())  # noqa: E731
        self._add(node, name, at, edits, make, None if augmented else edits + parens)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self._binop(node, node.op, node.left, node.right, augmented=False)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._binop(node, node.op, node.target, node.value, augmented=True)
        self.visit(node.value)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        swap = BOOL_SWAP[type(node.op)]
        edits, first = [], None
        for left, right in zip(node.values, node.values[1:]):
            a, b = self.text.end(left), self.text.start(right)
            at, token = self.text.token_between(a, b, [BOOL_TOKEN[type(node.op)]])
            edits.append((at, at + len(token), BOOL_TOKEN[swap].encode()))
            first = at if first is None else first
        name = f"{type(node.op).__name__}->{swap.__name__}"
        self._add(node, name, first, edits, lambda n: _with(n, op=swap()))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.USub):
            at = self.text.start(node)
            assert self.text.data[at : at + 1] == b"-"
            self._add(node, "drop-neg", at, [(at, at + 1, b"")], lambda n: n.operand)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value, name = _new_constant(node.value)
        if name is None:
            return
        start, end = self.text.start(node), self.text.end(node)
        edit = (start, end, repr(value).encode())
        self._add(node, name, start, [edit], lambda n: _with(n, value=value))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if isinstance(func, ast.Attribute):
            name_at = self.text.end(func) - len(func.attr.encode())
        else:
            name_at = self.text.start(func)
        if fname in MINMAX and (isinstance(func, ast.Attribute) or fname in ("min", "max")):
            swap = MINMAX[fname]
            if isinstance(func, ast.Attribute):
                new_func = _with(func, attr=swap)
            else:
                new_func = _with(func, id=swap)
            edit = (name_at, name_at + len(fname), swap.encode())
            self._add(node, f"{fname}->{swap}", name_at, [edit], lambda n: _with(n, func=new_func))
        if fname in CLAMPS and any(k.arg in ("min", "max") for k in node.keywords):
            edits, keywords = [], []
            for k in node.keywords:
                if k.arg in ("min", "max"):
                    other = "max" if k.arg == "min" else "min"
                    at = self.text.start(k)
                    edits.append((at, at + 3, other.encode()))
                    keywords.append(_with(k, arg=other))
                else:
                    keywords.append(k)
            self._add(
                node, f"{fname}(min<->max)", name_at, edits, lambda n: _with(n, keywords=keywords)
            )
        if (
            fname == "where"
            and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in WHERE_MODULES
            and len(node.args) == 3
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            _, b, c = node.args
            b0, b1, c0, c1 = (
                self.text.start(b),
                self.text.end(b),
                self.text.start(c),
                self.text.end(c),
            )
            data = self.text.data
            edits = [(b0, c1, data[c0:c1] + data[b1:c0] + data[b0:b1])]
            self._add(
                node,
                "where-swap",
                name_at,
                edits,
                lambda n: _with(n, args=[n.args[0], n.args[2], n.args[1]]),
            )
        self.generic_visit(node)


def _parents(tree: ast.AST) -> dict[int, tuple[ast.AST, str, int | None]]:
    out = {}
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, ast.AST):
                out[id(value)] = (parent, field, None)
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        out[id(item)] = (parent, field, i)
    return out


def _substitute(parents, node: ast.AST, new: ast.AST) -> Callable[[], None]:
    """Put `new` where `node` is in the tree; return the function that puts `node` back."""
    parent, field, index = parents[id(node)]
    if index is None:
        setattr(parent, field, new)
        return lambda: setattr(parent, field, node)
    getattr(parent, field)[index] = new
    return lambda: getattr(parent, field).__setitem__(index, node)


def _span(data: bytes, start: int, end: int) -> str:
    """The whole lines of data that [start, end) touches, stripped and joined."""
    a = data.rfind(b"\n", 0, start) + 1
    b = data.find(b"\n", max(end, start))
    lines = data[a : len(data) if b < 0 else b].decode().splitlines()
    return " ".join(line.strip() for line in lines)


def _apply(data: bytes, edits: list[tuple[int, int, bytes]]) -> str:
    out = bytearray(data)
    for start, end, new in reversed(edits):  # sorted and disjoint: later ones first
        out[start:end] = new
    return bytes(out).decode()


def _top_statement(parents, node: ast.AST) -> int:
    """The index in the module's body of the statement that holds `node`."""
    while True:
        parent, _, index = parents[id(node)]
        if isinstance(parent, ast.Module):
            return index
        node = parent


def _statement_spans(body: list[ast.stmt], text: _Text) -> list[tuple[int, int]]:
    """The byte span of each module-level statement, its decorators included."""
    out = []
    for stmt in body:
        first = min([stmt, *getattr(stmt, "decorator_list", [])], key=lambda n: n.lineno)
        out.append((text.offset(first.lineno, first.col_offset), text.end(stmt)))
    return out


def _statement_texts(body: list[ast.stmt], text: _Text) -> list[bytes]:
    """The source text of each module-level statement, its decorators included."""
    return [text.data[start:end] for start, end in _statement_spans(body, text)]


def _own_lines(spans: list[tuple[int, int]], text: _Text) -> list[tuple[int, int] | None]:
    """Each module-level statement's span from the start of its first line (a decorator's `@`
    included), where nothing else stands before it on that line; else None."""
    out = []
    for start, end in spans:
        line_start = text.line_starts[text.line_of(start) - 1]
        alone = text.data[line_start:start].strip() in (b"", b"@")
        out.append((line_start, end) if alone else None)
    return out


def _edit_parses_to(new_source: str, edits, lines, top: int, expected: str, old_texts) -> bool:
    """Whether the edited source parses to the mutated tree (SyntaxError if it does not parse).
    Parsing the whole module once per mutant took most of the generator's time: edits inside one
    module-level statement's own lines (nearly all) leave every other statement's text as it
    was, so that statement alone is parsed (from column 0 of its first line, it parses alone as
    it does in its module); other edits, the whole module."""
    if lines is not None and lines[0] <= edits[0][0] and edits[-1][1] <= lines[1]:
        growth = sum(len(new) - (stop - first) for first, stop, new in edits)
        body = ast.parse(new_source.encode()[lines[0] : lines[1] + growth]).body
        return len(body) == 1 and ast.dump(body[0]) == expected
    return _same_module(ast.parse(new_source), _Text(new_source), top, expected, old_texts)


def _same_module(new_tree, new_text: _Text, top: int, expected: str, old_texts) -> bool:
    """Whether the edited source parses to the mutated tree. Dumping the whole tree per mutant
    took most of the generator's time: the statement with the edit is compared as a tree, the
    others by their text (the same statement text parses to the same tree)."""
    if len(new_tree.body) != len(old_texts):
        return False
    if ast.dump(new_tree.body[top]) != expected:
        return False
    new_texts = _statement_texts(new_tree.body, new_text)
    return all(new_texts[i] == old_texts[i] for i in range(len(old_texts)) if i != top)


def generate(source: str, path: str) -> list[Mutant]:
    """All mutants of one module, in source order (line, column, operator)."""
    # Thousands of syntax trees, none of them cyclic garbage: in a process that holds torch's
    # objects the collector's full passes cost as much as the parsing itself.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _generate(source, path)
    finally:
        if enabled:
            gc.enable()


def _generate(source: str, path: str) -> list[Mutant]:
    text = _Text(source)
    tree = ast.parse(source)
    finder = _SiteFinder(text)
    finder.visit(tree)
    parents = _parents(tree)
    statement_texts = _statement_texts(tree.body, text)
    statement_lines = _own_lines(_statement_spans(tree.body, text), text)
    mutants = []
    for site in finder.sites:
        top = _top_statement(parents, site.node)
        restore = _substitute(parents, site.node, site.make(site.node))
        try:
            expected = ast.dump(tree.body[top])
            for edits in filter(None, [site.edits, site.alt_edits]):
                edits = sorted(edits)
                new_source = _apply(text.data, edits)
                try:
                    rewritten = not _edit_parses_to(
                        new_source, edits, statement_lines[top], top, expected, statement_texts
                    )
                except SyntaxError:
                    rewritten = True
                if not rewritten:
                    break
            else:
                new_source = ast.unparse(tree) + "\n"
        finally:
            restore()
        first, last = edits[0][0], edits[-1][1]
        growth = len(new_source.encode()) - len(text.data)
        line, col = site.pos
        line_start = text.line_starts[line - 1]
        col_chars = len(text.data[line_start : line_start + col].decode())  # bytes -> characters
        mutated = (
            _span(new_source.encode(), first, last + growth) if not rewritten else "<rewritten>"
        )
        mutants.append(
            Mutant(
                file=path,
                line=line,
                col=col_chars + 1,
                operator=site.operator,
                original=_span(text.data, first, last),
                mutated=mutated,
                source=new_source,
                rewritten=rewritten,
            )
        )
    mutants.sort(key=lambda m: (m.line, m.col, m.operator))
    ids = [m.id for m in mutants]
    assert len(ids) == len(set(ids)), "mutant ids must be unique"
    return mutants


def sample(mutants: list, max_n: int | None, seed: int = 0) -> list:
    """max_n of the mutants, evenly spread over the ordered list (systematic sampling with a
    seeded random start), in order; all of them when there are not more than max_n."""
    if max_n is None or max_n >= len(mutants):
        return list(mutants)
    if max_n <= 0:
        return []
    step = len(mutants) / max_n
    start = random.Random(seed).random() * step
    return [mutants[int(start + i * step)] for i in range(max_n)]


def read_equivalent(path: Path) -> dict[str, str]:
    """id -> reason from a file of lines `<id> <reason>` (blank lines and # comments skipped)."""
    out = {}
    if not path.exists():
        return out
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        mutant_id, _, reason = line.partition(" ")
        out[mutant_id] = reason.strip() or "(no reason given)"
    return out


# ------------------------------------------------------------------------------------ running


def make_workspace(src: Path, dest: Path) -> None:
    """A copy of what the tests import, laid out like the installed package."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore, symlinks=True)
        elif path.exists():
            shutil.copy2(path, dest / name)
    for link, target in LINKED.items():
        if not (dest / link).is_symlink():
            (dest / link).symlink_to(Path("..") / target, target_is_directory=True)


def workspace_env(workspace: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workspace), env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant of the same size in the same second: no stale
    env["TORCHINDUCTOR_CACHE_DIR"] = str(workspace / ".inductor-cache")
    env["TRITON_CACHE_DIR"] = str(workspace / ".triton-cache")
    return env


def check_imports(workspace: Path) -> None:
    """Fail unless `fusedrl`, `fusedrl.kernels` and `fusedrl.trainer` come from the copy."""
    code = (
        "import fusedrl, fusedrl.kernels, fusedrl.trainer, fusedrl.reference, fusedrl.token_terms\n"
        "for m in (fusedrl, fusedrl.kernels, fusedrl.trainer, fusedrl.reference): print(m.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=workspace,
        env=workspace_env(workspace),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    outside = [path for path in out if not Path(path).is_relative_to(workspace)]
    if len(out) != 4 or outside:
        raise SystemExit(f"the copy in {workspace} is not what gets imported: {out}")


def pytest_command(tests: list[str], extra: list[str]) -> list[str]:
    args = [sys.executable, "-m", "pytest", *tests, *PYTEST_ARGS]
    if importlib.util.find_spec("hypothesis") is not None:
        args.append("--hypothesis-seed=0")  # the same examples for every mutant
    return args + extra


_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
_STOP = threading.Event()


def _stop_all() -> None:
    """Start no more test runs and kill the running ones (each is its own process group)."""
    _STOP.set()
    with _LIVE_LOCK:
        for proc in list(_LIVE):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_tests(workspace: Path, command: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output, seconds)."""
    shutil.rmtree(workspace / ".hypothesis", ignore_errors=True)  # no examples from other mutants
    start = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        if _STOP.is_set():
            raise KeyboardInterrupt("stopped")
        proc = subprocess.Popen(
            command,
            cwd=workspace,
            env=workspace_env(workspace),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
        log.seek(0)
        return rc, log.read(), time.monotonic() - start


def _failure(output: str) -> str:
    """The first FAILED/ERROR line of pytest's short summary, else the last line."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def run_mutant(mutant: Mutant, workspace: Path, command: list[str], timeout: float) -> dict:
    target = workspace / mutant.file
    original = target.read_text()
    target.write_text(mutant.source)
    try:
        rc, output, seconds = run_tests(workspace, command, timeout)
    finally:
        target.write_text(original)
    if rc is None:
        status, killed_by = "killed", f"timeout after {timeout:.0f} s"
    elif rc < 0:
        status, killed_by = "killed", f"crashed (signal {-rc})"
    elif rc == 0:
        status, killed_by = "survived", ""
    else:
        status, killed_by = (
            "killed",
            _failure(output) if rc == 1 else f"rc={rc}: {_failure(output)}",
        )
    return {"status": status, "rc": rc, "killed_by": killed_by, "seconds": round(seconds, 1)}


# ------------------------------------------------------------------------------------ report


def summarize(records: list[dict], files: list[str]) -> dict:
    out = {}
    for name in [*files, "total"]:
        rows = [r for r in records if name in ("total", r["file"])]
        counted = [r for r in rows if r["status"] in ("killed", "survived")]
        killed = sum(r["status"] == "killed" for r in counted)
        out[name] = {
            "mutants": len(counted),
            "killed": killed,
            "survived": len(counted) - killed,
            "equivalent": sum(r["status"] == "equivalent" for r in rows),
            "kill_rate": round(killed / len(counted), 4) if counted else None,
        }
    return out


def apply_equivalent(records: list[dict], equivalent: dict[str, str]) -> None:
    for r in records:
        if r["id"] in equivalent:
            r["status"], r["reason"] = "equivalent", equivalent[r["id"]]


def print_report(records: list[dict], files: list[str]) -> dict:
    summary = summarize(records, files)
    width = max(len(name) for name in summary)
    print(f"\n{'file':<{width}}  mutants  killed  survived  equivalent  kill rate")
    for name, row in summary.items():
        rate = "-" if row["kill_rate"] is None else f"{100 * row['kill_rate']:.1f}%"
        print(
            f"{name:<{width}}  {row['mutants']:>7}  {row['killed']:>6}  {row['survived']:>8}  "
            f"{row['equivalent']:>10}  {rate:>9}"
        )
    survivors = [r for r in records if r["status"] == "survived"]
    if survivors:
        print(f"\nsurvivors ({len(survivors)}):")
        for r in survivors:
            print(f"  {r['id']}\n      - {r['original']}\n      + {r['mutated']}")
    equivalents = [r for r in records if r["status"] == "equivalent"]
    if equivalents:
        print(f"\njudged equivalent ({len(equivalents)}, not counted):")
        for r in equivalents:
            print(f"  {r['id']}: {r['reason']}")
    return summary


def _record(mutant: Mutant) -> dict:
    fields = ("file", "line", "col", "operator", "original", "mutated", "rewritten")
    return {"id": mutant.id, **{name: getattr(mutant, name) for name in fields}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="repo-relative files")
    parser.add_argument("--max", type=int, default=None, help="run an even sample of N mutants")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run just these mutant ids")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS, help="pytest targets")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    parser.add_argument("--timeout", type=float, default=300.0, help="per mutant, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (one copy each)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument(
        "--report-from",
        type=Path,
        help="re-print (and --json re-write) an earlier run's results "
        "with the current tools/mutation_equivalent.txt, running nothing",
    )
    args = parser.parse_args(argv)
    equivalent = read_equivalent(EQUIVALENT_FILE)

    if args.report_from:
        data = json.loads(args.report_from.read_text())
        for r in data["mutants"]:
            if r["status"] == "equivalent" and r["id"] not in equivalent:
                r["status"] = r.get("result", "not run")
            r.pop("reason", None)
        apply_equivalent(data["mutants"], equivalent)
        data["summary"] = print_report(data["mutants"], data["files"])
        if args.json:
            args.json.write_text(json.dumps(data, indent=1) + "\n")
        return 0

    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` cleans up like Ctrl-C
    tmp = Path(tempfile.mkdtemp(prefix="fusedrl-mutate-"))
    workspaces = [tmp / f"w{i}" for i in range(max(1, args.jobs))]
    try:
        make_workspace(ROOT, workspaces[0])
        for workspace in workspaces[1:]:
            shutil.copytree(workspaces[0], workspace, symlinks=True)
        mutants, generated = [], {}
        for name in args.files:
            path = workspaces[0] / name
            if not path.is_file():
                raise SystemExit(f"{name}: not a file of the copied tree ({', '.join(COPIED)})")
            found = generate(path.read_text(), name)
            generated[name] = len(found)
            mutants += found
        if args.only:
            unknown = set(args.only) - {m.id for m in mutants}
            if unknown:
                raise SystemExit(f"no such mutant: {', '.join(sorted(unknown))}")
            mutants = [m for m in mutants if m.id in args.only]
        chosen = sample(mutants, args.max, args.seed)
        print(
            f"{len(mutants)} mutants ({', '.join(f'{k}: {v}' for k, v in generated.items())}); "
            f"running {len(chosen)} (seed {args.seed}); tests: {' '.join(args.tests)}",
            flush=True,
        )
        if args.list:
            for m in chosen:
                print(f"{m.id}\n    - {m.original}\n    + {m.mutated}")
            return 0

        for workspace in workspaces:
            check_imports(workspace)
        command = pytest_command(args.tests, args.pytest_args.split())
        baseline_s = None
        if not args.no_baseline:
            rc, output, baseline_s = run_tests(workspaces[0], command, args.timeout)
            if rc != 0:
                print(output[-3000:])
                raise SystemExit(f"the unmutated copy fails its tests (rc={rc}): fix that first")
            print(f"baseline: tests pass unmutated in {baseline_s:.1f} s", flush=True)

        records = [_record(m) for m in chosen]
        by_id = {m.id: m for m in chosen}
        free: queue.Queue[Path] = queue.Queue()
        for workspace in workspaces:
            free.put(workspace)
        lock, done = threading.Lock(), [0]
        started = time.monotonic()

        def job(record: dict) -> None:
            if record["id"] in equivalent:
                record.update(status="equivalent", reason=equivalent[record["id"]])
            else:
                workspace = free.get()
                try:
                    record.update(run_mutant(by_id[record["id"]], workspace, command, args.timeout))
                finally:
                    free.put(workspace)
            with lock:
                done[0] += 1
                elapsed = time.monotonic() - started
                status = (
                    record["status"].upper() if record["status"] == "survived" else record["status"]
                )
                print(
                    f"[{done[0]:>3}/{len(records)}] {status:<10} {record.get('seconds', 0):>6.1f} s"
                    f"  {record['id']}  ({elapsed / 60:.1f} min)",
                    flush=True,
                )

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(workspaces))
        try:
            for future in [pool.submit(job, r) for r in records]:
                future.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            _stop_all()
            raise
        pool.shutdown()
        for r in records:
            r["result"] = r["status"] if r["status"] != "equivalent" else "not run"
        summary = print_report(records, args.files)
        if args.json:
            report = {
                "date": datetime.date.today().isoformat(),
                "command": " ".join(["python", "tools/mutate.py", *sys.argv[1:]])
                if argv is None
                else " ".join(["python", "tools/mutate.py", *argv]),
                "files": args.files,
                "tests": args.tests,
                "pytest_command": command[1:],
                "seed": args.seed,
                "max": args.max,
                "jobs": args.jobs,
                "generated": generated,
                "sampled": len(records),
                "baseline_s": None if baseline_s is None else round(baseline_s, 1),
                "wall_s": round(time.monotonic() - started, 1),
                "summary": summary,
                "mutants": records,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
            print(f"\nwrote {args.json}")
        return 0
    finally:
        _stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        sys.exit(f"interrupted ({exc}); the temporary copies are removed")
    except BrokenPipeError:  # `... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
