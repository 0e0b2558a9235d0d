"""A worker's summary is counted by the agent that receives it (docs/compaction.md#the-
summary-reaches-the-agent): agents with different counters or framing share one worker
with drift 0. The recount itself (compact.lua: a summary replacing itself in the open
turn) on every backend: only the summary's tokens change, no compaction is counted, and
a rollback of the turn puts the compactor's count back."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import Agent, Consumer, Item, Ledger, LedgerSettings, SessionBudget
from ledger.agent import TiktokenCounter
from ledger.testing import spawn_worker
from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
W = Consumer.WORKING_MEMORY
SYSTEM = "You are a helpful assistant."


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def test_a_recount_changes_the_summary_alone_and_rolls_back(ledger: Ledger) -> None:
    budget = SessionBudget(
        window=20_000, system_prompt=500, output_reserve=1_000, compaction="agent"
    )
    s = ledger.open_session(f"recount/{uuid.uuid4().hex[:12]}", budget)
    s.admit(W, [Item("w1", 2_000), Item("w2", 2_000)])
    assert s.compact(["w1", "w2"], Item("sum", 300, 1000)).compacted
    before = {_text(k): _text(v) for k, v in ledger.client.hgetall(s.keys.session).items()}
    t = s.begin_turn(0)
    done = s.compact([(W, "sum")], Item("sum", 304, 1000))
    assert done.outcome == "recounted" and not done.compacted
    held = {i.id: i for i in ledger.items(s.id)}
    assert held["sum"].tokens == 304 and held["sum"].priority == 1000
    after = {_text(k): _text(v) for k, v in ledger.client.hgetall(s.keys.session).items()}
    assert after["kn"] == before["kn"] and after["kf"] == before["kf"] == "0"
    assert int(after["a_w"]) == int(before["a_w"]) + 4
    s.abort_turn()  # rolled back: the compactor's count again
    assert {i.id: i.tokens for i in ledger.items(s.id)}["sum"] == 300
    t = s.begin_turn(0)
    assert s.compact([(W, "sum")], Item("sum", 296, 1000)).outcome == "recounted"
    s.end_turn(t.turn, 500 + 296)
    assert {i.id: i.tokens for i in ledger.items(s.id)}["sum"] == 296
    assert ledger.audit(s.id).clean


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_agents_with_different_framing_share_one_worker_with_drift_0(
    redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    """One `ledger worker` whose summarizer counts with no item overhead serves two
    agents, one framing each object with 0 tokens, one with 4: every turn of both ends with
    drift 0 (judged with tolerance 0), and the second agent's summaries hold its count."""
    prefix = f"rc{uuid.uuid4().hex[:8]}"
    env = {
        "LEDGER_REDIS_URL": redis_server.url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_WORKER_COMPACTOR": "tests.support.fleet_compactor:SUMMARIZER",
        "PYTHONPATH": str(ROOT),
    }
    worker = spawn_worker("w1", env, tmp_path / "worker.log")
    try:
        worker.wait_started(60)
        counter = TiktokenCounter()
        settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
        with Ledger.from_settings(settings) as led:

            def session(overhead: int) -> Any:  # (the system prompt framed as an object too)
                budget = SessionBudget(
                    window=2_000, system_prompt=counter(SYSTEM) + overhead, framing_tolerance=0
                )
                return led.open_session(f"rc-{overhead}", budget)

            agents = {o: Agent(session(o), counter, item_overhead=o) for o in (0, 4)}
            prompts: dict[int, list[Any]] = {0: [], 4: []}
            delivered: dict[int, list[str]] = {0: [], 4: []}
            for n in range(8):
                for overhead, agent in agents.items():
                    with agent.turn() as turn:
                        prompt = turn.apply(prompts[overhead])
                        delivered[overhead] += [o["id"] for o in turn.summaries]
                        msg = {"id": f"m{n}", "content": "word " * 300}
                        prompt += turn.admit("working_memory", [msg]).kept
                        turn.prompt([SYSTEM, *prompt])
                        prompts[overhead] = prompt
                    assert turn.report.drift == 0, (overhead, n, turn.report)
            for overhead, agent in agents.items():
                assert delivered[overhead], overhead  # the worker's summaries arrived
                held = {i.id: i.tokens for i in led.items(agent.session.id)}
                for sid in delivered[overhead]:
                    if sid in held:
                        text = next(o for o in prompts[overhead] if o["id"] == sid)["content"]
                        assert held[sid] == counter(text) + overhead
                assert led.audit(agent.session.id).clean
                agent.session.delete()
    finally:
        worker.stop()
