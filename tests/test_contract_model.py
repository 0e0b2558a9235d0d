"""The ledger's contract, no over-allocation (docs/rules.md#budget-and-claims): a mixed
random sequence of admit, release, reserve, settle and void, each call's outcome compared
with a model's and the invariants checked after each step.

Every test takes the parametrized ``ledger`` (or ``aledger``) fixture, so it runs on the
embedded fakeredis backend, a real redis-server and a real Redis Cluster. Expected
numbers are computed from the budget, never hard-coded; the helpers are in
tests/support/contract.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ledger import (
    AdmissionRefused,
    Consumer,
    Item,
    Ledger,
    Session,
    SessionBudget,
    SessionConflict,
    UnknownReservation,
)
from tests.support.contract import (
    EXHAUSTED,
    REC,
    RET,
    SCR,
    WM,
    allocation,
    check,
    floors_budget,
    open_fresh,
)


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
