"""The turn's owner is part of what a turn call proves (issue 41 part 1).

A call into an open turn carries '<epoch>@<turn>!<owner token>': the token is made by the
handle that began the turn, sent with its begin_turn and stored only as its SHA-1 (field
lk), never shown by snapshot(). Another handle that names the turn by its number
(``turn=n``, which ``snapshot().turn`` gives away), even under the owner's name (which
``snapshot().turn_owner`` gives away), is refused with ``TurnInProgress`` and changes
nothing; the real owner goes on and ends its turn. Embedded, a real Redis and a Cluster.

Without the token (protocol 1) the same calls were accepted: the intruder admitted into
the turn and committed it, and the owner got ``TurnLost`` for a turn it never gave up.
``test_without_the_token_the_intruder_would_commit`` shows it: the intruder given the
owner's token (as the server could not tell the two apart before) commits the turn, and
the owner's next call is ``TurnLost``: the refusals above are the token's doing.
"""

from __future__ import annotations

import hashlib

import pytest

from ledger import (
    Item,
    Ledger,
    Session,
    SessionBudget,
    TurnInProgress,
    TurnLost,
    schema,
)

SID = "owner-token/s-1"


def _hash(ledger: Ledger, s: Session) -> dict[bytes, bytes]:
    return ledger.client.hgetall(s.keys.session)


def _owner_and_intruder(ledger: Ledger, budget: SessionBudget) -> tuple[Session, Session, int]:
    owner = ledger.open_session(SID, budget, owner="agent-a")
    started = owner.begin_turn(working_set=500)
    snap = ledger.open_session(SID, budget).snapshot()
    assert snap.turn == started.turn and snap.turn_owner == "agent-a"  # both are public
    # the intruder knows both, and even takes the owner's name
    intruder = ledger.open_session(SID, budget, owner="agent-a")
    return owner, intruder, snap.turn


def test_a_handle_without_the_turn_cannot_call_into_it_or_end_it(
    ledger: Ledger, budget: SessionBudget
) -> None:
    owner, intruder, turn = _owner_and_intruder(ledger, budget)
    owner.admit("working_memory", [Item("mine", 100)])
    before = _hash(ledger, owner)
    calls = {
        "admit": lambda: intruder.admit("working_memory", [Item("theirs", 10)], turn=turn),
        "reserve": lambda: intruder.reserve("scratchpad", "res-x", 10, turn=turn),
        "release": lambda: intruder.release("working_memory", ["mine"], turn=turn),
        "record_span": lambda: intruder.record_span(turn, "search", 10),
        "renew_turn": lambda: intruder.renew_turn(turn),
        "abort_turn": lambda: intruder.abort_turn(turn),
        "end_turn": lambda: intruder.end_turn(turn, 3_000),
        # the same owner name beginning again ends its own open turn: not without its token
        "begin_turn": lambda: intruder.begin_turn(working_set=500),
    }
    for name, call in calls.items():
        with pytest.raises(TurnInProgress, match="owner token") as info:
            call()
        assert info.value.turn == turn and info.value.owner == "agent-a", name
        assert _hash(ledger, owner) == before, f"{name} changed the session"
    # The owner's turn is intact: it goes on and commits.
    owner.admit("working_memory", [Item("mine-2", 50)])
    report = owner.end_turn(turn, 3_000)
    assert report.turn == turn
    snap = owner.snapshot()
    assert snap.last_ended_turn == turn and snap.turn_owner is None
    assert snap.items["working_memory"] == 2  # mine, mine-2; never 'theirs'


def test_the_token_is_stored_hashed_and_never_shown(ledger: Ledger, budget: SessionBudget) -> None:
    owner = ledger.open_session(SID, budget, owner="agent-a")
    owner.begin_turn(working_set=500)
    token = owner._token
    stored = _hash(ledger, owner)
    assert stored[schema.TURN_KEY.encode()] == hashlib.sha1(token.encode()).hexdigest().encode()
    assert all(token.encode() not in v for v in stored.values())
    snap = owner.snapshot()
    assert token not in repr(snap) and schema.TURN_KEY not in snap.raw
    # The key goes with the turn: ended, no call can prove it any more.
    owner.end_turn(owner.turn or 0, 3_000)
    assert schema.TURN_KEY.encode() not in _hash(ledger, owner)


def test_without_the_token_the_intruder_would_commit(ledger: Ledger, budget: SessionBudget) -> None:
    """What the token stops: the same intruder's end_turn, sent with the owner's token (as
    a protocol 1 call, which had no token, was accepted), commits the owner's turn, and
    the owner's next call of its turn is TurnLost."""
    owner, intruder, turn = _owner_and_intruder(ledger, budget)
    intruder._token = owner._token  # what the server could not tell apart before
    intruder.end_turn(turn, 3_000)
    with pytest.raises(TurnLost):
        owner.admit("working_memory", [Item("late", 10)])
