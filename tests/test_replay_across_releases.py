"""Two releases of one protocol share their outcomes and store the same: a call that one
release's scripts ran, sent again with the same op id to the other's, gets its first reply
back byte for byte and changes nothing, never ``OpReused`` and never applied twice; and a
session whose calls the previous release ran first holds what one whose calls this release
ran first holds.

That is what a fleet meets while it rolls from the previous release of this protocol
(``PREVIOUS``, taken from git history) to this one: a begin_turn sent by an upgraded process
under the op id an old one used (one owner serving from several places, docs/agent.md), a
batch retried by a process that restarted into the new release. The scripts of a release of
the same protocol may compute what they store in another way (fewer instructions, say), but
what they store and send must stay the same: an outcome's fingerprint and coded reply, the
session's fields, the replies. Each call below is built by this release's client (whose bytes
``tests/test_protocol.py`` pins) over a session's life: admissions with texts, a release, a
refusal, a reservation, turns that finish, end and abort, spans, a hard reset, a delete."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger import AdmissionRefused, Item, Ledger, LedgerSettings, SessionBudget, protocol, scripts
from ledger.client import Session
from ledger.protocol import Call
from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS = ("0.4.0", "3a5ac54")  # the previous release of this protocol (4)


@pytest.fixture(scope="module")
def previous_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every script's text as the previous release sends it (its own assembly of lua/)."""
    root = tmp_path_factory.mktemp("previous")
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS[1], "ledger", "lua"],
                         capture_output=True, check=True)  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(root)], input=tar.stdout, check=True)
    probe = (
        "import json; from ledger import protocol, scripts; print(json.dumps("
        "[protocol.VERSION, {n: scripts.source(n) for n in scripts.script_names()}]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(root)},
                          capture_output=True, text=True, check=True, cwd=root)  # fmt: skip
    version, sources = json.loads(done.stdout)
    assert version == protocol.VERSION, (
        f"{PREVIOUS[0]} is of protocol {version}, this release of {protocol.VERSION}: name "
        "the previous release of this protocol in PREVIOUS (tests/test_upgrade.py covers "
        "upgrades across protocols)"
    )
    return dict(sources)


def _state(r: redis.Redis, pattern: str) -> dict[bytes, object]:
    """Every key of the pattern with its value (not DUMP's bytes: a hash table's order
    moves as a read rehashes it)."""
    read = {b"hash": r.hgetall, b"zset": lambda k: r.zrange(k, 0, -1, withscores=True),
            b"string": r.get, b"stream": r.xrange, b"set": r.smembers}  # fmt: skip
    return {k: read[r.type(k)](k) for k in sorted(r.scan_iter(match=pattern, count=1000))}


def _fields(r: redis.Redis, key: str) -> dict[bytes, bytes]:
    """A hash's fields, Redis's clock (13-digit milliseconds) masked, and an outcome
    record's fingerprint (its call's epoch, a session's own, is signed in it)."""
    fp = {
        f: re.sub(rb"(\x1e[0-9a-f]{14})[0-9a-f]{12}", rb"\1<fp>", v)
        for f, v in r.hgetall(key).items()
    }
    return {f: re.sub(rb"(?<![0-9a-f])\d{13}(?![0-9a-f])", b"<ms>", v) for f, v in fp.items()}


