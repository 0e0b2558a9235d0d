"""The ledger's contract on the asyncio face (AsyncLedger): admit, reserve, settle,
fencing and expiry.

Every test takes the parametrized ``ledger`` (or ``aledger``) fixture, so it runs on the
embedded fakeredis backend, a real redis-server and a real Redis Cluster. Expected
numbers are computed from the budget, never hard-coded; the helpers are in
tests/support/contract.py.
"""

from __future__ import annotations

import asyncio

import pytest

from ledger import (
    AdmissionRefused,
    AsyncLedger,
    Item,
    ReservationExpired,
    SessionBudget,
    StaleEpoch,
    UnknownReservation,
    UnknownSession,
)
from tests.support.contract import (
    RET,
    SCR,
    assert_new_epoch,
    base_free,
    expected_free,
    new_sid,
)


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
