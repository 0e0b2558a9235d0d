"""Each operation is defined once: its Lua script, its builder and parser (protocol.py),
its result model (ledger/models/) and one typed method of SessionCore (session_calls.py).
The sync and asyncio faces, the scripts a ledger registers and the package's exports follow
with no line per operation; one body retries and translates for both faces."""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import shutil
import subprocess
import sys
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
    return Call(
        "probe", (keys.session,), (str(protocol.VERSION),), lambda r: Probed(int(r["epoch"]))
    )


def probe_call(self: SessionCore) -> Call[Probed]:  # session_calls.py: the session method
    """The session's epoch, read by the probe script."""
    return probe(self.keys)


PROBE_LUA = """-- probe.lua: a test's read-only operation: the session's epoch.
--
-- KEYS[1]  session hash
-- ARGV[1]  protocol version
--
-- Mode: read-only
-- Reply: epoch=<n>
-- Errors: LEDGER_NOSESSION.
-- Calls: HGET.
local ep = redis.call('HGET', KEYS[1], 'ep')
if not ep then fail('NOSESSION', NOSESSION) end
return reply({ 'epoch=' .. ep })
"""


@pytest.fixture
def with_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    lua = tmp_path / "lua"
    shutil.copytree(scripts.lua_dir(), lua)
    (lua / "probe.lua").write_text(PROBE_LUA)  # the script
    caches = (scripts.source, scripts.sha, scripts.definitions, scripts.spec)
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
    assert "probe" in scripts.NAMES and scripts.spec("probe").read_only
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


# --- a mutating operation added in four files, in a copy of the repository ----------------

PROBE_SCRIPT = """\
-- probe.lua: a test's mutating operation: an op that counts tokens and changes nothing.
--
-- KEYS[1]  session hash
-- KEYS[2]  partition tally         '<tag>:tally': the fleet's indicators
-- KEYS[3]  outcome hash            current generation of outcomes ('<tag>:out:<session>')
-- KEYS[4]  previous outcome hash   previous generation ('<tag>:old:<session>')
-- ARGV[1]  operation id            [A-Za-z0-9._:/@+=#-]{1,128}
-- ARGV[2]  epoch[@turn]            integer; older than the session's -> LEDGER_STALE; @turn:
--                                  a call of that turn (see `fence`)
-- ARGV[3]  session id              must name KEYS[1]
-- ARGV[4]  tokens                  1..1e8
--
-- Mode: mutating
-- Reply: status=ok|probed=<tokens>|epoch=<n>
-- Errors: LEDGER_BADARG, LEDGER_NOSESSION, LEDGER_STALE, LEDGER_OPREUSED, LEDGER_TURNHELD,
--         LEDGER_TURNLOST.
-- Calls: HMGET, TIME, HSET (of the op's outcome bucket).

local op, fp, epoch, tok = op_args('probe', false)
session_arg(ARGV[3])
local n = int_arg(ARGV[4], 'tokens', 1, 1e8)
if #ARGV ~= 4 then fail('BADARG', 'expected 4 arguments, got ' .. #ARGV) end

local key = KEYS[1]
local H, R = load(key, { 'ep', 'tn', 'gz', 'xp', 'lo', 'uo' }, 4)
local again = gate(recorded(op), H.ep, op, fp, epoch)
if again then return again end
fence(key, R[1], H.tn, tok)
return commit(key, now_ms(), op, fp, reply({ 'status=ok', 'probed=' .. n, 'epoch=' .. H.ep }),
  {}, { gz = H.gz, xp = H.xp, uo = R[2] or '' })
"""
PROBE_MODEL = '''

@dataclass(frozen=True)
class Probed:
    """The probe's result (tests/test_operations.py)."""

    tokens: int
    epoch: int
'''
PROBE_BUILDER = '''

def probe(keys: SessionKeys, op_id: str, epoch: Epoch, tokens: int) -> Call[Probed]:
    """A test's probe (tests/test_operations.py): counts ``tokens``, changes nothing."""

    def parse(r: Reply) -> Probed:
        return Probed(tokens=int(r["probed"]), epoch=int(r["epoch"]))

    return _mutating("probe", keys, (), op_id, epoch, [keys.session_id, _num(tokens)], parse)
'''
PROBE_METHOD = '''
    def probe_call(self, tokens: int, *, op_id: str | None = None) -> Call[Probed]:
        """A test's probe: counts ``tokens`` in a call (of the turn the handle holds)."""
        return protocol.probe(self.keys, _op(op_id), self._stamp(), tokens)

    probe = operation(probe_call)
'''
# What the copy's own code says of the probe, run there (its faces, its spec, its sample).
PROBE_CHECKS = """\
import uuid
from typing import assert_type

import ledger
from ledger import AsyncLedger, Ledger, Probed, SessionBudget, scripts
from tests.support import spec_calls

assert "probe" in scripts.NAMES and "probe" not in scripts.READ_ONLY
assert "Probed" in ledger.__all__ and "Probed" in ledger.models.__all__
spec = scripts.spec("probe")
assert not spec.read_only and spec.arg(4).range == (1, 10**8)
url = f"embedded://{uuid.uuid4().hex}"
with Ledger.from_url(url) as led:
    s = led.open_session("probe", SessionBudget(window=32_000, system_prompt=2_000))
    assert_type(s.probe(7), Probed)
    assert s.probe(7) == Probed(7, s.epoch)
    turn = s.begin_turn(1_000).turn  # the sample is a call of the open turn
    sample = spec_calls.sample("probe", spec_calls.Context(s.keys, s.epoch, turn, s._token))
    assert sample is not None and sample[1][2:] == ["probe", "100"], sample
    assert led._scripts["probe"](keys=list(sample[0]), args=sample[1]).startswith(b"status=ok")
    s.abort_turn()  # the asyncio handle below is another owner


async def faces() -> None:
    async with AsyncLedger.from_url(url) as aled:
        a = await aled.session("probe")
        assert await a.probe(8) == Probed(8, a.epoch)


import asyncio

asyncio.run(faces())
print("probe ok")
"""
COPIED = ("ledger", "lua", "tools", "tests", "docs", "pyproject.toml", "README.md")


