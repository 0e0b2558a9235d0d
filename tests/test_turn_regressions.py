"""Turn leases on every backend: regressions found by review, each failed before its fix."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from ledger import (
    Item,
    Ledger,
    SessionBudget,
    SessionConflict,
    TurnInProgress,
    TurnLost,
)
from ledger.agent import Agent
from tests.support.turn_state import (
    BUDGET,
    R,
    W,
    loaded,
    msg,
    sid,
    whole,
    words,
    worker_compaction,
)

# --- found by review: each failed before its fix -----------------------------------------


def test_a_compaction_never_overwrites_a_summary_id_held_in_another_version(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    a.admit(W, [Item("sum", 700)])
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "sum")
    before = whole(ledger, a)
    with pytest.raises(SessionConflict, match="another version"):
        a.compact([(W, "sum", seq + 99), (W, "w1")], Item("sum", 50))
    assert whole(ledger, a) == before and ledger.audit(a.id).clean


def test_the_same_owner_after_its_lease_lapsed_rolls_its_dead_turn_back(ledger: Ledger) -> None:
    """A process restarted under the dead one's owner name: the half-done turn is rolled
    back (its delivery comes again), not committed."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1"], Item("sum-1", 80, 1000))
    t1 = a.begin_turn(0, lease_ms=100)
    assert t1.summaries == ("sum-1",)
    a.admit(R, [Item("half-done", 100)])
    time.sleep(0.25)
    again = ledger.session(a.id, owner="A")  # the same name, a new process
    t2 = again.begin_turn(0)
    assert t2.rolled_back == t1.turn and t2.summaries == ("sum-1",)
    assert "half-done" not in {i.id for i in ledger.items(a.id)}


def test_a_turn_objects_calls_carry_its_own_turn(ledger: Ledger) -> None:
    """An old Turn (a leftover task) after the agent moved on: its calls are refused, not
    made in the later turn; and an agent serves one turn at a time."""
    s = loaded(ledger, "A")
    agent = Agent(s, words)
    with agent.turn(0) as first:
        first.prompt(5_000)
    with agent.turn(0) as second:
        with pytest.raises(TurnLost):
            first.admit("retrieval", [msg("late-doc")])
        with pytest.raises(TurnInProgress, match="one turn at a time"):
            agent.turn(0).__enter__()
        second.prompt(5_000)
    assert "late-doc" not in {i.id for i in ledger.items(s.id)}


def test_an_op_sent_again_after_its_turn_was_rolled_back_is_judged_anew(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    a.release(R, ["r1"], op_id="req-7:release")
    a.admit(R, [Item("r9", 600)], op_id="req-7:admit")
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0, takeover=True)
    assert t2.rolled_back == t.turn
    with pytest.raises(TurnLost):  # the old turn's retry: its turn is gone
        a.release(R, ["r1"], op_id="req-7:release")
    # The request retried in the new turn: done there, once (not answered from the undone one).
    assert b.release(R, ["r1"], op_id="req-7:release").count == 1
    assert b.admit(R, [Item("r9", 600)], op_id="req-7:admit").charged == 600
    assert b.admit(R, [Item("r9", 600)], op_id="req-7:admit").charged == 600  # a replay now
    held = {i.id for i in ledger.items(a.id)}
    assert "r1" not in held and "r9" in held and ledger.audit(a.id).clean


def test_a_rollback_gives_back_what_the_turn_counted_against_a_pending_compaction(
    ledger: Ledger,
) -> None:
    s = ledger.open_session(
        sid(), SessionBudget(window=10_000, system_prompt=100, high_water_mark=0.3)
    )
    s.admit(W, [Item("w", 3_500)])
    s.end_turn(0, 3_600)  # a compaction is pending now (agent-free: no worker in this test)
    assert s.snapshot().compaction_pending
    pm = s.snapshot().raw["pm"]
    t = s.begin_turn(0)
    s.admit(R, [Item("doc", 2_000)])
    assert s.snapshot().raw["pm"] == pm + 2_000
    s.abort_turn(t.turn)
    assert s.snapshot().raw["pm"] == pm


def test_a_resized_item_is_a_new_version(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "w1")
    a.reconcile({W: [Item("w1", 1_200), Item("w2", 700, 3)]})  # new text, new size
    done = a.compact([(W, "w1", seq)], Item("sum-x", 50))
    assert done.missing == ((W, "w1"),)
    assert {i.id: i.tokens for i in ledger.items(a.id)}["w1"] == 1_200


