"""A worker's compaction that arrives while a turn is open is staged and lands at the
session's next begin_turn (docs/compaction.md#the-summary-reaches-the-agent), on the
embedded backend, a real redis-server and a real Redis Cluster: nothing changes under the
running turn; the next begin lands it once, before its turn is gated, and delivers it; a
plan whose items changed meanwhile is stale, refused and counted failed; a compaction is
judged on the history its compactor read; bad input is refused typed, changing nothing."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest

from ledger import (
    CompactionPending,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    SessionBudget,
    protocol,
)
from ledger.client import Session

W, R = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL
BUDGET = SessionBudget(window=20_000, system_prompt=500, tool_framing=100, output_reserve=1_000)
# high-water mark 0.72: 14,400 tokens


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def history(led: Ledger, tokens: int = 2_000, n: int = 4) -> Session:
    """A worker-owned session holding w1..wn (committed history), between turns."""
    s = led.open_session(f"stage/{uuid.uuid4().hex[:12]}", BUDGET, owner="A")
    s.admit(W, [Item(f"w{i}", tokens) for i in range(1, n + 1)])
    return s


def read_of(led: Ledger, s: Session) -> tuple[int, dict[str, int]]:
    """What a worker's compactor reads: the newest sequence number and each item's."""
    seqs = {i.id: i.seq for i in led.items(s.id)}
    return max(seqs.values()), seqs


def job_call(
    led: Ledger, s: Session, replaced: list[Any], summary: Item, read: int | None, text: str = ""
) -> protocol.Call[Any]:
    """A compaction as the worker commits its job: with the job's stream entry."""
    entry = _text(led.client.xadd(s.keys.jobs, {"kind": "compact", "session": s.id}))
    return protocol.compact(
        s.keys, f"job-{entry}", s.epoch, replaced, summary, job=entry,
        summary_text=text or f"summary of {len(replaced)}", read=read,
    )  # fmt: skip


def session_hash(led: Ledger, s: Session) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in led.client.hgetall(s.keys.session).items()}


def test_a_compaction_under_a_running_turn_lands_at_the_next_begin_once(ledger: Ledger) -> None:
    s = history(ledger)
    read, seqs = read_of(ledger, s)
    t = s.begin_turn(0)
    s.admit(W, [Item("w5", 500)])  # the open turn's own item: no summary may hold it
    before = session_hash(ledger, s)
    call = job_call(
        ledger, s, [(W, "w1", seqs["w1"]), (W, "w2", seqs["w2"])], Item("sum", 300), read
    )
    got = ledger.run(call)
    assert got.outcome == "staged" and not got.compacted
    again = ledger.run(call)  # the same op sent again: its outcome, nothing more
    assert again.outcome == "staged"
    after = session_hash(ledger, s)
    assert {k for k in {*before, *after} if before.get(k) != after.get(k)} <= {"kp", "gz", "xp"}
    held = {i.id for i in ledger.items(s.id)}
    assert {"w1", "w2", "w5"} <= held  # nothing replaced under the running turn
    s.end_turn(t.turn, 9_000)
    kn = int(session_hash(ledger, s).get("kn", 0))
    t2 = s.begin_turn(0)  # lands here, delivered to this turn
    assert t2.landed == "compacted" and t2.summaries == ("sum",)
    assert set(t2.dropped) == {(W, "w1"), (W, "w2")}
    h = session_hash(ledger, s)
    assert "kp" not in h and int(h["kn"]) == kn + 1 and h["cd"] == "0"
    held = {i.id for i in ledger.items(s.id)}
    assert "w1" not in held and "w2" not in held and {"sum", "w5"} <= held
    assert ledger.client.hget(s.keys.compacted, "sum") is not None
    s.end_turn(t2.turn, 9_000)
    # Sent again after it landed: the recorded outcome, and nothing lands twice.
    assert ledger.run(call).outcome == "staged"
    t3 = s.begin_turn(0)
    assert t3.landed is None and t3.summaries == ()
    assert int(session_hash(ledger, s)["kn"]) == kn + 1
    s.end_turn(t3.turn, 9_000)
    assert ledger.audit(s.id).clean


def test_a_stale_plan_is_refused_and_counted_failed(ledger: Ledger) -> None:
    s = history(ledger)
    read, seqs = read_of(ledger, s)
    t = s.begin_turn(0)
    replaced = [(W, "w1", seqs["w1"]), (W, "w2", seqs["w2"])]
    assert ledger.run(job_call(ledger, s, replaced, Item("sum", 300), read)).outcome == "staged"
    s.release(W, ["w2"])  # the open turn changes what the compactor read
    s.admit(W, [Item("w2", 900)])  # (another version of w2)
    s.end_turn(t.turn, 9_000)
    jobs = ledger.client.xlen(s.keys.jobs)
    t2 = s.begin_turn(0)
    assert t2.landed == "stale" and t2.summaries == () and t2.dropped == ()
    h = session_hash(ledger, s)
    assert "kp" not in h and h["kf"] == "1" and h["cd"] == "1"
    assert int(h["x:failed_compactions"]) == 1
    assert ledger.client.xlen(s.keys.jobs) == jobs + 1  # the next attempt, a new job
    held = {i.id: i.tokens for i in ledger.items(s.id)}
    assert held["w1"] == 2_000 and held["w2"] == 900 and "sum" not in held  # nothing replaced
    assert not ledger.client.hget(s.keys.compacted, "sum")
    s.end_turn(t2.turn, 9_000)
    assert ledger.audit(s.id).clean


