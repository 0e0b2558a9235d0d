"""Turn leases on every backend (docs/agent.md#turn-leases): a turn is owned by one
owner at a time; a second begin is refused before anything changes; a turn taken over or
whose lease lapsed is rolled back to exactly what it found; its zombie's calls are
refused; a worker's compaction never lands under a running turn, and its summary is
delivered to one committed turn, once."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import pytest

from ledger import (
    BegunBy,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    SessionBudget,
    SessionConflict,
    TurnInProgress,
    TurnLost,
    TurnStarted,
    protocol,
)
from ledger.client import Session
from ledger.core import new_op_id

W, R, M, S = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)
BUDGET = SessionBudget(
    window=20_000,
    system_prompt=500,
    tool_framing=100,
    output_reserve=1_000,
    working_memory_floor=1_000,
    spill_preview_tokens=100,
)
# The fields a rollback must give back exactly as the turn found them: everything but the
# turn's own bookkeeping (turn number, lease, undo log, deliveries, telemetry, outcomes).
BOOKKEEPING = {
    "tn",
    "lo",
    "le",
    "ul",
    "vs",
    "vd",
    "lb",
    "qs",
    "qd",
    "rb",
    "ws",
    "ai",
    "ao",
    "an",
    "xp",
    "gz",
}
BOOKKEEPING |= {"sq", "oq", "ox"}  # item sequences are never reused (the order index follows)
# What a compaction attempt counted stays (the jobs it enqueued cannot be taken back), and
# a compaction made due by the turn stays due.
BOOKKEEPING |= {"cd", "cq", "pm", "kf", "kn", "kt", "rq"}
BOOKKEEPING |= {"kp"}  # a worker's compaction staged under the turn lands at the next begin


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def state(led: Ledger, s: Session) -> tuple[dict[str, str], list[tuple[str, float]]]:
    """What a rollback restores: the session hash without its bookkeeping, and the
    reservations' members of the deadline index."""
    raw = {_text(k): _text(v) for k, v in led.client.hgetall(s.keys.session).items()}
    kept = {k: v for k, v in raw.items() if k not in BOOKKEEPING and not k.startswith("x:")}
    members = [
        (_text(m), score)
        for m, score in led.client.zrange(s.keys.deadlines, 0, -1, withscores=True)
        if _text(m).startswith(f"{s.id}|") and not _text(m).endswith("|~")
    ]
    return kept, members


def whole(led: Ledger, s: Session) -> tuple[dict[bytes, bytes], list[Any]]:
    return (
        led.client.hgetall(s.keys.session),
        led.client.zrange(s.keys.deadlines, 0, -1, withscores=True),
    )


def sid() -> str:
    return f"turns/{uuid.uuid4().hex[:12]}"


def loaded(led: Ledger, owner: str = "A") -> Session:
    """A session with items of every consumer and an open reservation, between turns."""
    s = led.open_session(sid(), BUDGET, owner=owner)
    s.admit(W, [Item("w1", 900), Item("w2", 700, 3)])
    s.admit(R, [Item("r1", 800), Item("r2", 600, 2)])
    s.admit(M, [Item("m1", 300)])
    s.admit_tool_result("s1", 1_200, b"{}")
    s.reserve(S, "res0", 400, lease_ms=600_000)
    return s


# --- one owner at a time ----------------------------------------------------------------


def test_a_second_begin_is_refused_before_anything_changes(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500)
    a.admit(R, [Item("r3", 100)])
    b = ledger.session(a.id, owner="B")
    before = whole(ledger, a)
    with pytest.raises(TurnInProgress) as caught:
        b.begin_turn(500)
    assert (caught.value.turn, caught.value.owner) == (t.turn, "A")
    assert 0 < (caught.value.lease_left_ms or 0) <= 30_000
    # A call of no turn while A's is open: refused too, nothing changed.
    with pytest.raises(TurnInProgress):
        b.admit(R, [Item("r4", 100)])
    with pytest.raises(TurnInProgress):
        b.release(R, ["r1"])
    assert whole(ledger, a) == before
    snap = b.snapshot()
    assert snap.turn_open and snap.turn_owner == "A" and snap.turn == t.turn
    assert a.end_turn(t.turn, 5_100).turn == t.turn
    assert b.begin_turn(500).turn == t.turn + 1  # free again
    assert ledger.audit(a.id).clean