def test_each_release_replays_the_other_releases_outcomes(
    redis_server: servers.RedisProcess, previous_sources: dict[str, str]
) -> None:
    """Each call on two sessions: on one, the previous release's scripts run it first and
    this release's get it again; on the other, the other way round. The replay is the first
    reply byte for byte and changes no key of the partition; in the end both sessions hold
    the same fields (Redis's clock aside) and the same outcome records."""
    current = {n: scripts.source(n) for n in scripts.script_names()}
    assert set(current) >= set(previous_sources)
    changed = sorted(n for n in previous_sources if previous_sources[n] != current[n])
    assert changed, f"no script differs from {PREVIOUS[0]}'s: PREVIOUS names the wrong release"
    r = redis.Redis.from_url(redis_server.url)
    orders = {"a": (previous_sources, current), "b": (current, previous_sources)}
    ran: set[str] = set()
    settings = LedgerSettings(redis_url=redis_server.url, prefix="twins")
    with Ledger.from_settings(settings) as led:
        budget = SessionBudget(window=60_000, system_prompt=500)
        token = "ab" * 16  # (one owner for both: the lease's stored fields alike)
        handles = {
            n: led.open_session(n, budget, owner="twin", owner_token=token, op_id="op-0")
            for n in orders
        }
        tag = handles["a"].keys.session.rsplit(":s:", 1)[0]
        steps = 0

        def twice(make: Callable[[Session], Call[Any]]) -> Any:
            """The same call (the same op id) on each session, in each session's order."""
            nonlocal steps
            steps += 1
            parsed = []
            for name, (first, then) in orders.items():
                call = make(handles[name])  # (its op id, ARGV[1], the same on both)
                call = dataclasses.replace(call, args=(f"op-{steps}", *call.args[1:]))
                n = len(call.keys)
                got = r.eval(first[call.script], n, *call.keys, *call.args)
                before = _state(r, f"{tag}:*")
                again = r.eval(then[call.script], n, *call.keys, *call.args)
                assert again == got, (name, call.script, got, again)
                assert _state(r, f"{tag}:*") == before, (name, call.script, "applied again")
                ran.add(call.script)
                try:
                    parsed.append(call.parse(protocol.decode(got)))
                except AdmissionRefused as exc:
                    parsed.append(exc)
            return parsed[0]

        text = "the ledger keeps every worker on one budget of tokens " * 12
        small = SessionBudget(window=9_000, system_prompt=100)
        twice(lambda h: led.open_call(f"other-{h.id}", small, None))
        twice(lambda h: h.admit_call("working_memory", [Item("u1", 25)], texts=["hello"]))
        chunks = [Item(f"c{k}", 150) for k in range(12)]
        twice(lambda h: h.admit_call("retrieval", chunks, texts=[text] * 12, partial=True))
        twice(lambda h: h.release_call("retrieval", ["c0", "never-held"]))
        refused = twice(lambda h: h.admit_call("retrieval", [Item("huge", 59_000)]))
        assert isinstance(refused, AdmissionRefused)  # (a refusal's outcome is kept too)
        twice(lambda h: h.reserve_call("scratchpad", "r1", 800))
        twice(lambda h: h.settle_call("r1", 640))
        for turn in range(1, 4):
            assert twice(lambda h: h.begin_turn_call(0)).turn == turn
            twice(
                lambda h, t=turn: h.admit_call("working_memory", [Item(f"m{t}", 30)], texts=["m"])
            )
            twice(lambda h, t=turn: h.record_span_call(t, "summarize", 1_200, 300))
            if turn == 1:
                twice(lambda h, t=turn: h.finish_turn_call(t, 4_000, [(f"t{t}", 250, text)]))
            elif turn == 2:
                twice(lambda h, t=turn: h.admit_tool_result_call(f"t{t}", 250, text))
                twice(lambda h, t=turn: h.end_turn_call(t, 4_300))
            else:
                twice(lambda h, t=turn: h.abort_turn_call(t))
        twice(lambda h: h.reset_call("reason"))
        twice(lambda h: h.admit_call("scratchpad", [Item("after", 10)], texts=["after the reset"]))
        a, b = (handles[n].keys for n in orders)
        for key in ("session", "content", "order", "outcomes", "outcomes_old"):
            fa, fb = _fields(r, getattr(a, key)), _fields(r, getattr(b, key))
            assert fa == fb, key
        twice(lambda h: h.delete_call())
    assert ran >= {"open", "admit", "release", "reserve", "settle", "begin_turn", "record_span",
                   "finish_turn", "admit_tool", "end_turn", "abort_turn", "reset",
                   "delete"}, ran  # fmt: skip
    print(f"\n{steps} calls, each run by one release and replayed by the other, both ways; "
          f"scripts changed since {PREVIOUS[0]}: {', '.join(changed)}")  # fmt: skip
