"""Each operation is defined once: its Lua script, its builder and parser (protocol.py),
its result model (ledger/models/) and one typed method of SessionCore (session_calls.py).
The sync and asyncio faces, the scripts a ledger registers and the package's exports follow
with no line per operation; one body retries and translates for both faces."""

from __future__ import annotations

import ast
import inspect
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions as rex

import ledger
from ledger import (
    AsyncLedger,
    AsyncSession,
    BackendUnavailable,
    Ledger,
    LedgerError,
    LedgerSettings,
    Session,
    SessionBudget,
    UnknownSession,
    models,
    protocol,
    scripts,
)
from ledger.core import SessionCore, operation
from ledger.keys import SessionKeys
from ledger.protocol import Call
from tests.conftest import make_settings

# Scripts that a ledger or the worker runs itself (open_session, expire_due, audit,
# the worker's check of a partition), not a session.
LEDGER_SCRIPTS = {
    "open",
    "expire",
    "audit",
    "worker_check",
    "read_spill",
    "set_scope",
}  # Ledger methods

BUDGET = SessionBudget(window=32_000, system_prompt=2_000)


def _operations() -> dict[str, operation[Any, Any]]:
    return {n: v for n, v in vars(SessionCore).items() if isinstance(v, operation)}


def _scripts_built() -> dict[str, str]:
    """protocol function -> the script its Call names (read from protocol.py)."""
    tree = ast.parse(Path(protocol.__file__).read_text())
    out: dict[str, str] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("Call", "_mutating")
            ):
                continue
            # the script's name: the first argument, or the keyword script=
            named = [k.value for k in node.keywords if k.arg == "script"]
            first = node.args[0] if node.args else named[0] if named else None
            if isinstance(first, ast.Constant):
                out[fn.name] = first.value
    return out


def _protocol_used(build: Callable[..., Any]) -> set[str]:
    """The protocol functions a SessionCore builder calls."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(build)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "protocol"
    }


def test_script_names_are_the_lua_files() -> None:
    files = {p.stem for p in scripts.lua_dir().glob("*.lua")} - {"_common"}
    assert set(scripts.NAMES) == files and len(scripts.NAMES) == len(files)
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        assert set(led._scripts) == files


def test_every_script_has_a_builder_and_every_session_script_a_method_on_both_faces() -> None:
    built = _scripts_built()
    assert set(built.values()) == set(scripts.NAMES)  # one builder at least per script
    ops = _operations()
    reached = {built[f] for op in ops.values() for f in _protocol_used(op.build) if f in built}
    assert reached | LEDGER_SCRIPTS == set(scripts.NAMES)
    assert not reached & LEDGER_SCRIPTS
    assert len(ops) >= 14
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        s = Session(led, led.keyspace.session("faces"), 1)
        a = AsyncSession(AsyncLedger.from_url(led.settings.redis_url), s.keys, 1)
        for name, op in ops.items():
            assert op.build is getattr(SessionCore, f"{name}_call")
            for face, is_async in ((s, False), (a, True)):
                method = getattr(face, name)
                assert inspect.iscoroutinefunction(method) is is_async, (name, face)
                assert method.__name__ == name and method.__doc__ == op.build.__doc__
                assert method.__self__ is face
            assert getattr(Session, name) is op and getattr(AsyncSession, name) is op


def test_the_package_exports_every_model() -> None:
    assert set(models.__all__) <= set(ledger.__all__)
    assert len(ledger.__all__) == len(set(ledger.__all__))
    for name in ledger.__all__:
        assert getattr(ledger, name) is not None
    results = {
        inspect.signature(op.build, eval_str=True).return_annotation.__args__[0]
        for op in _operations().values()
    }
    assert {r.__name__ for r in results} <= set(models.__all__)


# --- an operation added in the four places, with no other file touched -------------------


@dataclass(frozen=True)
class Probed:  # ledger/models/: the result
    epoch: int


def probe(keys: SessionKeys) -> Call[Probed]:  # protocol.py: builder and parser
    return Call("probe", (keys.session,), (), lambda r: Probed(int(r["epoch"])))


def probe_call(self: SessionCore) -> Call[Probed]:  # session_calls.py: the session method
    """The session's epoch, read by the probe script."""
    return probe(self.keys)


PROBE_LUA = """-- probe.lua: a test's read-only operation: the session's epoch.
local ep = redis.call('HGET', KEYS[1], 'ep')
if not ep then fail('NOSESSION', NOSESSION) end
return reply({ 'epoch=' .. ep })
"""


