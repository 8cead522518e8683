"""The house has one direction: no import cycle among fusedrl's modules, and no family or lower
layer importing an entry point.

Read from the source (every `import` / `from ... import`, those inside functions too, package
`__init__` files included), not from what happens to be loaded: a lazy import that closes a
cycle is a cycle all the same. docs/design.md ("Layers") draws the layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's source lies (pyproject.toml maps the last two into fusedrl).
SOURCES = {
    "fusedrl": ROOT / "fusedrl",
    "fusedrl.kernels": ROOT / "kernels",
    "fusedrl.trainer": ROOT / "trainer",
}

# The public entry points: what users call. Everything else lies below them.
ENTRY_MODULES = {
    "fusedrl",  # the package root re-exports the entry points
    "fusedrl.api",  # policy_loss, token_logprobs, PolicyLoss
    "fusedrl.linear",  # linear_policy_loss, linear_token_logprobs
    "fusedrl.distill.linear",  # linear_distill_loss
}
# The trainer and the drop-ins for other trainers sit on top of the entry points.
ABOVE_THE_ENTRY_POINTS = ("fusedrl.integrations", "fusedrl.trainer")


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, plain: bool = False) -> set[str]:
    """The fusedrl modules `name` imports, anywhere in its file. (A package's `__init__` is a
    module like the others; a submodule's implicit run of its parent package is not an edge:
    an `__init__` that imports its own submodules is how packages are made.) `plain`: read
    `from pkg import x` as an import of pkg, as simpler import graphs do."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                child = f"{module}.{alias.name}"
                found.add(child if child in MODULES and not plain else module)
    return {m for m in found if m in MODULES and m != name}


def _with_packages(name: str, imported: set[str]) -> set[str]:
    """`imported` and the packages above each (importing `fusedrl.distill.heads` runs
    `fusedrl/distill/__init__.py` first), but for `name`'s own packages, which are running."""
    found = set()
    for module in imported:
        parts = module.split(".")
        for end in range(1, len(parts) + 1):
            above = ".".join(parts[:end])
            if above in MODULES and above != name and not name.startswith(above + "."):
                found.add(above)
    return found


GRAPH = {name: _with_packages(name, _imports(name, path)) for name, path in MODULES.items()}
# The same source read plainly: `from . import backends` inside fusedrl/ would be an import of
# the package root (which imports the entry points, which import everything): so the modules
# below the entry points import their siblings by name (`import fusedrl.backends as backends`),
# and both readings find the same graph.
# (An explicit import of a module's own package is an edge here, unlike the implicit run.)
PLAIN_IMPORTS = {name: _imports(name, path, plain=True) for name, path in MODULES.items()}
PLAIN_GRAPH = {name: _with_packages(name, found) | found for name, found in PLAIN_IMPORTS.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_source_is_read():
    assert {"fusedrl.api", "fusedrl.tp.loss", "fusedrl.kernels.token_loss"} <= set(MODULES)
    assert "fusedrl.single_process" in GRAPH["fusedrl.tp.loss"]  # a function-level import
    assert "fusedrl.distill.args" in GRAPH["fusedrl.distill"]  # a package's __init__
    # importing a submodule runs its package's __init__ first
    assert "fusedrl.distill" in GRAPH["fusedrl.linear_single_process"]


def test_no_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(set(MODULES) - ENTRY_MODULES))
def test_nothing_below_the_entry_points_imports_one(name):
    if name.startswith(ABOVE_THE_ENTRY_POINTS):
        return
    explicit = GRAPH[name] - {p for p in ENTRY_MODULES if name.startswith(p + ".")}
    assert not explicit & ENTRY_MODULES, (name, sorted(explicit & ENTRY_MODULES))


@pytest.mark.parametrize("name", sorted(m for m in MODULES if m.startswith("fusedrl.kernels")))
def test_the_kernels_import_nothing_above_them(name):
    """The kernels are the lowest layer: they import no module of fusedrl/ (the CUDA loader
    hands the extension's raw ops up; fusedrl.cuda_backend makes the driver's ops of them)."""
    above = {m for m in GRAPH[name] if not m.startswith("fusedrl.kernels")}
    assert not above, (name, sorted(above))


def test_no_import_cycle_read_plainly():
    cycle = _cycle(PLAIN_GRAPH)
    assert cycle is None, "import cycle, `from pkg import module` read as pkg: " + " -> ".join(
        cycle
    )


def test_the_plain_reading_sees_a_relative_module_import_as_its_package(tmp_path):
    planted = tmp_path / "loss.py"
    planted.write_text("from .. import single_process\n")
    assert _imports("fusedrl.tp.loss", planted) == {"fusedrl.single_process"}
    assert _imports("fusedrl.tp.loss", planted, plain=True) == {"fusedrl"}


def test_a_planted_cycle_is_found():
    """The check itself: an import of an entry point from a backend closes a cycle."""
    planted = {**GRAPH, "fusedrl.torch_backend": GRAPH["fusedrl.torch_backend"] | {"fusedrl.api"}}
    assert _cycle(planted) is not None


# The entry points and the two argument hubs read as a table of contents: a few named steps each.
ENTRY_FUNCTIONS = {
    "fusedrl.api": ("policy_loss", "token_logprobs"),
    "fusedrl.linear": ("linear_policy_loss", "linear_token_logprobs"),
    "fusedrl.distill": ("distill_loss",),
    "fusedrl.distill.linear": ("linear_distill_loss",),
    "fusedrl._inputs": ("prepare_loss_inputs",),
    "fusedrl.config": ("__post_init__",),
}
# Counted in statements (those nested in a with / if / for included), not lines: the formatter
# lays out a call that passes thirteen arguments on fifteen lines, and that is one step.
MAX_STATEMENTS = 25


