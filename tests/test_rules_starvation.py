"""Record 000 of docs/rules.md, replayed with the demo scenario's numbers: working memory
starving at 0.58-0.64 utilization, and the begin-turn gate that reclaims the oldest
scratchpad, reports the loud regime, or refuses and reclaims nothing.

Every test takes the parametrized ``ledger`` fixture (embedded fakeredis, a real
redis-server, a real Redis Cluster); the helpers are in tests/support/rules.py. Tests named
``test_bug_*`` are regressions of defects found and fixed.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger import (
    AdmissionRefused,
    Item,
    Ledger,
    Session,
    SessionBudget,
)
from ledger.errors import WorkingMemoryStarvation
from tests.support.rules import (
    REC,
    RET,
    SCR,
    WM,
    clean,
    held,
    jobs,
    new_sid,
    numbers,
)

# --- working-memory starvation under a satisfied total (rules.md#working-memory-starvation)

WINDOW_000 = 32_000
SYSTEM_000 = 2_100
FRAMING_000 = 150
OUTPUT_000 = 9_000  # with the scenario's load this leaves a residual under 6k
WORKING_SET = 6_000  # "a task that required holding ~6k tokens of intermediate state"
CHUNKS, CHUNK = 15, 400  # "12-18 chunks per turn at ~400 tokens each (~6k tokens)"
SCRATCH, SCRATCH_ITEMS = 3_000, 3  # "~9k tokens of raw tool output retained"


# Working memory 2.5k, as four turns with priorities (rules.md#working-memory-practice):
# compact order is lowest priority first, then oldest: t2, t4, t3, t1.
WM_000 = [Item("t1", 1_000, 2), Item("t2", 500, 0), Item("t3", 500, 1), Item("t4", 500, 0)]
COMPACT_ORDER = ("t2", "t4", "t3", "t1")


def budget_000(**kw: Any) -> SessionBudget:
    """The starvation scenario: no working-memory floor."""
    return SessionBudget(
        window=WINDOW_000,
        system_prompt=SYSTEM_000,
        tool_framing=FRAMING_000,
        output_reserve=OUTPUT_000,
        **kw,
    )


def load_000(s: Session, *, chunks: int = CHUNKS) -> None:
    """The scenario's sticky load: working memory, retrieval chunks, scratchpad results."""
    s.admit(WM, WM_000)
    s.admit(RET, [Item(f"c{i:02d}", CHUNK) for i in range(chunks)])
    for k in range(1, SCRATCH_ITEMS + 1):
        got = s.admit_tool_result(f"s{k}", SCRATCH, f'{{"tool":"read","part":{k}}}')
        assert got.outcome == "admitted" and got.charged == SCRATCH


