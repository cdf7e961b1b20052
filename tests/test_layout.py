"""The house keeps its shape: stages in a fixed order, no import cycle, no private name
used across modules, the package's own imports at the top of each module, and modules and
functions within the house's sizes.

An `ast` walk over `src/automap`; see docs/DESIGN.md ("Layout") for the order and why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "automap"
TESTS = Path(__file__).resolve().parent

#: Lowest first. A module may import from its own stage and from stages on lower rows;
#: two stages on one row know nothing of each other.
LAYERS = (
    ("_version", "_errors", "_axes"),
    ("_lowering", "_slices"),
    ("_presets",),
    ("_graph", "_cluster"),
    ("_plan",),
    ("_solvers", "rl", "_zoo"),
    ("_capture",),
    ("_groups",),
    ("_pipeline",),
    ("_remat",),
    ("_cost",),
    ("_space",),
    ("_search",),
    ("_run",),
    ("_verify",),
    ("_api",),
    ("_report",),
    ("_bench",),
    ("_cli",),
    ("",),  # automap/__init__.py: the public API
)
RANK = {stage: i for i, row in enumerate(LAYERS) for stage in row}
#: Function-level imports of the package's own names: only the CLI, for start-up time.
LAZY_OK = ("_cli",)

#: The house's sizes (docs/STYLE.md): one concept per module, short functions. A function's
#: lines run from its `def` to its last line, docstring and nested functions included.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
LONG_FUNCTION_LINES = 80
MAX_LONG_FUNCTIONS = 8


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _stage(module: str) -> str:
    return module.split(".")[0]


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """The imported module's name relative to the package ("" is automap itself)."""
    if node.level == 0:
        name = node.module or ""
        if name != "automap" and not name.startswith("automap."):
            return None
        return name.removeprefix("automap").removeprefix(".")
    is_pkg = MODULES[module].name == "__init__.py"
    base = module.split(".") if module else []
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(module: str):
    """(target module, name or None for a module, in a function, under TYPE_CHECKING,
    line) per name imported from the package."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve(module, node)
        if target is None:
            continue
        in_function = type_checking = False
        up = node
        while up in parents:
            up = parents[up]
            in_function |= isinstance(up, ast.FunctionDef | ast.AsyncFunctionDef)
            type_checking |= isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test)
        for alias in node.names:
            # `from .. import _errors` imports the module automap._errors.
            sub = f"{target}.{alias.name}" if target else alias.name
            if sub in MODULES:
                yield sub, None, in_function, type_checking, node.lineno
            else:
                yield target, alias.name, in_function, type_checking, node.lineno


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _, type_checking, _ in _imports(module):
            if not type_checking:
                edges[module].add(target)
    return edges


def test_every_stage_has_a_layer():
    stages = {_stage(m) for m in MODULES}
    assert stages <= set(RANK), f"stages with no row in LAYERS: {sorted(stages - set(RANK))}"
    flat = sorted(m for m in MODULES if "." not in m and MODULES[m].name != "__init__.py")
    # Flat modules are the nouns (plain data) and the public entry points.
    assert len(flat) <= 12, flat


def test_no_import_cycle():
    edges, state, path = _edges(), {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(n) :], n]))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_stages_import_only_lower_stages_through_their_init():
    bad = []
    for module in MODULES:
        here = _stage(module)
        for target, _, _, type_checking, line in _imports(module):
            there = _stage(target)
            if there == here or type_checking:
                continue
            where = f"{MODULES[module].relative_to(SRC)}:{line} imports {target or 'automap'}"
            if RANK[there] >= RANK[here]:
                bad.append(f"{where}: not a lower stage")
            elif target != there:
                bad.append(f"{where}: go through the stage's __init__ ({there})")
    assert not bad, "\n".join(bad)


def test_no_private_name_across_modules():
    bad = []
    for module in MODULES:
        for _, name, _, _, line in _imports(module):
            if name and name.startswith("_") and not name.startswith("__"):
                bad.append(f"{MODULES[module].relative_to(SRC)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_own_imports_at_module_top_outside_the_cli():
    bad = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {target} inside a function"
        for m in MODULES
        if _stage(m) not in LAZY_OK
        for target, _, in_function, type_checking, line in _imports(m)
        if in_function and not type_checking
    ]
    assert not bad, "\n".join(bad)


def test_tests_import_stages_through_their_init():
    # Moves inside a stage then touch no test. `import automap._x._y as m` (to monkeypatch
    # one module's global) is the one allowed way in.
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("automap."):
                parts = node.module.split(".")
                if len(parts) > 2:
                    bad.append(f"{path.relative_to(TESTS)}:{node.lineno} from {node.module}")
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or node.module[len("automap.") :] not in RANK:
                    what = ", ".join(private) or node.module
                    bad.append(f"{path.relative_to(TESTS)}:{node.lineno} imports {what}")
    assert not bad, "\n".join(bad)


def _function_lengths(tree: ast.Module):
    """(qualified name, first line, lines) of every function in a module, nested ones too."""

    def visit(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                yield name, child.lineno, child.end_lineno - child.lineno + 1
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(tree, "")


def _long_functions(limit: int) -> list[str]:
    """Every function of the package over `limit` lines, longest first, as 'path:line name
    (n lines)'."""
    found = [
        (length, f"{path.relative_to(SRC)}:{line} {name} ({length} lines)")
        for path in MODULES.values()
        for name, line, length in _function_lengths(ast.parse(path.read_text()))
        if length > limit
    ]
    return [text for _, text in sorted(found, key=lambda f: -f[0])]