def _statements(function: ast.FunctionDef) -> int:
    """The body's statements, nested ones included, its docstring not."""
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return sum(1 for top in body for node in ast.walk(top) if isinstance(node, ast.stmt))


@pytest.mark.parametrize("module", sorted(ENTRY_FUNCTIONS))
def test_entry_points_are_a_few_named_steps(module):
    source = MODULES[module].read_text()
    functions = {
        node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
    }
    for name in ENTRY_FUNCTIONS[module]:
        count = _statements(functions[name])
        assert count <= MAX_STATEMENTS, f"{module}.{name}: {count} statements"


def test_the_step_count_sees_nested_statements():
    nested = ast.parse(
        'def f():\n    "doc"\n    with a:\n        if b:\n            c()\n    d = 1\n'
    )
    assert _statements(nested.body[0]) == 4


# Packages whose __init__ docstring maps their modules: every module is named there.
MODULE_MAPS = ("fusedrl.kernels", "fusedrl.tp")


@pytest.mark.parametrize("package", MODULE_MAPS)
def test_module_maps_name_every_module(package):
    init = MODULES[package]
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    files = sorted(p.name for p in init.parent.glob("*.py") if p.name != "__init__.py")
    missing = [name for name in files if name not in docstring]
    assert not missing, f"{package}'s docstring does not name {missing}"


def test_the_testing_map_names_every_module_and_real_tests():
    """docs/testing.md, "From the module you edit to its tests": every module of the package
    and of its kernels is in the table (by its path, or in its folder's row), and every test
    file the table names exists."""
    text = (ROOT / "docs" / "testing.md").read_text()
    table = text.split("## From the module you edit to its tests", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    modules_column = " ".join(row.split(" | ")[0] for row in rows)
    missing = []
    for package in ("fusedrl", "fusedrl.kernels"):
        folder = SOURCES[package]
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder).as_posix()
            shown = relative if package == "fusedrl" else f"kernels/{relative}"
            parent = f"{path.parent.name}/" if path.parent != folder else None
            named = f"`{shown}`" in modules_column or f"`{path.name}`" in modules_column
            if not named and not (parent and f"`{parent}`" in modules_column):
                missing.append(shown)
    assert not missing, f"docs/testing.md's module map lacks {missing}"
    named_tests = set(re.findall(r"(test_\w+\.py)", " ".join(rows)))
    assert named_tests and all((ROOT / "tests" / name).exists() for name in named_tests), sorted(
        name for name in named_tests if not (ROOT / "tests" / name).exists()
    )


def _names_imported_from_modules() -> list[tuple[str, str, str, int]]:
    """(importing module, imported module, name, line) of every `from <fusedrl module> import
    name` in the source, the lazy ones inside functions included, where name is not itself a
    submodule."""
    found = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module not in MODULES:
                continue
            for alias in node.names:
                if f"{module}.{alias.name}" not in MODULES:
                    found.append((name, module, alias.name, node.lineno))
    return found


def _defined_names(path: Path) -> set[str]:
    """Every name a module binds at its top level (defs, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # a guarded definition
            names.update(_defined_in(node))
    return names


def _defined_in(block: ast.stmt) -> set[str]:
    names = set()
    for node in ast.walk(block):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_imported_name_exists():
    """A name imported from a fusedrl module is defined there. A lazy import inside a function
    (the CUDA extension's loader, the Triton kernels) runs only on the machine that takes that
    path: a helper renamed or removed elsewhere breaks it there alone (a GPU), not here."""
    imports = _names_imported_from_modules()
    assert len(imports) > 100  # the scan sees the package's imports
    missing = [
        f"{importer}:{line} imports {name} from {module}"
        for importer, module, name, line in imports
        if name != "*" and name not in _defined_names(MODULES[module])
    ]
    assert not missing, "\n".join(missing)


# The families that run a policy-loss call, below the entry points: each takes the call's rollout
# inputs and model head as the two objects of fusedrl/arguments.py, never as their fields.
FAMILY_LOSSES = {
    "fusedrl.single_process": "policy_loss",
    "fusedrl.linear_single_process": "linear_policy_loss",
    "fusedrl.packed": "policy_loss",
    "fusedrl.context_parallel": "policy_loss",
    "fusedrl.tp.loss": "policy_loss",
    "fusedrl.tp.linear": "linear_policy_loss",
}
OBJECT_FIELDS = {
    "rollout": ("old_logp", "ref_logp", "rollout_logp", "prox_logp", "is_weights"),
    "head": ("temperature", "transform", "softcap", "logit_scale"),
}


def _parameters(module: str, function: str) -> list[str]:
    tree = ast.parse(MODULES[module].read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    arguments = node.args
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


@pytest.mark.parametrize("module", sorted(FAMILY_LOSSES))
def test_families_take_the_rollout_and_head_as_objects(module):
    parameters = _parameters(module, FAMILY_LOSSES[module])
    for name, fields in OBJECT_FIELDS.items():
        assert name in parameters, (module, name)
        spelled = sorted(set(fields) & set(parameters))
        assert not spelled, f"{module}: {spelled} travel in `{name}` (fusedrl/arguments.py)"


def test_the_object_fields_are_the_objects():
    """The lists above are the objects' own fields (a new field joins both, or the check is
    blind to it)."""
    import dataclasses

    from fusedrl.arguments import ModelHead, RolloutInputs

    assert {f.name for f in dataclasses.fields(RolloutInputs)} == set(OBJECT_FIELDS["rollout"])
    head_fields = {f.name for f in dataclasses.fields(ModelHead)}
    assert head_fields <= set(OBJECT_FIELDS["head"])
