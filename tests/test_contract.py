"""The ledger's contract: open, admit, release, snapshot and close, their refusals and the
invariants. The other operations' contracts are in test_contract_reservations.py,
test_contract_once.py (op ids, epoch fencing), test_contract_async.py (the asyncio face)
and test_contract_model.py (a random sequence against a model).

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
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    OperationIdReused,
    Session,
    SessionBudget,
    SessionConflict,
    StaleEpoch,
    UnknownSession,
)
from ledger.models import Opened
from tests.support.contract import (
    REC,
    RET,
    SCR,
    WM,
    allocation,
    assert_new_epoch,
    base_free,
    check,
    floors_budget,
    new_sid,
    open_fresh,
    state,
)

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
