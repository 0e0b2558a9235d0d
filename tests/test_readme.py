"""The README stays true: its usage example runs, and its Quick start is two commands."""

from __future__ import annotations

import re
from pathlib import Path

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