def _insert(path: Path, after: str, text: str) -> None:
    source = path.read_text()
    assert source.count(after) == 1, (path, after)
    path.write_text(source.replace(after, after + text))


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.mark.slow
@pytest.mark.timeout(600)  # the copy's tests, and a cold mypy over the package
def test_a_mutating_operation_added_in_four_files_passes_the_checks(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    repo = tmp_path / "repo"
    for name in COPIED:
        if (root / name).is_dir():
            shutil.copytree(root / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(root / name, repo / name)
    before = _digests(repo)

    # The four files: the script, its builder, its result model, its session method.
    (repo / "lua" / "probe.lua").write_text(PROBE_SCRIPT)
    proto = repo / "ledger" / "protocol.py"
    _insert(proto, "    PartitionCheck,\n", "    Probed,\n")
    proto.write_text(proto.read_text() + PROBE_BUILDER)
    model = repo / "ledger" / "models" / "readings.py"
    _insert(model, "__all__ = [\n", '    "Probed",\n')
    model.write_text(model.read_text() + PROBE_MODEL)
    calls = repo / "ledger" / "session_calls.py"
    _insert(calls, "    Item,\n", "    Probed,\n")
    calls.write_text(calls.read_text() + PROBE_METHOD)
    after = _digests(repo)
    touched = {p for p in after if after[p] != before.get(p)}
    assert touched == {
        "lua/probe.lua",
        "ledger/protocol.py",
        "ledger/models/readings.py",
        "ledger/session_calls.py",
    }

    env = {**os.environ, "PYTHONPATH": str(repo)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False
        )

    # What is derived: the doc is generated (as ledger/_sync/ is), the rest is read.
    assert run(sys.executable, "tools/protocol_doc.py", "--check").returncode == 1
    assert run(sys.executable, "tools/protocol_doc.py").returncode == 0
    generated = _digests(repo)
    assert {p for p in generated if generated[p] != after.get(p)} == {"docs/protocol.md"}
    doc = (repo / "docs" / "protocol.md").read_text()
    assert "### `probe`" in doc and "| `probe` | 4 |" in doc

    checks = [
        [sys.executable, "tools/protocol_doc.py", "--check"],
        [sys.executable, "tools/unasync.py", "--check"],
        [sys.executable, "tools/legend.py", "--check"],
        [sys.executable, "-c", PROBE_CHECKS],
        [sys.executable, "-m", "ruff", "check", "--no-cache", "ledger"],  # the files touched
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "ledger"],
        [
            *(sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider"),
            *("-k", "not added_in_four_files", "tests/test_operations.py"),
            *("tests/test_specs.py", "tests/test_fuzz.py", "tests/test_protocol_doc.py"),
            *("tests/test_protocol.py", "tests/test_models.py", "tests/test_imports.py"),
        ],
    ]
    for args in checks:
        done = run(*args)
        assert done.returncode == 0, (args[:4], done.stdout[-3000:], done.stderr[-3000:])
    snippet = repo / "probe_typed.py"  # a user's code: strict mypy sees the new operation
    snippet.write_text(
        "from typing import assert_type\n\nfrom ledger import Probed, Session\n\n\n"
        "def use(s: Session) -> None:\n    assert_type(s.probe(3), Probed)\n"
        "    s.probe('3')  # error\n"
    )
    done = run(sys.executable, "-m", "mypy", "--strict", "--cache-dir", "cache", snippet.name)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "probe_typed.py:8:" in errors[0], done.stdout