def test_a_staged_plan_of_an_earlier_epoch_is_dropped(ledger: Ledger) -> None:
    s = history(ledger)
    read, seqs = read_of(ledger, s)
    s.begin_turn(0)
    assert ledger.run(job_call(ledger, s, [(W, "w1", seqs["w1"])], Item("sum", 300), read))
    s.reset("test")
    s.refresh()
    t = s.begin_turn(0)
    assert t.landed is None and t.summaries == ()
    assert "kp" not in session_hash(ledger, s) and not ledger.items(s.id)


def test_a_compaction_is_judged_on_the_history_its_compactor_read(ledger: Ledger) -> None:
    """w5 (8,000 tokens) was admitted after the compactor read w1..w4: the summary of w1
    leaves 15,600 tokens, over the mark (14,400), but 7,600 of the history it read. Judged
    on what it read, it lands; held against it (no read sent: the judgement before), the
    same compaction is a failed one."""
    outcomes = {}
    for read_sent in (True, False):
        s = history(ledger)
        read, seqs = read_of(ledger, s)
        t = s.begin_turn(0)
        s.admit(W, [Item("w5", 8_000)])
        call = job_call(
            ledger, s, [(W, "w1", seqs["w1"])], Item("sum", 1_000), read if read_sent else None
        )
        assert ledger.run(call).outcome == "staged"
        s.end_turn(t.turn, 16_600)
        t2 = s.begin_turn(0)
        outcomes[read_sent] = t2.landed
        # either way the effect is applied (the tokens are real), and still due
        assert t2.summaries == ("sum",) and t2.compaction_due
        h = session_hash(ledger, s)
        assert h["kf"] == ("0" if read_sent else "1")
    assert outcomes == {True: "compacted", False: "failed"}


def test_bad_input_is_refused_typed_changing_nothing(ledger: Ledger) -> None:
    s = history(ledger)
    read, seqs = read_of(ledger, s)
    for bad in (-1, 10**15 + 1, 1.5, "7"):
        with pytest.raises(InvalidArgument):
            job_call(ledger, s, [(W, "w1")], Item("sum", 300), bad)  # type: ignore[arg-type]
    s.begin_turn(0)
    good = job_call(ledger, s, [(W, "w1", seqs["w1"])], Item("sum", 300), read)
    before = session_hash(ledger, s)
    for arg in ("x", "-5", "1e3", "1000000000000001", ""):
        call = dataclasses.replace(good, args=(*good.args[:-1], arg))
        with pytest.raises(InvalidArgument, match="history read"):
            ledger.run(call)
    too_many = dataclasses.replace(good, args=(*good.args, "1"))
    with pytest.raises(InvalidArgument, match="arguments"):
        ledger.run(too_many)
    assert session_hash(ledger, s) == before  # nothing staged, nothing changed
    entry = good.args[-3]
    assert ledger.client.xrange(s.keys.jobs, _text(entry), _text(entry))  # the job stays


def test_a_turn_that_waits_for_a_pending_compaction_gets_the_staged_one(ledger: Ledger) -> None:
    """A begin that waits for a pending compaction (await) is refused while one is pending
    and none is staged; with one staged it lands the plan instead and begins."""
    s = history(ledger, tokens=4_000)  # 16,600 tokens: over the mark, due at the turn
    read, seqs = read_of(ledger, s)
    t = s.begin_turn(0)
    assert t.compaction_due
    s.end_turn(t.turn, 16_600)

    def waiting_begin() -> Any:
        call = protocol.begin_turn(s.keys, f"b-{uuid.uuid4().hex}", s.epoch, 0, None, "A", 30_000,
                                   await_compaction=True)  # fmt: skip
        return ledger.run(call)

    with pytest.raises(CompactionPending):
        waiting_begin()  # pending, nothing staged: refused, nothing changed
    t2 = s.begin_turn(0)
    replaced = [(W, f"w{i}", seqs[f"w{i}"]) for i in (1, 2, 3)]
    assert ledger.run(job_call(ledger, s, replaced, Item("sum", 500), read)).outcome == "staged"
    s.end_turn(t2.turn, 16_600)
    t3 = waiting_begin()
    assert t3.landed == "compacted" and t3.summaries == ("sum",) and not t3.compaction_due