@pytest.fixture
def with_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    lua = tmp_path / "lua"
    shutil.copytree(scripts.lua_dir(), lua)
    (lua / "probe.lua").write_text(PROBE_LUA)  # the script
    caches = (scripts.source, scripts.sha, scripts.definitions)
    monkeypatch.setattr(scripts, "lua_dir", lambda: lua)
    monkeypatch.setattr(scripts, "NAMES", scripts.script_names())
    monkeypatch.setattr(SessionCore, "probe_call", probe_call, raising=False)
    monkeypatch.setattr(SessionCore, "probe", operation(probe_call), raising=False)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


@pytest.mark.usefixtures("with_probe")
async def test_an_operation_added_in_four_places_runs_on_both_faces(
    settings: LedgerSettings,
) -> None:
    assert "probe" in scripts.NAMES
    sid = f"probe-{uuid.uuid4().hex[:8]}"
    with Ledger.from_settings(settings) as led:
        s = led.open_session(sid, BUDGET)
        assert s.probe() == Probed(s.epoch)  # type: ignore[attr-defined]
        before = s.epoch
        s.reset("probe")  # the handle adopts the new epoch
        assert s.epoch == before + 1
        assert led.run_many([s.probe_call(), s.snapshot_call()])[0] == Probed(s.epoch)  # type: ignore[attr-defined]
        async with AsyncLedger.from_settings(settings) as aled:
            a = await aled.session(sid)
            assert inspect.iscoroutinefunction(a.probe)  # type: ignore[attr-defined]
            assert await a.probe() == Probed(s.epoch)  # type: ignore[attr-defined]
            s.refresh()
            s.delete()
            with pytest.raises(UnknownSession):
                await a.probe()  # type: ignore[attr-defined]


# --- one retry body for both faces --------------------------------------------------------


def _flaky(
    monkeypatch: pytest.MonkeyPatch, obj: object, name: str, fails: int, error: Exception
) -> list[int]:
    """Make obj.name (sync or async) fail with `error` its first `fails` times; returns
    the list whose one element counts the tries."""
    real = getattr(obj, name)
    tries = [0]

    def fail() -> None:
        tries[0] += 1
        if tries[0] <= fails:
            raise error

    def sync(*args: Any) -> Any:
        fail()
        return real(*args)

    async def asyncio(*args: Any) -> Any:
        fail()
        return await real(*args)

    monkeypatch.setattr(obj, name, asyncio if inspect.iscoroutinefunction(real) else sync)
    return tries


@pytest.mark.parametrize("batch", [False, True], ids=["call", "batch"])
@pytest.mark.parametrize(
    ("fails", "error", "tries", "raised"),
    [
        (2, rex.ConnectionError("cut"), 3, None),  # transient: tried again, then it works
        (9, rex.TimeoutError("slow"), 4, BackendUnavailable),  # retry_attempts=4 in all
        (1, rex.ResponseError("bad"), 1, LedgerError),  # not transient: never again
    ],
    ids=["recovers", "gives-up", "not-transient"],
)
async def test_both_faces_retry_and_translate_alike(
    monkeypatch: pytest.MonkeyPatch,
    batch: bool,
    fails: int,
    error: Exception,
    tries: int,
    raised: type[LedgerError] | None,
) -> None:
    settings = make_settings(
        f"embedded://{uuid.uuid4().hex}",
        retry_attempts=4,
        retry_initial_backoff=0.001,
        retry_max_backoff=0.002,
    )
    with Ledger.from_settings(settings) as led:
        s = led.open_session("flaky", BUDGET)
        async with AsyncLedger.from_settings(settings) as aled:
            a = await aled.session("flaky")

            async def sync_face() -> object:
                return led.run_many([s.snapshot_call()]) if batch else s.snapshot()

            async def async_face() -> object:
                return await aled.run_many([a.snapshot_call()]) if batch else await a.snapshot()

            for face, run in ((led, sync_face), (aled, async_face)):
                # a batch is one MULTI/EXEC: the whole of it fails and is sent again
                target, name = (face, "_send_batch") if batch else (face.client, "evalsha")
                count = _flaky(monkeypatch, target, name, fails, error)
                if raised is None:
                    assert await run()
                else:
                    with pytest.raises(raised) as info:
                        await run()
                    assert info.value.__cause__ is error
                    assert isinstance(info.value, BackendUnavailable) is (
                        raised is BackendUnavailable
                    )
                assert count[0] == tries, face
                monkeypatch.undo()
