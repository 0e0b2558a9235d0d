"""Turn leases on every backend (docs/agent.md#turn-leases): a turn is owned by one
owner at a time; a second begin is refused before anything changes; a turn taken over or
whose lease lapsed is rolled back to exactly what it found; its zombie's calls are
refused; a worker's compaction never lands under a running turn, and its summary is
delivered to one committed turn, once. The agent layer's turns are in
test_turn_agents.py, the regressions found by review in test_turn_regressions.py; the
helpers in tests/support/turn_state.py.
"""

from __future__ import annotations

import random
import time

import pytest

from ledger import (
    BegunBy,
    InvalidArgument,
    Item,
    Ledger,
    TurnInProgress,
    TurnLost,
    TurnStarted,
    protocol,
)
from ledger.client import Session
from ledger.core import new_op_id
from tests.support.turn_state import (
    M,
    R,
    S,
    W,
    loaded,
    state,
    whole,
    worker_compaction,
)

# --- one owner at a time ----------------------------------------------------------------


def test_a_second_begin_is_refused_before_anything_changes(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500)
    a.admit(R, [Item("r3", 100)])
    b = ledger.session(a.id, owner="B")
    before = whole(ledger, a)
    with pytest.raises(TurnInProgress) as caught:
        b.begin_turn(500)
    assert (caught.value.turn, caught.value.owner) == (t.turn, "A")
    assert 0 < (caught.value.lease_left_ms or 0) <= 30_000
    # A call of no turn while A's is open: refused too, nothing changed.
    with pytest.raises(TurnInProgress):
        b.admit(R, [Item("r4", 100)])
    with pytest.raises(TurnInProgress):
        b.release(R, ["r1"])
    assert whole(ledger, a) == before
    snap = b.snapshot()
    assert snap.turn_open and snap.turn_owner == "A" and snap.turn == t.turn
    assert a.end_turn(t.turn, 5_100).turn == t.turn
    assert b.begin_turn(500).turn == t.turn + 1  # free again
    assert ledger.audit(a.id).clean


def test_a_turns_first_calls_go_in_the_batch_that_begins_it(ledger: Ledger) -> None:
    """Calls stamped with their begin_turn's op id (BegunBy) are of the turn that begin
    opened: one round trip begins the turn and admits into it. When the begin is refused
    (another owner's turn, starvation) they are refused too (TurnLost), nothing changed:
    never admitted into another owner's turn or into none."""
    a = loaded(ledger, "A")
    b = ledger.session(a.id, owner="B")
    op = new_op_id()
    began, admitted, released = ledger.run_many([
        a.begin_turn_call(500, op_id=op),
        a.admit_call(R, [Item("first", 100)], turn=BegunBy(op)),
        a.release_call(M, ["m1"], turn=BegunBy(op)),
    ])  # fmt: skip
    assert a.turn == began.turn and admitted.charged == 100 and released.count == 1
    # they are the turn's own: a rollback undoes them
    a.abort_turn()
    held = {(i.consumer, i.id) for i in ledger.items(a.id)}
    assert (R, "first") not in held and (M, "m1") in held
    t = a.begin_turn(500)
    before = whole(ledger, a)
    op2 = new_op_id()
    got = ledger.run_many(
        [b.begin_turn_call(500, op_id=op2), b.admit_call(R, [Item("b", 1)], turn=BegunBy(op2))],
        return_exceptions=True,
    )
    assert isinstance(got[0], TurnInProgress) and isinstance(got[1], TurnLost)
    assert f"begun by op {op2} is not open" in str(got[1])
    assert whole(ledger, a) == before  # not into A's open turn
    a.end_turn(t.turn, 5_100)
    starved = ledger.run_many(
        [b.begin_turn_call(10**7, op_id=op2), b.admit_call(R, [Item("b", 1)], turn=BegunBy(op2))],
        return_exceptions=True,
    )
    assert not isinstance(starved[0], TurnStarted) and isinstance(starved[1], TurnLost)
    # an op id's turn is a fence, not an argument; abort_turn takes only a number
    with pytest.raises(InvalidArgument):
        ledger.run(protocol.abort_turn(a.keys, new_op_id(), a.epoch, BegunBy(op)))  # type: ignore[arg-type]
    assert ledger.audit(a.id).clean