def test_record000_starvation_reclaims_oldest_scratchpad_and_proceeds(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000())
    load_000(s)
    before = clean(ledger, s)
    # What was observed: every allocation succeeded, utilization is "healthy" ...
    assert 0.58 <= before.utilization <= 0.64
    assert before.occupancy < int(WINDOW_000 * 0.90)  # below the eviction threshold
    assert before.used == {WM: 2_500, RET: 6_000, REC: 0, SCR: 9_000}
    # ... and yet residual working memory is below the working set: silent starvation.
    residual = WINDOW_000 - SYSTEM_000 - FRAMING_000 - OUTPUT_000 - 6_000 - 9_000
    assert before.residual_working_memory == residual == 5_750 < WORKING_SET

    t = s.begin_turn(WORKING_SET)
    assert t.regime == "starvation"
    assert t.reclaimed == ((SCR, "s1"),)  # scratchpad first, oldest first, only what it takes
    assert t.released == SCRATCH and t.rotated == 0
    assert t.turn == before.turn + 1 == 1  # the turn proceeds
    assert t.need == WORKING_SET
    assert t.residual == residual + SCRATCH >= WORKING_SET
    assert t.utilization == (before.occupancy * 1000 // WINDOW_000) / 1000
    assert not t.compaction_due

    after = clean(ledger, s)
    assert after.turn == 1
    assert after.residual_working_memory == t.residual >= WORKING_SET
    assert after.used == {WM: 2_500, RET: 6_000, REC: 0, SCR: 6_000}  # retrieval untouched
    assert (SCR, "s1", SCRATCH) not in held(ledger, s)
    assert not after.compaction_pending
    assert t.free == after.free

    # The same instance at the same kind of load now simply proceeds.
    t2 = s.begin_turn(WORKING_SET)
    assert (t2.regime, t2.reclaimed, t2.released, t2.turn) == ("ok", (), 0, 2)
    clean(ledger, s)


def test_record000_stale_retrieval_next_recall_copies_first(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000())
    load_000(s)
    # Recall also holds two of the chunks (c07, c11): those retrieval copies go first.
    s.admit(REC, [Item("c07", CHUNK), Item("c11", CHUNK)])
    before = clean(ledger, s)
    start = before.residual_working_memory
    # Scratchpad alone is not enough; three chunks more are.
    ws = start + SCRATCH * SCRATCH_ITEMS + 3 * CHUNK - 200
    t = s.begin_turn(ws)
    assert t.regime == "starvation"
    assert t.reclaimed == (
        (SCR, "s1"),
        (SCR, "s2"),
        (SCR, "s3"),
        (RET, "c07"),
        (RET, "c11"),
        (RET, "c00"),  # then the oldest chunk
    )
    assert t.released == SCRATCH * SCRATCH_ITEMS + 3 * CHUNK
    assert t.residual >= ws and t.turn == 1
    after = clean(ledger, s)
    assert after.used[SCR] == 0
    assert after.used[RET] == (CHUNKS - 3) * CHUNK
    assert after.used[REC] == 2 * CHUNK  # recall keeps its copies
    assert after.used[WM] == 2_500  # working memory is the last resort, not touched
    assert after.residual_working_memory >= ws


def test_record000_nothing_suffices_raises_and_reclaims_nothing(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000())
    load_000(s)
    before = clean(ledger, s)
    items_before = held(ledger, s)
    numbers_before = numbers(s)
    # Even with all scratchpad and all retrieval reclaimed the residual is 20,750.
    ws = WINDOW_000 - SYSTEM_000 - FRAMING_000 - OUTPUT_000 + 250
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(ws)
    e = info.value
    assert e.reason == "starvation"
    assert e.residual == before.residual_working_memory == 5_750
    assert e.requirement == e.requested == ws
    assert e.shortfall == ws - 5_750
    assert e.utilization == (before.occupancy * 1000 // WINDOW_000) / 1000
    assert 0.58 <= e.utilization <= 0.64
    # The declared working set cannot fit even in an empty window: compacting working
    # memory cannot help, so no items are offered for compaction.
    assert e.compact == ()
    assert isinstance(e, AdmissionRefused)

    # Nothing reclaimed, the turn not advanced; only the compaction became pending.
    after = clean(ledger, s)
    assert held(ledger, s) == items_before
    numbers_after = numbers(s)
    assert numbers_before.pop("cd") == 0 and numbers_after.pop("cd") == 1
    assert numbers_after == numbers_before
    assert after.turn == 0 and after.compaction_pending
    (job,) = jobs(ledger, s, "compact")
    assert (job["reason"], job["epoch"]) == ("starvation", str(s.epoch))
    # A second refusal does not enqueue the same compaction twice.
    with pytest.raises(WorkingMemoryStarvation):
        s.begin_turn(ws)
    assert len(jobs(ledger, s, "compact")) == 1


def test_record003_compact_list_covers_the_shortfall_in_order(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000())
    s.admit(WM, WM_000)  # 2,500 tokens: t1 (priority 2), t2 (0), t3 (1), t4 (0)
    room = WINDOW_000 - SYSTEM_000 - FRAMING_000  # what working memory and output share
    # A larger output reserve this turn leaves working memory 250 short of what it holds.
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(1_000, output_reserve=room - 2_500 + 250)
    assert info.value.shortfall == 250
    assert info.value.compact == ("t2",)  # the lowest-priority oldest item covers it
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(1_000, output_reserve=room - 2_500 + 700)
    assert info.value.compact == ("t2", "t4")
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(0, output_reserve=room - 2_500 + 2_400)
    assert info.value.compact == COMPACT_ORDER  # lowest priority, then oldest
    # A declared working set that cannot fit beside this output reserve: no advice.
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(1_000, output_reserve=room - 2_500 + 2_400)
    assert info.value.compact == ()
    # Following the advice lets the turn proceed.
    assert s.compact(["t2", "t4"], None).compacted
    t = s.begin_turn(1_000, output_reserve=room - 2_500 + 700)
    assert t.turn == 1
    clean(ledger, s)


def test_record000_recall_is_reclaimed_after_retrieval(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000())
    s.admit(WM, WM_000)
    s.admit(REC, [Item("m1", 6_000)])
    ws = s.snapshot().residual_working_memory + 250
    t = s.begin_turn(ws)
    assert t.reclaimed == ((REC, "m1"),) and t.turn == 1
    assert clean(ledger, s).used[REC] == 0


def loud_budget() -> SessionBudget:
    return SessionBudget(
        window=WINDOW_000, system_prompt=SYSTEM_000, tool_framing=FRAMING_000, output_reserve=1_024
    )


def test_record000_loud_regime_reclaims_and_reports_loud(ledger: Ledger) -> None:
    b = loud_budget()
    s = ledger.open_session(new_sid(), b)
    s.admit(WM, [Item("t1", 2_500)])
    s.admit(REC, [Item("m1", 10_000)])
    for k in range(1, 4):
        s.admit_tool_result(f"s{k}", 5_000, "{}")
    before = clean(ledger, s)
    assert before.occupancy >= b.eviction_tokens  # above the eviction threshold
    assert before.residual_working_memory < WORKING_SET
    t = s.begin_turn(WORKING_SET)
    assert t.regime == "loud"
    assert t.reclaimed == ((SCR, "s1"),)
    assert t.residual >= WORKING_SET and t.turn == 1
    clean(ledger, s)


def test_record000_loud_regime_refusal_says_compaction_pending(ledger: Ledger) -> None:
    b = loud_budget()
    s = ledger.open_session(new_sid(), b)
    s.admit(WM, [Item("t1", 2_500)])
    s.admit(REC, [Item("m1", 20_500)])
    s.admit_tool_result("s1", 3_600, "{}")
    before = clean(ledger, s)
    assert before.utilization > 0.90
    numbers_before = numbers(s)
    with pytest.raises(WorkingMemoryStarvation) as info:
        s.begin_turn(29_000)  # more than the window can hold for working memory
    assert info.value.reason == "compaction_pending"
    assert info.value.utilization > 0.90
    assert info.value.compact == ()
    numbers_after = numbers(s)
    assert numbers_after.pop("cd") == 1 and numbers_before.pop("cd") == 0
    assert numbers_after == numbers_before
    (job,) = jobs(ledger, s, "compact")
    assert job["reason"] == "loud"
    clean(ledger, s)


def test_record000_release_each_turn_rotates_retrieval(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_000(release_each_turn={"retrieval"}))
    load_000(s)
    assert s.snapshot().residual_working_memory < WORKING_SET
    t = s.begin_turn(WORKING_SET)
    # Non-sticky retrieval: the starvation is transient and self-correcting.
    assert t.regime == "ok"
    assert t.rotated == CHUNKS * CHUNK and t.released == 0 and t.reclaimed == ()
    after = clean(ledger, s)
    assert after.used == {WM: 2_500, RET: 0, REC: 0, SCR: SCRATCH * SCRATCH_ITEMS}
    assert after.residual_working_memory >= WORKING_SET
    # The next turn's chunks are rotated out at the turn after.
    s.admit(RET, [Item("n1", CHUNK), Item("n2", CHUNK)])
    assert s.begin_turn(WORKING_SET).rotated == 2 * CHUNK
    assert clean(ledger, s).used[RET] == 0
