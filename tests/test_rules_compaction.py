"""Records 001 and 003 of docs/rules.md, replayed with the demo scenarios' numbers:
retrieval starved behind compactions (compaction_pending, the hard post-condition,
escalation to a hard reset after three failed compactions), and the roll-up hint.

Every test takes the parametrized ``ledger`` fixture (embedded fakeredis, a real
redis-server, a real Redis Cluster); the helpers are in tests/support/rules.py. Tests named
``test_bug_*`` are regressions of defects found and fixed.
"""

from __future__ import annotations

import pytest

from ledger import (
    AdmissionRefused,
    ConfigurationError,
    Item,
    Ledger,
    Session,
    SessionBudget,
)
from tests.support.rules import (
    REC,
    RET,
    WM,
    clean,
    jobs,
    new_sid,
)

# --- the compaction-credit rule (rules.md#compaction-credit) -----------------------------

WINDOW_001 = 128_000  # "a 128k token window"
HISTORY = [Item(f"h{i}", 10_000) for i in range(1, 10)]  # 90k of history


def budget_001() -> SessionBudget:
    return SessionBudget(
        window=WINDOW_001, system_prompt=4_000, tool_framing=200, output_reserve=8_000
    )


def pending_001(ledger: Ledger) -> tuple[Session, SessionBudget]:
    """A session whose occupancy passed H = 0.72 * window during turn 1; end_turn marks it."""
    b = budget_001()
    s = ledger.open_session(new_sid(), b)
    t = s.begin_turn(4_000)
    assert not t.compaction_due
    s.admit(WM, HISTORY)
    assert s.snapshot().occupancy > b.high_water_tokens == 92_160
    assert not s.snapshot().compaction_pending
    report = s.end_turn(t.turn, 40_000)
    assert report.compaction_due
    assert s.snapshot().compaction_pending
    (job,) = jobs(ledger, s, "compact")
    assert (job["reason"], job["epoch"]) == ("high_water_mark", str(s.epoch))
    return s, b


def test_record001_retrieval_refused_while_compaction_pending(ledger: Ledger) -> None:
    s, b = pending_001(ledger)
    free = s.snapshot().free
    cap = b.window - b.output_reserve - b.high_water_tokens
    assert free < cap  # occupancy is above the mark
    for consumer in (RET, REC):
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("doc", cap + 1)])
        # The honest reason, not token_budget_exhausted: the post-compaction bound.
        assert info.value.reason == "compaction_pending"
        assert info.value.bound == "pending"
        assert info.value.baseline == b.high_water_tokens
        # Within the bound but not the free room: labelled apart, as a free-room refusal.
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("doc", free + 1)])
        assert info.value.reason == "token_budget_exhausted"
        assert info.value.bound is None
    # Working memory is not judged against the pending compaction.
    assert s.admit(WM, [Item("note", 100)]).charged == 100
    # begin_turn also marks it: a compaction due with the occupancy above the mark.
    t = s.begin_turn(4_000)
    assert t.compaction_due and t.turn == 2
    assert len(jobs(ledger, s, "compact")) == 1  # already pending: not enqueued twice

    # Below the mark again (history released) but still pending: retrieval is judged on
    # the post-compaction baseline, occupancy at H, not on the current free room.
    s.release(WM, ["h8", "h9", "note"])
    snap = s.snapshot()
    assert snap.occupancy < b.high_water_tokens and snap.compaction_pending
    cap = b.window - b.output_reserve - b.high_water_tokens
    assert cap + 1 <= snap.free  # the naive check would admit it
    with pytest.raises(AdmissionRefused) as info:
        s.admit(RET, [Item("doc", cap + 1)])
    assert info.value.reason == "compaction_pending"
    # Chunk by chunk: the longest prefix within the post-compaction baseline.
    got = s.admit(RET, [Item(f"k{i}", 10_000) for i in range(4)], partial=True)
    assert (got.charged, got.skipped) == (20_000, ("k2", "k3"))
    assert snap.free >= 40_000  # all four fit the current free room
    clean(ledger, s)


