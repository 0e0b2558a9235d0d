"""The reclaim-order index (docs/protocol.md#the-reclaim-order-index) changes no decision.

Two sessions get the same random calls: one through a client that sends the index (and, now
and then, through one that does not, as an older client would), the other only through one
that never sends it, so that every turn there reads the items with HSCAN. Every reply and the
items held must be the same, and whenever the index says it is complete it must hold every
scratchpad, retrieval and recall item at its sequence number.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest

from ledger import Item, Ledger, LedgerError, SessionBudget
from ledger.client import Session
from ledger.protocol import Call
from tests.support.older import OldClient

BUDGET = dict(window=3_000, system_prompt=100, output_reserve=200, compaction="agent")
CODES = {"scratchpad": "s", "retrieval": "r", "recall": "m"}
KINDS = {  # how often each call comes (rollbacks and reconciles leave the index to rebuild)
    "admit": 12, "release": 4, "tool": 2, "begin": 4, "end": 4, "reserve": 1, "abort": 0.5,
    "reconcile": 0.25, "reopen": 0.2,
}  # fmt: skip
POOL = {
    "working_memory": [f"w{i}" for i in range(8)],
    "retrieval": [f"d{i}" for i in range(16)],
    "recall": [f"d{i}" for i in range(8)] + [f"m{i}" for i in range(4)],
    "scratchpad": [f"s{i}" for i in range(10)],
}


def call(
    s: Session, kind: str, consumer: str, ids: list[str], turn: int | None, name: str, seed: float
) -> Call[Any]:
    """The call of this kind, its sizes drawn from ``seed`` (the same for both sessions)."""
    rng = random.Random(seed)
    if kind == "admit":
        items = [Item(i, rng.randint(10, 250), rng.randint(0, 3)) for i in ids]
        return s.admit_call(consumer, items, partial=True, turn=turn)
    if kind == "release":
        return s.release_call(consumer, ids, turn=turn)
    if kind == "tool":
        return s.admit_tool_result_call(ids[0] + "t", rng.randint(10, 400), "{}", turn=turn)
    if kind == "begin":
        return s.begin_turn_call(rng.randint(0, 2_800))
    if kind == "end":
        return s.end_turn_call(turn or 0, rng.randint(100, 3_000))
    if kind == "abort":
        return s.abort_turn_call(turn or 0)
    if kind == "reserve":
        return s.reserve_call(consumer, name, rng.randint(10, 200), turn=turn)
    held = [Item(i, rng.randint(10, 250)) for i in ids]  # reconcile
    return s.reconcile_call({"scratchpad": held}, turn=turn)


def outcome(run: Callable[[Call[Any]], Any], call: Call[Any], epoch: int) -> Any:
    """A call's result as two sessions can compare it: without their epochs and clocks."""
    try:
        got = run(call)
    except LedgerError as exc:
        return type(exc).__name__, str(exc).replace(str(epoch), "E")
    fields = dataclasses.asdict(got)
    for k in ("epoch", "lease_until_ms", "deadline_ms", "mark"):
        fields.pop(k, None)
    return type(got).__name__, fields


def held(led: Ledger, s: Session) -> list[tuple[Any, ...]]:
    return sorted(dataclasses.astuple(i) for i in led.items(s.id))


def index_is_true(led: Ledger, s: Session) -> bool:
    """Whether the index says it is complete; if it does, that it is."""
    r = led.client
    oq, sq = r.hmget(s.keys.session, "oq", "sq")
    if oq != sq or r.zscore(s.keys.order, "~") is None:
        return False
    members = {m.decode(): sc for m, sc in r.zrange(s.keys.order, 0, -1, withscores=True)}
    for f, rec in r.hgetall(s.keys.session).items():
        name = f.decode()
        if name[:2] == "i:" and name[2] in "srm":
            rank = "srm".index(name[2])
            assert members.get(name) == rank * 2**50 + int(rec.split(b"|")[3]), name
    return True


@pytest.mark.parametrize("older", [0.0, 0.1], ids=["current", "with-older-calls"])
@pytest.mark.parametrize("rotate", [False, True], ids=["kept", "retrieval-rotated"])
@pytest.mark.parametrize("seed", range(2))
def test_the_index_changes_no_decision(
    ledger: Ledger, seed: int, rotate: bool, older: float
) -> None:
    """``older``: the share of the first session's calls sent without the index."""
    rng = random.Random(seed)
    old = OldClient(ledger.client, ledger.settings)
    budget = SessionBudget(**BUDGET, release_each_turn={"retrieval"} if rotate else set())
    a = ledger.open_session(f"order/a{seed}{rotate}", budget, owner="A")
    b = old.open_session(f"order/b{seed}{rotate}", budget, owner="A")
    turn: int | None = None
    reclaims = complete_reclaims = 0
    for step in range(400):
        kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
        consumer = rng.choice(list(POOL))
        ids = rng.sample(POOL[consumer], rng.randint(1, 3))

        if kind in ("end", "abort") and turn is None:
            continue
        if kind == "reopen":  # the id deleted and opened again: a new incarnation
            assert outcome(ledger.run, a.delete_call(), a.epoch)[0] == "Deleted"
            assert outcome(old.run, b.delete_call(), b.epoch)[0] == "Deleted"
            a = ledger.open_session(a.id, budget, owner="A")
            b = old.open_session(b.id, budget, owner="A")
            turn = None
            continue
        what = (kind, consumer, ids, turn, f"q{step}", rng.random())
        was_complete = index_is_true(ledger, a)
        got_a = outcome(old.run if rng.random() < older else ledger.run, call(a, *what), a.epoch)
        got_b = outcome(old.run, call(b, *what), b.epoch)
        assert got_a == got_b, (step, kind)
        assert held(ledger, a) == held(old, b), (step, kind)
        if got_a[0] == "TurnStarted":
            turn = got_a[1]["turn"]
            reclaims += bool(got_a[1]["reclaimed"])
            complete_reclaims += bool(got_a[1]["reclaimed"]) and was_complete
        elif kind in ("end", "abort") and got_a[0] != "TurnInProgress":
            turn = None
        index_is_true(ledger, a)
        card = ledger.client.zcard(a.keys.order)
        n = sum(1 for i in ledger.items(a.id) if i.consumer.value in CODES)
        assert card <= 2 * n + 64, (step, card, n)  # what is gone leaves it, as a rule
    # Between rollbacks and reconciles, which leave it to be built again, the calls keep the
    # index complete: the turns read it as it was kept, not as they built it.
    assert reclaims >= 10 and (older or complete_reclaims >= reclaims / 2)
    assert not ledger.client.exists(b.keys.order)  # the other session's turns never had it


