"""Two releases of one protocol share their outcomes: a call that one release's scripts ran,
sent again with the same op id to the other's, gets its first reply back byte for byte, never
``OpReused`` and never applied twice.

That is what a fleet meets while it rolls from the previous release of this protocol
(``PREVIOUS``, taken from git history) to this one: a begin_turn sent by an upgraded process
under the op id an old one used (one owner serving from several places, docs/agent.md), a
batch retried by a process that restarted into the new release. The scripts of a release of
the same protocol may compute what they store in another way (fewer instructions, say), but
what they store and send must stay the same: an outcome's fingerprint and coded reply, the
session's fields, the replies. Each call below is built by this release's client (whose bytes
``tests/test_protocol.py`` pins), run by one release's scripts, then sent again to the
other's, alternating which goes first, over a session's life: admissions with texts, a
release, a reservation, turns that finish, end and abort, spans, a hard reset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from ledger import AdmissionRefused, Item, Ledger, LedgerSettings, SessionBudget, protocol, scripts
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


def test_each_release_replays_the_other_releases_outcomes(
    redis_server: servers.RedisProcess, previous_sources: dict[str, str]
) -> None:
    current = {n: scripts.source(n) for n in scripts.script_names()}
    assert set(current) >= set(previous_sources)
    changed = sorted(n for n in previous_sources if previous_sources[n] != current[n])
    r = redis.Redis.from_url(redis_server.url)
    ran: list[tuple[str, str]] = []
    settings = LedgerSettings(redis_url=redis_server.url, prefix="twins")
    with Ledger.from_settings(settings) as led:
        s = led.open_session("s", SessionBudget(window=60_000, system_prompt=500))

        def twice(call: Call[Any]) -> Any:
            """Run by one release, sent again to the other: the same reply, byte for byte."""
            first, then = (
                (previous_sources, current) if len(ran) % 2 else (current, previous_sources)
            )
            n = len(call.keys)
            got = r.eval(first[call.script], n, *call.keys, *call.args)
            again = r.eval(then[call.script], n, *call.keys, *call.args)
            assert again == got, (call.script, got, again)
            ran.append(
                (call.script, "previous first" if first is previous_sources else "this first")
            )
            return call.parse(protocol.decode(got))

        text = "the ledger keeps every worker on one budget of tokens " * 12
        twice(led.open_call("other", SessionBudget(window=9_000, system_prompt=100), None))
        twice(s.admit_call("working_memory", [Item("u1", 25)], texts=["hello"]))
        chunks = [Item(f"c{k}", 150) for k in range(12)]
        twice(s.admit_call("retrieval", chunks, texts=[text] * 12, partial=True))
        twice(s.release_call("retrieval", ["c0", "never-held"]))
        with pytest.raises(AdmissionRefused):  # (a refusal's outcome is kept too)
            twice(s.admit_call("retrieval", [Item("huge", 59_000)]))
        twice(s.reserve_call("scratchpad", "r1", 800))
        twice(s.settle_call("r1", 640))
        for turn in range(1, 4):
            started = twice(s.begin_turn_call(0))
            assert started.turn == turn
            twice(s.admit_call("working_memory", [Item(f"m{turn}", 30)], texts=["m"]))
            twice(s.record_span_call(turn, "summarize", 1_200, 300))
            if turn == 1:
                twice(s.finish_turn_call(turn, 4_000, [(f"t{turn}", 250, text)]))
            elif turn == 2:
                twice(s.admit_tool_result_call(f"t{turn}", 250, text))
                twice(s.end_turn_call(turn, 4_300))
            else:
                twice(s.abort_turn_call(turn))
        twice(s.reset_call("reason"))
        twice(s.admit_call("scratchpad", [Item("after", 10)], texts=["after the reset"]))
        twice(s.delete_call())
    assert {name for name, _ in ran} >= {"open", "admit", "release", "reserve", "settle",
                                         "begin_turn", "record_span", "finish_turn",
                                         "admit_tool", "end_turn", "abort_turn", "reset",
                                         "delete"}, ran  # fmt: skip
    assert {how for _, how in ran} == {"previous first", "this first"}
    print(f"\n{len(ran)} calls replayed across {PREVIOUS[0]} and this release; "
          f"scripts changed since: {', '.join(changed) or 'none'}")  # fmt: skip