def test_a_turns_first_calls_go_in_the_batch_that_begins_it(ledger: Ledger) -> None:
    """Calls stamped with their begin_turn's op id (BegunBy) are of the turn that begin
    opened: one round trip begins the turn and admits into it. When the begin is refused
    (another owner's turn, starvation) they are refused too (TurnLost), nothing changed:
    never admitted into another owner's turn or into none."""
    a = loaded(ledger, "A")
    b = ledger.session(a.id, owner="B")
    op = new_op_id()
    began, admitted, released = ledger.run_many([
        a.begin_turn_call(500, op_id=op),
        a.admit_call(R, [Item("first", 100)], turn=BegunBy(op)),
        a.release_call(M, ["m1"], turn=BegunBy(op)),
    ])  # fmt: skip
    assert a.turn == began.turn and admitted.charged == 100 and released.count == 1
    # they are the turn's own: a rollback undoes them
    a.abort_turn()
    held = {(i.consumer, i.id) for i in ledger.items(a.id)}
    assert (R, "first") not in held and (M, "m1") in held
    t = a.begin_turn(500)
    before = whole(ledger, a)
    op2 = new_op_id()
    got = ledger.run_many(
        [b.begin_turn_call(500, op_id=op2), b.admit_call(R, [Item("b", 1)], turn=BegunBy(op2))],
        return_exceptions=True,
    )
    assert isinstance(got[0], TurnInProgress) and isinstance(got[1], TurnLost)
    assert f"begun by op {op2} is not open" in str(got[1])
    assert whole(ledger, a) == before  # not into A's open turn
    a.end_turn(t.turn, 5_100)
    starved = ledger.run_many(
        [b.begin_turn_call(10**7, op_id=op2), b.admit_call(R, [Item("b", 1)], turn=BegunBy(op2))],
        return_exceptions=True,
    )
    assert not isinstance(starved[0], TurnStarted) and isinstance(starved[1], TurnLost)
    # an op id's turn is a fence, not an argument; abort_turn takes only a number
    with pytest.raises(InvalidArgument):
        ledger.run(protocol.abort_turn(a.keys, new_op_id(), a.epoch, BegunBy(op)))  # type: ignore[arg-type]
    assert ledger.audit(a.id).clean


