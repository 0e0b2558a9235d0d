"""A hard reset that finds a turn open waits for the turn's end (protocol 4,
docs/rules.md#a-reset-waits-for-the-turns-end), on the embedded backend, a real
redis-server and a real Redis Cluster: staged while the turn's lease is live (nothing else
written, the turn's calls go on); applied by the call that ends the turn (end_turn,
finish_turn, abort_turn, the begin_turn that ends it or takes it over), after the turn's own
effects, its reply saying so (reset=<new epoch>) and the handle taking the new epoch; a
reset sent again stays one reset; a staged reset is bounded (a reset call applies it once
due); the agent layer begins the next turn with no StaleEpoch; bad input changes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from ledger import (
    Agent,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    SessionBudget,
    StagedReset,
    protocol,
)
from ledger.client import Session
from ledger.errors import LedgerError, OperationIdReused, StaleEpoch, TurnInProgress, TurnLost
from tests.support.redis_clock import until_past

W, R = Consumer.WORKING_MEMORY, Consumer.RETRIEVAL
BUDGET = SessionBudget(window=20_000, system_prompt=500, output_reserve=1_000)
WAIT = 600_000  # ms: a staged reset waits this long at most (longer than any test)


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def raw(led: Ledger, s: Session) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in led.client.hgetall(s.keys.session).items()}


def in_turn(led: Ledger, owner: str = "A", lease_ms: int = 30_000) -> tuple[Session, int]:
    """A session holding w1, w2 and r1, its owner's turn open (w3 admitted in it)."""
    s = led.open_session(f"rz/{uuid.uuid4().hex[:12]}", BUDGET, owner=owner)
    s.admit(W, [Item("w1", 1_000), Item("w2", 800)])
    s.admit(R, [Item("r1", 500)])
    t = s.begin_turn(0, lease_ms=lease_ms)
    s.admit(W, [Item("w3", 300)])
    return s, t.turn


def staged(led: Ledger, s: Session, reason: str = "failed_compactions", **kw: Any) -> Any:
    """The worker's reset, from a handle of its own at the session's epoch."""
    return led.session(s.id).reset(reason, wait_ms=kw.pop("wait_ms", WAIT), **kw)


