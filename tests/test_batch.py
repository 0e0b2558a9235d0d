"""run_many: many calls in one round trip, on every backend, sync and asyncio."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
import redis.asyncio.cluster

from ledger import (
    AdmissionRefused,
    AsyncLedger,
    BegunBy,
    InvalidArgument,
    Item,
    Ledger,
    SessionBudget,
    StaleEpoch,
)
from ledger.core import SessionCore
from ledger.keys import KeySpace
from ledger.models import Admitted, Released, Snapshot
from tests.support import servers


def _sid() -> str:
    return f"batch/s-{uuid.uuid4().hex[:10]}"


def test_empty_batch(ledger: Ledger) -> None:
    assert ledger.run_many([]) == []


def test_calls_of_several_sessions_come_back_in_order(
    ledger: Ledger, budget: SessionBudget
) -> None:
    a, b = ledger.open_session(_sid(), budget), ledger.open_session(_sid(), budget)
    a.admit("retrieval", [Item("old", 50)])
    got = ledger.run_many(
        [
            a.admit_call("retrieval", [Item("x", 100)]),
            b.admit_call("scratchpad", [Item("y", 200), Item("z", 300)]),
            a.release_call("retrieval", ["old", "never-held"]),
            b.snapshot_call(),
        ]
    )
    assert [type(r) for r in got] == [Admitted, Admitted, Released, Snapshot]
    assert (got[0].charged, got[1].charged, got[1].admitted) == (100, 500, 2)
    assert (got[2].released, got[2].missing) == (50, ("never-held",))
    assert got[3].used["scratchpad"] == 500  # the batch ran in order
    assert a.snapshot().used["retrieval"] == 100
    assert a.audit().clean and b.audit().clean


def test_a_refusal_is_raised_after_the_whole_batch_ran(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = ledger.open_session(_sid(), budget)
    free = s.snapshot().free
    calls = [
        s.admit_call("retrieval", [Item("a", 10)]),
        s.admit_call("retrieval", [Item("huge", free + 1)]),
        s.admit_call("retrieval", [Item("b", 20)]),
    ]
    with pytest.raises(AdmissionRefused) as caught:
        ledger.run_many(calls)
    assert caught.value.requested == free + 1
    assert s.snapshot().used["retrieval"] == 30  # the calls around it took effect

    # Sending the same calls again is safe: every outcome is the stored one.
    again = ledger.run_many(calls, return_exceptions=True)
    assert isinstance(again[1], AdmissionRefused)
    assert (again[0].charged, again[2].charged) == (10, 20)
    assert s.snapshot().used["retrieval"] == 30
    assert s.audit().clean


def test_errors_take_their_place_with_return_exceptions(
    ledger: Ledger, budget: SessionBudget
) -> None:
    s = ledger.open_session(_sid(), budget)
    ledger.session(s.id).reset("test")  # s keeps the old epoch
    fresh = ledger.session(s.id)
    got = ledger.run_many(
        [s.admit_call("retrieval", [Item("a", 1)]), fresh.admit_call("retrieval", [Item("a", 1)])],
        return_exceptions=True,
    )
    assert isinstance(got[0], StaleEpoch)
    assert isinstance(got[1], Admitted) and got[1].charged == 1


async def test_async_batch(aledger: AsyncLedger, budget: SessionBudget) -> None:
    s = await aledger.open_session(_sid(), budget)
    calls: list[Any] = [s.admit_call("working_memory", [Item(f"t{k}", 10)]) for k in range(20)]
    got = await aledger.run_many([*calls, s.snapshot_call()])
    assert sum(r.charged for r in got[:-1]) == 200
    assert got[-1].used["working_memory"] == 200
    again = await aledger.run_many(calls)  # replayed, not charged twice
    assert [r.charged for r in again] == [10] * 20
    assert (await s.snapshot()).used["working_memory"] == 200


@pytest.mark.redis
def test_batch_after_script_flush(
    redis_server: servers.RedisProcess, budget: SessionBudget
) -> None:
    """A batch of one script meets NOSCRIPT on every call (inside one EXEC the script
    cache cannot change): none ran, the script is loaded and the batch sent again."""
    from tests.conftest import make_settings

    with Ledger.from_settings(make_settings(redis_server.url)) as led:
        s = led.open_session(_sid(), budget)
        redis.Redis.from_url(redis_server.url).script_flush()
        got = led.run_many([s.admit_call("retrieval", [Item(f"c{k}", 5)]) for k in range(10)])
        assert sum(r.charged for r in got) == 50
        assert s.snapshot().used["retrieval"] == 50
        assert s.audit().clean


@pytest.mark.parametrize("backend", ["embedded", "redis"], indirect=True)
def test_calls_keep_their_order_when_only_some_scripts_are_cached(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """After a SCRIPT FLUSH and one admit (which loads admit.lua alone), a batch of a
    release then an admit that only fits after it: the release must run first."""
    s = ledger.open_session(_sid(), budget)
    free = s.snapshot().free
    s.admit("retrieval", [Item("big", free - 100)])
    ledger.client.script_flush()
    s.admit("retrieval", [Item("small", 1)])  # admit.lua is cached again, release.lua not
    got = ledger.run_many(
        [s.release_call("retrieval", ["big"]), s.admit_call("retrieval", [Item("next", free - 50)])]
    )
    assert got[0].released == free - 100
    assert got[1].charged == free - 50
    assert s.audit().clean


async def test_async_batch_after_script_flush(aledger: AsyncLedger, budget: SessionBudget) -> None:
    s = await aledger.open_session(_sid(), budget)
    if not isinstance(aledger.client, redis.asyncio.cluster.RedisCluster):
        await aledger.client.script_flush()
    got = await aledger.run_many(
        [s.admit_call("retrieval", [Item("a", 5)]), s.release_call("retrieval", ["a"])]
    )
    assert (got[0].charged, got[1].released) == (5, 5)
    assert (await s.audit()).clean


@pytest.mark.cluster
def test_batch_spread_over_a_cluster(
    redis_cluster: list[servers.RedisProcess], budget: SessionBudget
) -> None:
    from tests.conftest import make_settings

    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    with Ledger.from_settings(make_settings(url)) as led:
        sessions = [led.open_session(_sid(), budget) for _ in range(12)]
        for node in redis_cluster:  # every primary forgets the scripts
            redis.Redis(port=node.port).script_flush()
        got = led.run_many(
            [s.admit_call("scratchpad", [Item("x", 7)]) for s in sessions]
            + [s.snapshot_call() for s in sessions]
        )
        assert [r.charged for r in got[:12]] == [7] * 12
        assert all(r.used["scratchpad"] == 7 for r in got[12:])
        assert all(s.audit().clean for s in sessions)


@pytest.mark.parametrize("backend", ["embedded", "redis"], indirect=True)
def test_only_the_calls_that_met_noscript_are_sent_again(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """Two sessions, one script each: admit.lua is cached, release.lua is not. The
    admits run in the first EXEC, the releases in the second; no call runs twice."""
    a, b = ledger.open_session(_sid(), budget), ledger.open_session(_sid(), budget)
    b.admit("scratchpad", [Item("x", 40), Item("y", 60)])
    ledger.client.script_flush()
    a.admit("retrieval", [Item("warm", 1)])  # loads admit.lua again, not release.lua
    got = ledger.run_many(
        [
            a.admit_call("retrieval", [Item("p", 5)]),
            b.release_call("scratchpad", ["x"]),
            a.admit_call("retrieval", [Item("q", 7)]),
            b.release_call("scratchpad", ["y"]),
        ]
    )
    assert [type(r) for r in got] == [Admitted, Released, Admitted, Released]
    assert (got[1].released, got[3].released, got[3].free) == (40, 60, b.snapshot().free)
    assert a.snapshot().used["retrieval"] == 13
    assert a.audit().clean and b.audit().clean


def test_batch_loads_only_for_sessions_reached_by_several_scripts() -> None:
    from ledger.core import batch_loads

    ks = KeySpace("t", 16)
    s1, s2 = SessionCore(ks.session("s1"), 1), SessionCore(ks.session("s2"), 1)
    one_each = [s1.admit_call("retrieval", [Item("a", 1)]), s2.snapshot_call()]
    assert batch_loads(one_each) == []
    mixed = [*one_each, s1.release_call("retrieval", ["a"])]
    assert batch_loads(mixed) == ["admit", "release"]


def test_a_begin_and_its_fenced_calls_load_no_script() -> None:
    """Calls stamped with the first call's op id (BegunBy) cannot run before it: such a
    batch sends no SCRIPT LOAD; one that is not fenced on its first call does."""
    from ledger.core import batch_loads

    s = SessionCore(KeySpace("t", 16).session("s1"), 1)
    fenced = [s.begin_turn_call(0, op_id="op-b"),
              s.admit_call("retrieval", [Item("a", 1)], turn=BegunBy("op-b")),
              s.release_call("scratchpad", ["x"], turn=BegunBy("op-b"))]  # fmt: skip
    assert batch_loads(fenced) == []
    other = [*fenced[:2], s.release_call("scratchpad", ["x"], turn=BegunBy("op-other"))]
    assert batch_loads(other) == ["admit", "begin_turn", "release"]
    assert batch_loads([*fenced, s.snapshot_call()]) == [
        "admit",
        "begin_turn",
        "release",
        "snapshot",
    ]


@pytest.mark.parametrize("backend", ["embedded", "redis"], indirect=True)
def test_a_fenced_batch_is_in_order_when_only_its_later_scripts_are_cached(
    ledger: Ledger, budget: SessionBudget
) -> None:
    """After a SCRIPT FLUSH and one admit (which loads admit.lua alone), a begin_turn and
    an admit fenced on it: the admit runs first and is refused (TurnLost, nothing
    changed), the begin meets NOSCRIPT; both are sent again, in order, and both land."""
    s = ledger.open_session(_sid(), budget)
    ledger.client.script_flush()
    s.admit("retrieval", [Item("small", 1)])  # admit.lua is cached again, begin_turn.lua not
    got = ledger.run_many([
        s.begin_turn_call(0, op_id="op-begin-1"),
        s.admit_call("retrieval", [Item("in-turn", 5)], turn=BegunBy("op-begin-1")),
    ])  # fmt: skip
    assert got[1].charged == 5 and s.turn == got[0].turn
    assert {i.id: i.turn for i in ledger.items(s.id)}["in-turn"] == got[0].turn
    s.end_turn(got[0].turn, s.snapshot().occupancy)
    assert s.audit().clean


def test_a_batch_has_at_most_1000_calls(ledger: Ledger, budget: SessionBudget) -> None:
    s = ledger.open_session(_sid(), budget)
    with pytest.raises(InvalidArgument, match="at most 1000"):
        ledger.run_many([s.snapshot_call()] * 1001)


def test_a_permission_refusal_stops_the_batch_whatever_return_exceptions() -> None:
    from redis.exceptions import NoPermissionError

    from ledger import PermissionDenied
    from ledger.core import collect

    s = SessionCore(KeySpace("t", 16).session("s"), 1)
    calls = [s.admit_call("retrieval", [Item("a", 1)]), s.snapshot_call()]
    raws = [AdmissionRefused("token_budget_exhausted", 1, 0, {}), NoPermissionError("NOPERM no")]
    with pytest.raises(PermissionDenied):
        collect(calls, raws, return_exceptions=True)
