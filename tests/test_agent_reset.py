"""A hard reset between two turns does not crash the agent (docs/agent.md#after-a-hard-reset).

A real `ledger worker` whose compactor always raises (``tests.support.reset_agent:always_raises``,
each job dead after one delivery) and two agent OS processes (tests/support/reset_agent.py) serving
alternate turns of one session on a real redis-server, the plain agent layer or the
LangGraph adapter, on the sync or the asyncio face. Every turn ends over the high-water
mark, so its compaction fails until the worker hard-resets the session (the epoch
advances, every item goes) before the next turn, which the other process serves with its
handle's old epoch: that turn begins at the new epoch (``turn.reset_from_epoch``) and, its
admissions and the reconcile done, ends with the ledger equal to the real prompt (drift 0).
Before the fix, the turn after the reset raised StaleEpoch.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger import Agent, Ledger, LedgerSettings, SessionBudget
from ledger.errors import StaleEpoch
from ledger.testing import WorkerProc, spawn_worker
from tests.support import jobs, servers
from tests.support.agent_process import AgentProcess
from tests.support.reset_agent import ALWAYS_RAISES
from tests.test_adapters import load

ROOT = Path(__file__).resolve().parent.parent
TURNS = 3  # turn 1, then a reset before each of turns 2 and 3 (one on each process)


@pytest.fixture(scope="module")
def fleet(
    redis_server: servers.RedisProcess, tmp_path_factory: Any
) -> Iterator[tuple[str, Ledger]]:
    """A worker whose compactor always raises, and the test's own ledger (its prefix)."""
    prefix = f"rs{uuid.uuid4().hex[:8]}"
    env = {
        "LEDGER_REDIS_URL": redis_server.url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_WORKER_COMPACTOR": ALWAYS_RAISES,
        "LEDGER_WORKER_MAX_DELIVERIES": "1",
        "LEDGER_WORKER_CLAIM_IDLE_MS": "100",
        "PYTHONPATH": str(ROOT),
    }
    worker: WorkerProc = spawn_worker("reset", env, tmp_path_factory.mktemp("w") / "worker.log")
    led = Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix))
    try:
        worker.wait_started(60)
        yield prefix, led
    finally:
        worker.stop()
        led.close()


def resets(led: Ledger, sid: str) -> int:
    return int(jobs.session_hash(led, sid).get("x:resets", 0))


