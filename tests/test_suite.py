"""The test suite's own layout (docs/contributing.md, "Where tests go"): the top of
``tests/`` holds test files only, and what they share lives in ``tests/support/``, a
package of helper modules with no test in it, each named in its ``__init__.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"


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
