"""The test suite's own layout (docs/contributing.md, "Where tests go"): the top of
``tests/`` holds test files only, and what they share lives in ``tests/support/``, a
package of helper modules with no test in it, each named in its ``__init__.py``; every
test file carries one quality marker or more (``QUALITIES`` in tests/conftest.py), each
declared in pyproject.toml, so ``pytest -m fleet`` runs the fleet tests."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import QUALITIES, qualities_of

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"
ROOT = TESTS.parent


def test_the_top_of_tests_holds_test_files_only() -> None:
    top = sorted(p.name for p in TESTS.iterdir() if p.name != "__pycache__")
    assert "test_suite.py" in top and "support" in top, top
    others = [
        n for n in top if not n.startswith("test_") and n not in ("__init__.py", "conftest.py")
    ]
    assert others == ["support"], f"helpers go in tests/support/, not beside the tests: {others}"


def test_support_holds_no_test() -> None:
    modules = sorted(p for p in SUPPORT.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(modules) > 20 and SUPPORT / "servers.py" in modules, modules
    named_test = [p.name for p in modules if p.name.startswith("test_")]
    assert not named_test, f"a test file in tests/support/ (pytest would collect it): {named_test}"
    with_tests = []
    for path in modules:
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        if [d.name for d in defs if d.name.startswith("test")] or [
            c.name for c in classes if c.name.startswith("Test")
        ]:
            with_tests.append(path.relative_to(TESTS).as_posix())
    assert not with_tests, f"tests in support modules: {with_tests}"


def test_support_names_every_module_it_holds() -> None:
    """tests/support/__init__.py's list of what is there stays whole."""
    index = ast.get_docstring(ast.parse((SUPPORT / "__init__.py").read_text())) or ""
    names = [p.stem for p in SUPPORT.glob("*.py") if p.name != "__init__.py"]
    names += [p.name for p in SUPPORT.iterdir() if p.is_dir() and p.name != "__pycache__"]
    names += [p.name for p in SUPPORT.glob("*.json")]
    assert "history" in names and "protocol_vectors.json" in names, names
    unnamed = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", index))
    assert not unnamed, f"tests/support/__init__.py does not name {unnamed}"


# --- the qualities, as markers -------------------------------------------------------------


def declared_markers() -> dict[str, str]:
    pytest_ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    lines = pytest_ini["ini_options"]["markers"]
    return dict(line.split(": ", 1) for line in lines)


def test_every_test_file_has_a_quality_and_the_table_names_real_files() -> None:
    files = sorted(TESTS.glob("test_*.py"))
    assert len(files) > 80 and Path(__file__) in files, "the glob missed the tests"
    without = [p.name for p in files if not qualities_of(p)]
    assert not without, f"no quality in QUALITIES (tests/conftest.py) for {without}"
    subjects = {p.stem.removeprefix("test_") for p in files}
    stale = {q: sorted(set(f.split()) - subjects) for q, f in QUALITIES.items()}
    assert not any(stale.values()), f"QUALITIES names no such test file: {stale}"
    declared = declared_markers()
    undeclared = sorted(set(QUALITIES) - set(declared))
    assert not undeclared, f"qualities not declared as markers in pyproject.toml: {undeclared}"
    assert not set(QUALITIES) & {"embedded", "redis", "cluster", "slow"}


def test_every_collected_test_carries_its_files_qualities(request: pytest.FixtureRequest) -> None:
    """The table reaches the tests: every test collected with this one (the whole suite,
    run as CI runs it) is marked with each quality of its file (a test may add one of its
    own, as the bench smoke tests of other files do)."""
    items = request.session.items
    assert request.node in items, "not the session's items"
    for item in items:
        marks = {m.name for m in item.iter_markers()} & set(QUALITIES)
        assert marks >= set(qualities_of(item.path)) and marks, (item.nodeid, marks)


def test_a_quality_selects_its_files() -> None:
    """``pytest -m fleet`` collects the fleet files' tests and no other file's."""
    files = ["tests/test_fleet_nopause.py", "tests/test_contract_async.py", "tests/test_suite.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
         "no:cacheprovider", "-m", "fleet", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    selected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert selected == {"tests/test_fleet_nopause.py"}, proc.stdout
    nodes = [line for line in proc.stdout.splitlines() if "::" in line]
    assert re.search(rf"{len(nodes)}/\d+ tests collected \(\d+ deselected\)", proc.stdout), (
        proc.stdout
    )


def test_contributing_lists_every_quality() -> None:
    """docs/contributing.md's table of markers ("Where tests go") has a row per quality."""
    text = (ROOT / "docs" / "contributing.md").read_text()
    section = text[text.index("## Where tests go") : text.index("## Why lua/")]
    rows = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(rows) == sorted(QUALITIES), rows
