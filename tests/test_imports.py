"""The import graph of the ``ledger`` package: no circle, no import up the layers.

The graph is read from the source with the standard library (``ast``), not by importing:
an edge is every ``import`` and ``from ... import`` of a ``ledger`` module, at the top of
a module or inside a function (a lazy import is an import), except those under ``if
TYPE_CHECKING:`` (read by mypy only, never run). ``from ledger.x import y`` is an edge to
``ledger.x.y`` when that is a module, else to ``ledger.x``. The layers are the table
below, the same as in docs/contributing.md ("The import layers"): a module may import
its own layer and those before it, never one after.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (layer, the modules in it: a name ending in ".*" is every module under that package)
LAYERS: list[tuple[str, list[str]]] = [
    (
        "base",
        [
            "ledger.errors",
            "ledger.extras",
            "ledger.settings",
            "ledger.keys",
            "ledger.models",
            "ledger.models.*",
            "ledger.schema",
            "ledger.schema.*",
            "ledger.scripts",
            "ledger.specs",
            "ledger._version",
        ],
    ),
    ("wire", ["ledger.protocol", "ledger.backends", "ledger.health"]),
    (
        "core",
        [
            "ledger.core",
            "ledger.handles",
            "ledger.operations",
            "ledger.session_calls",
            "ledger.batches",
            "ledger.allowance",
            "ledger.agent.core",
            "ledger.agent.effects",
            "ledger.agent.ids",
            "ledger.agent.turns",
            "ledger.agent.calibration",
            "ledger.agent.items",
            "ledger.agent.billing",
            "ledger.agent.admission",
            "ledger.agent.counters",
            "ledger.agent.lease",
            "ledger.agent.telemetry",
        ],
    ),
    (
        "faces",
        [
            "ledger._async",
            "ledger._sync",
            "ledger._async.client",
            "ledger._sync.client",
            "ledger.client",
            "ledger.aio",
            "ledger.scope_reads",
        ],
    ),
    (
        "agent",
        [
            "ledger.agent",
            "ledger.agent.aio",
            "ledger.agent.sync",
            "ledger._async.agent",
            "ledger._sync.agent",
        ],
    ),
    ("workers", ["ledger.workers", "ledger.workers.*"]),
    (
        "adapters",
        [
            "ledger.adapters",
            "ledger.adapters.*",
            "ledger._async.langgraph",
            "ledger._async.langchain",
            "ledger._sync.langgraph",
            "ledger._sync.langchain",
        ],
    ),
    ("fleet", ["ledger.fleet", "ledger.fleet.*"]),
    (
        "top",
        [
            "ledger",
            "ledger.views",
            "ledger.views.*",
            "ledger.cli",
            "ledger.cli.*",
            "ledger.testing",
        ],
    ),
]


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` by dotted name (a package by its
    ``__init__.py``)."""
    found = {}
    for path in sorted((root / "ledger").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported(tree: ast.AST, name: str, is_package: bool, mods: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (its syntax tree) imports."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: set[str] = set()

    def owner(dotted: str) -> str:
        while dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    walk_one(other)
            else:
                walk_one(child)

    def walk_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(owner(a.name) for a in node.names if a.name.split(".")[0] == "ledger")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "ledger":
                return
            for a in node.names:
                full = f"{source}.{a.name}"
                out.add(full if full in mods else owner(source))
        else:
            walk(node)

    walk(tree)
    out.discard(name)
    return out


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module's docstring)."""
    mods = modules(root)
    return {
        name: imported(ast.parse(path.read_text(), str(path)), name, path.stem == "__init__", mods)
        for name, path in mods.items()
    }


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_of(name: str, layers: list[tuple[str, list[str]]]) -> int | None:
    for rank, (_, members) in enumerate(layers):
        for m in members:
            if name == m or (m.endswith(".*") and name.startswith(m[:-1])):
                return rank
    return None


def upward(
    edges: dict[str, set[str]], layers: list[tuple[str, list[str]]]
) -> list[tuple[str, str]]:
    """The imports from a module of a lower layer to one of a higher layer."""
    up = []
    for source, targets in sorted(edges.items()):
        here = layer_of(source, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there > here:
                up.append((source, target))
    return up


@functools.cache
def package_graph() -> dict[str, set[str]]:
    return graph(ROOT)


def test_every_module_has_a_layer() -> None:
    missing = [m for m in modules(ROOT) if layer_of(m, LAYERS) is None]
    assert not missing, f"modules in no layer of LAYERS (and docs/contributing.md): {missing}"


def test_the_package_imports_in_no_circle() -> None:
    found = circles(package_graph())
    print(f"import circles: {len(found)} {found}")
    assert found == [], f"modules that import each other in a circle: {found}"


def test_no_module_imports_a_higher_layer() -> None:
    up = upward(package_graph(), LAYERS)
    print(f"upward imports: {len(up)} {up}")
    assert up == [], "imports up the layers (docs/contributing.md, The import layers): " + str(up)


def test_the_layers_in_the_docs_are_the_table_here() -> None:
    text = (ROOT / "docs" / "contributing.md").read_text()
    section = text[text.index("## The import layers") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    documented = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        documented.append((cells[1], sorted(re.findall(r"`([^`]+)`", cells[2]))))
    assert documented == [(name, sorted(members)) for name, members in LAYERS]


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The checks can fail: a small package with a circle (one edge a lazy import), an
    upward import, and an import under TYPE_CHECKING that counts for neither."""
    pkg = tmp_path / "ledger"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from ledger.sub import high\n")
    (pkg / "sub" / "high.py").write_text("from ledger import low\n")
    (pkg / "other.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ledger import low\n"
    )
    edges = graph(tmp_path)
    assert edges["ledger.low"] == {"ledger.sub.high"}
    assert edges["ledger.other"] == set()
    assert circles(edges) == [["ledger.low", "ledger.sub.high"]]
    layers = [("low", ["ledger.low", "ledger.other"]), ("high", ["ledger.sub.*"])]
    assert upward(edges, layers) == [("ledger.low", "ledger.sub.high")]