@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["agent", "langgraph"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_turn_after_a_hard_reset_runs_on_the_other_process(
    kind: str,
    face: str,
    fleet: tuple[str, Ledger],
    redis_server: servers.RedisProcess,
    tmp_path: Path,
) -> None:
    prefix, led = fleet
    sid = f"rs-{kind}-{face}-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("LEDGER_")}
    state = tmp_path / ("history.json" if kind == "agent" else "checkpoints.sqlite")
    args = [str(ROOT / "tests/support/reset_agent.py"), redis_server.url, prefix, sid, kind, face]
    args.append(str(state))
    procs: list[AgentProcess] = []
    rows: list[dict[str, Any]] = []
    try:
        procs = [AgentProcess(args, env) for _ in range(2)]  # both at the session's first epoch
        for n in range(1, TURNS + 1):
            if n > 1:  # the failed compactions of the last turn reach the hard reset
                deadline = time.monotonic() + 20
                while resets(led, sid) < n - 1:
                    assert time.monotonic() < deadline, (rows, resets(led, sid))
                    time.sleep(0.05)
            rows.append(procs[(n + 1) % 2].ask({"turn": n}))
            assert "error" not in rows[-1], rows  # (before the fix: StaleEpoch at turn 2)
    finally:
        for p in procs:
            p.close()
    assert len({r["pid"] for r in rows}) == 2  # alternating: each process met a reset
    first, *after = rows
    assert first["reset_from_epoch"] is None
    for before, r in zip(rows, after, strict=False):
        # the turn began at the session's new epoch, told the epoch its handle had
        assert r["reset_from_epoch"] is not None and r["epoch"] > r["reset_from_epoch"], r
        assert r["epoch"] == before["epoch"] + 1, (before, r)
    for r in rows:  # the ledger holds exactly the real prompt after each turn
        assert r["drift"] == 0 and r["flag"] == "none" and r["compaction_due"], r
        assert r["occupancy"] == r["counted"], r


# --- on the embedded backend: the core's steps, and the adapters' turn after a reset ---

EMBEDDED_BUDGET = SessionBudget(window=4_000, system_prompt=3, output_reserve=200)


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.embedded
def test_the_turn_after_a_reset_forgets_what_the_agent_believed_held() -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        session = led.open_session("forget", EMBEDDED_BUDGET)
        agent = Agent(session, words)
        objs = [{"id": "m1", "content": "one two three"}, {"id": "m2", "content": "four five"}]
        with agent.turn() as t:
            assert t.reset_from_epoch is None
            t.admit("working_memory", objs)
            t.end(["a b c", *objs])
        old = session.epoch
        assert len(agent.core.known) == 2
        led.session("forget").reset("test")  # another handle: this one's epoch is stale
        with agent.turn() as t:  # begun at the new epoch, no StaleEpoch
            assert t.reset_from_epoch == old and t.state is not None and t.state.reset
            assert agent.core.known == {}  # nothing is believed held
            again = t.admit("working_memory", objs)
            assert again.charged == 5  # charged again: the ledger held none of them
            t.end(["a b c", *objs])
        assert t.report is not None and t.report.drift == 0
        assert session.epoch == old + 1 == led.session("forget").snapshot().epoch
        with agent.turn() as t:  # the next turn: no reset between
            assert t.reset_from_epoch is None
            assert t.admit("working_memory", objs).charged == 0
            t.end(["a b c", *objs])


@pytest.mark.embedded
def test_a_second_stale_epoch_in_a_row_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        session = led.open_session("twice", EMBEDDED_BUDGET)
        agent = Agent(session, words)
        old = session.epoch
        led.session("twice").reset("test")
        begins: list[int] = []
        real = led.run

        def run(call: Any) -> Any:
            if call.script == "begin_turn":
                begins.append(session.epoch)
                if len(begins) == 2:  # the session reset again while the turn began
                    raise StaleEpoch("reset again")
            return real(call)

        monkeypatch.setattr(led, "run", run)
        with pytest.raises(StaleEpoch, match="reset again"), agent.turn():
            pass
        assert begins == [old, old + 1]  # began again once, at the epoch it adopted
        monkeypatch.undo()
        with agent.turn() as t:  # and the next turn begins
            assert t.reset_from_epoch is None
            t.end(["a b c"])


@pytest.mark.embedded
def test_langchain_middleware_turn_after_a_reset(tmp_path: Path) -> None:
    mod = load("langchain")
    sid = "lc-reset"
    w = mod.Server(f"embedded://{uuid.uuid4().hex}", sid, str(tmp_path / "c.sqlite"))
    rows = [w.turn(n) for n in (1, 2)]
    ledger = w.gov.agent.session.ledger
    old = w.gov.agent.session.epoch
    ledger.session(sid).reset("test")
    rows.append(w.turn(3))
    assert w.gov.agent.session.epoch == old + 1
    for r in rows:  # the reset turn too: the ledger set to the state it started from
        assert r["drift"] == 0 and r["flag"] == "none", r


@pytest.mark.embedded
def test_agents_sdk_turn_after_a_reset() -> None:
    mod = load("openai_agents")
    sid = "oa-reset"
    w = mod.Server(f"embedded://{uuid.uuid4().hex}", sid)  # (its own event loop)
    rows = [w.turn(n) for n in (1, 2)]
    ledger = w.gov.agent.session.ledger
    old = w.gov.agent.session.epoch

    async def reset() -> None:
        other = await ledger.session(sid)
        await other.reset("test")

    w.loop.run_until_complete(reset())
    rows.append(w.turn(3))
    assert w.gov.agent.session.epoch == old + 1
    for r in rows:  # the reset turn too: the ledger set to the history it sends
        assert r["drift"] == 0 and r["flag"] == "none", r
