"""The faces' operations keep their static types with no line per operation: mypy
(strict) sees ``session.admit(...)`` as ``Admitted`` and ``await asession.admit(...)``
as ``Admitted``, with the builder's parameters; never ``Any``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.core import SessionCore, operation

OPS = sorted(n for n, v in vars(SessionCore).items() if isinstance(v, operation))

# Lines marked `# error` must be refused, and only they.
CHECKED = """\
from collections.abc import Callable, Coroutine
from typing import Any, assert_type

from ledger import Admitted, AsyncSession, Deleted, Item, Session, Snapshot
from ledger.protocol import Call


def sync_face(s: Session) -> None:
    assert_type(s.admit("retrieval", [Item("a", 1)], partial=True), Admitted)
    assert_type(s.snapshot(), Snapshot)
    assert_type(s.admit_call("retrieval", []), Call[Admitted])
    assert_type(s.delete, Callable[..., Deleted])  # error
    s.admit("retrieval", [], partal=True)  # error
    s.admit("retrieval")  # error
    count: int = s.snapshot()  # error
    s.snapshot().no_such_field  # error


async def async_face(a: AsyncSession) -> None:
    assert_type(await a.admit("retrieval", [Item("a", 1)]), Admitted)
    assert_type(a.snapshot, Callable[[], Coroutine[Any, Any, Snapshot]])
    snap: Snapshot = a.snapshot()  # error
    await a.settle("r1", "many")  # error
"""


def _mypy(tmp_path: Path, source: str) -> list[str]:
    (tmp_path / "snippet.py").write_text(source)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", "cache", "snippet.py"],
        cwd=tmp_path,  # no project config: the snippet only, as a user's code
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert "snippet.py" in done.stdout, done.stdout + done.stderr
    return done.stdout.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(300)  # a cold mypy run over ledger and its dependencies
def test_operations_keep_their_types_on_both_faces(tmp_path: Path) -> None:
    assert len(OPS) >= 14
    lines = CHECKED.splitlines()
    lines += ["", "", "def reveal(s: Session, a: AsyncSession) -> None:"]
    at: dict[str, int] = {}  # operation -> line of its first reveal_type
    for name in OPS:
        at[name] = len(lines) + 1
        lines += [f"    reveal_type(s.{name}_call)", f"    reveal_type(s.{name})"]
        lines.append(f"    reveal_type(a.{name})")
    out = _mypy(tmp_path, "\n".join(lines) + "\n")

    errors = {int(line.split(":")[1]) for line in out if ": error:" in line}
    marked = {i for i, line in enumerate(CHECKED.splitlines(), 1) if line.endswith("# error")}
    assert errors == marked, "\n".join(out)

    revealed = {
        int(line.split(":")[1]): line.split('Revealed type is "', 1)[1].rstrip('"')
        for line in out
        if "Revealed type is" in line
    }
    for name, first in at.items():
        call, sync, coro = (revealed[first + i] for i in range(3))
        # the result: a class of one of ledger/models/'s modules
        m = re.fullmatch(r"def (\(.*\)) -> ledger\.protocol\.Call\[(ledger\.models\.\w+\.\w+)\]",
                         call)  # fmt: skip
        assert m, (name, call)
        params, result = m.groups()
        assert sync == f"def {params} -> {result}", name
        assert coro == f"def {params} -> typing.Coroutine[Any, Any, {result}]", name