def test_the_same_owner_beginning_again_ends_its_turn_as_it_stands(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t1 = a.begin_turn(500)
    a.admit(R, [Item("r3", 100)])
    t2 = a.begin_turn(500)
    assert t2.turn == t1.turn + 1 and t2.rolled_back is None
    assert any(i.id == "r3" for i in ledger.items(a.id))  # kept: not rolled back
    with pytest.raises(TurnLost):  # the first turn's calls are over
        ledger.run(
            protocol.admit(a.keys, new_op_id(), protocol.stamp(a.epoch, t1.turn), R, [Item("x", 1)])
        )


@pytest.mark.parametrize("how", ["takeover", "lapsed", "abort", "worker"])
def test_a_dead_turn_is_rolled_back_to_exactly_what_it_found(ledger: Ledger, how: str) -> None:
    """Every kind of change a turn makes, then the turn dies: the session is as the turn
    found it (items, reservations and their deadlines, counters, output reserve)."""
    a = loaded(ledger, "A")
    before = state(ledger, a)
    lease = 150 if how in ("lapsed", "worker") else 30_000
    t = a.begin_turn(15_000, output_reserve=2_000, lease_ms=lease)  # reclaims scratchpad
    assert ("scratchpad", "s1") in [(c.value, i) for c, i in t.reclaimed]
    a.admit(W, [Item("w3", 500)])
    a.admit(R, [Item("r3", 400), Item("r1", 800)])  # r1 held: a duplicate
    a.release(W, ["w2"])
    a.release(R, ["nope"])
    got = a.admit_tool_result("s2", 13_800, b"[" + b"0," * 3000 + b"0]")
    assert got.outcome == "admitted" and got.evicted == ((R, "r1"),)  # memory gave way
    a.reserve(W, "res1", 300)
    a.settle("res0", 350, "s0")
    a.reserve(R, "res2", 200)
    a.void("res2")
    a.reconcile({M: [Item("m1", 250), Item("m2", 90)]})
    a.compact(["w1", (R, "r3")], Item("sum-a", 120))
    assert state(ledger, a) != before
    b = ledger.session(a.id, owner="B")
    if how == "takeover":
        t2 = b.begin_turn(0, takeover=True)
        assert t2.rolled_back == t.turn
        b.abort_turn()
    elif how == "lapsed":
        time.sleep(0.3)
        t2 = b.begin_turn(0)  # no takeover needed: the lease lapsed
        assert t2.rolled_back == t.turn
        b.abort_turn()
    elif how == "abort":
        assert a.abort_turn().rolled_back == t.turn
        assert a.abort_turn(t.turn).rolled_back is None  # done already: left alone
    else:
        time.sleep(0.3)
        assert ledger.sweep_partition(a.keys.partition) == (0, 1)
    assert state(ledger, a) == before
    report = ledger.audit(a.id)
    assert report.clean, report.problems
    snap = b.snapshot()
    assert not snap.turn_open and snap.raw["x:rolled_back"] >= 1
    assert ledger.client.zscore(a.keys.deadlines, f"{a.id}|~") is None


def test_a_zombie_is_refused_once_its_turn_was_taken_over(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500)
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(500, takeover=True)
    b.admit(R, [Item("b1", 100)])
    before = whole(ledger, a)
    for call in (
        lambda: a.admit(R, [Item("z1", 100)]),
        lambda: a.release(R, ["b1"]),
        lambda: a.admit_tool_result("z2", 10, b"{}"),
        lambda: a.reserve(S, "z3", 10),
        lambda: a.settle("res0", 10),
        lambda: a.void("res0"),
        lambda: a.reconcile({R: []}),
        lambda: a.compact(["w1"], Item("zs", 10)),
        lambda: a.record_span(t.turn, "recall", 10),
        lambda: a.end_turn(t.turn, 5_000),
        lambda: a.renew_turn(),
    ):
        with pytest.raises(TurnLost) as caught:
            call()
        assert caught.value.turn == t.turn and caught.value.rolled_back
        assert "taken over by B" in str(caught.value)
    assert whole(ledger, a) == before
    assert b.end_turn(t2.turn, 5_200).turn == t2.turn


def test_renewing_keeps_the_turn_and_its_end_commits_a_mark(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(500, lease_ms=400)
    b = ledger.session(a.id, owner="B")
    for _ in range(4):
        time.sleep(0.2)
        renewed = a.renew_turn(lease_ms=400)
        assert renewed.turn == t.turn and renewed.lease_until_ms >= t.lease_until_ms
        with pytest.raises(TurnInProgress):
            b.begin_turn(0)
    a.end_turn(t.turn, 5_000, mark="checkpoint-1")
    nxt = b.begin_turn(0)
    assert nxt.mark == "checkpoint-1" and nxt.rolled_back is None
    b.abort_turn()
    assert b.begin_turn(0).mark == "checkpoint-1"  # a rolled-back turn commits no mark


def test_bad_lease_arguments_are_refused_before_anything_changes(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    before = whole(ledger, a)
    for kw in ({"lease_ms": 0}, {"lease_ms": 86_400_001}, {"lease_ms": 1.5}):
        with pytest.raises(InvalidArgument):
            a.begin_turn(0, **kw)  # type: ignore[arg-type]
    for owner in ("", "a b", "x" * 129, "a|b"):
        with pytest.raises(InvalidArgument):
            ledger.run(protocol.begin_turn(a.keys, new_op_id(), a.epoch, 0, None, owner, 1000))
    with pytest.raises(InvalidArgument):
        a.end_turn(0, 100, mark="not an id")
    with pytest.raises(InvalidArgument):  # no turn to abort or renew
        a.abort_turn()
    assert whole(ledger, a) == before


# --- deliveries --------------------------------------------------------------------------


def worker_compaction(led: Ledger, s: Session, replaced: list[Any], summary: Item) -> Any:
    """A compaction as the worker commits it: with its job's stream entry."""
    entry = led.client.xadd(s.keys.jobs, {"kind": "compact", "session": s.id})
    return led.run(
        protocol.compact(
            s.keys, f"job-{_text(entry)}", s.epoch, replaced, summary, job=_text(entry)
        )
    )


def test_a_worker_compaction_is_staged_under_a_turn_and_delivered_once(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    before = whole(ledger, a)
    got = worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    assert got.outcome == "staged" and not got.compacted
    after = whole(ledger, a)
    changed = {k for k in {*before[0], *after[0]} if before[0].get(k) != after[0].get(k)}
    assert b"kp" in changed and changed <= {b"kp", b"gz", b"xp"}  # only the plan is stored
    assert after[1] == before[1] and not ledger.client.hgetall(a.keys.compacted)
    a.end_turn(t.turn, 5_000)
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0)  # it lands here, before this turn is gated, and is delivered to it
    assert t2.landed in ("compacted", "deferred", "failed"), t2
    assert t2.summaries == ("sum-1",) and set(t2.dropped) == {(W, "w1"), (R, "r1")}
    assert b"kp" not in ledger.client.hgetall(a.keys.session)
    b.abort_turn()  # ... which dies: delivered again to the next
    t3 = a.begin_turn(0)
    assert t3.summaries == ("sum-1",) and set(t3.dropped) == {(W, "w1"), (R, "r1")}
    a.end_turn(t3.turn, 5_000)
    t4 = b.begin_turn(0)  # done: once
    assert t4.summaries == () and t4.dropped == ()
    # A summary replaced before it was delivered leaves the queue; its drops stay.
    b.end_turn(t4.turn, 5_000)
    worker_compaction(ledger, a, ["w2"], Item("sum-2", 80, 1000))
    worker_compaction(ledger, a, ["sum-2", (R, "r2")], Item("sum-3", 90, 1000))
    t5 = a.begin_turn(0)
    assert t5.summaries == ("sum-3",) and set(t5.dropped) == {(W, "w2"), (R, "r2")}
    assert ledger.audit(a.id).clean


def test_a_summary_given_back_by_a_rollback_and_replaced_while_queued_leaves_the_queue(
    ledger: Ledger,
) -> None:
    """A summary delivered to a turn that is rolled back is queued again; a compaction
    that replaces it before a turn takes it again (staged under the dying turn and landed
    by the begin that rolls it back, or committed between turns) takes it out of the
    queue, as one never delivered: no later turn is given it, nor told to drop it, and
    what it replaced comes with the later summary (the history checker relies on this)."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    t = a.begin_turn(0)
    assert t.summaries == ("sum-1",) and set(t.dropped) == {(W, "w1"), (R, "r1")}
    got = worker_compaction(ledger, a, ["sum-1", (M, "m1")], Item("sum-2", 90, 1000))
    assert got.outcome == "staged"
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0, takeover=True)  # A's turn rolled back, then the plan lands
    assert t2.rolled_back == t.turn and t2.landed in ("compacted", "deferred", "failed"), t2
    assert t2.summaries == ("sum-2",)
    assert set(t2.dropped) == {(W, "w1"), (R, "r1"), (M, "m1")}
    b.abort_turn()  # once more, now between turns
    worker_compaction(ledger, a, ["sum-2", "w2"], Item("sum-3", 80, 1000))
    t3 = a.begin_turn(0)
    assert t3.summaries == ("sum-3",)
    assert set(t3.dropped) == {(W, "w1"), (R, "r1"), (M, "m1"), (W, "w2")}
    a.end_turn(t3.turn, 5_000)
    held = {i.id for i in ledger.items(a.id)}
    assert {"sum-1", "sum-2"}.isdisjoint(held) and "sum-3" in held
    t4 = b.begin_turn(0)
    assert t4.summaries == () and t4.dropped == ()
    assert ledger.audit(a.id).clean


def test_a_compaction_replaces_only_the_version_it_read(ledger: Ledger) -> None:
    """The compactor read w1 at one sequence number; w1 released and admitted again (new
    text) since: the commit leaves the new version."""
    a = loaded(ledger, "A")
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "w1")
    a.release(W, ["w1"])
    a.admit(W, [Item("w1", 450)])
    done = a.compact([(W, "w1", seq), (R, "r1")], Item("sum-v", 60))
    assert done.missing == ((W, "w1"),)
    held = {i.id: i.tokens for i in ledger.items(a.id)}
    assert held["w1"] == 450 and "r1" not in held


# --- any interleaving: a random turn, then its death ---------------------------------------


def random_turn(s: Session, rnd: random.Random, n: int) -> None:
    """n random calls of a turn (refusals and errors of its own are fine)."""
    ids = [f"x{i}" for i in range(8)]
    for k in range(n):
        c = rnd.choice([W, R, M, S])
        op = rnd.randrange(9)
        try:
            if op == 0:
                s.admit(c, [Item(rnd.choice(ids), rnd.randint(1, 2_500))], partial=True)
            elif op == 1:
                s.release(c, [rnd.choice(ids), "w1", "r1"][: rnd.randint(1, 3)])
            elif op == 2:
                s.admit_tool_result(rnd.choice(ids), rnd.randint(1, 9_000), b"{}")
            elif op == 3:
                s.reserve(c, f"res-{k}", rnd.randint(1, 900))
            elif op == 4:
                s.settle(rnd.choice(["res0", f"res-{k - 1}"]), rnd.randint(1, 900), f"set-{k}")
            elif op == 5:
                s.void(rnd.choice(["res0", f"res-{k - 1}"]))
            elif op == 6:
                s.reconcile({c: [Item(i, rnd.randint(1, 800)) for i in rnd.sample(ids, 2)]})
            elif op == 7:
                s.compact([(c, rnd.choice(ids)), (W, "w2")], Item(f"sum-{k}", rnd.randint(1, 300)))
            else:
                s.record_span(s.turn or 0, "recall", rnd.randint(0, 3_000))
        except Exception as exc:  # a refusal of the ledger's rules, not of the lease
            assert not isinstance(exc, (TurnLost, TurnInProgress)), exc


def test_any_turn_rolls_back_to_what_it_found(ledger: Ledger, backend: str) -> None:
    rounds = 4 if backend == "cluster" else 12
    for seed in range(rounds):
        rnd = random.Random(seed)
        a = loaded(ledger, "A")
        random_turn(a, rnd, 6)  # some history first, between turns
        before = state(ledger, a)
        t = a.begin_turn(rnd.choice([0, 2_000, 9_000]), output_reserve=rnd.choice([None, 1_500]))
        random_turn(a, rnd, 25)
        b = ledger.session(a.id, owner="B")
        assert b.begin_turn(0, takeover=True).rolled_back == t.turn
        b.abort_turn()
        assert state(ledger, a) == before, f"seed {seed}"
        assert ledger.audit(a.id).clean, f"seed {seed}"


# --- the agent layer ---------------------------------------------------------------------

from ledger import AsyncLedger  # noqa: E402
from ledger.agent import Agent, AsyncAgent  # noqa: E402


def words(text: str) -> int:
    return len(text.split())


def msg(i: str, n: int = 50) -> dict[str, str]:
    return {"id": i, "content": "word " * n}


def test_an_agent_turn_that_raises_is_rolled_back(ledger: Ledger) -> None:
    s = loaded(ledger, "A")
    before = state(ledger, s)
    agent = Agent(s, words)
    with pytest.raises(RuntimeError, match="the model call failed"), agent.turn(200) as turn:
        turn.admit("retrieval", [msg("doc-1"), msg("doc-2")])
        turn.tool_result({"id": "call-1", "content": "row " * 300})
        raise RuntimeError("the model call failed")
    assert turn.state is not None and turn.state.aborted is not None
    assert state(ledger, s) == before and ledger.audit(s.id).clean
    with agent.turn(200) as turn:  # the next turn starts from what was committed
        assert turn.rolled_back is None
        turn.prompt(5_000)


async def test_the_asyncio_face_rolls_back_and_renews_alike(aledger: AsyncLedger) -> None:
    s = await aledger.open_session(sid(), BUDGET, owner="A")
    await s.admit(W, [Item("w1", 900)])
    agent = AsyncAgent(s, words, lease_ms=300)
    other = AsyncAgent(await aledger.session(s.id, owner="B"), words)
    with pytest.raises(RuntimeError):
        async with agent.turn(0) as turn:
            await turn.admit("retrieval", [msg("doc-1")])
            raise RuntimeError("boom")
    assert [i.id for i in await aledger.items(s.id)] == ["w1"]
    async with agent.turn(0) as turn:
        import asyncio

        await asyncio.sleep(1.0)  # three leases long: renewed in the background
        with pytest.raises(TurnInProgress):
            async with other.turn(0):
                pass
        assert turn.lost is None
        turn.prompt(1_400)
    assert (await s.audit()).clean


def test_the_agent_renews_its_lease_and_others_wait_or_take_over(ledger: Ledger) -> None:
    s = loaded(ledger, "A")
    a = Agent(s, words, lease_ms=300)
    b = Agent(ledger.session(s.id, owner="B"), words, poll_interval=0.02)
    with a.turn(0) as turn:
        time.sleep(1.0)  # three leases long: renewed in the background
        with pytest.raises(TurnInProgress) as caught:
            b.turn(0).__enter__()
        assert caught.value.owner == "A"
        started = time.monotonic()
        with pytest.raises(TurnInProgress):  # waiting is bounded
            b.turn(0, wait=0.2).__enter__()
        assert 0.15 <= time.monotonic() - started < 1.0
        turn.prompt(5_100)
    with b.turn(0, wait=1.0) as theirs:  # free now: no wait
        theirs.prompt(5_100)
    with pytest.raises(TurnLost), a.turn(0) as mine:  # its end: the turn is not its own
        mine.admit("retrieval", [msg("doc-9")])
        with b.turn(0, takeover=True) as theirs:  # a stuck owner is taken over
            assert theirs.rolled_back == mine.number
            theirs.prompt(5_100)
        with pytest.raises(TurnLost):
            mine.admit("retrieval", [msg("doc-10")])
        mine.prompt(5_100)
    assert mine.state is not None and mine.state.aborted is not None
    assert mine.state.aborted.rolled_back is None  # nothing of its own left to roll back
    assert ledger.audit(s.id).clean


def test_apply_brings_any_process_state_up_to_the_ledger(ledger: Ledger) -> None:
    """Objects admitted by one process, a compaction committed between turns, the next
    turn served by another process that never saw those objects: apply drops what the
    summary replaced and puts the summary where that history began."""
    system = "You are brief."
    s = ledger.open_session(sid(), SessionBudget(window=20_000, system_prompt=words(system)))
    a = Agent(s, words)
    history: list[Any] = [system]
    with a.turn(0) as turn:
        for i in range(4):
            history += turn.admit("working_memory", [msg(f"m{i}", 100)]).kept
        turn.prompt(history)
    ledger.client.hset(
        s.keys.compacted,
        "sum-1",
        '{"text": "Earlier: four messages.", "replaced": ["w:m0", "w:m1", "w:m2"]}',
    )
    worker_compaction(
        ledger, s, ["m0", "m1", "m2"], Item("sum-1", words("Earlier: four messages."))
    )
    b = Agent(ledger.session(s.id, owner="B"), words)  # another process: knows none of them
    with b.turn(0) as turn:
        assert turn.dropped == []  # nothing it knows of
        shown = turn.apply(history)
        assert [o if isinstance(o, str) else o["id"] for o in shown] == [system, "sum-1", "m3"]
        assert turn.apply(shown) == shown  # applying twice changes nothing
        turn.prompt(shown)
    assert turn.report is not None and turn.report.drift == 0


def test_a_reconcile_drops_the_deliveries_the_prompt_contradicts(ledger: Ledger) -> None:
    """A worker's compaction lands between turns; before the next turn the app sets the
    ledger to its prompt (a repair), which still holds what the compaction replaced and
    not its summary: the queued deliveries it contradicts go, so the next turn's prompt
    is the ledger."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1", (R, "r1")], Item("sum-1", 100, 1000))
    held = {W: [Item("w1", 900), Item("w2", 700, 3)], R: [Item("r1", 800), Item("r2", 600, 2)]}
    a.reconcile(held)
    t = a.begin_turn(0)
    assert t.summaries == () and t.dropped == ()
    assert {i.id for i in ledger.items(a.id)} >= {"w1", "w2", "r1", "r2"}
    assert "sum-1" not in {i.id for i in ledger.items(a.id)} and ledger.audit(a.id).clean


def test_a_tool_result_with_no_room_is_answered_by_a_note(ledger: Ledger) -> None:
    """Not even its preview fits: the tool call is answered by a short note that says so,
    held in the result's place; never a result cut."""
    s = ledger.open_session(
        sid(),
        SessionBudget(
            window=2_000, system_prompt=100, output_reserve=100, spill_preview_tokens=300
        ),
    )
    agent = Agent(s, words)
    with agent.turn(0) as turn:
        turn.admit("working_memory", [msg("m1", 1_750)])
        out = turn.tool_result({"id": "call-1", "content": "row " * 5_000})
        assert out.refused and out.reason in ("token_budget_exhausted", "floor_protected")
        assert "refused by the ledger" in out.text and not out.spilled
        assert {i.id: i.tokens for i in ledger.items(s.id)}["call-1"] == words(out.text)
        turn.prompt(100 + 1_750 + words(out.text))
    assert turn.report is not None and turn.report.drift == 0 and s.audit().clean


# --- found by review: each failed before its fix -----------------------------------------


def test_a_compaction_never_overwrites_a_summary_id_held_in_another_version(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    a.admit(W, [Item("sum", 700)])
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "sum")
    before = whole(ledger, a)
    with pytest.raises(SessionConflict, match="another version"):
        a.compact([(W, "sum", seq + 99), (W, "w1")], Item("sum", 50))
    assert whole(ledger, a) == before and ledger.audit(a.id).clean


def test_the_same_owner_after_its_lease_lapsed_rolls_its_dead_turn_back(ledger: Ledger) -> None:
    """A process restarted under the dead one's owner name: the half-done turn is rolled
    back (its delivery comes again), not committed."""
    a = loaded(ledger, "A")
    worker_compaction(ledger, a, ["w1"], Item("sum-1", 80, 1000))
    t1 = a.begin_turn(0, lease_ms=100)
    assert t1.summaries == ("sum-1",)
    a.admit(R, [Item("half-done", 100)])
    time.sleep(0.25)
    again = ledger.session(a.id, owner="A")  # the same name, a new process
    t2 = again.begin_turn(0)
    assert t2.rolled_back == t1.turn and t2.summaries == ("sum-1",)
    assert "half-done" not in {i.id for i in ledger.items(a.id)}


def test_a_turn_objects_calls_carry_its_own_turn(ledger: Ledger) -> None:
    """An old Turn (a leftover task) after the agent moved on: its calls are refused, not
    made in the later turn; and an agent serves one turn at a time."""
    s = loaded(ledger, "A")
    agent = Agent(s, words)
    with agent.turn(0) as first:
        first.prompt(5_000)
    with agent.turn(0) as second:
        with pytest.raises(TurnLost):
            first.admit("retrieval", [msg("late-doc")])
        with pytest.raises(TurnInProgress, match="one turn at a time"):
            agent.turn(0).__enter__()
        second.prompt(5_000)
    assert "late-doc" not in {i.id for i in ledger.items(s.id)}


def test_an_op_sent_again_after_its_turn_was_rolled_back_is_judged_anew(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    a.release(R, ["r1"], op_id="req-7:release")
    a.admit(R, [Item("r9", 600)], op_id="req-7:admit")
    b = ledger.session(a.id, owner="B")
    t2 = b.begin_turn(0, takeover=True)
    assert t2.rolled_back == t.turn
    with pytest.raises(TurnLost):  # the old turn's retry: its turn is gone
        a.release(R, ["r1"], op_id="req-7:release")
    # The request retried in the new turn: done there, once (not answered from the undone one).
    assert b.release(R, ["r1"], op_id="req-7:release").count == 1
    assert b.admit(R, [Item("r9", 600)], op_id="req-7:admit").charged == 600
    assert b.admit(R, [Item("r9", 600)], op_id="req-7:admit").charged == 600  # a replay now
    held = {i.id for i in ledger.items(a.id)}
    assert "r1" not in held and "r9" in held and ledger.audit(a.id).clean


def test_a_rollback_gives_back_what_the_turn_counted_against_a_pending_compaction(
    ledger: Ledger,
) -> None:
    s = ledger.open_session(
        sid(), SessionBudget(window=10_000, system_prompt=100, high_water_mark=0.3)
    )
    s.admit(W, [Item("w", 3_500)])
    s.end_turn(0, 3_600)  # a compaction is pending now (agent-free: no worker in this test)
    assert s.snapshot().compaction_pending
    pm = s.snapshot().raw["pm"]
    t = s.begin_turn(0)
    s.admit(R, [Item("doc", 2_000)])
    assert s.snapshot().raw["pm"] == pm + 2_000
    s.abort_turn(t.turn)
    assert s.snapshot().raw["pm"] == pm


def test_a_resized_item_is_a_new_version(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    seq = next(i.seq for i in ledger.items(a.id) if i.id == "w1")
    a.reconcile({W: [Item("w1", 1_200), Item("w2", 700, 3)]})  # new text, new size
    done = a.compact([(W, "w1", seq)], Item("sum-x", 50))
    assert done.missing == ((W, "w1"),)
    assert {i.id: i.tokens for i in ledger.items(a.id)}["w1"] == 1_200


def test_a_turn_a_reset_cut_off_is_over(ledger: Ledger) -> None:
    a = loaded(ledger, "A")
    t = a.begin_turn(0)
    a.reset("operator")
    a.refresh()
    with pytest.raises(TurnLost, match="rolled back \\(reset\\)"):
        a.end_turn(t.turn, 5_000, mark="ckpt-of-dead-turn")
    assert a.begin_turn(0).mark is None


def test_begin_turn_awaiting_a_pending_compaction_refuses_and_changes_nothing(
    ledger: Ledger,
) -> None:
    """With await_compaction, begin_turn says a compaction is pending (and whether a
    worker computes it, from the summaries hash's '~') instead of beginning: no lease, no
    turn, nothing changed. Without a pending compaction, or without await, it begins."""
    from ledger import CompactionPending

    s = ledger.open_session(f"aw-{uuid.uuid4().hex[:8]}", BUDGET)
    first = s.begin_turn(0, await_compaction=True)  # nothing pending: it begins
    s.end_turn(first.turn, 1_600)
    ledger.client.hset(s.keys.session, "cd", 1)  # a compaction becomes pending
    unstamped = ledger.client.hgetall(s.keys.session)
    with pytest.raises(CompactionPending, match="not picked up") as no_worker:
        s.begin_turn(0, await_compaction=True)
    assert not no_worker.value.computing and no_worker.value.requested_ms_ago is None
    assert ledger.client.hgetall(s.keys.session) == unstamped  # nothing changed
    asked = int(ledger.client.time()[0]) * 1000 - 5_000  # the job was requested 5 s ago
    ledger.client.hset(s.keys.session, "cq", asked)
    before = ledger.client.hgetall(s.keys.session)
    with pytest.raises(CompactionPending, match=r"requested [0-9]+ ms ago") as late:
        s.begin_turn(0, await_compaction=True)
    assert 4_000 <= (late.value.requested_ms_ago or 0) < 60_000
    until = int(time.time() * 1000) + 60_000
    ledger.client.hset(s.keys.compacted, "~", f"worker-7|{until}")
    with pytest.raises(CompactionPending) as running:
        s.begin_turn(0, await_compaction=True)
    assert running.value.computing and running.value.worker == "worker-7"
    assert running.value.until_ms == until
    assert ledger.client.hgetall(s.keys.session) == before  # no lease, no turn, nothing
    ledger.client.hset(s.keys.compacted, "~", f"worker-7|{until - 120_000}")  # lapsed
    with pytest.raises(CompactionPending, match="not picked up"):
        s.begin_turn(0, await_compaction=True)
    assert s.begin_turn(0).turn == first.turn + 1  # without await it begins


def test_a_turn_with_no_compaction_pending_is_one_call_to_begin(ledger: Ledger) -> None:
    """The agent asks begin_turn itself whether to wait for a compaction: a worker-owned
    session's turn calls no snapshot before it (only the agent's first turn asks, once,
    who compacts the session)."""
    from ledger import Agent

    s = ledger.open_session(f"one-{uuid.uuid4().hex[:8]}", BUDGET)
    agent = Agent(s, len)
    ran: list[str] = []
    run = ledger.run

    def counted(call: Any) -> Any:
        ran.append(call.script)
        return run(call)

    ledger.run = counted  # type: ignore[method-assign]
    for i in range(3):
        with agent.turn(0) as t:
            t.admit("retrieval", [{"id": f"d{i}", "content": "x" * 50}])
            t.prompt(100)
    ledger.run = run  # type: ignore[method-assign]
    assert ran == ["snapshot", *["begin_turn", "admit", "end_turn"] * 3], ran


def test_a_turn_of_thousands_of_items_is_rolled_back_and_reconciled_whole(ledger: Ledger) -> None:
    """A turn that rotated out 6,000 chunks is rolled back whole (its undo runs to 12,000
    values, past what Lua unpacks at once), and a reconcile drops 6,000 items in one step."""
    budget = SessionBudget(
        window=1_000_000, system_prompt=100, compaction="agent", release_each_turn={R}
    )
    s = ledger.open_session(sid(), budget)
    for k in range(6):
        s.admit(R, [Item(f"d{k}-{i}", 5) for i in range(1_000)])
    t = s.begin_turn(0)
    assert t.rotated == 30_000 and not ledger.items(s.id)
    assert s.abort_turn().rolled_back == t.turn
    assert len(ledger.items(s.id)) == 6_000 and ledger.audit(s.id).clean
    done = s.reconcile({R: [Item("d0-0", 5)]})
    assert len(done.removed) == 5_999 and [i.id for i in ledger.items(s.id)] == ["d0-0"]
    assert ledger.audit(s.id).clean