def test_an_expired_index_comes_back_with_a_ttl_and_is_built_again(ledger: Ledger) -> None:
    """The index lives on the session's idle TTL. Kept alive by calls that do not touch the
    index, the session outlives it; the next admit creates it again with a TTL, and the next
    reclaiming turn, finding it incomplete, builds it again from the session's items."""
    s = ledger.open_session("order/ttl", SessionBudget(**BUDGET, idle_ttl_seconds=1))
    s.admit("scratchpad", [Item("s0", 900), Item("sx", 100)])
    assert not ledger.client.exists(s.keys.order)  # a new session's: built when first needed
    t = s.begin_turn(3_000 - 100 - 200 - 950)  # short by 50: reclaims s0, the oldest
    assert [i for _, i in t.reclaimed] == ["s0"]
    s.end_turn(t.turn, 1_000)
    s.admit("scratchpad", [Item("s0", 900)])  # kept in it as it was built
    assert 0 < ledger.client.pttl(s.keys.order) <= 1_000
    assert ledger.client.zscore(s.keys.order, "~") == -1  # built: it holds every item
    while ledger.client.exists(s.keys.order):  # the session is refreshed, the index is not
        s.void(s.reserve("working_memory", "q", 10).id)
    s.admit("scratchpad", [Item("s1", 900)])
    assert 0 < ledger.client.pttl(s.keys.order) <= 1_000
    assert ledger.client.zscore(s.keys.order, "~") is None  # s0 is missing: not complete
    s.release("scratchpad", ["s1"])  # its one member: the key goes, its TTL with it
    assert not ledger.client.exists(s.keys.order)
    s.admit("scratchpad", [Item("s1", 900)])  # so the next add sets the TTL again
    assert 0 < ledger.client.pttl(s.keys.order) <= 1_000
    t = s.begin_turn(3_000 - 100 - 200 - 1_050)  # short by 850: reclaims sx, then s0
    assert [i for _, i in t.reclaimed] == ["sx", "s0"]
    assert [m for m, _ in ledger.client.zrange(s.keys.order, 0, -1, withscores=True)] == [
        b"~", b"i:s:s1"
    ]  # fmt: skip


@pytest.mark.parametrize("rotate", [False, True], ids=["kept", "retrieval-rotated"])
def test_chunks_recall_holds_go_first_on_both_paths(ledger: Ledger, rotate: bool) -> None:
    """Past the scratchpad, a turn reclaims the retrieval chunks recall also holds first
    (oldest first), then the others, then recall: read from the index (a page at a time,
    past more than one page) as from the scan."""
    old = OldClient(ledger.client, ledger.settings)
    budget = SessionBudget(
        window=100_000, system_prompt=100, compaction="agent",
        release_each_turn={"retrieval"} if rotate else set(),
    )  # fmt: skip
    got = []
    for led, name in ((ledger, "with"), (old, "without")):
        s = led.open_session(f"order/deep-{name}-{rotate}", budget)
        s.end_turn(s.begin_turn(0).turn, 1_000)  # (with the index: builds it, empty)
        s.admit("scratchpad", [Item(f"s{i}", 100) for i in range(20)])
        s.admit("retrieval", [Item(f"d{i}", 100) for i in range(40)])
        s.admit("recall", [Item(f"d{i}", 100) for i in range(30, 2, -3)])  # d30, d27 ... d3
        s.admit("recall", [Item(f"m{i}", 100) for i in range(5)])
        # 7,500 held: short by 3,500 (2,000 of scratchpad, then 1,500 of retrieval), or,
        # retrieval rotated out (4,000), by 2,500 (2,000 of scratchpad, then 500 of recall)
        t = s.begin_turn(100_000 - 100 - 7_500 + (6_500 if rotate else 3_500))
        got.append((t.reclaimed, t.rotated, t.released, held(led, s)))
    assert got[0] == got[1]
    # 20 scratchpad items (two pages and more of the index), then the retrieval chunks
    # recall holds, oldest first (d3, d6 ... d30), then the others; or, retrieval rotated,
    # the oldest recall items (d30, d27 ... as recall admitted them)
    then = [("recall", f"d{i}") for i in (30, 27, 24, 21, 18)] if rotate else [
        ("retrieval", f"d{i}") for i in [*range(3, 31, 3), 0, 1, 2, 4, 5]
    ]  # fmt: skip
    assert [(c.value, i) for c, i in got[0][0]] == [
        ("scratchpad", f"s{i}") for i in range(20)
    ] + then
    assert got[0][1] == (4_000 if rotate else 0)
