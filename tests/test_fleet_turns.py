"""One session, many processes (docs/agent.md#several-processes): turns served
alternately by two agent OS processes on a real redis-server, with a real `ledger
worker` compacting, the conversation shared the framework's own way (LangGraph and a
LangChain create_agent agent: a SqliteSaver checkpointer both processes open; the
Agents SDK: its Session, the ledger's governed one in Redis; the agent layer with no
framework: the app's own versioned table in SQLite, a turn's first admissions sent with
its begin), and the README's loop on a real Redis with a worker serving its prefix.

Each framework's run (examples/*_agent.py, 40 turns) has turns ending above and below
the high-water mark, drift injected on one turn (and repaired with gov.reconcile), the
same turn started on both processes at once, and the owner of one turn killed with -9
inside its tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, LedgerSettings
from tests.support import servers
from tests.test_readme import README, blocks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["langgraph", "langchain", "openai_agents", "plain"]
TURNS, DRIFT_AT, RACE_AT, KILL_AT, LEASE_S, TOLERANCE = 40, 17, 11, 23, 2.0, 8


@pytest.fixture(scope="module", params=EXAMPLES)
def fleet_run(
    request: pytest.FixtureRequest, redis_server: servers.RedisProcess
) -> tuple[list[dict[str, Any]], str, str]:
    example = ROOT / "examples" / f"{request.param}_agent.py"
    prefix, sid = f"fleet{uuid.uuid4().hex[:8]}", f"f-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [
            sys.executable,
            str(example),
            "--json",
            "--url",
            redis_server.url,
            "--session",
            sid,
            "--processes",
            "2",
            "--turns",
            str(TURNS),
            "--drift-at",
            str(DRIFT_AT),
            "--race-at",
            str(RACE_AT),
            "--kill-at",
            str(KILL_AT),
            "--lease",
            str(LEASE_S),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "LEDGER_PREFIX": prefix},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout), prefix, sid


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_forty_turns_on_two_processes_are_each_right(
    fleet_run: tuple[list[dict[str, Any]], str, str],
) -> None:
    rows, _, _ = fleet_run
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    assert not [r for r in rows if "error" in r], "no failed turn"
    # Both processes served turns, alternating (the crash's retry excepted).
    assert len({r["pid"] for r in rows}) >= 3  # two processes, and the one that replaced the dead
    for r in rows:
        assert r["max_sent"] <= r["window"], r
        if r["turn"] == DRIFT_AT:  # context added behind the ledger's back: flagged there
            assert r["flag"] == "drift" and r["drift"] > TOLERANCE and r["warned"] == 1, r
        else:
            assert abs(r["drift"]) <= TOLERANCE and r["flag"] == "none", r
        assert r["audit_clean"], r  # the flagged one repaired by gov.reconcile
        assert not any(r["billing_flagged"]), r  # what the model billed agrees
    high = [r["high"] for r in rows]
    assert any(high) and not all(high), "turns end above and below the high-water mark"


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_worker_summary_reaches_a_later_prompt_exactly_once(
    fleet_run: tuple[list[dict[str, Any]], str, str], redis_server: servers.RedisProcess
) -> None:
    rows, prefix, sid = fleet_run
    delivered = [s for r in rows for s in r["delivered"]]
    assert len(delivered) >= 8, "the worker compacted, again and again"
    assert len(delivered) == len(set(delivered)), "a summary applied twice"
    seen: set[str] = set()
    for r in rows:
        seen |= set(r["delivered"])
        # delivered to this turn: in its prompt; in a prompt: delivered, to this turn or before
        assert set(r["delivered"]) <= set(r["summaries_in_prompt"]) <= seen, r
    # Deliveries went to both processes.
    assert len({r["process"] for r in rows if r["delivered"]}) == 2
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        assert led.audit(sid).clean
        snap = led.session(sid).snapshot()
        assert snap.raw["kn"] <= len(delivered) + 1  # every compaction (but a queued last one)
        assert not snap.turn_open


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_turn_started_twice_and_a_killed_owner(
    fleet_run: tuple[list[dict[str, Any]], str, str],
) -> None:
    rows, _, _ = fleet_run
    race = rows[RACE_AT - 1]
    refused = race["raced"]
    # The second start was refused at begin_turn, naming the process that holds the turn.
    assert refused["error"] == "TurnInProgress" and refused["pid"] != race["pid"]
    assert refused["owner"].split(":")[-2] == str(race["pid"]) and refused["left_ms"] > 0
    assert abs(race["drift"]) <= TOLERANCE  # and it admitted nothing
    # The owner killed inside the tool: the other process's turn was clean without any
    # reconcile, after the dead turn was rolled back, within the lease (plus polling).
    crashed = rows[KILL_AT - 1]
    assert crashed["rolled_back"] is not None and crashed["flag"] == "none"
    assert LEASE_S * 0.5 <= crashed["takeover_s"] <= LEASE_S + 2.0, crashed
    after = rows[KILL_AT]
    assert after["flag"] == "none" and after["rolled_back"] is None


# --- the README's loop ----------------------------------------------------------------------


def readme_loop() -> str:
    return next(
        code
        for lang, code, _ in blocks(ROOT / "README.md")
        if lang == "python" and "Agent(" in code
    )


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_loop_is_right_in_a_fleet(
    redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    """The README's agent loop with only its URL changed, on a real Redis with a `ledger
    worker` (an LLM summarizer) serving its prefix: every turn's drift is 0, the worker's
    summary reaches the prompt, and its own `assert session.audit().clean` holds."""
    code = readme_loop()
    assert 'Ledger.from_url("embedded://readme")' in README
    code = code.replace('"embedded://readme"', repr(redis_server.url))
    prefix = f"readme{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "LEDGER_PREFIX": prefix}
    log = tmp_path / "worker.log"
    with log.open("wb") as fh:
        worker = subprocess.Popen(
            [sys.executable, "-m", "ledger.cli", "--url", redis_server.url, "worker",
             "--compactor", "tests.support.fleet_compactor:SUMMARIZER"],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60  # a fleet's worker is up before its agents' turns
    while b'"worker started"' not in log.read_bytes():
        assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    script = tmp_path / "readme_loop.py"
    summaries = (
        "print(sum(str(o.get('id', '')).startswith('summary-') for o in prompt "
        "if isinstance(o, dict)))\nsession.delete()"
    )
    script.write_text(code.replace("session.delete()", summaries))
    try:
        for _ in range(2):  # twice: it cleans up after itself
            out = subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                env=env, cwd=ROOT,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-3000:]
            lines = out.stdout.splitlines()
            assert len(lines) == 5 and all("(drift 0)" in line for line in lines[:4]), lines
            assert int(lines[4]) == 1, lines  # the worker's summary is in the prompt
    finally:
        worker.terminate()
        worker.wait(timeout=30)
