"""The sync faces are generated from their asyncio sources (``ledger._unasync``)."""

from __future__ import annotations

import inspect
import shutil
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
    _unasync,
    protocol,
)
from ledger.core import collect


def test_sync_faces_are_generated_from_the_async_ones() -> None:
    assert {(t.source, t.target) for t in _unasync.TWINS} == {
        ("aio.py", "client.py"),
        ("agent/aio.py", "agent/sync.py"),
    }
    assert _unasync.main(["--check"]) == 0


@pytest.mark.parametrize("twin", _unasync.TWINS, ids=lambda t: t.target)
def test_a_hand_edit_of_a_generated_face_is_caught(
    twin: _unasync.Twin,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for t in _unasync.TWINS:
        for name in (t.source, t.target):
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(_unasync.PACKAGE / name, tmp_path / name)
    monkeypatch.setattr(_unasync, "PACKAGE", tmp_path)
    assert _unasync.main(["--check"]) == 0
    target = tmp_path / twin.target
    good = target.read_text()
    target.write_text(good.replace("def ", "def  ", 1))
    assert _unasync.stale(twin)
    assert _unasync.main(["--check"]) == 1
    assert f"ledger/{twin.target} is stale" in capsys.readouterr().err
    assert target.read_text() != good  # the check writes nothing
    assert _unasync.main([]) == 0
    assert target.read_text() == good and _unasync.main(["--check"]) == 0


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
