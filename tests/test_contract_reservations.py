"""The ledger's contract for reservations: reserve, settle and void, their refusals,
deadlines and expiry.

Every test takes the parametrized ``ledger`` (or ``aledger``) fixture, so it runs on the
embedded fakeredis backend, a real redis-server and a real Redis Cluster. Expected
numbers are computed from the budget, never hard-coded; the helpers are in
tests/support/contract.py.
"""

from __future__ import annotations

import time

import pytest

from ledger import (
    AdmissionRefused,
    Item,
    Ledger,
    ReservationExpired,
    SessionBudget,
    SessionConflict,
    UnknownReservation,
)
from tests.support.contract import (
    REC,
    RET,
    SCR,
    allocation,
    base_free,
    check,
    open_fresh,
    state,
)


def test_reserve_holds_tokens(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    r = s.reserve(SCR, "tool-1", 500, lease_ms=10_000)
    assert (r.id, r.free, r.epoch, r.turn) == ("tool-1", free - 500, s.epoch, 0)
    snap = check(ledger, s, budget)
    assert 0 < r.deadline_ms - snap.now_ms <= 10_000
    assert snap.free == free - 500
    assert snap.open_reservations == 1
    assert snap.reserved[SCR] == 500 and snap.used[SCR] == 0 and snap.items[SCR] == 0
    report = ledger.audit(s.id)
    assert report.overdue == ()
    # Refused when the estimate does not fit; nothing is held.
    before = allocation(s)
    with pytest.raises(AdmissionRefused) as info:
        s.reserve(RET, "tool-2", free - 500 + 1)
    assert (info.value.reason, info.value.requested, info.value.free) == (
        "floor_protected",  # working memory's floor is unused: the room is reserved
        free - 500 + 1,
        free - 500,
    )
    assert allocation(s) == before
    check(ledger, s, budget)


def test_settle_lower_and_higher_than_the_estimate(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.reserve(RET, "q1", 500)
    low = s.settle("q1", 300, "chunk-1", priority=7)
    assert (low.reservation, low.item, low.charged, low.free) == ("q1", "chunk-1", 300, free - 300)
    snap = check(ledger, s, budget)
    assert (snap.used[RET], snap.items[RET], snap.reserved[RET]) == (300, 1, 0)
    assert snap.open_reservations == 0

    assert s.reserve(RET, "q2", 500).free == free - 300 - 500
    high = s.settle("q2", 800, "chunk-2")
    assert (high.charged, high.free) == (800, free - 300 - 800)
    snap = check(ledger, s, budget)
    assert (snap.used[RET], snap.items[RET], snap.reserved[RET]) == (1_100, 2, 0)
    # A settled item is an ordinary item: release gives its actual size back.
    rel = s.release(RET, ["chunk-2"])
    assert (rel.released, rel.free) == (800, free - 300)
    # Settled means closed: neither settle nor void find it again.
    with pytest.raises(UnknownReservation):
        s.settle("q2", 800, "chunk-3")
    with pytest.raises(UnknownReservation):
        s.void("q2")
    check(ledger, s, budget)


def test_settle_that_does_not_fit_keeps_the_reservation(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.reserve(SCR, "q1", 100)
    s.admit(RET, [Item("filler", free - 100 - 50)])
    before = allocation(s)
    with pytest.raises(AdmissionRefused) as info:
        s.settle("q1", 100 + 51, "out-1")
    assert (info.value.reason, info.value.requested, info.value.free) == (
        "floor_protected",
        151,
        50,
    )
    assert allocation(s) == before
    snap = check(ledger, s, budget)
    assert snap.open_reservations == 1 and snap.reserved[SCR] == 100 and snap.refusals == 1
    got = s.settle("q1", 100 + 50, "out-1")
    assert (got.charged, got.free) == (150, 0)
    snap = check(ledger, s, budget)
    assert snap.open_reservations == 0 and snap.used[SCR] == 150


def test_settle_into_a_held_item_conflicts(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(RET, [Item("chunk", 10)])
    s.reserve(RET, "q1", 20)
    before = state(s)
    with pytest.raises(SessionConflict):
        s.settle("q1", 20, "chunk")
    assert state(s) == before
    assert s.settle("q1", 20, "chunk-b").charged == 20
    check(ledger, s, budget)


def test_void_releases_and_unknown_reservations(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.reserve(REC, "q1", 700)
    got = s.void("q1")
    assert (got.reservation, got.released, got.free) == ("q1", 700, free)
    snap = check(ledger, s, budget)
    assert snap.open_reservations == 0 and snap.reserved[REC] == 0 and snap.items[REC] == 0
    before = state(s)
    with pytest.raises(UnknownReservation):
        s.void("q1")
    with pytest.raises(UnknownReservation):
        s.settle("never", 10, "x")
    with pytest.raises(UnknownReservation):
        s.void("never")
    assert state(s) == before
    check(ledger, s, budget)


def test_reservation_id_reused_while_open_conflicts(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.reserve(SCR, "q1", 100)
    before = state(s)
    for consumer in (SCR, RET):
        with pytest.raises(SessionConflict):
            s.reserve(consumer, "q1", 100)
    assert state(s) == before
    s.void("q1")
    # Once closed, the id can be used again.
    assert s.reserve(RET, "q1", 60).free == free - 60
    assert s.settle("q1", 60, "q1-item").free == free - 60
    assert s.reserve(RET, "q1", 40).free == free - 100
    snap = check(ledger, s, budget)
    assert snap.open_reservations == 1 and snap.reserved[RET] == 40 and snap.used[RET] == 60


def test_settle_after_the_deadline_then_expiry(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    s.reserve(SCR, "slow", 300, lease_ms=50)
    s.reserve(RET, "live", 200, lease_ms=60_000)
    time.sleep(0.2)
    before = state(s)
    with pytest.raises(ReservationExpired):
        s.settle("slow", 300, "late-item")
    assert state(s) == before
    report = ledger.audit(s.id)
    assert report.clean and report.overdue == ("slow",)

    assert ledger.expire_due(s.keys.partition) == 1
    snap = check(ledger, s, budget)
    assert snap.free == free - 200
    assert snap.open_reservations == 1 and snap.reserved[SCR] == 0 and snap.reserved[RET] == 200
    assert snap.expirations == 1
    assert ledger.audit(s.id).overdue == ()
    with pytest.raises(UnknownReservation):
        s.settle("slow", 300, "late-item")
    # Nothing more is due; the live reservation still settles.
    assert ledger.expire_due(s.keys.partition) == 0
    assert s.settle("live", 200, "on-time").free == free - 200
    check(ledger, s, budget)