def test_the_same_owner_beginning_again_ends_its_turn_as_it_stands(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t1 = a.begin_turn(500)
    a.admit(R, [Item("r3", 100)])
    t2 = a.begin_turn(500)
    assert t2.turn == t1.turn + 1 and t2.rolled_back is None
    assert any(i.id == "r3" for i in ledger.items(a.id))  # kept: not rolled back
    with pytest.raises(TurnLost):  # the first turn's calls are over
        ledger.run(
            protocol.admit(a.keys, new_op_id(), protocol.stamp(a.epoch, t1.turn), R, [Item("x", 1)])
        )


@pytest.mark.parametrize("how", ["takeover", "lapsed", "abort", "worker"])
def test_a_dead_turn_is_rolled_back_to_exactly_what_it_found(ledger: Ledger, how: str) -> None:
    """Every kind of change a turn makes, then the turn dies: the session is as the turn
    found it (items, reservations and their deadlines, counters, output reserve)."""
    a = loaded(ledger, "A")
    before = state(ledger, a)
    lease = 150 if how in ("lapsed", "worker") else 30_000
    t = a.begin_turn(15_000, output_reserve=2_000, lease_ms=lease)  # reclaims scratchpad
    assert ("scratchpad", "s1") in [(c.value, i) for c, i in t.reclaimed]
    a.admit(W, [Item("w3", 500)])
    a.admit(R, [Item("r3", 400), Item("r1", 800)])  # r1 held: a duplicate
    a.release(W, ["w2"])
    a.release(R, ["nope"])
    got = a.admit_tool_result("s2", 13_800, b"[" + b"0," * 3000 + b"0]")
    assert got.outcome == "admitted" and got.evicted == ((R, "r1"),)  # memory gave way
    a.reserve(W, "res1", 300)
    a.settle("res0", 350, "s0")
    a.reserve(R, "res2", 200)
    a.void("res2")
    a.reconcile({M: [Item("m1", 250), Item("m2", 90)]})
    a.compact(["w1", (R, "r3")], Item("sum-a", 120))
    assert state(ledger, a) != before
    b = ledger.session(a.id, owner="B")
    if how == "takeover":
        t2 = b.begin_turn(0, takeover=True)
        assert t2.rolled_back == t.turn
        b.abort_turn()
    elif how == "lapsed":
        time.sleep(0.3)
        t2 = b.begin_turn(0)  # no takeover needed: the lease lapsed
        assert t2.rolled_back == t.turn
        b.abort_turn()
    elif how == "abort":
        assert a.abort_turn().rolled_back == t.turn
        assert a.abort_turn(t.turn).rolled_back is None  # done already: left alone
    else:
        time.sleep(0.3)
        assert ledger.sweep_partition(a.keys.partition) == (0, 1)
    assert state(ledger, a) == before
    report = ledger.audit(a.id)
    assert report.clean, report.problems
    snap = b.snapshot()
    assert not snap.turn_open and snap.raw["x:rolled_back"] >= 1
    assert ledger.client.zscore(a.keys.deadlines, f"{a.id}|~") is None


def test_a_zombie_is_refused_once_its_turn_was_taken_over(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500)
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(500, takeover=True)
    b.admit(R, [Item("b1", 100)])
    before = whole(ledger, a)
    for call in (
        lambda: a.admit(R, [Item("z1", 100)]),
        lambda: a.release(R, ["b1"]),
        lambda: a.admit_tool_result("z2", 10, b"{}"),
        lambda: a.reserve(S, "z3", 10),
        lambda: a.settle("res0", 10),
        lambda: a.void("res0"),
        lambda: a.reconcile({R: []}),
        lambda: a.compact(["w1"], Item("zs", 10)),
        lambda: a.record_span(t.turn, "recall", 10),
        lambda: a.end_turn(t.turn, 5_000),
        lambda: a.renew_turn(),
    ):
        with pytest.raises(TurnLost) as caught:
            call()
        assert caught.value.turn == t.turn and caught.value.rolled_back
        assert "taken over by B" in str(caught.value)
    assert whole(ledger, a) == before
    assert b.end_turn(t2.turn, 5_200).turn == t2.turn


def test_renewing_keeps_the_turn_and_its_end_commits_a_mark(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500, lease_ms=400)
    b = ledger.session(a.id, owner="B")
    for _ in range(4):
        time.sleep(0.2)
        renewed = a.renew_turn(lease_ms=400)
        assert renewed.turn == t.turn and renewed.lease_until_ms >= t.lease_until_ms
        with pytest.raises(TurnInProgress):
            b.begin_turn(0)
    a.end_turn(t.turn, 5_000, mark="checkpoint-1")
    nxt = b.begin_turn(0)
    assert nxt.mark == "checkpoint-1" and nxt.rolled_back is None
    b.abort_turn()
    assert b.begin_turn(0).mark == "checkpoint-1"  # a rolled-back turn commits no mark


def test_bad_lease_arguments_are_refused_before_anything_changes(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    before = whole(ledger, a)
    for kw in ({"lease_ms": 0}, {"lease_ms": 86_400_001}, {"lease_ms": 1.5}):
        with pytest.raises(InvalidArgument):
            a.begin_turn(0, **kw)  # type: ignore[arg-type]
    for owner in ("", "a b", "x" * 129, "a|b"):
        with pytest.raises(InvalidArgument):
            ledger.run(protocol.begin_turn(a.keys, new_op_id(), a.epoch, 0, None, owner, 1000))
    with pytest.raises(InvalidArgument):
        a.end_turn(0, 100, mark="not an id")
    with pytest.raises(InvalidArgument):  # no turn to abort or renew
        a.abort_turn()
    assert whole(ledger, a) == before


# --- deliveries --------------------------------------------------------------------------


def test_a_worker_compaction_is_staged_under_a_turn_and_delivered_once(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    before = whole(ledger, a)
    got = worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    assert got.outcome == "staged" and not got.compacted
    after = whole(ledger, a)
    changed = {k for k in {*before[0], *after[0]} if before[0].get(k) != after[0].get(k)}
    assert b"kp" in changed and changed <= {b"kp", b"gz", b"xp"}  # only the plan is stored
    assert after[1] == before[1] and not ledger.client.hgetall(a.keys.compacted)
    a.end_turn(t.turn, 5_000)
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0)  # it lands here, before this turn is gated, and is delivered to it
    assert t2.landed in ("compacted", "deferred", "failed"), t2
    assert t2.summaries == ("sum-1",) and set(t2.dropped) == {(W, "w1"), (R, "r1")}
    assert b"kp" not in ledger.client.hgetall(a.keys.session)
    b.abort_turn()  # ... which dies: delivered again to the next
    t3 = a.begin_turn(0)
    assert t3.summaries == ("sum-1",) and set(t3.dropped) == {(W, "w1"), (R, "r1")}
    a.end_turn(t3.turn, 5_000)
    t4 = b.begin_turn(0)  # done: once
    assert t4.summaries == () and t4.dropped == ()
    # A summary replaced before it was delivered leaves the queue; its drops stay.
    b.end_turn(t4.turn, 5_000)
    worker_compaction(ledger, a, ["w2"], Item("sum-2", 80, 1000))
    worker_compaction(ledger, a, ["sum-2", (R, "r2")], Item("sum-3", 90, 1000))
    t5 = a.begin_turn(0)
    assert t5.summaries == ("sum-3",) and set(t5.dropped) == {(W, "w2"), (R, "r2")}
    assert ledger.audit(a.id).clean


def test_a_summary_given_back_by_a_rollback_and_replaced_while_queued_leaves_the_queue(
    ledger: Ledger,
) -> None:
    """A summary delivered to a turn that is rolled back is queued again; a compaction
    that replaces it before a turn takes it again (staged under the dying turn and landed
    by the begin that rolls it back, or committed between turns) takes it out of the
    queue, as one never delivered: no later turn is given it, nor told to drop it, and
    what it replaced comes with the later summary (the history checker relies on this)."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    t = a.begin_turn(0)
    assert t.summaries == ("sum-1",) and set(t.dropped) == {(W, "w1"), (R, "r1")}
    got = worker_compaction(ledger, a, ["sum-1", (M, "m1")], Item("sum-2", 90, 1000))
    assert got.outcome == "staged"
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0, takeover=True)  # A's turn rolled back, then the plan lands
    assert t2.rolled_back == t.turn and t2.landed in ("compacted", "deferred", "failed"), t2
    assert t2.summaries == ("sum-2",)
    assert set(t2.dropped) == {(W, "w1"), (R, "r1"), (M, "m1")}
    b.abort_turn()  # once more, now between turns
    worker_compaction(ledger, a, ["sum-2", "w2"], Item("sum-3", 80, 1000))
    t3 = a.begin_turn(0)
    assert t3.summaries == ("sum-3",)
    assert set(t3.dropped) == {(W, "w1"), (R, "r1"), (M, "m1"), (W, "w2")}
    a.end_turn(t3.turn, 5_000)
    held = {i.id for i in ledger.items(a.id)}
    assert {"sum-1", "sum-2"}.isdisjoint(held) and "sum-3" in held
    t4 = b.begin_turn(0)
    assert t4.summaries == () and t4.dropped == ()
    assert ledger.audit(a.id).clean


def test_a_compaction_replaces_only_the_version_it_read(ledger: Ledger) -> None:
    """The compactor read w1 at one sequence number; w1 released and admitted again (new
    text) since: the commit leaves the new version."""
    a = loaded(ledger, "A")
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "w1")
    a.release(W, ["w1"])
    a.admit(W, [Item("w1", 450)])
    done = a.compact([(W, "w1", seq), (R, "r1")], Item("sum-v", 60))
    assert done.missing == ((W, "w1"),)
    held = {i.id: i.tokens for i in ledger.items(a.id)}
    assert held["w1"] == 450 and "r1" not in held


# --- any interleaving: a random turn, then its death ---------------------------------------


def random_turn(s: Session, rnd: random.Random, n: int) -> None:
    """n random calls of a turn (refusals and errors of its own are fine)."""
    ids = [f"x{i}" for i in range(8)]
    for k in range(n):
        c = rnd.choice([W, R, M, S])
        op = rnd.randrange(9)
        try:
            if op == 0:
                s.admit(c, [Item(rnd.choice(ids), rnd.randint(1, 2_500))], partial=True)
            elif op == 1:
                s.release(c, [rnd.choice(ids), "w1", "r1"][: rnd.randint(1, 3)])
            elif op == 2:
                s.admit_tool_result(rnd.choice(ids), rnd.randint(1, 9_000), b"{}")
            elif op == 3:
                s.reserve(c, f"res-{k}", rnd.randint(1, 900))
            elif op == 4:
                s.settle(rnd.choice(["res0", f"res-{k - 1}"]), rnd.randint(1, 900), f"set-{k}")
            elif op == 5:
                s.void(rnd.choice(["res0", f"res-{k - 1}"]))
            elif op == 6:
                s.reconcile({c: [Item(i, rnd.randint(1, 800)) for i in rnd.sample(ids, 2)]})
            elif op == 7:
                s.compact([(c, rnd.choice(ids)), (W, "w2")], Item(f"sum-{k}", rnd.randint(1, 300)))
            else:
                s.record_span(s.turn or 0, "recall", rnd.randint(0, 3_000))
        except Exception as exc:  # a refusal of the ledger's rules, not of the lease
            assert not isinstance(exc, (TurnLost, TurnInProgress)), exc


def test_any_turn_rolls_back_to_what_it_found(ledger: Ledger, backend: str) -> None:
    rounds = 4 if backend == "cluster" else 12
    for seed in range(rounds):
        rnd = random.Random(seed)
        a = loaded(ledger, "A")
        random_turn(a, rnd, 6)  # some history first, between turns
        before = state(ledger, a)
        t = a.begin_turn(rnd.choice([0, 2_000, 9_000]), output_reserve=rnd.choice([None, 1_500]))
        random_turn(a, rnd, 25)
        b = ledger.session(a.id, owner="B")
        assert b.begin_turn(0, takeover=True).rolled_back == t.turn
        b.abort_turn()
        assert state(ledger, a) == before, f"seed {seed}"
        assert ledger.audit(a.id).clean, f"seed {seed}"