def test_record001_retrieval_up_to_the_post_compaction_baseline(ledger: Ledger) -> None:
    s, b = pending_001(ledger)
    s.release(WM, ["h8", "h9"])
    cap = b.window - b.output_reserve - b.high_water_tokens
    assert s.snapshot().free > cap
    assert s.admit(RET, [Item("doc", cap)]).charged == cap  # H + t_retrieval + t_output <= B
    clean(ledger, s)


def test_record001_memory_admitted_while_pending_counts_on_the_baseline(ledger: Ledger) -> None:
    """Each admission within W - out - H alone, but together past it: the post-compaction
    occupancy carries the memory admitted since the compaction became pending."""
    s, b = pending_001(ledger)
    s.release(WM, ["h7", "h8", "h9"])  # room now, still pending
    cap = b.window - b.output_reserve - b.high_water_tokens
    first = cap // 2 + 1
    assert s.admit(RET, [Item("a", first)]).charged == first
    assert s.snapshot().raw["pm"] == first
    assert s.snapshot().free > first  # the free room would take the second one too
    with pytest.raises(AdmissionRefused) as info:
        s.admit(REC, [Item("b", first)])
    assert (info.value.reason, info.value.bound) == ("compaction_pending", "pending")
    assert info.value.baseline == b.high_water_tokens + first
    with pytest.raises(AdmissionRefused) as info:  # a reservation is judged alike
        s.reserve(RET, "res-b", first)
    assert (info.value.reason, info.value.bound) == ("compaction_pending", "pending")
    assert s.admit(REC, [Item("c", cap - first)]).charged == cap - first  # exactly the rest
    snap = clean(ledger, s)
    assert snap.raw["x:refused_pending"] == 2
    # The next compaction episode starts its own count.
    done = s.compact(["h1", "h2", "h3", "h4", "h5", "h6"], Item("sum", 1_000))
    assert done.compacted and not s.snapshot().compaction_pending
    assert s.admit(RET, [Item("d", first)]).charged == first  # no longer pending


def test_record001_no_memory_while_the_last_compaction_failed(ledger: Ledger) -> None:
    s, _ = pending_001(ledger)
    failed = s.compact(["h1"], Item("sum1", 9_000))  # still above the mark
    assert not failed.compacted and failed.outcome == "failed"
    s.release(WM, ["h8", "h9"])  # room, and well within the pending bound
    for consumer in (RET, REC):
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("doc", 100)])
        assert (info.value.reason, info.value.bound) == ("compaction_pending", "failed")
    with pytest.raises(AdmissionRefused) as info:
        s.reserve(REC, "res-1", 100)
    assert info.value.bound == "failed"
    assert s.admit(WM, [Item("note", 100)]).charged == 100  # working memory is not judged
    done = s.compact(["h2", "h3", "h4", "sum1"], Item("sum2", 2_000))
    assert done.compacted
    assert s.admit(RET, [Item("doc", 100)]).charged == 100
    clean(ledger, s)


def deferral_001(ledger: Ledger) -> tuple[Session, SessionBudget]:
    """pending_001 with the demo's compaction_min_gain 0.25 (32k of the window)."""
    b = SessionBudget(
        window=WINDOW_001,
        system_prompt=4_000,
        tool_framing=200,
        output_reserve=8_000,
        compaction_min_gain=0.25,
    )
    assert b.compaction_min_gain_tokens == 32_000
    s = ledger.open_session(new_sid(), b)
    t = s.begin_turn(4_000)
    s.admit(WM, HISTORY)
    assert s.end_turn(t.turn, 40_000).compaction_due
    return s, b


