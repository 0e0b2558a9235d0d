"""The ledger's contract for retries and resets: an op id applies once (its outcome,
refusals included, is replayed; other arguments under it are refused), and a reset fences
the handles of the session's earlier epoch.

Every test takes the parametrized ``ledger`` (or ``aledger``) fixture, so it runs on the
embedded fakeredis backend, a real redis-server and a real Redis Cluster. Expected
numbers are computed from the budget, never hard-coded; the helpers are in
tests/support/contract.py.
"""

from __future__ import annotations

import pytest

from ledger import (
    AdmissionRefused,
    Consumer,
    Item,
    Ledger,
    OperationIdReused,
    Session,
    SessionBudget,
    StaleEpoch,
)
from ledger.models import Opened
from tests.support.contract import (
    RET,
    SCR,
    WM,
    base_free,
    check,
    open_fresh,
    state,
)

# --- at-most-once ---------------------------------------------------------------------


def test_same_op_id_applies_once(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    items = [Item("a", 120), Item("b", 80)]
    first = s.admit(RET, items, op_id="op-admit")
    assert s.admit(RET, items, op_id="op-admit") == first
    assert first.charged == 200
    assert s.snapshot().used[RET] == 200

    r1 = s.reserve(SCR, "q1", 50, op_id="op-reserve")
    # A retry is the stored outcome (same deadline), not a conflict.
    assert s.reserve(SCR, "q1", 50, op_id="op-reserve") == r1
    snap = s.snapshot()
    assert snap.open_reservations == 1 and snap.reserved[SCR] == 50

    st = s.settle("q1", 70, "q1-item", op_id="op-settle")
    assert s.settle("q1", 70, "q1-item", op_id="op-settle") == st
    assert st.free == free - 200 - 70

    s.reserve(SCR, "q2", 30)
    vd = s.void("q2", op_id="op-void")
    assert s.void("q2", op_id="op-void") == vd
    assert vd.free == free - 270

    rel = s.release(RET, ["a"], op_id="op-release")
    s.admit(RET, [Item("a", 120)])  # held again: a replayed release must not free it
    assert s.release(RET, ["a"], op_id="op-release") == rel
    snap = check(ledger, s, budget)
    assert snap.used[RET] == 200 and snap.used[SCR] == 70 and snap.open_reservations == 0
    assert snap.free == free - 270


def test_same_op_id_with_other_arguments_is_refused(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(RET, [Item("a", 120)], op_id="op-1")
    s.reserve(SCR, "q1", 10, op_id="op-2")
    before = state(s)
    reuses = [
        lambda: s.admit(RET, [Item("a", 121)], op_id="op-1"),
        lambda: s.admit(RET, [Item("a", 120)], partial=True, op_id="op-1"),
        lambda: s.admit(SCR, [Item("a", 120)], op_id="op-1"),
        lambda: s.release(RET, ["a"], op_id="op-1"),
        lambda: s.reserve(SCR, "q1", 11, op_id="op-2"),
        lambda: s.settle("q1", 10, "x", op_id="op-2"),
        lambda: s.void("q1", op_id="op-2"),
        lambda: s.reset("why", op_id="op-1"),
        lambda: s.delete(op_id="op-2"),
    ]
    for call in reuses:
        with pytest.raises(OperationIdReused):
            call()
    assert state(s) == before
    check(ledger, s, budget)


def test_refusal_outcome_is_replayed(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.admit(SCR, [Item("filler", free)])
    with pytest.raises(AdmissionRefused) as first:
        s.admit(RET, [Item("doc", 10)], op_id="op-refused")
    with pytest.raises(AdmissionRefused) as reserve_first:
        s.reserve(RET, "q1", 10, op_id="op-refused-r")
    s.release(SCR, ["filler"])
    # There is room now, but the retry gets the outcome the first attempt got.
    with pytest.raises(AdmissionRefused) as again:
        s.admit(RET, [Item("doc", 10)], op_id="op-refused")
    with pytest.raises(AdmissionRefused) as reserve_again:
        s.reserve(RET, "q1", 10, op_id="op-refused-r")
    for a, b in ((first, again), (reserve_first, reserve_again)):
        assert (a.value.reason, a.value.requested, a.value.free) == ("floor_protected", 10, 0)
        assert (b.value.reason, b.value.requested, b.value.free) == ("floor_protected", 10, 0)
        assert a.value.detail == b.value.detail
    snap = check(ledger, s, budget)
    assert snap.refusals == 2
    assert snap.free == free and snap.items[RET] == 0 and snap.open_reservations == 0


# --- epoch fencing --------------------------------------------------------------------


def test_reset_fences_stale_handles(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    old = ledger.session(s.id)
    e0 = s.epoch
    assert old.epoch == e0
    s.admit(RET, [Item("a", 100), Item("b", 200)])
    old.admit(WM, [Item("t1", 50)])
    s.reserve(SCR, "q-old", 300)
    done = s.reset("context-overflow", op_id="reset-1")
    assert (done.epoch, done.dropped, done.released) == (e0 + 1, 3, 100 + 200 + 50 + 300)
    snap = check(ledger, s, budget)
    assert snap.epoch == e0 + 1 and snap.free == free and snap.open_reservations == 0
    assert all(snap.used[c] == snap.reserved[c] == snap.items[c] == 0 for c in Consumer)
    assert ledger.client.zcard(s.keys.deadlines) == 0

    assert s.epoch == e0 + 1  # the resetting handle takes the new epoch ...
    assert old.epoch == e0  # ... every other one is stale until refresh()
    s.admit(RET, [Item("after", 10)])  # so its next call is accepted
    s.release(RET, ["after"])

    # A reset delivered twice applies once: the same request (same op id, same
    # epoch) gets the stored outcome; another op id at the old epoch is fenced.
    retry = Session(ledger, s.keys, e0)
    assert retry.reset("context-overflow", op_id="reset-1") == done
    assert retry.epoch == e0 + 1  # (a replay adopts the epoch its first reply named)
    with pytest.raises(StaleEpoch):
        Session(ledger, s.keys, e0).reset("context-overflow")
    snap = check(ledger, s, budget)
    assert snap.epoch == e0 + 1 and snap.free == free
    assert int(ledger.client.hget(s.keys.session, "x:resets")) == 1

    fresh = ledger.session(s.id)
    assert fresh.epoch == e0 + 1
    fresh.admit(RET, [Item("c", 10)])
    fresh.reserve(SCR, "q-new", 20)
    before = state(s)
    stale_calls = [
        lambda: old.admit(RET, [Item("d", 1)]),
        lambda: old.release(RET, ["c"]),
        lambda: old.reserve(SCR, "q-x", 1),
        lambda: old.settle("q-new", 20, "q-new-item"),
        lambda: old.void("q-new"),
        lambda: old.delete(),
    ]
    for call in stale_calls:
        with pytest.raises(StaleEpoch):
            call()
    assert state(s) == before

    assert old.refresh() == e0 + 1
    assert old.admit(RET, [Item("d", 1)]).free == free - 10 - 20 - 1
    assert old.settle("q-new", 20, "q-new-item").free == free - 31
    # An epoch from the future is not this session's either (an earlier incarnation whose
    # resets ran ahead, or writes a failover lost): stale too, and nothing changes.
    ahead = ledger.session(s.id)
    ahead.epoch = e0 + 2
    with pytest.raises(StaleEpoch, match="newer than the session epoch"):
        ahead.admit(RET, [Item("e", 1)])
    # Reopening with the same budget confirms the session at its current epoch.
    assert ledger.run(ledger.open_call(s.id, budget, None)) == Opened(False, e0 + 1, 0)
    snap = check(ledger, s, budget)
    assert snap.used[RET] == 11 and snap.used[SCR] == 20 and snap.free == free - 31


def test_reset_retried_on_the_same_handle_applies_once(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = open_fresh(ledger, budget)
    e0 = s.epoch
    call = s.reset_call("why", op_id="reset-1")  # sent twice: its first reply was lost
    done = ledger.run(call)
    try:
        assert ledger.run(call) == done
    finally:
        assert s.snapshot().epoch == s.epoch == e0 + 1  # once, and the handle follows
        check(ledger, s, budget)


def test_settle_of_a_pre_reset_reservation_is_stale(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    worker = ledger.session(s.id)
    worker.reserve(SCR, "q1", 100)
    s.reset("why")
    before = state(s)
    try:
        with pytest.raises(StaleEpoch):
            worker.settle("q1", 100, "q1-item")
    finally:
        assert state(s) == before
        check(ledger, s, budget)
