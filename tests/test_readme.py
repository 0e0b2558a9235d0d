"""The README stays true: its usage example runs, and its Quick start is two commands."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_quick_start_is_two_commands() -> None:
    section = README.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("ledger demo")
    assert commands[1] == ".venv/bin/pytest"
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert commands[1] in ci


def test_usage_example_runs_on_embedded() -> None:
    code = re.search(r"## Usage\n\n```python\n(.*?)```", README, re.S)
    assert code is not None
    source = code.group(1).replace('"redis://localhost:6379/0"', '"embedded://readme"')
    scope: dict[str, object] = {}
    exec(compile(source, "README.md", "exec"), scope)
    snap = scope["snap"]
    assert snap.free >= 0  # type: ignore[attr-defined]


def test_agent_loop_follows_quick_start_and_runs_on_embedded() -> None:
    sections = re.split(r"^## ", README, flags=re.M)
    titles = [s.split("\n", 1)[0] for s in sections]
    at = titles.index("Quick start")
    assert titles[at + 1] == "An agent loop governed by the ledger"
    code = re.search(r"```python\n(.*?)```", sections[at + 1], re.S)
    assert code is not None
    lines = [line for line in code.group(1).splitlines() if line.strip()]
    assert len(code.group(1).splitlines()) <= 40 and len(lines) >= 20
    scope: dict[str, object] = {}
    exec(compile(code.group(1), "README.md (agent loop)", "exec"), scope)


DOCS = sorted(
    d
    for d in (Path(__file__).resolve().parent.parent / "docs").glob("*.md")
    if "```python" in d.read_text()
)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_python_blocks_run_on_embedded(doc: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        # A real module: typing annotations (a graph's state) resolve in its namespace.
        module = types.ModuleType(f"docs_{doc.stem}_{i}")
        sys.modules[module.__name__] = module
        try:
            exec(compile(block, f"{doc.name} block {i + 1}", "exec"), module.__dict__)
        finally:
            del sys.modules[module.__name__]