def test_function_lengths_run_from_def_to_last_line():
    # The measure the size limits rest on, checked while they wait to be turned on.
    source = (
        "@decorated\n"
        "def outer(x):\n"
        '    """Doc."""\n'
        "    def inner():\n"
        "        return x\n"
        "\n"
        "    return inner\n"
        "\n"
        "class Box:\n"
        "    def method(self):\n"
        "        pass\n"
    )
    assert sorted(_function_lengths(ast.parse(source))) == [
        ("Box.method", 10, 2),
        ("outer", 2, 6),
        ("outer.inner", 4, 2),
    ]


def test_no_module_over_the_limit():
    bad = [
        f"{path.relative_to(SRC)} ({n} lines)"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not bad, f"modules over {MAX_MODULE_LINES} lines (split by concept):\n" + "\n".join(bad)


def test_no_function_over_the_limit():
    bad = "\n".join(_long_functions(MAX_FUNCTION_LINES))
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (break into named parts):\n{bad}"


def test_few_long_functions():
    long = _long_functions(LONG_FUNCTION_LINES)
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {LONG_FUNCTION_LINES} lines, at most "
        f"{MAX_LONG_FUNCTIONS}:\n" + "\n".join(long)
    )


def _name_comparisons(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines comparing something with one of `names` as a string (==, !=, in, not in)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        sides += [e for s in sides if isinstance(s, ast.Tuple | ast.List | ast.Set) for e in s.elts]
        if any(isinstance(s, ast.Constant) and s.value in names for s in sides):
            lines.append(node.lineno)
    return lines


def test_no_schedule_name_compared_outside_the_registry():
    """A pipeline schedule is an object (`_pipeline.pipeline_schedule`): what a search may
    try besides it, or what it runs, is read from it, never branched on by its name."""
    from automap._pipeline import schedule_names

    names = set(schedule_names())
    bad = [
        f"{path.relative_to(SRC)}:{line}"
        for module, path in MODULES.items()
        if _stage(module) != "_pipeline"
        for line in _name_comparisons(ast.parse(path.read_text()), names)
    ]
    assert not bad, "schedule names compared outside _pipeline/:\n" + "\n".join(bad)
    planted = ast.parse('if plan.schedule != "1f1b" or name in ("gpipe", "x"):\n    pass')
    assert _name_comparisons(planted, names) == [1, 1]  # the check sees both forms