def test_a_turn_a_reset_cut_off_is_over(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    a.reset("operator")
    a.refresh()
    with pytest.raises(TurnLost, match="rolled back \\(reset\\)"):
        a.end_turn(t.turn, 5_000, mark="ckpt-of-dead-turn")
    assert a.begin_turn(0).mark is None


def test_begin_turn_awaiting_a_pending_compaction_refuses_and_changes_nothing(
    ledger: Ledger,
) -> None:
    """With await_compaction, begin_turn says a compaction is pending (and whether a
    worker computes it, from the summaries hash's '~') instead of beginning: no lease, no
    turn, nothing changed. Without a pending compaction, or without await, it begins."""
    from ledger import CompactionPending

    s = ledger.open_session(f"aw-{uuid.uuid4().hex[:8]}", BUDGET)
    first = s.begin_turn(0, await_compaction=True)  # nothing pending: it begins
    s.end_turn(first.turn, 1_600)
    ledger.client.hset(s.keys.session, "cd", 1)  # a compaction becomes pending
    unstamped = ledger.client.hgetall(s.keys.session)
    with pytest.raises(CompactionPending, match="not picked up") as no_worker:
        s.begin_turn(0, await_compaction=True)
    assert not no_worker.value.computing and no_worker.value.requested_ms_ago is None
    assert ledger.client.hgetall(s.keys.session) == unstamped  # nothing changed
    asked = int(ledger.client.time()[0]) * 1000 - 5_000  # the job was requested 5 s ago
    ledger.client.hset(s.keys.session, "cq", asked)
    before = ledger.client.hgetall(s.keys.session)
    with pytest.raises(CompactionPending, match=r"requested [0-9]+ ms ago") as late:
        s.begin_turn(0, await_compaction=True)
    assert 4_000 <= (late.value.requested_ms_ago or 0) < 60_000
    until = int(time.time() * 1000) + 60_000
    ledger.client.hset(s.keys.compacted, "~", f"worker-7|{until}")
    with pytest.raises(CompactionPending) as running:
        s.begin_turn(0, await_compaction=True)
    assert running.value.computing and running.value.worker == "worker-7"
    assert running.value.until_ms == until
    assert ledger.client.hgetall(s.keys.session) == before  # no lease, no turn, nothing
    ledger.client.hset(s.keys.compacted, "~", f"worker-7|{until - 120_000}")  # lapsed
    with pytest.raises(CompactionPending, match="not picked up"):
        s.begin_turn(0, await_compaction=True)
    assert s.begin_turn(0).turn == first.turn + 1  # without await it begins


def test_a_turn_with_no_compaction_pending_is_one_call_to_begin(ledger: Ledger) -> None:
    """The agent asks begin_turn itself whether to wait for a compaction: a worker-owned
    session's turn calls no snapshot before it (only the agent's first turn asks, once,
    who compacts the session)."""
    from ledger import Agent

    s = ledger.open_session(f"one-{uuid.uuid4().hex[:8]}", BUDGET)
    agent = Agent(s, len)
    ran: list[str] = []
    run = ledger.run

    def counted(call: Any) -> Any:
        ran.append(call.script)
        return run(call)

    ledger.run = counted  # type: ignore[method-assign]
    for i in range(3):
        with agent.turn(0) as t:
            t.admit("retrieval", [{"id": f"d{i}", "content": "x" * 50}])
            t.prompt(100)
    ledger.run = run  # type: ignore[method-assign]
    assert ran == ["snapshot", *["begin_turn", "admit", "end_turn"] * 3], ran


def test_a_turn_of_thousands_of_items_is_rolled_back_and_reconciled_whole(ledger: Ledger) -> None:
    """A turn that rotated out 6,000 chunks is rolled back whole (its undo runs to 12,000
    values, past what Lua unpacks at once), and a reconcile drops 6,000 items in one step."""
    budget = SessionBudget(
        window=1_000_000, system_prompt=100, compaction="agent", release_each_turn={R}
    )
    s = ledger.open_session(sid(), budget)
    for k in range(6):
        s.admit(R, [Item(f"d{k}-{i}", 5) for i in range(1_000)])
    t = s.begin_turn(0)
    assert t.rotated == 30_000 and not ledger.items(s.id)
    assert s.abort_turn().rolled_back == t.turn
    assert len(ledger.items(s.id)) == 6_000 and ledger.audit(s.id).clean
    done = s.reconcile({R: [Item("d0-0", 5)]})
    assert len(done.removed) == 5_999 and [i.id for i in ledger.items(s.id)] == ["d0-0"]
    assert ledger.audit(s.id).clean
