"""What each cure of the demo costs (issue 43, docs/demo.md): counted from what the
agents did, non-zero where the cure acts and zero where it does not. Small runs on
embedded: scenario 001's fleet of 4 sessions, 002's and 004's own run functions."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ledger import Ledger
from ledger.fleet import fanout, report, truncation
from ledger.fleet import run as fleet_run
from ledger.fleet.agent import SimAgent
from ledger.fleet.run import FleetConfig
from tests.conftest import make_settings


@pytest.fixture
def led() -> Iterator[Ledger]:
    with Ledger.from_settings(make_settings(f"embedded://{uuid.uuid4().hex}")) as ledger:
        yield ledger


@pytest.mark.embedded
@pytest.mark.timeout(300)
def test_001_costs_resets_waits_and_refused_retrieval_per_column() -> None:
    """Seed 9's 4 sessions (one of 90 turns reaches a hard reset): each reset counts the
    context the session held, on the turn that rebuilt; only turns whose begin waited
    count a wait; the naive arbiter's compactions are charged to its turns."""
    config = FleetConfig(sessions=4, tail=0, max_turns=90, seed=9, only=frozenset({"001"}))
    r = fleet_run.run(make_settings(f"embedded://{uuid.uuid4().hex}"), config)
    s = report.summarize(r)
    led, off, naive = (s[k]["cure_costs"] for k in ("ledger", "off", "naive"))
    assert r.decay_off is not None
    for runs in (r.decay_ledger, r.decay_off):
        records = [x for run in runs for x in run.records]
        assert all(bool(x.discarded) == x.reset for x in records)  # no reset, nothing lost
        assert all((x.wait_ms > 0) == x.waited for x in records)
        assert all(x.compaction_ms == 0 for x in records)  # asynchronous: not in a turn
    # the ledger's resets discarded what the sessions held: tens of thousands of tokens
    assert led["resets"] == s["ledger"]["resets"] > 0 and led["reset_sessions"] > 0
    assert led["discarded_tokens"]["n"] == led["resets"]
    assert 10_000 < led["discarded_tokens"]["median"] <= 128_000
    assert led["discarded_items"]["median"] > 0
    assert led["waited_turns"] > 0 and led["waited_ms_total"] > 0
    # without the credit: no reset, so nothing discarded, but retrieval refused
    assert off["resets"] == 0 and off["discarded_tokens_total"] == 0
    assert off["retrieval_refused_tokens"] > 0
    # a turn refused every chunk (a refusal) or the chunks past those that fit
    assert 0 < sum(s["off"]["retrieval_refusals"].values()) <= off["retrieval_refused_turns"]
    # naive: no reset, no wait; its synchronous compactions are in its turns' latency
    assert naive["resets"] == naive["waited_turns"] == 0
    assert naive["sync_compaction_turns"] == s["naive"]["compactions"] > 0
    assert 0 < naive["sync_compaction_latency_share"] < 1
    assert led["sync_compaction_turns"] == 0


def _counts(led: Ledger, turns: tuple[truncation.TurnPlan, ...], rule: bool) -> Any:
    c = truncation.Counts()
    agent = SimAgent(led, f"costs-{uuid.uuid4().hex[:8]}", truncation.BUDGET)
    truncation.run_ledger(agent, turns, c, rule)
    return c


@pytest.mark.embedded
def test_002_a_spilled_result_is_read_back_whole_and_memory_gives_way(led: Ledger) -> None:
    """Two 26k results after a turn of 30 memory chunks: memory gives way to the first
    (admitted whole, chunks evicted for it); the second, beside it, is spilled and the
    agent reads all of it back by its handle. Without spill it is cut and nothing is
    read back; with no tool result, nothing is cut short at all."""
    turns = tuple(truncation.TurnPlan(t, 30, 26_000 * (t > 1)) for t in (1, 2, 3))
    c = _counts(led, turns, rule=True)
    assert c.admitted_whole == 1 and c.memory_evicted > 0
    assert c.memory_evicted_tokens == truncation.CHUNK * c.memory_evicted
    assert c.spilled == c.read_back == 1 and c.read_back_tokens == 26_000
    off = _counts(led, turns, rule=False)
    assert off.truncated > 0 and off.read_back == off.read_back_tokens == 0
    quiet = _counts(led, tuple(truncation.TurnPlan(t, 30, 0) for t in (1, 2, 3)), True)
    assert quiet.memory_evicted == quiet.memory_refused == quiet.read_back == 0


@pytest.mark.embedded
def test_002_costs_of_a_seed_per_column(led: Ledger) -> None:
    """Seed 1's sessions: the naive pipeline empties memory for results it cannot fit;
    the ledger evicts chunks for results and reads every spilled one back; the
    truncating variant evicts nothing (its results take only the free room)."""
    out = truncation.run(led, 1, uuid.uuid4().hex[:8])
    n, lg, off = out.naive, out.ledger, out.off
    assert off is not None
    assert n.memory_evicted > 0 and n.memory_refused > 0 and n.read_back == 0
    assert lg.read_back == lg.spilled > 0
    assert lg.read_back_tokens > lg.read_back * truncation.BUDGET.spill_preview_tokens
    assert lg.memory_evicted > 0 and lg.memory_refused > 0
    assert off.memory_evicted == 0 and off.read_back == 0


@pytest.mark.embedded
def test_004_the_guards_summarize_spans_are_counted_in_their_turns(led: Ledger) -> None:
    """Every turn has one summarize span, inside its latency; the guard's turns are
    counted apart. The unguarded run has none of those."""
    rows = fanout.run_ledger(SimAgent(led, f"fan-{uuid.uuid4().hex[:8]}", fanout.BUDGET), 1, 0)
    assert all(0 < r.summarize_ms < r.latency_ms for r in rows)
    costs = report._fanout(rows, ledger=True)["cure_costs"]
    guard = costs["guard_summarize"]
    assert costs["summarize"]["spans"] == len(rows) == fanout.TURNS
    assert guard["spans"] == sum(r.guard_stops for r in rows) > 0
    assert 0 < guard["latency_share"] < 1 and guard["ms"]["n"] == guard["spans"]
    naive = report._fanout(fanout.run_naive(1, 0), ledger=False)["cure_costs"]
    assert naive["guard_summarize"]["spans"] == 0 and naive["summarize"]["spans"] == len(rows)