def test_record001_a_compaction_below_the_min_gain_is_a_deferral(ledger: Ledger) -> None:
    s, b = deferral_001(ledger)
    # Under the mark, but it frees only 20k - 1k = 19k: a deferral, counted as a failure.
    small = s.compact(["h1", "h2"], Item("sum1", 1_000))
    assert (small.compacted, small.outcome, small.gain) == (False, "deferred", 19_000)
    assert small.occupancy <= b.high_water_tokens and small.failures == 1
    snap = s.snapshot()
    # It landed under the mark: counted toward the escalation, but nothing is pending any
    # more and no retry is enqueued (the job still queued finds nothing due).
    assert not snap.compaction_pending and snap.failed_compactions == 1
    assert snap.raw["kr"] == 1  # it reached the mark
    assert [j["reason"] for j in jobs(ledger, s, "compact")] == ["high_water_mark"]
    big = s.compact(["h3", "h4", "h5", "h6", "sum1"], Item("sum2", 2_000))
    assert (big.compacted, big.outcome, big.gain, big.failures) == (True, "compacted", 39_000, 0)
    snap = clean(ledger, s)
    assert not snap.compaction_pending and snap.raw["kr"] == 0


def test_record001_memory_after_a_deferral_is_judged_on_the_post_compaction_bound(
    ledger: Ledger,
) -> None:
    """A deferral landed at or under H: its baseline holds, so retrieval and recall within
    the free room are admitted (the `failed` bound refused them all, kf > 0), up to the
    post-compaction bound once the next compaction is due."""
    s, b = deferral_001(ledger)
    assert s.compact(["h1", "h2"], Item("sum1", 1_000)).outcome == "deferred"
    assert s.admit(RET, [Item("now", 100)]).charged == 100  # nothing pending: the free room
    # The next turn passes H again: the next compaction is due, the deferral still counted.
    t = s.begin_turn(4_000)
    assert not t.compaction_due
    s.admit(WM, [Item("h10", 20_000)])
    assert s.end_turn(t.turn, 40_000).compaction_due
    snap = s.snapshot()
    assert snap.compaction_pending and snap.failed_compactions == 1 and snap.raw["kr"] == 1
    s.release(WM, ["h10"])  # under the mark again, still pending: the bound is the tighter
    s.release(RET, ["now"])
    cap = b.window - b.output_reserve - b.high_water_tokens
    assert s.snapshot().free > cap
    for consumer in (RET, REC):
        assert s.admit(consumer, [Item("doc", 100)]).charged == 100
    assert s.snapshot().raw["pm"] == 200  # counted from the deferral on
    with pytest.raises(AdmissionRefused) as info:  # within the free room, past the bound
        s.admit(RET, [Item("big", cap - 200 + 1)])
    assert (info.value.reason, info.value.bound) == ("compaction_pending", "pending")
    assert info.value.baseline == b.high_water_tokens + 200
    with pytest.raises(AdmissionRefused) as info:  # a reservation is judged alike
        s.reserve(REC, "res-big", cap - 200 + 1)
    assert info.value.bound == "pending"
    s.reserve(REC, "res-1", 300)
    with pytest.raises(AdmissionRefused) as info:  # and so is a settle that grows past it
        s.settle("res-1", 300 + cap - 500 + 1)
    assert (info.value.reason, info.value.bound) == ("compaction_pending", "pending")
    assert s.settle("res-1", 400).charged == 400
    assert s.admit(RET, [Item("rest", cap - 600)]).charged == cap - 600  # exactly the rest
    clean(ledger, s)


def test_record001_a_failure_after_a_deferral_refuses_memory_again(ledger: Ledger) -> None:
    s, b = deferral_001(ledger)
    assert s.compact(["h1", "h2"], Item("sum1", 1_000)).outcome == "deferred"
    # A summary that leaves occupancy above H: a failed compaction, the baseline unproven.
    failed = s.compact(["h3"], Item("sum2", 28_000))
    assert failed.outcome == "failed" and failed.occupancy > b.high_water_tokens
    assert failed.failures == 2 and s.snapshot().raw["kr"] == 0
    for consumer in (RET, REC):
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("doc", 100)])
        assert (info.value.reason, info.value.bound) == ("compaction_pending", "failed")
    with pytest.raises(AdmissionRefused) as info:
        s.reserve(RET, "res-1", 100)
    assert info.value.bound == "failed"
    # A summary that does not fit is no deferral either.
    assert s.compact(["h4"], Item("huge", 100_000)).outcome == "did_not_fit"
    with pytest.raises(AdmissionRefused) as info:
        s.admit(RET, [Item("doc", 100)])
    assert info.value.bound == "failed"
    clean(ledger, s)


