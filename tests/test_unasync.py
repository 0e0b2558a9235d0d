"""The sync faces are generated from their asyncio sources (``tools/unasync.py``)."""

from __future__ import annotations

import importlib.util
import inspect
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ledger import (
    AsyncLedger,
    AsyncSession,
    InvalidArgument,
    Ledger,
    PartitionCheck,
    Session,
    SessionBudget,
    protocol,
)
from ledger.core import collect
from tests.support import tools

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "unasync.py"


unasync = tools.load("unasync")


def test_sync_faces_are_generated_from_the_async_ones() -> None:
    assert {(t.source, t.target) for t in unasync.TWINS} == {
        ("ledger/_async/client.py", "ledger/_sync/client.py"),
        ("ledger/_async/agent.py", "ledger/_sync/agent.py"),
        ("ledger/_async/langgraph.py", "ledger/_sync/langgraph.py"),
        ("ledger/_async/langchain.py", "ledger/_sync/langchain.py"),
    }
    assert {p.name for p in (ROOT / "ledger" / "_async").glob("*.py")} - {"__init__.py"} == {
        p.name for p in (ROOT / "ledger" / "_sync").glob("*.py")
    } - {"__init__.py"}  # every source has its twin, under the same name
    assert unasync.main(["--check"]) == 0
    for twin in unasync.TWINS:  # the first line says what made the file, and from what
        first = (ROOT / twin.target).read_text().splitlines()[0]
        assert "GENERATED" in first and twin.source in first, first
    run = [sys.executable, str(TOOL), "--check"]
    assert subprocess.run(run, cwd=ROOT, timeout=60).returncode == 0


def test_the_generator_is_not_in_the_package() -> None:
    assert importlib.util.find_spec("ledger._unasync") is None
    assert not list((ROOT / "ledger").rglob("*unasync*"))


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of every source and generated face, the generator pointed at it."""
    for t in unasync.TWINS:
        for name in (t.source, t.target):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(unasync, "ROOT", tmp_path)
    assert unasync.main(["--check"]) == 0
    return tmp_path


@pytest.mark.parametrize("twin", unasync.TWINS, ids=lambda t: t.target)
def test_a_hand_edit_of_a_generated_face_is_caught(
    twin: object, tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tree / twin.target  # type: ignore[attr-defined]
    good = target.read_text()
    target.write_text(good.replace("def ", "def  ", 1))
    assert unasync.stale(twin)
    assert unasync.main(["--check"]) == 1
    assert f"{twin.target} is stale" in capsys.readouterr().err  # type: ignore[attr-defined]
    assert target.read_text() != good  # the check writes nothing
    assert unasync.main([]) == 0
    assert target.read_text() == good and unasync.main(["--check"]) == 0


@pytest.mark.parametrize("twin", unasync.TWINS, ids=lambda t: t.source)
def test_an_edit_of_a_source_not_generated_is_caught(
    twin: object, tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, target = tree / twin.source, tree / twin.target  # type: ignore[attr-defined]
    before = target.read_text()
    source.write_text(source.read_text() + "\n\nasync def added() -> None:\n    await x()\n")
    assert unasync.main(["--check"]) == 1
    assert f"{twin.target} is stale" in capsys.readouterr().err  # type: ignore[attr-defined]
    assert target.read_text() == before  # the check writes nothing
    assert unasync.main([]) == 0
    assert target.read_text().endswith("\n\ndef added() -> None:\n    x()\n")
    assert unasync.main(["--check"]) == 0


def public(cls: type) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(v)
        for n, v in vars(cls).items()
        if callable(v) and not n.startswith("_") and n not in ("close", "aclose")
    }


@pytest.mark.parametrize(("sync", "aio"), [(Ledger, AsyncLedger), (Session, AsyncSession)])
def test_both_faces_have_the_same_methods(sync: type, aio: type) -> None:
    got, want = public(sync), public(aio)
    assert got.keys() == want.keys() and "run_many" in public(Ledger)
    for name, sig in want.items():
        assert str(got[name]).replace("Async", "") == str(sig).replace("Async", ""), name
    assert callable(Ledger.close) and inspect.iscoroutinefunction(AsyncLedger.aclose)


async def test_the_asyncio_face_checks_partitions_and_sends_plain_pipelines(
    aledger: AsyncLedger, backend: str, budget: SessionBudget
) -> None:
    with pytest.raises(InvalidArgument):
        await aledger.check_partition(aledger.keyspace.partitions, "g", 5)
    assert await aledger.check_partition(1, "g", 5) == PartitionCheck(None, True)  # no group
    if backend == "cluster":  # redis-py pipelines no EVALSHA on a cluster
        return
    s = await aledger.open_session(f"s-{uuid.uuid4().hex[:8]}", budget)
    calls = [s.snapshot_call(), protocol.audit(s.keys)]
    await aledger.client.script_flush()  # each call meets NOSCRIPT, loads and is sent again
    raws = await aledger._send_batch(calls, transaction=False)
    snap, report = collect(calls, raws, return_exceptions=False)
    assert (snap.epoch, snap.window, snap.free) == (
        s.epoch,
        budget.window,
        (await s.snapshot()).free,
    )
    assert report.clean
