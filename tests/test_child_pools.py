"""A reservation that is the pool of child sessions (docs/ceilings.md#parent-and-child-sessions)
leaves none of its children's fields behind when it closes, on the embedded backend, a real
redis-server and a real Redis Cluster: settle, void, expiry and a hard reset (at once, or
staged and applied at the turn's end) drop its pool 'k:<id>' and every 'k:<id>|<child>' in
the same step; a turn that closed it and is rolled back gets them back as they were; a turn
rolled back after the reservation expired leaves none; `audit` names such fields whose
reservation is not open (an orphan)."""

from __future__ import annotations

import uuid

import pytest

from ledger import Consumer, Ledger, SessionBudget
from ledger.client import Session
from tests.support.redis_clock import until_past

W = Consumer.WORKING_MEMORY
BUDGET = SessionBudget(window=200_000, system_prompt=1_000)


def children(led: Ledger, s: Session) -> dict[bytes, bytes]:
    """The session's child-pool fields ('k:...'), byte for byte."""
    return {k: v for k, v in led.client.hgetall(s.keys.session).items() if k.startswith(b"k:")}


def pool(led: Ledger, rid: str = "fan", lease_ms: int = 60_000) -> tuple[Session, int]:
    """A session whose reservation ``rid`` (4,000 tokens) has three children, one of them
    drawn past its floor; returns the session and the reservation's deadline."""
    s = led.open_session(f"kp/{uuid.uuid4().hex[:12]}", BUDGET)
    r = s.reserve(W, rid, 4_000, lease_ms=lease_ms)
    for k, floor in enumerate((1_000, 500, 0)):
        s.open_child(rid, f"kid{k}", floor)
    s.draw_child(rid, "kid0", 1_200)
    assert len(children(led, s)) == 4
    return s, r.deadline_ms


@pytest.mark.parametrize("close", ["settle", "void", "expire", "reset", "staged_reset"])
def test_a_closed_reservation_leaves_no_child_fields(ledger: Ledger, close: str) -> None:
    s, deadline = pool(ledger, lease_ms=300 if close == "expire" else 60_000)
    other = s.reserve(W, "other", 100)  # a pool of its own, left open (but by a reset)
    s.open_child(other.id, "sub", 50)
    if close == "settle":
        s.settle("fan", 2_000, "out")
    elif close == "void":
        s.void("fan")
    elif close == "expire":
        until_past(ledger, deadline)
        assert ledger.expire_due(s.keys.partition) == 1
    elif close == "reset":
        s.reset("ops")
    else:  # staged while a turn is open, applied by the call that ends it
        t = s.begin_turn(0)
        assert ledger.session(s.id).reset("ops", wait_ms=600_000).staged
        assert s.end_turn(t.turn, 1_500).reset == s.epoch
    left = children(ledger, s)
    if close in ("reset", "staged_reset"):
        assert left == {}  # every reservation went, and every pool
    else:
        assert left == {b"k:other": b"50|0|1", b"k:other|sub": b"50|0"}
    assert ledger.audit(s.id).clean
    # the id is new again: its pool starts empty, the same child opens with all of it free
    s.reserve(W, "fan", 4_000)
    assert s.open_child("fan", "kid0", 1_000).free == 3_000


@pytest.mark.parametrize("close", ["settle", "void"])
def test_a_turn_that_closed_the_pool_rolled_back_gives_its_children_back(
    ledger: Ledger, close: str
) -> None:
    """The children's fields go into the turn's undo log with the reservation: the
    rollback puts back the pool and every child as the turn found them."""
    s, _ = pool(ledger)
    before = children(ledger, s)
    s.begin_turn(0)
    s.open_child("fan", "kid3", 200)  # logged first: the rollback closes it again
    if close == "settle":
        s.settle("fan", 2_000, "out")
    else:
        s.void("fan")
    assert children(ledger, s) == {}
    assert s.abort_turn().rolled_back > 0
    assert children(ledger, s) == before  # byte for byte
    assert ledger.audit(s.id).clean
    assert s.draw_child("fan", "kid1", 500).used == 500  # open again, as it was
    s.settle("fan", 2_000, "out")
    assert children(ledger, s) == {}


def test_a_turn_rolled_back_after_its_pool_expired_leaves_no_orphan(ledger: Ledger) -> None:
    """A turn drew from a child (its undo log holds the pool and the child as they were);
    the reservation then expired, its children with it. The rollback does not bring back
    the children of a reservation that is no longer open."""
    s, deadline = pool(ledger, lease_ms=1_000)
    s.begin_turn(0)
    s.draw_child("fan", "kid1", 100)
    until_past(ledger, deadline)
    assert ledger.expire_due(s.keys.partition) == 1  # the reservation; the turn is live
    assert children(ledger, s) == {}
    assert s.abort_turn().rolled_back > 0
    assert children(ledger, s) == {}
    assert ledger.audit(s.id).clean


def test_audit_names_child_fields_whose_reservation_is_not_open(ledger: Ledger) -> None:
    s, _ = pool(ledger)
    assert ledger.audit(s.id).clean  # an open reservation's children are no orphans
    ledger.client.hset(s.keys.session, mapping={"k:gone": "10|0|1", "k:gone|kid": "10|0"})
    report = ledger.audit(s.id)
    assert not report.clean
    assert report.problems == (
        "orphan: 2 child field(s) k:gone* of reservation gone, which is not open",
    )
    ledger.client.hdel(s.keys.session, "k:gone")  # a child's field alone is one too
    assert ledger.audit(s.id).problems == (
        "orphan: 1 child field(s) k:gone* of reservation gone, which is not open",
    )
    ledger.client.hdel(s.keys.session, "k:gone|kid")
    assert ledger.audit(s.id).clean