def test_record001_consecutive_deferrals_escalate_to_a_hard_reset(ledger: Ledger) -> None:
    """Deferrals count toward the escalation as failures do (a failure and deferrals
    together too); the hard reset is enqueued in the step of the third."""
    s, b = deferral_001(ledger)
    outcomes = []
    for k, (items, size) in enumerate(
        ((["h1"], 9_990), (["h2", "h3"], 1_000), (["h4"], 1_000)), start=1
    ):
        c = s.compact(items, Item(f"sum{k}", size), op_id=f"compact-{k}")
        outcomes.append(c.outcome)
        assert c.failures == k and c.escalated == (k == 3)
        assert len(jobs(ledger, s, "hard_reset")) == (k == 3)
    assert outcomes == ["failed", "deferred", "deferred"]
    (reset,) = jobs(ledger, s, "hard_reset")
    assert (reset["op"], reset["reason"]) == ("compact-3", "failed_compactions")
    snap = s.snapshot()
    assert snap.raw["rq"] == 1 and snap.raw["kr"] == 3  # kf as the deferral left it
    # Three deferrals alone escalate the same, under the reset's new epoch.
    s.reset("failed_compactions")
    assert s.snapshot().raw["kr"] == 0
    s.admit(WM, HISTORY)
    assert s.begin_turn(0).compaction_due
    for k in (1, 2, 3):
        c = s.compact([f"h{k}"], Item(f"s{k}", 1_000))
        assert (c.outcome, c.failures, c.escalated) == ("deferred", k, k == 3)
        assert c.occupancy <= b.high_water_tokens
    # a deferral is not retried: one compaction job an epoch, the one that made it due
    assert len(jobs(ledger, s, "compact")) == 2
    assert [j["epoch"] for j in jobs(ledger, s, "hard_reset")] == [
        str(s.epoch - 1),
        str(s.epoch),
    ]
    clean(ledger, s)


def test_record001_min_gain_above_the_window_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        SessionBudget(window=1_000, system_prompt=10, compaction_min_gain=1.5)


def test_record001_three_failed_compactions_escalate_once(ledger: Ledger) -> None:
    s, b = pending_001(ledger)
    hw = b.high_water_tokens
    summaries = [9_000, 9_500, 9_900, 10_000]  # each leaves occupancy above the mark
    escalation_op = "compact-3"
    for k, size in enumerate(summaries, start=1):
        c = s.compact([f"h{k}"], Item(f"sum{k}", size), op_id=f"compact-{k}")
        assert not c.compacted  # a deferral, not a compaction
        assert c.occupancy > hw == c.high_water_mark
        assert c.dropped == 10_000 and c.summary == size
        assert c.failures == min(k, 3)  # none counted past the escalation, until the reset
        assert c.escalated == (k == 3)
        resets = jobs(ledger, s, "hard_reset")
        if k < 3:
            assert resets == []
        else:
            # Appended in the same step: present right after the call, exactly one.
            assert resets == [
                {
                    "kind": "hard_reset",
                    "session": s.id,
                    "epoch": str(s.epoch),
                    "reason": "failed_compactions",
                    "op": escalation_op,
                    "inc": str(s.snapshot().raw["inc"]),  # this incarnation of the session
                }
            ]
        snap = s.snapshot()
        assert snap.compaction_pending and snap.failed_compactions == min(k, 3)
    # The pending job only: the agent's own failures while it is queued add no retry jobs.
    assert [j["reason"] for j in jobs(ledger, s, "compact")] == ["high_water_mark"]
    with pytest.raises(AdmissionRefused) as info:
        s.admit(RET, [Item("doc", s.snapshot().free + 1)])
    assert info.value.reason == "compaction_pending"
    clean(ledger, s)


