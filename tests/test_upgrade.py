"""Versions a fleet can see (issue 40): the upgrade runbook of docs/operations.md#upgrades,
run from the release deployed today to this one, and the refusals that name both versions.

Each earlier release (``RELEASES``: 0.1.0 at 033c8b3, protocol 1; 0.2.0 at a8b2daf,
protocol 2; 0.3.0 at fc950fe, protocol 3; 0.4.0 at 3a5ac54, protocol 4) is taken from git
history with ``git archive`` into a temporary directory and run with its own PYTHONPATH:
its ``ledger worker`` and its agents (tests/support/upgrade_agent.py) beside this
release's, on one real redis-server, turns of shared sessions alternating between all of
them, as the runbook says (workers one at a time, then agents). No turn fails, and
``ledger audit --strict`` is clean.

A client of an earlier protocol (``OLDER``) whose calls reach this release's scripts (its
Python client with these scripts in place of its own: what a client in another language
meets when it uses scripts it did not ship) is refused with ``LEDGER_VERSION`` naming both
versions, and nothing is written. A session of a stored layout these scripts do not read
(one a later release wrote) is refused the same way (``VersionMismatch``), on every backend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import (
    Item,
    Ledger,
    LedgerSettings,
    ScopeBudget,
    SessionBudget,
    VersionMismatch,
    cli,
    protocol,
    schema,
)
from ledger.scripts import lua_dir
from ledger.testing import WorkerProc, spawn_worker, standalone
from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
# The releases a fleet may run when it upgrades to this one: (commit, protocol version).
RELEASES = {
    "0.1.0": ("033c8b3", 1),  # protocol 1: no version carried, sessions of layout 1
    "0.2.0": ("a8b2daf", 2),  # protocol 2: the version carried, sessions of layout 2
    "0.3.0": ("fc950fe", 3),  # protocol 3: the two-call turn, budget scopes of layout 3
    "0.4.0": ("3a5ac54", 4),  # protocol 4: this one's (its scripts compute the same another way)
}
# The releases of an older protocol than this one's: their calls are refused by these scripts.
OLDER = [r for r, (_, version) in RELEASES.items() if version < protocol.VERSION]
AGENT = ROOT / "tests" / "support" / "upgrade_agent.py"
BUDGET = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)


@pytest.fixture(scope="module", params=list(RELEASES))
def old_release(request: pytest.FixtureRequest) -> str:
    release: str = request.param
    return release


@pytest.fixture(scope="module")
def old_tree(old_release: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package ``ledger`` of an earlier release, alone in a directory (its PYTHONPATH)."""
    return _archive(old_release, tmp_path_factory.mktemp(f"release-{old_release}"))


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package ``ledger`` of 0.2.0 (protocol 2), the release before this one."""
    return _archive("0.2.0", tmp_path_factory.mktemp("release-0.2.0-alone"))


def _archive(release: str, root: Path) -> Path:
    commit, version = RELEASES[release]
    # (from 0.3.0 on, the scripts are in the top-level lua/, read beside the package)
    has_lua = (
        subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:lua"], capture_output=True
        ).returncode
        == 0
        and subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:ledger/lua"], capture_output=True
        ).returncode
        != 0
    )
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "ledger", *(["lua"] if has_lua else [])],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(root)], input=tar.stdout, check=True)
    errors = (root / "ledger" / "errors.py").read_text()
    assert ("VersionMismatch" in errors) == (version > 1)  # the release it says it is
    return root


def _env(pythonpath: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def _agent(
    tree: Path | None, url: str, prefix: str, name: str, turns: int, sids: list[str], cwd: Path
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(AGENT), url, prefix, name, str(turns), *sids],
        env=_env(tree),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(p: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _worker(tree: Path | None, url: str, prefix: str, name: str, logs: Path) -> WorkerProc:
    env = {
        "LEDGER_REDIS_URL": url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_WORKER_CLAIM_IDLE_MS": "300",
        "LEDGER_WORKER_POLL_INTERVAL": "0.02",
        **({"PYTHONPATH": str(tree)} if tree is not None else {}),
    }
    w = spawn_worker(name, env, logs / f"{name}.log")
    w.wait_started()
    return w


@pytest.mark.redis
@pytest.mark.timeout(180)
def test_the_runbook_upgrades_a_running_fleet_from_the_deployed_release(
    old_release: str, old_tree: Path, tmp_path: Path
) -> None:
    """From each earlier release: sessions opened by the old release and by this one, each
    served by both side by side (this release's sessions keep the layout the previous one
    reads, docs/protocol.md#versions), the workers replaced one at a time."""
    with standalone("--appendonly", "yes") as server:  # (as production: audit --strict)
        _upgrade(server.url, old_release, old_tree, tmp_path)


def _upgrade(url: str, old_release: str, old_tree: Path, tmp_path: Path) -> None:
    prefix = f"up{uuid.uuid4().hex[:8]}"
    sids = [f"up-{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
    turns = 14  # per agent and session: 4 agents x 14 = 56 turns of each session
    old_worker = _worker(old_tree, url, prefix, "old-worker", tmp_path)
    # today's fleet: the deployed release's worker and two agents (one session opened
    # by each release: layouts 1 and 2 side by side)
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        led.open_session(sids[1], BUDGET)
        old_agents = [
            _agent(old_tree, url, prefix, f"old-{i}", turns, sids, tmp_path) for i in range(2)
        ]
        # the old fleet serves turns until the old worker has compacted a session
        deadline = time.monotonic() + 60
        while not old_worker.messages("job done"):
            assert time.monotonic() < deadline, old_worker.tail()
            time.sleep(0.05)
        # 2. the workers, one at a time: the new one is ready before the old one stops
        new_worker = _worker(None, url, prefix, "new-worker", tmp_path)
        assert old_worker.stop() == 0, old_worker.tail()
        # 3. the agents: new ones start while the old ones still serve turns
        new_agents = [
            _agent(None, url, prefix, f"new-{i}", turns, sids, tmp_path) for i in range(2)
        ]
        results = [_result(p) for p in (*old_agents, *new_agents)]
        assert new_worker.stop() == 0, new_worker.tail()
        for r, tree in zip(results, [old_tree, old_tree, ROOT, ROOT], strict=True):
            assert r["ledger"].startswith(str(tree)), r  # each ran the release it should
            assert r["errors"] == [] and r["turns"] == turns * len(sids), r
        layouts = [
            led.client.hget(led.keyspace.session(sid).session, schema.LAYOUT) for sid in sids
        ]
        # opened by the old release (protocol 1 stores no layout), and by this one
        old_layout = None if RELEASES[old_release][1] == 1 else b"2"
        assert layouts == [old_layout, str(protocol.LAYOUT).encode()]
        for sid in sids:
            snap = led.session(sid).snapshot()
            assert snap.last_ended_turn == snap.turn == 4 * turns and snap.turn_owner is None
            assert snap.raw[schema.COMPACTIONS_DONE] >= 1  # the workers compacted it
        # both workers compacted: the old one before it stopped, the new one after
        assert old_worker.messages("job done") and new_worker.messages("job done")
        # 4. check
        assert cli.main(["--url", url, "--prefix", prefix, "audit", "--strict"]) == cli.EXIT_OK


@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("old_release", OLDER)
def test_a_client_of_the_previous_protocol_is_refused_naming_both_versions(
    redis_server: servers.RedisProcess, old_release: str, tmp_path: Path
) -> None:
    """An earlier protocol's client with this release's scripts in place of its own: its
    calls carry another version (protocol 1: none), so every script refuses them
    (LEDGER_VERSION, both versions named) before it reads or writes anything: a new
    session is not created, an existing one not changed, a snapshot not answered."""
    version = RELEASES[old_release][1]
    tree = _archive(old_release, tmp_path)
    for old_scripts in (tree / "ledger" / "lua", tree / "lua"):  # (from 0.3.0: the latter)
        shutil.rmtree(old_scripts, ignore_errors=True)
    shutil.copytree(lua_dir(), tree / "ledger" / "lua")
    prefix = f"v1{uuid.uuid4().hex[:8]}"
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("existing", BUDGET)
        s.admit("working_memory", [Item("a", 100)])
        before = led.client.hgetall(s.keys.session)
        probe = f"""
import json
from ledger import Item, Ledger, LedgerError, LedgerSettings, SessionBudget
from ledger.client import Session

b = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)
out = []
with Ledger.from_settings(LedgerSettings(redis_url={redis_server.url!r}, prefix={prefix!r})) as led:
    h = Session(led, led.keyspace.session("existing"), {s.epoch})
    for name, call in [
        ("open", lambda: led.open_session("fresh", b)),
        ("admit", lambda: h.admit("working_memory", [Item("x", 1)])),
        ("snapshot", h.snapshot),
    ]:
        try:
            call()
            out.append([name, "accepted", ""])
        except LedgerError as exc:
            out.append([name, type(exc).__name__, str(exc)])
print(json.dumps(out))
"""
        done = subprocess.run(
            [sys.executable, "-c", probe],
            env=_env(tree),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert [name for name, _, _ in got] == ["open", "admit", "snapshot"]
        for name, kind, message in got:
            if version == 1:  # no VERSION code: its most general error, naming both
                assert kind == "LedgerError", (name, kind, message)
                assert "is of protocol 1 (it carries no version)" in message, message
            else:
                assert kind == "VersionMismatch", (name, kind, message)
                assert f"is of protocol {version}," in message, message
            assert f"these scripts are of protocol {protocol.VERSION}" in message, message
        assert led.client.exists(led.keyspace.session("fresh").session) == 0
        assert led.client.hgetall(s.keys.session) == before


def test_a_session_of_a_layout_these_scripts_do_not_read_is_refused(ledger: Ledger) -> None:
    """A session a later release wrote with a layout it declared incompatible (field lv
    above LAYOUT): every call is refused before it writes, naming both versions, instead
    of reading renamed fields as missing (the incident of issue 40)."""
    s = ledger.open_session(f"layout-{uuid.uuid4().hex[:6]}", BUDGET)
    assert ledger.client.hget(s.keys.session, schema.LAYOUT) == str(protocol.LAYOUT).encode()
    newer = protocol.LAYOUT + 1
    ledger.client.hset(s.keys.session, schema.LAYOUT, str(newer))
    before = ledger.client.hgetall(s.keys.session)
    calls = {
        "begin_turn": lambda: s.begin_turn(working_set=100),
        "admit": lambda: s.admit("working_memory", [Item("x", 10)]),
        "snapshot": s.snapshot,
        "audit": lambda: ledger.audit(s.id),
        "open": lambda: ledger.open_session(s.id, BUDGET),
        "reset": lambda: s.reset("upgrade"),
    }
    for name, call in calls.items():
        with pytest.raises(VersionMismatch, match=r"stored layout mismatch") as info:
            call()
        assert (info.value.kind, info.value.found, info.value.expected) == (
            "layout",
            newer,
            protocol.VERSION,
        ), name
        assert ledger.client.hgetall(s.keys.session) == before, name
    # A session of layout 1 (no lv: opened by protocol 1) is read and written as it is.
    ledger.client.hdel(s.keys.session, schema.LAYOUT)
    s.begin_turn(working_set=100)
    s.admit("working_memory", [Item("x", 10)])
    assert s.snapshot().items["working_memory"] == 1


def test_a_call_of_another_protocol_is_a_typed_refusal(ledger: Ledger) -> None:
    """The Python face of LEDGER_VERSION: VersionMismatch with both versions, nothing
    written (a call built for the next protocol reaching these scripts)."""
    s = ledger.open_session(f"proto-{uuid.uuid4().hex[:6]}", BUDGET)
    call = s.admit_call("working_memory", [Item("x", 10)])
    head = str(call.args[1]).replace(f"{protocol.VERSION}:", f"{protocol.VERSION + 1}:", 1)
    foreign = protocol.Call(
        call.script, call.keys, (call.args[0], head, *call.args[2:]), call.parse
    )
    before = ledger.client.hgetall(s.keys.session)
    with pytest.raises(VersionMismatch) as info:
        ledger.run(foreign)
    assert (info.value.kind, info.value.found, info.value.expected) == (
        "protocol",
        protocol.VERSION + 1,
        protocol.VERSION,
    )
    assert ledger.client.hgetall(s.keys.session) == before


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_scope_this_release_set_is_refused_by_the_previous_one_not_read_as_unbounded(
    redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    """During a rolling upgrade from 0.2.0, a tenant's scope set by this release (its
    config packed, layout 3) meets 0.2.0's reserve: 0.2.0 finds no config it reads and
    refuses (UnknownScope) instead of holding with no ceiling; nothing is written."""
    (tmp_path / "release").mkdir()
    old_tree = _archive("0.2.0", tmp_path / "release")  # (0.1.0 has no budget scopes)
    prefix = f"sc{uuid.uuid4().hex[:8]}"
    url = redis_server.url
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        led.set_scope("acme", ScopeBudget(window_ms=86_400_000, tokens=1_000))
        scope = led.keyspace.scope("acme")
        before = (led.client.hgetall(scope.hash), led.client.zrange(scope.holds, 0, -1))
        probe = f"""
import json
from ledger import CallCost, Consumer, Ledger, LedgerError, LedgerSettings, SessionBudget

with Ledger.from_settings(LedgerSettings(redis_url={url!r}, prefix={prefix!r})) as led:
    s = led.open_session("@acme/old", SessionBudget(window=100_000, system_prompt=10))
    try:
        cost = CallCost(model="m", input=5_000, output=0)
        s.reserve(Consumer.WORKING_MEMORY, "r1", 10, cost=cost)
        print(json.dumps(["accepted", ""]))
    except LedgerError as exc:
        print(json.dumps([type(exc).__name__, str(exc)]))
"""
        done = subprocess.run(
            [sys.executable, "-c", probe],
            env=_env(old_tree),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        kind, message = json.loads(done.stdout.strip().splitlines()[-1])
        assert kind == "UnknownScope" and "acme" in message, (kind, message)
        assert (led.client.hgetall(scope.hash), led.client.zrange(scope.holds, 0, -1)) == before


_PROBE = """
import json, sys
from ledger import Item, Ledger, LedgerError, LedgerSettings, SessionBudget, VersionMismatch

url, prefix, sid = sys.argv[1:4]
b = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)
out = []
with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
    for name, call in [
        ("open", lambda: led.open_session("fresh", b)),
        ("admit", lambda: led.open_session(sid, b).admit("working_memory", [Item("x", 1)])),
        ("begin_turn", lambda: led.open_session(sid, b).begin_turn(0)),
    ]:
        try:
            call()
            out.append([name, "accepted", None, None, None])
        except VersionMismatch as exc:
            out.append([name, "VersionMismatch", exc.kind, exc.found, exc.expected])
        except LedgerError as exc:
            out.append([name, type(exc).__name__, str(exc), None, None])
print(json.dumps(out))
"""


def _probe(tree: Path, url: str, prefix: str, sid: str, cwd: Path) -> list[list[Any]]:
    done = subprocess.run([sys.executable, "-c", _PROBE, url, prefix, sid], env=_env(tree),
                          cwd=cwd, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got: list[list[Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_protocol_2_and_3_share_their_sessions_while_a_fleet_upgrades(
    redis_server: servers.RedisProcess, previous_tree: Path, tmp_path: Path
) -> None:
    """a8b2daf with its own scripts beside this release on one server: protocol 3 keeps
    layout 2, so a session a8b2daf opened is served by this release's two-call turn, and
    one this release opened by a8b2daf's calls; a layout above 2 is refused to a8b2daf
    (VersionMismatch, layout) before it writes."""
    prefix = f"l2{uuid.uuid4().hex[:8]}"
    url = redis_server.url
    got = _probe(previous_tree, url, prefix, "theirs", tmp_path)
    assert [kind for _, kind, *_ in got] == ["accepted"] * 3  # its own session, its turn open
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        theirs = led.session("theirs")
        assert led.client.hget(theirs.keys.session, schema.LAYOUT) == b"2"
        st = theirs.begin_turn(0, takeover=True)  # (the probe left its turn open)
        done = theirs.finish_turn(st.turn, 600, [("call-1", 40, "grep: 3 matches")])
        assert done.tools == (("call-1", 40),) and done.report.turn == st.turn
        assert theirs.snapshot().turn_owner is None
        mine = led.open_session("mine", BUDGET)
        assert led.client.hget(mine.keys.session, schema.LAYOUT) == b"2" == b"%d" % protocol.LAYOUT
        got = _probe(previous_tree, url, prefix, "mine", tmp_path)
        assert [kind for _, kind, *_ in got] == ["accepted"] * 3
        assert mine.snapshot().items["working_memory"] == 1  # its admit, in this session
        newer = led.open_session("newer", BUDGET)
        led.client.hset(newer.keys.session, schema.LAYOUT, "3")  # (a later layout)
        before = led.client.hgetall(newer.keys.session)
        got = _probe(previous_tree, url, prefix, "newer", tmp_path)
        assert got[1:] == [
            [name, "VersionMismatch", "layout", 3, 2] for name in ("admit", "begin_turn")
        ]
        assert led.client.hgetall(newer.keys.session) == before


_HOLDER = """
import json, sys
from ledger import Item, Ledger, LedgerError, LedgerSettings, SessionBudget

url, prefix, sid = sys.argv[1:4]
b = SessionBudget(window=10_000, system_prompt=500, output_reserve=500)
out = []
with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
    s = led.open_session(sid, b)
    s.admit("working_memory", [Item("w1", 400)])
    t = s.begin_turn(0)
    print("ready", flush=True)
    sys.stdin.readline()  # (the new release stages its reset meanwhile)
    try:
        ended = s.end_turn(t.turn, 1_000)
        t2 = s.begin_turn(0)
        s.admit("working_memory", [Item("w2", 100)])
        ended2 = s.end_turn(t2.turn, 1_000)
        snap = s.snapshot()
        out = ["ok", ended.epoch, ended2.epoch, snap.epoch, sorted(snap.raw)]
    except LedgerError as exc:
        out = [type(exc).__name__, str(exc)]
print(json.dumps(out), flush=True)
"""


@pytest.mark.redis
@pytest.mark.timeout(120)
def test_a_reset_staged_by_this_release_does_not_trouble_0_3_0(
    redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    """0.3.0 (protocol 3) beside this release: a reset this release stages while 0.3.0's turn
    is open leaves a field (rz) 0.3.0 never reads: its turn ends, its next turn runs and its
    snapshot reads the session, all at the epoch it had (0.3.0 applies no staged reset);
    the audit is clean; this release's reset sent again (the worker's job claimed again)
    applies it, the turn over."""
    (tmp_path / "release").mkdir()
    tree = _archive("0.3.0", tmp_path / "release")
    prefix, sid = f"rz{uuid.uuid4().hex[:8]}", "mixed"
    url = redis_server.url
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, url, prefix, sid],
        env=_env(tree),
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "ready", holder.communicate()[1][-3000:]
        with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
            s = led.session(sid)
            e0 = s.epoch
            done = s.reset("failed_compactions", wait_ms=60_000, op_id="job-1-0")
            assert done.staged and done.epoch == e0
            holder.stdin.write("go\n")
            holder.stdin.flush()
            out, err = holder.communicate(timeout=60)
            assert holder.returncode == 0, err[-3000:]
            got = json.loads(out.strip().splitlines()[-1])
            assert got[:4] == ["ok", e0, e0, e0], got  # 0.3.0 went on at its epoch
            assert "rz" not in got[4]  # (its snapshot names the fields it knows)
            h = led.client.hgetall(s.keys.session)
            assert h[b"ep"] == str(e0).encode() and h[b"rz"].startswith(f"{e0}|".encode())
            assert led.audit(sid).clean
            again = led.session(sid).reset("failed_compactions", wait_ms=60_000, op_id="job-1-0")
            assert not again.staged and again.epoch == e0 + 1  # no turn open: applied
            assert b"rz" not in led.client.hgetall(s.keys.session)
    finally:
        if holder.poll() is None:
            holder.kill()
