"""Stateful property test: the ledger against a small in-memory model of its rules.

The model (below) restates the rules of lua/_common.lua and the operation scripts:
each group claims max(active, floor) of the window, so

    free = W - S - T - out - max(a_w, F_w) - max(a_rm, F_rm) - a_s

where a_<group> counts the tokens of held items plus open reservations. A call whose
claim would make free negative is refused and changes nothing; an item id the
consumer already holds charges nothing; releasing ids that are not held lists them
as missing; an op id that produced an outcome (ok or refused) returns that outcome
again when re-sent with the same arguments, and OperationIdReused with others.
Errors (unknown reservation, conflicts) are not stored: re-sending such a call
evaluates it again against the current state.

Hypothesis drives admit / release / reserve / settle / void, replays of earlier
calls and op-id reuse, and after every step compares snapshot, audit and the raw
items and reservations of the session hash with the model.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ledger import (
    AdmissionRefused,
    Admitted,
    Consumer,
    Item,
    LedgerError,
    Released,
    Reservation,
    Session,
    SessionBudget,
    Settled,
    Voided,
)
from tests.support import servers
from tests.support.stateful import ModelMachine, Op, Outcome, run_machine

CONSUMERS = tuple(c.value for c in Consumer)
GROUP = {"working_memory": "w", "retrieval": "m", "recall": "m", "scratchpad": "s"}
ITEM_IDS = ("a", "b", "c", "d", "e", "f")
RESERVATION_IDS = ("r1", "r2", "r3")
LEASE_MS = 600_000
EXHAUSTED = "token_budget_exhausted"
SESSION_ID = "prop/s-1"

# An Outcome here: a result dataclass, ("refused", reason, requested, free) or (ErrorName,)


def stored(out: Outcome) -> bool:
    """Whether the ledger keeps this outcome under its op id (results and refusals)."""
    return not isinstance(out, tuple) or out[0] == "refused"


def capture(fn: Callable[[], Any]) -> Outcome:
    try:
        return fn()
    except AdmissionRefused as exc:
        return ("refused", exc.reason, exc.requested, exc.free)
    except LedgerError as exc:
        return (type(exc).__name__,)


def send(session: Session, op: Op) -> Outcome:
    a, oid = op.args, op.op_id
    if op.kind == "admit":
        c, items, partial = a
        batch = [Item(i, t, p) for i, t, p in items]
        return capture(lambda: session.admit(c, batch, partial=partial, op_id=oid))
    if op.kind == "release":
        c, ids = a
        return capture(lambda: session.release(c, list(ids), op_id=oid))
    if op.kind == "reserve":
        c, rid, tokens = a
        return capture(lambda: session.reserve(c, rid, tokens, lease_ms=LEASE_MS, op_id=oid))
    if op.kind == "settle":
        rid, actual, item, prio = a
        return capture(lambda: session.settle(rid, actual, item, priority=prio, op_id=oid))
    assert op.kind == "void"
    (rid,) = a
    return capture(lambda: session.void(rid, op_id=oid))


@dataclass
class Model:
    """The ledger's rules for one session, in plain Python."""

    budget: SessionBudget
    ep: int  # the epoch the session was opened at
    # consumer -> item id -> (tokens, priority, sequence number)
    items: dict[str, dict[str, tuple[int, int, int]]] = field(
        default_factory=lambda: {c: {} for c in CONSUMERS}
    )
    resv: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (consumer, tokens)
    seq: int = 0
    refusals: int = 0
    outcomes: dict[str, tuple[Op, Outcome]] = field(default_factory=dict)  # op id -> first

    def active(self) -> dict[str, int]:
        a = {"w": 0, "m": 0, "s": 0}
        for c, held in self.items.items():
            a[GROUP[c]] += sum(t for t, _, _ in held.values())
        for c, t in self.resv.values():
            a[GROUP[c]] += t
        return a

    def free(self, group: str = "w", delta: int = 0) -> int:
        """Free tokens, or what they would be with `delta` more active tokens in `group`."""
        b, a = self.budget, self.active()
        a[group] += delta
        return (
            b.window
            - b.system_prompt
            - b.tool_framing
            - b.output_reserve
            - max(a["w"], b.working_memory_floor)
            - max(a["m"], b.min_memory)
            - a["s"]
        )

    def room(self, c: str) -> int:
        """The most tokens consumer c can take now: free plus its group's unused floor."""
        g, b = GROUP[c], self.budget
        floor = {"w": b.working_memory_floor, "m": b.min_memory, "s": 0}[g]
        return self.free() + max(0, floor - self.active()[g])

    def used(self, c: str) -> int:
        return sum(t for t, _, _ in self.items[c].values())

    def reserved(self, c: str) -> int:
        return sum(t for rc, t in self.resv.values() if rc == c)

    def reason(self, growth: int) -> str:
        """floor_protected when the unclaimed room (floors ignored) would hold the growth."""
        b, a = self.budget, self.active()
        room = (
            b.window
            - b.system_prompt
            - b.tool_framing
            - b.output_reserve
            - a["w"]
            - a["m"]
            - a["s"]
        )
        return "floor_protected" if growth <= room else EXHAUSTED

    def refuse(self, requested: int, growth: int | None = None) -> Outcome:
        self.refusals += 1
        why = self.reason(requested if growth is None else growth)
        return ("refused", why, requested, self.free())

    def apply(self, op: Op) -> Outcome:
        """The outcome the ledger must give for op; updates the model as the ledger would."""
        if op.op_id in self.outcomes:
            first, out = self.outcomes[op.op_id]
            if (first.kind, first.args) == (op.kind, op.args):
                return out
            return ("OperationIdReused",)
        handler: Callable[..., Outcome] = getattr(self, f"_{op.kind}")
        return handler(*op.args)

    def remember(self, op: Op, out: Outcome) -> None:
        if op.op_id not in self.outcomes and stored(out):
            self.outcomes[op.op_id] = (op, out)

    def _admit(self, c: str, items: tuple[tuple[str, int, int], ...], partial: bool) -> Outcome:
        g, held = GROUP[c], self.items[c]
        new = [(i, t, p) for i, t, p in items if i not in held]
        dups = len(items) - len(new)
        taken: list[tuple[str, int, int]] = []
        skipped: list[str] = []
        charged = 0
        for i, t, p in new:
            if skipped or (partial and self.free(g, charged + t) < 0):
                skipped.append(i)
            else:
                taken.append((i, t, p))
                charged += t
        if partial and not taken and skipped:  # not even the first new item fits
            first = next(t for i, t, _ in new if i == skipped[0])
            return self.refuse(first)
        if self.free(g, charged) < 0:
            return self.refuse(charged)
        for i, t, p in taken:
            self.seq += 1
            held[i] = (t, p, self.seq)
        return Admitted(
            charged=charged,
            admitted=len(taken),
            duplicates=dups,
            skipped=tuple(skipped),
            free=self.free(),
            epoch=self.ep,
            turn=0,
        )

    def _release(self, c: str, ids: tuple[str, ...]) -> Outcome:
        held = self.items[c]
        missing = tuple(i for i in ids if i not in held)
        gone = [held.pop(i) for i in ids if i in held]
        return Released(
            released=sum(t for t, _, _ in gone),
            count=len(gone),
            missing=missing,
            free=self.free(),
            epoch=self.ep,
            turn=0,
        )

    def _reserve(self, c: str, rid: str, tokens: int) -> Outcome:
        if rid in self.resv or rid in self.items[c]:  # settle names the item after it
            return ("SessionConflict",)
        if self.free(GROUP[c], tokens) < 0:
            return self.refuse(tokens)
        self.resv[rid] = (c, tokens)
        return Reservation(id=rid, deadline_ms=-1, free=self.free(), epoch=self.ep, turn=0)

    def _settle(self, rid: str, actual: int, item: str, prio: int) -> Outcome:
        if rid not in self.resv:
            return ("UnknownReservation",)
        c, est = self.resv[rid]
        if item in self.items[c]:
            return ("SessionConflict",)
        if self.free(GROUP[c], actual - est) < 0:
            return self.refuse(actual, actual - est)
        del self.resv[rid]
        self.seq += 1
        self.items[c][item] = (actual, prio, self.seq)
        return Settled(
            reservation=rid, item=item, charged=actual, free=self.free(), epoch=self.ep, turn=0
        )

    def _void(self, rid: str) -> Outcome:
        if rid not in self.resv:
            return ("UnknownReservation",)
        _, est = self.resv.pop(rid)
        return Voided(reservation=rid, released=est, free=self.free(), epoch=self.ep, turn=0)