def test_record001_successful_compaction_resets_failures_and_pending(ledger: Ledger) -> None:
    s, b = pending_001(ledger)
    assert not s.compact(["h1"], Item("sum1", 9_000)).compacted
    assert s.snapshot().failed_compactions == 1
    c = s.compact(["sum1", "h2", "h3", "h4"], Item("sum2", 2_000))
    assert c.compacted and c.failures == 0 and not c.escalated
    assert c.occupancy <= b.high_water_tokens
    snap = clean(ledger, s)
    assert not snap.compaction_pending and snap.failed_compactions == 0
    # Retrieval is admitted again.
    assert s.admit(RET, [Item("doc", 4_000)]).charged == 4_000
    # And the failure count starts from zero: two more failures do not escalate.
    s.admit(WM, [Item("h10", 40_000)])
    t = s.begin_turn(0)
    assert t.compaction_due
    for k, size in ((5, 9_900), (6, 9_950)):
        c = s.compact([f"h{k}"], Item(f"s{k}", size))
        assert not c.compacted and not c.escalated
    assert s.snapshot().failed_compactions == 2
    assert jobs(ledger, s, "hard_reset") == []


def test_record001_reset_starts_the_compaction_state_over(ledger: Ledger) -> None:
    s, _ = pending_001(ledger)
    e0 = s.epoch
    for k in (1, 2, 3):
        s.compact([f"h{k}"], Item(f"sum{k}", 9_900))
    assert len(jobs(ledger, s, "hard_reset")) == 1
    done = s.reset("failed_compactions")
    assert done.epoch == s.epoch == e0 + 1
    snap = clean(ledger, s)
    assert not snap.compaction_pending and snap.failed_compactions == 0
    assert all(v == 0 for v in snap.used.values())
    # The same story again escalates again, under the new epoch.
    s.admit(WM, HISTORY)
    assert s.begin_turn(0).compaction_due
    for k in (1, 2, 3):
        c = s.compact([f"h{k}"], Item(f"sum{k}", 9_900))
        assert c.failures == k and c.escalated == (k == 3)
    assert [j["epoch"] for j in jobs(ledger, s, "hard_reset")] == [str(e0), str(e0 + 1)]
    clean(ledger, s)


# --- the roll-up hint (rules.md#working-memory-practice) -------------------------------


def test_record003_rollup_after_more_than_rollup_turns(ledger: Ledger) -> None:
    b = SessionBudget(window=32_000, system_prompt=2_100, working_memory_floor=6_000)
    assert b.rollup_turns == 20  # "after every 5-10 turns"; the ledger's default is 20
    s = ledger.open_session(new_sid(), b)
    s.admit(WM, [Item("t0", 1_000)])
    hints = [s.begin_turn(1_000).rollup_hint for _ in range(b.rollup_turns + 1)]
    assert hints == [False] * b.rollup_turns + [True]
    assert s.end_turn(b.rollup_turns + 1, 5_000).rollup_hint
    # A roll-up (a successful compaction) starts the count over.
    assert s.compact(["t0"], Item("summary", 300)).compacted
    assert not s.begin_turn(1_000).rollup_hint
    clean(ledger, s)


def test_record003_rollup_when_working_memory_above_its_share(ledger: Ledger) -> None:
    b = SessionBudget(window=32_000, system_prompt=2_100, working_memory_floor=6_000)
    s = ledger.open_session(new_sid(), b)
    at = int(b.working_memory_floor * b.rollup_fraction)  # 60% of its floor: 3,600
    s.admit(WM, [Item("t1", at)])
    t = s.begin_turn(0)
    assert not t.rollup_hint
    assert not s.end_turn(t.turn, 10_000).rollup_hint
    s.admit(WM, [Item("t2", 1)])
    t = s.begin_turn(0)
    assert t.rollup_hint
    assert s.end_turn(t.turn, 10_000).rollup_hint