def test_a_live_turn_stages_the_reset_and_nothing_else_changes(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    before = raw(ledger, s)
    done = staged(ledger, s, op_id="reset-job-1")
    assert done.staged and done.epoch == s.epoch and done.turn == turn
    assert done.dropped == done.released == 0 and done.due_ms is not None
    after = raw(ledger, s)
    rz = after.pop("rz")
    assert after == before  # the one field written
    assert rz.startswith(f"{s.epoch}|{done.due_ms}|") and rz.endswith(
        "|reset-job-1|failed_compactions"
    )
    # the turn goes on: its calls are of the epoch it began at
    assert s.admit(W, [Item("w4", 200)]).admitted == 1
    assert {i.id for i in ledger.items(s.id)} == {"w1", "w2", "w3", "w4", "r1"}


def test_the_snapshot_shows_a_staged_reset_until_it_is_applied(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    assert s.snapshot().reset_staged is None
    done = staged(ledger, s, "ops_asked")
    snap = s.snapshot()
    assert snap.reset_staged == StagedReset(reason="ops_asked", due_ms=done.due_ms)
    assert snap.reset_staged.due_ms > snap.now_ms  # waiting for the turn's end
    # one of an older epoch is no reset of this one: not shown
    h = raw(ledger, s)
    ledger.client.hset(s.keys.session, "rz", h["rz"].replace(f"{s.epoch}|", f"{s.epoch - 1}|", 1))
    assert s.snapshot().reset_staged is None
    ledger.client.hset(s.keys.session, "rz", h["rz"])
    assert s.end_turn(turn, 3_100).reset == s.epoch  # applied: nothing staged any more
    assert s.snapshot().reset_staged is None


def test_end_turn_commits_the_turn_then_applies_the_reset(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    e0 = s.epoch
    staged(ledger, s)
    report = s.end_turn(turn, 3_100, mark="ckpt-1")
    assert report.reset == e0 + 1 and report.epoch == e0 and report.turn == turn
    assert report.drift == 3_100 - (500 + 1_000 + 800 + 500 + 300)  # the turn's, judged first
    assert s.epoch == e0 + 1 and s.turn is None  # the handle took the new epoch
    h = raw(ledger, s)
    assert h["ep"] == str(e0 + 1) and h["te"] == str(turn) and h["cm"] == "ckpt-1"
    assert "rz" not in h and "lo" not in h and h["x:resets"] == "1"
    assert h["x:last_reset"] == "failed_compactions" and h["cd"] == "0" and h["kf"] == "0"
    assert ledger.items(s.id) == [] and ledger.audit(s.id).clean
    # the next turn begins at the new epoch with no StaleEpoch
    t2 = s.begin_turn(0)
    assert t2.epoch == e0 + 1 and t2.reset is None and t2.turn == turn + 1
    assert s.end_turn(t2.turn, 600).reset is None


def test_finish_turn_applies_the_reset_after_its_tool_results(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    e0 = s.epoch
    staged(ledger, s)
    done = s.finish_turn(turn, 3_200, [("call-1", 100, "grep: 3 matches")], keep_text=True)
    assert done.report.reset == e0 + 1 and done.tools == (("call-1", 100),)
    assert s.epoch == e0 + 1 and ledger.items(s.id) == []
    assert not ledger.client.exists(s.keys.content, s.keys.compacted)
    assert "rz" not in raw(ledger, s)


def test_abort_turn_rolls_back_then_applies_the_reset(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    e0 = s.epoch
    staged(ledger, s)
    done = s.abort_turn(turn)
    assert done.rolled_back == turn and done.reset == e0 + 1 and done.epoch == e0
    assert s.epoch == e0 + 1 and ledger.items(s.id) == []
    h = raw(ledger, s)
    assert h["rb"] == f"{turn} aborted by A" and h["x:rolled_back"] == "1"
    assert h["x:resets"] == "1" and "rz" not in h


@pytest.mark.parametrize("how", ["lapsed", "takeover", "same_owner"])
def test_the_begin_that_ends_the_open_turn_applies_the_reset(ledger: Ledger, how: str) -> None:
    lease = 150 if how == "lapsed" else 30_000
    s, turn = in_turn(ledger, lease_ms=lease)
    e0 = s.epoch
    staged(ledger, s)
    if how == "lapsed":
        until_past(ledger, int(raw(ledger, s)["le"]))
        b = ledger.session(s.id, owner="B")
        t2 = b.begin_turn(0)  # the dead owner's staged reset, applied by whoever begins
    elif how == "takeover":
        b = ledger.session(s.id, owner="B")
        t2 = b.begin_turn(0, takeover=True)
    else:
        b = s  # the owner beginning again ends its open turn as it stands
        t2 = s.begin_turn(0)
    assert t2.reset == e0 + 1 and t2.epoch == e0 + 1 and b.epoch == e0 + 1
    assert t2.rolled_back == (None if how == "same_owner" else turn)
    assert t2.turn == turn + 1 and t2.summaries == () and t2.dropped == ()
    assert ledger.items(s.id) == [] and "rz" not in raw(ledger, s)
    assert b.admit(W, [Item("n1", 100)]).admitted == 1  # the new turn, the new epoch
    b.end_turn(t2.turn, 700)
    assert ledger.audit(s.id).clean
    if b is not s:
        with pytest.raises(TurnLost):  # the old turn is over: its handle is told so
            s.refresh()
            s.end_turn(turn, 3_000)


def test_a_begin_refused_for_another_owners_live_turn_leaves_it_staged(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    staged(ledger, s)
    b = ledger.session(s.id, owner="B")
    with pytest.raises(TurnInProgress):
        b.begin_turn(0)
    assert "rz" in raw(ledger, s) and s.end_turn(turn, 3_000).reset == b.epoch + 1


def test_a_reset_sent_again_stays_one_reset(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    e0 = s.epoch
    worker = ledger.session(s.id)
    first = worker.reset("failed_compactions", wait_ms=WAIT, op_id="job-7")
    # the same op (a job delivered again): judged again, the first staging kept
    assert worker.reset("failed_compactions", wait_ms=WAIT, op_id="job-7") == first
    # another op of the same epoch (another job): one reset, its first reason and due
    other = worker.reset("operator", wait_ms=5_000, op_id="job-8")
    assert other.staged and other.due_ms == first.due_ms
    with pytest.raises(OperationIdReused):  # the same op id with other arguments
        worker.reset("other-reason", wait_ms=WAIT, op_id="job-7")
    assert s.end_turn(turn, 3_000).reset == e0 + 1
    h = raw(ledger, s)
    assert h["x:resets"] == "1" and h["x:last_reset"] == "failed_compactions"
    for op in ("job-7", "job-8"):  # after the turn's end applied it: stale, nothing changes
        with pytest.raises(StaleEpoch):
            ledger.run(protocol.reset(s.keys, op, e0, "failed_compactions", WAIT))
    assert raw(ledger, s) == h


def test_a_staged_reset_is_applied_once_due_whatever_is_open(ledger: Ledger) -> None:
    s, turn = in_turn(ledger)
    e0 = s.epoch
    worker = ledger.session(s.id)
    first = worker.reset("failed_compactions", wait_ms=200, op_id="job-9")
    assert first.staged and first.due_ms is not None
    s.renew_turn(turn)  # a live lease does not hold it past its due time
    until_past(ledger, first.due_ms)
    done = worker.reset("failed_compactions", wait_ms=200, op_id="job-9")
    assert not done.staged and done.epoch == e0 + 1 and done.dropped == 4
    # the open turn was cut off: its calls are refused, nothing of it stays
    with pytest.raises(TurnLost, match="rolled back \\(reset\\)"):
        s.refresh()
        s.end_turn(turn, 3_000)
    assert ledger.items(s.id) == [] and "rz" not in raw(ledger, s) and "lo" not in raw(ledger, s)


def test_no_live_turn_or_no_wait_applies_the_reset_at_once(ledger: Ledger) -> None:
    s, _ = in_turn(ledger, lease_ms=150)
    e0 = s.epoch
    until_past(ledger, int(raw(ledger, s)["le"]))  # the lease lapsed: nothing to wait for
    done = staged(ledger, s)
    assert not done.staged and done.epoch == e0 + 1
    s2, _ = in_turn(ledger)
    assert not ledger.session(s2.id).reset("operator").staged  # wait 0: as before protocol 4


def test_bad_input_to_reset_is_refused_typed_and_changes_nothing(ledger: Ledger) -> None:
    s, _ = in_turn(ledger)
    before = raw(ledger, s)
    for bad in (-1, 86_400_001, 1.5, "10"):
        with pytest.raises(InvalidArgument):
            ledger.session(s.id).reset("why", wait_ms=bad)  # type: ignore[arg-type]
    call = protocol.reset(s.keys, "op-bad", s.epoch, "why", 10)
    for args in ((*call.args[:4], "-1"), (*call.args[:4], "1e3"), call.args[:4]):
        with pytest.raises(LedgerError, match=r"wait|arguments"):
            ledger.run(protocol.Call(call.script, call.keys, args, call.parse))
    assert raw(ledger, s) == before


# --- the agent layer: the next turn begins with no StaleEpoch ------------------------------


AGENT_BUDGET = SessionBudget(window=4_000, system_prompt=3, output_reserve=200)


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.embedded
def test_the_agent_adopts_a_reset_applied_at_its_turns_end() -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        session = led.open_session("ag", AGENT_BUDGET)
        agent = Agent(session, words)
        objs = [{"id": "m1", "content": "one two three"}, {"id": "m2", "content": "four five"}]
        with agent.turn() as t:
            t.admit("working_memory", objs)
            old = session.epoch
            assert led.session("ag").reset("failed_compactions", wait_ms=WAIT).staged
            more = {"id": "m3", "content": "six"}
            assert t.admit("working_memory", [more]).charged == 1  # the turn goes on
            t.end(["a b c", *objs, more])
        assert t.report is not None and t.report.reset == old + 1
        assert session.epoch == old + 1 and agent.core.known == {}
        begins: list[int] = []
        real = led.run

        def run(call: Any) -> Any:
            if getattr(call, "script", "") == "begin_turn":
                begins.append(session.epoch)
            return real(call)

        led.run = run  # type: ignore[method-assign]
        with agent.turn() as t:  # no StaleEpoch round trip: one begin, at the new epoch
            assert t.reset_from_epoch == old and t.state is not None and t.state.reset
            assert t.admit("working_memory", objs).charged == 5  # charged again
            t.end(["a b c", *objs])
        assert begins == [old + 1] and t.report is not None and t.report.drift == 0
        with agent.turn() as t:
            assert t.reset_from_epoch is None
            t.end(["a b c", *objs])


@pytest.mark.embedded
def test_the_agent_whose_begin_applies_a_dead_owners_reset_admits_again() -> None:
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as led:
        dead = led.open_session("dead", AGENT_BUDGET, owner="dead")
        dead.admit(W, [Item("w1", 1_000)])
        dead.begin_turn(0, lease_ms=100)
        e0 = dead.epoch
        assert led.session("dead").reset("failed_compactions", wait_ms=WAIT).staged
        until_past(led, int(raw(led, dead)["le"]))
        agent = Agent(led.session("dead", owner="next"), words)
        objs = [{"id": "q1", "content": "one two three"}]
        with agent.turn(admit={"working_memory": objs}) as t:  # sent with the begin
            assert t.reset_from_epoch == e0 and t.state is not None
            assert t.state.started.reset == e0 + 1 and t.state.started.rolled_back
            assert [a.charged for a in t.state.admissions] == [3]  # sent again, new epoch
            t.end(["a b c", *objs])
        assert t.report is not None and t.report.drift == 0 and t.report.epoch == e0 + 1
        assert {i.id for i in led.items("dead")} == {agent.core.item_id(objs[0])}
