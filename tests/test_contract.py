"""The ledger's contract: every operation, every refusal and the invariants.

Every test takes the parametrized ``ledger`` (or ``aledger``) fixture, so the whole
suite runs on the embedded fakeredis backend, a real redis-server and a real Redis
Cluster. Expected numbers are computed from the budget, never hard-coded.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ledger import (
    AdmissionRefused,
    AsyncLedger,
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    OperationIdReused,
    ReservationExpired,
    Session,
    SessionBudget,
    SessionConflict,
    Snapshot,
    StaleEpoch,
    UnknownReservation,
    UnknownSession,
)
from ledger.models import Opened

WM, RET, REC, SCR = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)
EXHAUSTED = "token_budget_exhausted"


# --- helpers --------------------------------------------------------------------------


def new_sid() -> str:
    return f"tenant-c/s-{uuid.uuid4().hex[:12]}"


def base_free(b: SessionBudget) -> int:
    """Free tokens of an empty session: the window minus the reserved floor."""
    return b.window - b.reserved_floor


def floors_budget() -> SessionBudget:
    """Both floors non-zero: 10k window, 2k working-memory floor, 1.5k minimum memory."""
    return SessionBudget(
        window=10_000,
        system_prompt=1_000,
        working_memory_floor=2_000,
        min_memory=1_500,
        tool_framing=100,
        output_reserve=400,
    )


def state(s: Session) -> dict[str, int]:
    """Every stored number of the session except the clock."""
    raw = dict(s.snapshot().raw)
    del raw["now"]
    return raw


def allocation(s: Session) -> dict[str, int]:
    """The allocation only: what a refusal or a fenced call must leave alone."""
    return {k: v for k, v in state(s).items() if not k.startswith("x:")}


def expected_free(b: SessionBudget, snap: Snapshot) -> int:
    active = {c: snap.used[c] + snap.reserved[c] for c in Consumer}
    return (
        b.window
        - b.system_prompt
        - b.tool_framing
        - b.output_reserve
        - max(active[WM], b.working_memory_floor)
        - max(active[RET] + active[REC], b.min_memory)
        - active[SCR]
    )


def check(ledger: Ledger, s: Session, b: SessionBudget) -> Snapshot:
    """The invariants every session must satisfy after any sequence of calls."""
    snap = s.snapshot()
    assert snap.free >= 0
    assert snap.free == expected_free(b, snap)
    wm = snap.used[WM] + snap.reserved[WM]
    assert snap.residual_working_memory == snap.free + max(wm, b.working_memory_floor)
    occupancy = (
        b.system_prompt + b.tool_framing + sum(snap.used.values()) + sum(snap.reserved.values())
    )
    assert snap.occupancy == occupancy
    assert snap.utilization == pytest.approx(occupancy / b.window)
    report = ledger.audit(s.id)
    assert report.clean, report.problems
    assert report.problems == ()
    assert report.session_id == s.id
    return snap


def assert_new_epoch(epoch: int) -> None:
    """A new session's epoch is Redis's clock in ms (above every earlier incarnation's)."""
    assert 1_600_000_000_000 < epoch < 10**14, epoch


def open_fresh(ledger: Ledger, b: SessionBudget) -> Session:
    s = ledger.open_session(new_sid(), b)
    assert_new_epoch(s.epoch)
    return s


# --- open -----------------------------------------------------------------------------


def test_open_creates_then_confirms(ledger: Ledger, budget: SessionBudget) -> None:
    sid = new_sid()
    first = ledger.run(ledger.open_call(sid, budget, None))
    e0 = first.epoch
    assert_new_epoch(e0)
    assert first == Opened(created=True, epoch=e0, turn=0)
    again = ledger.run(ledger.open_call(sid, budget, None))
    assert again == Opened(created=False, epoch=e0, turn=0)
    s = ledger.open_session(sid, budget)
    assert s.epoch == e0
    snap = s.snapshot()
    assert (snap.window, snap.system_prompt, snap.tool_framing, snap.output_reserve) == (
        budget.window,
        budget.system_prompt,
        budget.tool_framing,
        budget.output_reserve,
    )
    assert snap.working_memory_floor == budget.working_memory_floor
    assert snap.min_memory == budget.min_memory
    assert snap.high_water_mark == budget.high_water_tokens
    assert snap.eviction_threshold == budget.eviction_tokens
    assert snap.free == base_free(budget)
    assert snap.epoch == e0 and snap.turn == 0
    assert snap.open_reservations == 0 and snap.refusals == 0 and snap.expirations == 0
    assert all(snap.used[c] == snap.reserved[c] == snap.items[c] == 0 for c in Consumer)
    check(ledger, s, budget)


def test_open_replayed_with_same_op_id(ledger: Ledger, budget: SessionBudget) -> None:
    sid = new_sid()
    first = ledger.run(ledger.open_call(sid, budget, "open-1"))
    assert first.created
    # The stored outcome is sent again, created flag included.
    assert ledger.run(ledger.open_call(sid, budget, "open-1")) == first
    other = budget.model_copy(update={"system_prompt": budget.system_prompt + 1})
    with pytest.raises(OperationIdReused):
        ledger.run(ledger.open_call(sid, other, "open-1"))
    check(ledger, ledger.session(sid), budget)


def test_open_with_another_budget_conflicts(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(RET, [Item("d1", 10)])
    before = state(s)
    other = SessionBudget(
        window=budget.window,
        system_prompt=budget.system_prompt + 1,
        working_memory_floor=budget.working_memory_floor,
        tool_framing=budget.tool_framing,
        output_reserve=budget.output_reserve,
    )
    with pytest.raises(SessionConflict):
        ledger.open_session(s.id, other)
    assert state(s) == before
    check(ledger, s, budget)


def test_floor_larger_than_window_is_a_configuration_error(ledger: Ledger) -> None:
    with pytest.raises(ConfigurationError, match="exceeds window"):
        SessionBudget(window=1_000, system_prompt=600, output_reserve=300, tool_framing=101)
    # Exactly the window is allowed and leaves nothing free.
    b = SessionBudget(window=1_000, system_prompt=600, output_reserve=300, tool_framing=100)
    s = open_fresh(ledger, b)
    assert s.snapshot().free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(SCR, [Item("x", 1)])
    check(ledger, s, b)


def test_open_accepts_every_valid_budget(ledger: Ledger) -> None:
    b = SessionBudget(window=1, system_prompt=0)
    s = open_fresh(ledger, b)
    check(ledger, s, b)


# --- admit ----------------------------------------------------------------------------


def test_admit_charges_a_batch_in_one_call(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free0 = base_free(budget)
    got = s.admit(RET, [Item("doc7#3", 410), Item("doc9#1", 388, priority=5)])
    assert (got.charged, got.admitted, got.duplicates, got.skipped) == (410 + 388, 2, 0, ())
    assert got.free == free0 - 410 - 388
    assert (got.epoch, got.turn) == (s.epoch, 0)
    snap = check(ledger, s, budget)
    assert snap.used[RET] == 410 + 388 and snap.items[RET] == 2
    assert snap.free == got.free

    # Re-admitting a held id charges nothing and counts as a duplicate.
    again = s.admit(RET, [Item("doc7#3", 410), Item("doc2#0", 77)])
    assert (again.charged, again.admitted, again.duplicates) == (77, 1, 1)
    assert again.free == free0 - 410 - 388 - 77
    # The same id under another consumer is another item.
    other = s.admit("recall", [Item("doc7#3", 410)])
    assert (other.charged, other.admitted, other.duplicates) == (410, 1, 0)
    snap = check(ledger, s, budget)
    assert snap.used[RET] == 410 + 388 + 77 and snap.items[RET] == 3
    assert snap.used[REC] == 410 and snap.items[REC] == 1
    assert snap.free == free0 - 410 - 388 - 77 - 410


def test_admit_all_mode_refuses_the_whole_batch(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(SCR, [Item("held", 1_000)])
    free = base_free(budget) - 1_000
    before = state(s)
    batch = [Item("held", 1_000), Item("a", 100), Item("b", 200), Item("c", free - 300 + 1)]
    with pytest.raises(AdmissionRefused) as info:
        s.admit(SCR, batch)
    # The room exists, but inside working memory's unused floor: the honest reason.
    assert info.value.reason == "floor_protected"
    assert info.value.requested == free + 1  # new items only: the held one charges nothing
    assert info.value.free == free
    after = state(s)
    assert after["x:refused"] == before["x:refused"] + 1
    assert {k: v for k, v in after.items() if k != "x:refused"} == {
        k: v for k, v in before.items() if k != "x:refused"
    }
    assert s.release(SCR, ["a", "b", "c"]).missing == ("a", "b", "c")
    # One token less fits exactly.
    ok = s.admit(SCR, [*batch[:3], Item("c", free - 300)])
    assert (ok.charged, ok.admitted, ok.duplicates, ok.free) == (free, 3, 1, 0)
    check(ledger, s, budget)


def test_admit_partial_takes_the_longest_prefix(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    got = s.admit(
        RET,
        [Item("a", 100), Item("b", free - 100 + 1), Item("c", 1), Item("d", 1)],
        partial=True,
    )
    # c would fit on its own, but only a prefix is admitted.
    assert (got.charged, got.admitted, got.duplicates) == (100, 1, 0)
    assert got.skipped == ("b", "c", "d")
    assert got.free == free - 100
    snap = check(ledger, s, budget)
    assert snap.items[RET] == 1 and snap.used[RET] == 100

    # Not even the first new item fits: a prefix admission that admits nothing is a
    # refusal, and it names the first item's tokens.
    before = allocation(s)
    with pytest.raises(AdmissionRefused) as nothing:
        s.admit(RET, [Item("big", free), Item("a", 100)], partial=True)
    assert (nothing.value.requested, nothing.value.free) == (free, free - 100)
    assert allocation(s) == before

    everything = s.admit(RET, [Item("e", 5), Item("f", free - 105)], partial=True)
    assert (everything.charged, everything.admitted, everything.skipped) == (free - 100, 2, ())
    assert everything.free == 0
    snap = check(ledger, s, budget)
    assert snap.free == 0 and snap.items[RET] == 3


def test_working_memory_floor_is_untouchable(ledger: Ledger, budget: SessionBudget) -> None:
    floor = budget.working_memory_floor
    assert floor > 0 and budget.min_memory == 0
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    for consumer in (RET, REC, SCR):
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("over", free + 1)])
        assert (info.value.requested, info.value.free) == (free + 1, free)
        with pytest.raises(AdmissionRefused):
            s.reserve(consumer, "r-over", free + 1)
    assert s.admit(RET, [Item("r", free - 10)]).free == 10
    assert s.admit(SCR, [Item("s", 10)]).free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(REC, [Item("m", 1)])
    # Working memory still gets its whole floor, and not one token more.
    got = s.admit(WM, [Item("turn-1", floor - 1), Item("turn-2", 1)])
    assert (got.charged, got.free) == (floor, 0)
    with pytest.raises(AdmissionRefused) as info:
        s.admit(WM, [Item("turn-3", 1)])
    assert (info.value.requested, info.value.free) == (1, 0)
    # Giving working memory back frees nothing for the others: it returns to the floor.
    assert s.release(WM, ["turn-1", "turn-2"]).free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(SCR, [Item("s2", 1)])
    snap = check(ledger, s, budget)
    assert snap.refusals == 3 * 2 + 3
    assert snap.used[WM] == 0 and snap.free == 0


def test_working_memory_inside_its_floor_costs_no_free(
    ledger: Ledger, budget: SessionBudget
) -> None:
    floor = budget.working_memory_floor
    s = open_fresh(ledger, budget)
    free = base_free(budget)
    assert s.admit(WM, [Item("t1", floor - 1)]).free == free
    r = s.reserve(WM, "wm-r", 1)
    assert r.free == free
    assert s.admit(WM, [Item("t2", 2)]).free == free - 2
    assert s.void("wm-r").free == free - 1
    assert s.release(WM, ["t1"]).free == free
    snap = check(ledger, s, budget)
    assert snap.used[WM] == 2 and snap.items[WM] == 1


def test_min_memory_floor_is_untouchable(ledger: Ledger) -> None:
    b = floors_budget()
    s = open_fresh(ledger, b)
    free = base_free(b)
    # Retrieval and recall share the minimum-memory floor: inside it they cost nothing.
    assert s.admit(RET, [Item("r1", b.min_memory - 500)]).free == free
    assert s.admit(REC, [Item("m1", 499)]).free == free
    assert s.admit(REC, [Item("m2", 2)]).free == free - 1
    assert s.release(REC, ["m2"]).free == free
    # Scratchpad and working memory cannot reach into the memory floor.
    for consumer in (SCR, WM):
        over = free + 1 + (b.working_memory_floor if consumer is WM else 0)
        with pytest.raises(AdmissionRefused) as info:
            s.admit(consumer, [Item("over", over)])
        assert (info.value.requested, info.value.free) == (over, free)
    assert s.admit(SCR, [Item("s1", free)]).free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(SCR, [Item("s2", 1)])
    # What is left of both floors is still there for their owners.
    assert s.admit(REC, [Item("m3", 1)]).free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(RET, [Item("r2", 1)])
    assert s.admit(WM, [Item("t1", b.working_memory_floor)]).free == 0
    with pytest.raises(AdmissionRefused):
        s.admit(WM, [Item("t2", 1)])
    snap = check(ledger, s, b)
    assert snap.used[RET] + snap.used[REC] == b.min_memory
    assert snap.used[WM] == b.working_memory_floor
    assert snap.used[SCR] == free


def test_invalid_arguments_change_nothing(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(RET, [Item("a", 5)])
    before = state(s)
    bad_calls = [
        lambda: s.admit(RET, [Item("zero", 0)]),
        lambda: s.admit(RET, [Item("neg", -3)]),
        lambda: s.admit(RET, [Item("has space", 3)]),
        lambda: s.admit(RET, [Item("twice", 3), Item("twice", 4)]),
        lambda: s.admit(RET, []),
        lambda: s.admit("compressor", [Item("x", 3)]),
        lambda: s.admit(RET, [Item("p", 3, priority=1001)]),
        lambda: s.release(RET, []),
        lambda: s.release(RET, ["a", "a"]),
        lambda: s.reserve(SCR, "r{1}", 5),
        lambda: s.reserve(SCR, "r1", 0),
        lambda: s.reserve(SCR, "r1", 5, lease_ms=0),
        lambda: s.admit(RET, [Item("x", 3)], op_id="bad op id"),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgument):
            call()
    assert state(s) == before
    check(ledger, s, budget)


# --- release --------------------------------------------------------------------------


def test_release_frees_tokens_and_reports_missing(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    empty = state(s)
    free = base_free(budget)
    s.admit(RET, [Item("a", 100), Item("b", 200), Item("c", 300)])
    s.admit(SCR, [Item("a", 40)])
    got = s.release(RET, ["a", "c", "ghost"])
    assert (got.released, got.count, got.missing) == (400, 2, ("ghost",))
    assert got.free == free - 200 - 40
    assert (got.epoch, got.turn) == (s.epoch, 0)
    snap = check(ledger, s, budget)
    assert (snap.used[RET], snap.items[RET], snap.used[SCR]) == (200, 1, 40)
    # A released id is missing the second time; the scratchpad's "a" is untouched.
    again = s.release(RET, ["a"])
    assert (again.released, again.count, again.missing, again.free) == (0, 0, ("a",), got.free)
    s.release(RET, ["b"])
    s.release(SCR, ["a"])
    after = state(s)
    # Counters are back where they started; only the item sequence moved on.
    assert after["sq"] == empty["sq"] + 4
    assert {k: v for k, v in after.items() if k != "sq"} == {
        k: v for k, v in empty.items() if k != "sq"
    }
    check(ledger, s, budget)


# --- reserve / settle / void ----------------------------------------------------------


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


# --- snapshot -------------------------------------------------------------------------


def test_snapshot_fields_are_consistent(ledger: Ledger) -> None:
    b = floors_budget()
    s = open_fresh(ledger, b)
    s.admit(WM, [Item("t1", 1_200), Item("t2", 1_300)])  # 500 above its floor
    s.admit(RET, [Item("r1", 400)])
    s.admit(REC, [Item("m1", 300), Item("m2", 100)])  # memory 800: inside its floor
    s.admit(SCR, [Item("s1", 250)])
    s.reserve(SCR, "q1", 150)
    s.reserve(RET, "q2", 600)  # memory 1400: still inside
    s.reserve(WM, "q3", 50)
    snap = check(ledger, s, b)
    assert snap.used == {WM: 2_500, RET: 400, REC: 400, SCR: 250}
    assert snap.items == {WM: 2, RET: 1, REC: 2, SCR: 1}
    assert snap.reserved == {WM: 50, RET: 600, REC: 0, SCR: 150}
    assert snap.open_reservations == 3
    wm, memory, scratch = 2_500 + 50, 400 + 600 + 400, 250 + 150
    assert memory < b.min_memory < wm - b.working_memory_floor + memory
    free = (
        b.window - b.system_prompt - b.tool_framing - b.output_reserve - wm - b.min_memory - scratch
    )
    assert snap.free == free
    assert snap.residual_working_memory == free + wm
    assert snap.utilization == pytest.approx(
        (b.system_prompt + b.tool_framing + wm + memory + scratch) / b.window
    )
    assert (snap.window, snap.working_memory_floor, snap.min_memory) == (
        b.window,
        b.working_memory_floor,
        b.min_memory,
    )
    assert snap.epoch == s.epoch and snap.refusals == 0 and snap.expirations == 0
    assert snap.raw["fr"] == free and snap.raw["nv"] == 3


# --- close ----------------------------------------------------------------------------


def test_close_then_everything_is_unknown(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    s.admit(RET, [Item("a", 10)])
    s.reserve(SCR, "q1", 20, lease_ms=50)
    check(ledger, s, budget)
    assert s.delete(op_id="delete-1").deleted is True
    assert s.delete(op_id="delete-1").deleted is True  # the retry gets deleted=1 back
    assert s.delete().deleted is False  # a new delete finds nothing
    # Closing dropped the reservation's deadline-index entry.
    assert ledger.client.zcard(s.keys.deadlines) == 0
    time.sleep(0.1)
    assert ledger.expire_due(s.keys.partition) == 0
    calls = [
        lambda: s.admit(RET, [Item("b", 1)]),
        lambda: s.release(RET, ["a"]),
        lambda: s.reserve(SCR, "q2", 1),
        lambda: s.settle("q1", 20, "x"),
        lambda: s.void("q1"),
        lambda: s.reset("why"),
        lambda: s.snapshot(),
        lambda: s.refresh(),
        lambda: ledger.audit(s.id),
        lambda: ledger.session(s.id),
    ]
    for call in calls:
        with pytest.raises(UnknownSession):
            call()
    # The id can be opened again, from scratch, at a later epoch: handles of the closed
    # session stay fenced (and so do its queued jobs, by the session's creation stamp).
    again = ledger.run(ledger.open_call(s.id, budget, None))
    assert again.created and again.turn == 0 and again.epoch > s.epoch
    snap = check(ledger, s, budget)
    assert snap.free == base_free(budget) and snap.items[RET] == 0
    with pytest.raises(StaleEpoch):
        s.admit(RET, [Item("late", 1)])


def test_close_is_fenced_by_epoch(ledger: Ledger, budget: SessionBudget) -> None:
    s = open_fresh(ledger, budget)
    old = ledger.session(s.id)
    s.reset("why")
    with pytest.raises(StaleEpoch):
        old.delete()
    check(ledger, s, budget)
    s.refresh()
    assert s.delete().deleted is True
    with pytest.raises(UnknownSession):
        s.snapshot()


def test_unknown_session(ledger: Ledger, budget: SessionBudget) -> None:
    ghost = Session(ledger, ledger.keyspace.session(new_sid()), 1)
    with pytest.raises(UnknownSession):
        ghost.admit(RET, [Item("a", 1)])
    with pytest.raises(UnknownSession):
        ghost.release(RET, ["a"])
    with pytest.raises(UnknownSession):
        ghost.reserve(RET, "q1", 1)
    with pytest.raises(UnknownSession):
        ghost.void("q1")
    with pytest.raises(UnknownSession):
        ghost.snapshot()
    with pytest.raises(UnknownSession):
        ledger.session(ghost.id)
    assert ghost.delete().deleted is False


# --- asyncio face ---------------------------------------------------------------------


async def test_async_admit_reserve_settle(aledger: AsyncLedger, budget: SessionBudget) -> None:
    free = base_free(budget)
    s = await aledger.open_session(new_sid(), budget)
    assert_new_epoch(s.epoch)
    got = await s.admit(RET, [Item("a", 300), Item("b", 200)])
    assert (got.charged, got.admitted, got.free) == (500, 2, free - 500)
    r = await s.reserve(SCR, "q1", 400)
    assert r.free == free - 900
    st = await s.settle("q1", 350, "q1-item")
    assert (st.charged, st.free) == (350, free - 850)
    with pytest.raises(AdmissionRefused) as info:
        await s.admit(SCR, [Item("big", free - 850 + 1)])
    assert (info.value.requested, info.value.free) == (free - 850 + 1, free - 850)
    snap = await s.snapshot()
    assert snap.free == free - 850 == expected_free(budget, snap)
    assert snap.used[RET] == 500 and snap.used[SCR] == 350 and snap.open_reservations == 0
    assert snap.refusals == 1
    report = await aledger.audit(s.id)
    assert report.clean and report.problems == ()


async def test_async_fencing_and_expiry(aledger: AsyncLedger, budget: SessionBudget) -> None:
    free = base_free(budget)
    s = await aledger.open_session(new_sid(), budget)
    e0 = s.epoch
    old = await aledger.session(s.id)
    await s.reserve(RET, "short", 100, lease_ms=50)
    first = await s.admit(RET, [Item("a", 10)], op_id="op-a")
    assert await s.admit(RET, [Item("a", 10)], op_id="op-a") == first
    await asyncio.sleep(0.2)
    with pytest.raises(ReservationExpired):
        await s.settle("short", 100, "x")
    assert await aledger.expire_due(s.keys.partition) == 1
    with pytest.raises(UnknownReservation):
        await s.settle("short", 100, "x")
    done = await s.reset("async-reset")
    assert (done.epoch, done.dropped, done.released) == (e0 + 1, 1, 10)
    assert s.epoch == e0 + 1  # the resetting handle follows; every other one is stale
    with pytest.raises(StaleEpoch):
        await old.admit(RET, [Item("b", 1)])
    with pytest.raises(StaleEpoch):
        await old.delete()
    assert await old.refresh() == e0 + 1
    assert (await old.admit(RET, [Item("b", 1)])).free == free - 1
    report = await aledger.audit(s.id)
    assert report.clean
    assert (await old.delete(op_id="delete-1")).deleted is True
    assert (await old.delete(op_id="delete-1")).deleted is True
    with pytest.raises(UnknownSession):
        await old.snapshot()


# --- no over-allocation (docs/rules.md#budget-and-claims), a mixed random sequence -----


@dataclass
class Model:
    """What the ledger should hold: items per consumer and open reservations."""

    b: SessionBudget
    items: dict[Consumer, dict[str, int]] = field(default_factory=lambda: {c: {} for c in Consumer})
    res: dict[str, tuple[Consumer, int]] = field(default_factory=dict)

    def group(self, c: Consumer) -> tuple[tuple[Consumer, ...], int]:
        if c is WM:
            return (WM,), self.b.working_memory_floor
        if c in (RET, REC):
            return (RET, REC), self.b.min_memory
        return (SCR,), 0

    def active(self, members: tuple[Consumer, ...]) -> int:
        held = sum(sum(self.items[c].values()) for c in members)
        return held + sum(t for c, t in self.res.values() if c in members)

    def delta(self, c: Consumer, d: int) -> int:
        members, floor = self.group(c)
        a = self.active(members)
        return max(a + d, floor) - max(a, floor)

    def reason(self, growth: int) -> str:
        """floor_protected when the unclaimed room (floors ignored) would hold the growth."""
        b = self.b
        room = (
            b.window
            - b.system_prompt
            - b.tool_framing
            - b.output_reserve
            - self.active((WM,))
            - self.active((RET, REC))
            - self.active((SCR,))
        )
        return "floor_protected" if growth <= room else EXHAUSTED

    def free(self) -> int:
        b = self.b
        return (
            b.window
            - b.system_prompt
            - b.tool_framing
            - b.output_reserve
            - max(self.active((WM,)), b.working_memory_floor)
            - max(self.active((RET, REC)), b.min_memory)
            - self.active((SCR,))
        )


Step = tuple[tuple[object, ...], Callable[[], object]]


def outcome(call: Callable[[], object]) -> tuple[object, ...]:
    """A call's result, or its error reduced to comparable parts."""
    try:
        return ("ok", call())
    except AdmissionRefused as exc:
        return ("refused", exc.reason, exc.requested, exc.free)
    except (SessionConflict, UnknownReservation) as exc:
        return (type(exc).__name__,)


def plan_admit(s: Session, m: Model, rng: random.Random, c: Consumer, op: str) -> Step:
    ids = rng.sample([f"i{k}" for k in range(8)], rng.randint(1, 4))
    batch = [Item(i, rng.randint(1, 1_200), rng.randint(0, 9)) for i in ids]
    partial = rng.random() < 0.5
    free = m.free()
    new = [it for it in batch if it.id not in m.items[c]]
    taken: list[Item] = []
    skipped: list[str] = []
    for it in new:
        fits = m.delta(c, sum(t.tokens for t in taken) + it.tokens) <= free
        if partial and (skipped or not fits):
            skipped.append(it.id)
        else:
            taken.append(it)
    charged = sum(it.tokens for it in taken)
    expect: tuple[object, ...]
    if partial and not taken and skipped:  # not even the first new item fits
        first = next(it.tokens for it in new if it.id == skipped[0])
        expect = ("refused", m.reason(first), first, free)
    elif m.delta(c, charged) > free:
        expect = ("refused", m.reason(charged), charged, free)
    else:
        expect = ("ok", (charged, len(taken), len(batch) - len(new), tuple(skipped)))
        for it in taken:
            m.items[c][it.id] = it.tokens

    def call() -> object:
        got = s.admit(c, batch, partial=partial, op_id=op)
        assert got.free == m.free()
        return (got.charged, got.admitted, got.duplicates, got.skipped)

    return expect, call


def plan_release(s: Session, m: Model, rng: random.Random, c: Consumer, op: str) -> Step:
    ids = rng.sample([f"i{k}" for k in range(8)], rng.randint(1, 3))
    held = [i for i in ids if i in m.items[c]]
    tokens = sum(m.items[c].pop(i) for i in held)
    expect = ("ok", (tokens, len(held), tuple(i for i in ids if i not in held)))

    def call() -> object:
        got = s.release(c, ids, op_id=op)
        assert got.free == m.free()
        return (got.released, got.count, got.missing)

    return expect, call


def plan_reserve(s: Session, m: Model, rng: random.Random, c: Consumer, op: str) -> Step:
    rid = f"q{rng.randint(0, 4)}"
    est = rng.randint(1, 1_500)
    expect: tuple[object, ...]
    if rid in m.res:
        expect = ("SessionConflict",)
    elif m.delta(c, est) > m.free():
        expect = ("refused", m.reason(est), est, m.free())
    else:
        expect = ("ok", rid)
        m.res[rid] = (c, est)

    def call() -> object:
        got = s.reserve(c, rid, est, lease_ms=600_000, op_id=op)
        assert got.free == m.free()
        return got.id

    return expect, call


def plan_settle(s: Session, m: Model, rng: random.Random, c: Consumer, op: str) -> Step:
    rid = f"q{rng.randint(0, 4)}"
    actual = rng.randint(1, 1_500)
    item = f"i{rng.randint(0, 7)}"
    expect: tuple[object, ...]
    if rid not in m.res:
        expect = ("UnknownReservation",)
    else:
        rc, est = m.res[rid]
        if item in m.items[rc]:
            expect = ("SessionConflict",)
        elif m.delta(rc, actual - est) > m.free():
            expect = ("refused", m.reason(actual - est), actual, m.free())
        else:
            expect = ("ok", (rid, item, actual))
            del m.res[rid]
            m.items[rc][item] = actual

    def call() -> object:
        got = s.settle(rid, actual, item, priority=rng.randint(0, 9), op_id=op)
        assert got.free == m.free()
        return (got.reservation, got.item, got.charged)

    return expect, call


def plan_void(s: Session, m: Model, rng: random.Random, c: Consumer, op: str) -> Step:
    rid = f"q{rng.randint(0, 4)}"
    held = m.res.pop(rid, None)
    expect = ("UnknownReservation",) if held is None else ("ok", (rid, held[1]))

    def call() -> object:
        got = s.void(rid, op_id=op)
        assert got.free == m.free()
        return (got.reservation, got.released)

    return expect, call


PLANS = [plan_admit, plan_admit, plan_release, plan_reserve, plan_settle, plan_settle, plan_void]


@pytest.mark.parametrize("seed", [7, 2024])
def test_random_sequence_keeps_invariant_one(ledger: Ledger, seed: int) -> None:
    rng = random.Random(seed)
    b = floors_budget()
    s = open_fresh(ledger, b)
    m = Model(b)
    seen: dict[str, int] = {}
    for step in range(70):
        plan = rng.choice(PLANS)
        c = rng.choice(list(Consumer))
        expect, call = plan(s, m, rng, c, f"op-{seed}-{step}")
        got = outcome(call)
        assert got == expect, (step, plan.__name__, c)
        seen[str(got[0])] = seen.get(str(got[0]), 0) + 1
        if rng.random() < 0.2:
            # A retry with the same op id returns the same outcome and changes nothing.
            before = allocation(s)
            assert outcome(call) == got
            assert allocation(s) == before
        snap = check(ledger, s, b)
        assert snap.free == m.free()
        assert snap.open_reservations == len(m.res)
        for cons in Consumer:
            assert snap.used[cons] == sum(m.items[cons].values())
            assert snap.items[cons] == len(m.items[cons])
            assert snap.reserved[cons] == sum(t for rc, t in m.res.values() if rc is cons)
    # The sequence exercised admissions, refusals and the other outcomes.
    assert seen.get("ok", 0) > 10 and seen.get("refused", 0) > 0, seen