def same(actual: Outcome, expected: Outcome) -> bool:
    """Equal outcomes; a fresh reservation's deadline is not known to the model."""
    if isinstance(expected, Reservation) and expected.deadline_ms == -1:
        if not isinstance(actual, Reservation):
            return False
        now_ms = time.time() * 1000
        if not now_ms - 60_000 < actual.deadline_ms - LEASE_MS <= now_ms + 1_000:
            return False
        return dataclasses.replace(actual, deadline_ms=-1) == expected
    return bool(actual == expected)


class LedgerMachine(ModelMachine):
    """One fresh session per example, on the backend at `url`, beside the Model."""

    def send(self, op: Op) -> Outcome:
        assert self.session is not None
        return send(self.session, op)

    def same(self, actual: Outcome, expected: Outcome) -> bool:
        return same(actual, expected)

    def seen(self, op: Op, actual: Outcome) -> None:
        self.model.remember(op, actual)

    # --- rules --------------------------------------------------------------------------

    @initialize(
        system_prompt=st.sampled_from([0, 500, 2_100]),
        tool_framing=st.sampled_from([0, 150]),
        output_reserve=st.sampled_from([0, 1_024]),
        working_memory_floor=st.sampled_from([0, 1_500, 6_000]),
        min_memory=st.sampled_from([0, 1_000, 4_000]),
        room=st.integers(0, 12_000),
    )
    def open_session(
        self,
        system_prompt: int,
        tool_framing: int,
        output_reserve: int,
        working_memory_floor: int,
        min_memory: int,
        room: int,
    ) -> None:
        floor = system_prompt + tool_framing + output_reserve + working_memory_floor + min_memory
        budget = SessionBudget(
            window=max(floor + room, 100),
            system_prompt=system_prompt,
            tool_framing=tool_framing,
            output_reserve=output_reserve,
            working_memory_floor=working_memory_floor,
            min_memory=min_memory,
        )
        self.session = self.ledger.open_session(SESSION_ID, budget)
        self.model = Model(budget, self.session.epoch)

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        items=st.lists(
            st.tuples(st.sampled_from(ITEM_IDS), st.integers(1, 3_000), st.integers(0, 2)),
            min_size=1,
            max_size=4,
            unique_by=lambda t: t[0],
        ),
        partial=st.booleans(),
    )
    def admit(self, consumer: str, items: list[tuple[str, int, int]], partial: bool) -> None:
        self.do(Op("admit", self.new_op_id(), (consumer, tuple(items), partial)))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Mostly ids the consumer holds, mixed with ids it does not."""
        assert self.model is not None
        holding = [c for c in CONSUMERS if self.model.items[c]]
        consumer = data.draw(st.sampled_from(holding or CONSUMERS), label="consumer")
        held = sorted(self.model.items[consumer])
        pool = st.sampled_from(ITEM_IDS)
        if held:
            pool = st.one_of(st.sampled_from(held), pool)
        ids = data.draw(st.lists(pool, min_size=1, max_size=4, unique=True), label="ids")
        self.do(Op("release", self.new_op_id(), (consumer, tuple(ids))))

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        item=st.sampled_from(ITEM_IDS),
        off=st.integers(-1, 1),
        partial=st.booleans(),
        reserve=st.booleans(),
    )
    def fill(self, consumer: str, item: str, off: int, partial: bool, reserve: bool) -> None:
        """Admit or reserve exactly the room left (off 0), one token less or one more."""
        assert self.model is not None
        tokens = max(1, self.model.room(consumer) + off)
        if reserve:
            self.do(Op("reserve", self.new_op_id(), (consumer, item, tokens)))
        else:
            items = ((item, tokens, 0),)
            self.do(Op("admit", self.new_op_id(), (consumer, items, partial)))

    @rule(
        consumer=st.sampled_from(CONSUMERS),
        rid=st.sampled_from(RESERVATION_IDS),
        tokens=st.integers(1, 3_000),
    )
    def reserve(self, consumer: str, rid: str, tokens: int) -> None:
        self.do(Op("reserve", self.new_op_id(), (consumer, rid, tokens)))

    def draw_reservation(self, data: st.DataObject) -> str:
        """Mostly an open reservation, sometimes any id (open or not)."""
        assert self.model is not None
        ids = st.sampled_from(RESERVATION_IDS)
        if self.model.resv:
            ids = st.one_of(st.sampled_from(sorted(self.model.resv)), ids)
        return data.draw(ids, label="reservation")

    @rule(
        data=st.data(),
        change=st.one_of(st.integers(-3_000, 3_000), st.sampled_from(["-1", "0", "+1"])),
        item=st.sampled_from(ITEM_IDS),
        prio=st.integers(0, 2),
    )
    def settle(self, data: st.DataObject, change: int | str, item: str, prio: int) -> None:
        """Settle lower or higher than the estimate; a text change settles at the room left
        for the reservation's consumer plus that offset (the boundary of a refusal)."""
        assert self.model is not None
        rid = self.draw_reservation(data)
        c, est = self.model.resv.get(rid, ("scratchpad", 1_000))
        if isinstance(change, str):
            change = self.model.room(c) + int(change)
        self.do(Op("settle", self.new_op_id(), (rid, max(1, est + change), item, prio)))

    @rule(data=st.data())
    def void(self, data: st.DataObject) -> None:
        self.do(Op("void", self.new_op_id(), (self.draw_reservation(data),)))

    @precondition(lambda self: bool(self.history))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """Re-send an earlier call with its op id, as a retry after a lost reply would."""
        op = data.draw(st.one_of(st.just(self.history[-1]), st.sampled_from(self.history)))
        self.do(op)

    @precondition(lambda self: bool(self.history))
    @rule(
        data=st.data(),
        consumer=st.sampled_from(CONSUMERS),
        ids=st.lists(st.sampled_from(ITEM_IDS), min_size=1, max_size=2, unique=True),
    )
    def reuse_op_id(self, data: st.DataObject, consumer: str, ids: list[str]) -> None:
        """An earlier op id with other arguments: refused when an outcome is stored."""
        old = data.draw(st.sampled_from(self.history))
        self.do(Op("release", old.op_id, (consumer, tuple(ids))))

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        assert self.session is not None and self.model is not None
        m = self.model
        snap = self.session.snapshot()
        assert snap.free >= 0
        assert snap.free == m.free()
        for c in Consumer:
            assert snap.used[c] == m.used(c.value), c
            assert snap.reserved[c] == m.reserved(c.value), c
            assert snap.items[c] == len(m.items[c.value]), c
        assert snap.open_reservations == len(m.resv)
        assert snap.refusals == m.refusals
        report = self.session.audit()
        assert report.clean, report.problems
        assert report.overdue == ()

    @invariant()
    def hash_holds_the_model_items(self) -> None:
        """The session hash's item and reservation fields are exactly the model's."""
        assert self.session is not None and self.model is not None
        raw = self.ledger.client.hgetall(self.session.keys.session)
        items: dict[tuple[str, str], tuple[int, int, int]] = {}
        resv: dict[str, tuple[str, int]] = {}
        for k, v in raw.items():
            name, value = k.decode(), v.decode()
            if name.startswith("i:"):
                _, code, item = name.split(":", 2)
                tokens, _turn, prio, seq = (int(x) for x in value.split("|"))
                items[(code, item)] = (tokens, prio, seq)
            elif name.startswith("r:"):
                code, tokens, _deadline = value.split("|")
                resv[name[2:]] = (Consumer.from_code(code).value, int(tokens))
        want = {
            (Consumer(c).code, i): rec
            for c, held in self.model.items.items()
            for i, rec in held.items()
        }
        assert items == want
        assert resv == self.model.resv


def check(url: str, max_examples: int) -> None:
    run_machine(LedgerMachine, url, max_examples, steps=30)


@pytest.mark.slow
@pytest.mark.embedded
def test_ledger_matches_model_embedded() -> None:
    check(f"embedded://{uuid.uuid4().hex}", max_examples=40)


@pytest.mark.slow
@pytest.mark.redis
def test_ledger_matches_model_redis(redis_server: servers.RedisProcess) -> None:
    check(redis_server.url, max_examples=25)
