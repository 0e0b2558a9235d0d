"""A job's effect happens once for its whole life in the stream, on every backend.

A compaction job committed but not acknowledged (its worker died between the two) is
taken over later, possibly after the op retention has dropped the outcome stored under
its op id: ``compact.lua`` deletes the job's stream entry in the same atomic step as
its effect, and a call naming an entry that is gone changes nothing (outcome
``already``). A hard-reset job is fenced by its epoch instead (one that finds a live turn
waits for the turn's end, its delivery uncounted). Once a hard reset is
requested, queued compaction jobs are skipped and no failure is counted past the
escalation.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator

import pytest
import redis.exceptions

from ledger import InvalidArgument, Item, Ledger, LedgerSettings, SessionBudget, protocol
from ledger.core import new_op_id
from ledger.errors import OperationIdReused, TurnLost
from ledger.models import Consumer
from ledger.scripts import stored_outcomes
from tests.conftest import BACKENDS, backend_url, make_settings
from tests.support import jobs
from tests.support.redis_clock import redis_ms

FAILS = ("kf", "x:failed_compactions", "x:escalations", "x:resets", "ep", "rq", "cd")


@pytest.fixture(params=BACKENDS)
def led(request: pytest.FixtureRequest) -> Iterator[Ledger]:
    """4 partitions and the shortest op retention (1 s)."""
    settings: LedgerSettings = make_settings(
        backend_url(request, str(request.param)),
        partitions=4,
        op_retention_seconds=1,
        retry_attempts=1,
    )
    with Ledger.from_settings(settings) as ledger:
        yield ledger


def deliver(led: Ledger, sid: str, consumer: str = "dying") -> tuple[str, dict[str, str]]:
    """Read the session's next job as `consumer`: it is pending for that consumer."""
    [(_, entries)] = led.client.xreadgroup(
        jobs.GROUP, consumer, {jobs.jobs_of(led, sid): ">"}, count=1
    )
    [(eid, raw)] = entries
    fields = {jobs.text(k): jobs.text(v) for k, v in raw.items()}
    assert fields["session"] == sid
    return jobs.text(eid), fields


def test_compaction_job_taken_over_after_the_op_retention_applies_once(led: Ledger) -> None:
    sid = "late-takeover"
    # no escalation in this test
    budget = SessionBudget(
        window=10_000, system_prompt=500, output_reserve=500, max_failed_compactions=10
    )
    jobs.open_compaction(led, sid, budget)
    jobs.never_enough.calls.pop(sid, None)
    worker = jobs.new_worker(led)
    worker.ensure_groups()

    # A worker commits the job's failed compaction and dies before acknowledging it.
    eid, fields = deliver(led, sid)
    assert worker.handle(eid, fields).effect == "applied"
    after_first = jobs.counters(led, sid, *FAILS)
    assert after_first[:2] == ("1", "1")
    # its follow-up (a failed compaction is retried) is not what this test is about
    [(follow_up, _)] = [(e, f) for e, f in jobs.entries_for(led, sid) if e != eid]
    led.client.xdel(jobs.jobs_of(led, sid), follow_up)

    # The op retention passes: the outcome stored under the job's op id is dropped.
    jobs.forget_outcome(led, sid, f"job-{eid}")
    assert not jobs.stored_outcome(led, sid, f"job-{eid}")

    # Delivered again (a duplicate, or taken over with its body): no second effect.
    outcome = worker.handle(eid, fields)
    assert outcome.effect == "already", outcome
    assert jobs.counters(led, sid, *FAILS) == after_first
    assert jobs.entries_for(led, sid) == []  # no second follow-up was enqueued

    # The takeover itself: the pending entry's body is gone, so it is acknowledged.
    jobs.wait_until(lambda: worker.poll_once() >= 0 and jobs.busy(led) == 0, 5, "the takeover")
    assert jobs.counters(led, sid, *FAILS) == after_first
    assert jobs.never_enough.calls.get(sid, 0) <= 2  # the first run and the duplicate


def test_hard_reset_job_taken_over_after_the_op_retention_applies_once(led: Ledger) -> None:
    """Needs no entry check: a reset at epoch e moves the session to e + 1, so the same
    job (fenced at e) is refused as stale whether or not its outcome is still stored."""
    sid = "late-reset"
    epoch = led.open_session(sid, jobs.BUDGET).epoch
    stream = jobs.jobs_of(led, sid)
    fields = {"kind": "hard_reset", "session": sid, "epoch": epoch, "reason": "test", "op": "x"}
    led.client.xadd(stream, fields)
    worker = jobs.new_worker(led)
    worker.ensure_groups()
    eid, body = deliver(led, sid)
    assert worker.handle(eid, body).effect == "applied"
    assert jobs.counters(led, sid, "ep", "x:resets") == ("2", "1")

    jobs.forget_outcome(led, sid, f"job-{eid}")
    assert worker.handle(eid, body).effect == "already"
    assert jobs.counters(led, sid, "ep", "x:resets") == ("2", "1")
    jobs.wait_until(lambda: worker.poll_once() >= 0 and jobs.busy(led) == 0, 5, "the takeover")
    assert jobs.counters(led, sid, "ep", "x:resets") == ("2", "1")


def test_a_hard_reset_job_that_finds_a_live_turn_waits_for_its_end(led: Ledger) -> None:
    """docs/rules.md#a-reset-waits-for-the-turns-end: the job stages the reset (ResetStaged:
    left pending, uncounted), the turn's end applies it, and the job claimed again is done
    (already), one reset in all. A turn kept open past reset_wait is cut off: the job
    claimed once the staged reset is due applies it."""
    from ledger.workers.jobs import ResetStaged

    for wait, ended in ((30.0, True), (0.2, False)):
        sid = f"reset-waits-{uuid.uuid4().hex[:6]}"
        s = led.open_session(sid, jobs.BUDGET)
        s.admit(Consumer.WORKING_MEMORY, [Item("w1", 100)])
        t = s.begin_turn(0)
        fields = {
            "kind": "hard_reset",
            "session": sid,
            "epoch": s.epoch,
            "reason": "test",
            "op": "x",
        }
        led.client.xadd(jobs.jobs_of(led, sid), fields)
        worker = jobs.new_worker(led, reset_wait=wait)
        worker.ensure_groups()
        eid, body = deliver(led, sid)
        with pytest.raises(ResetStaged):
            worker.handle(eid, body)
        with pytest.raises(ResetStaged):  # claimed again before the turn's end: still waits
            worker.handle(eid, body)
        assert jobs.counters(led, sid, "x:resets") == ("0",) and "rz" in jobs.session_hash(led, sid)
        if ended:
            assert s.end_turn(t.turn, 500).reset == s.epoch
            assert worker.handle(eid, body).effect == "already"
        else:
            due = int(jobs.session_hash(led, sid)["rz"].split("|")[1])
            jobs.wait_until(lambda d=due: redis_ms(led) > d, 5, "the staged reset's due time")
            assert worker.handle(eid, body).effect == "applied"
            with pytest.raises(TurnLost):
                s.refresh()
                s.end_turn(t.turn, 500)
        assert jobs.counters(led, sid, "x:resets") == ("1",) and not led.items(sid)


def test_compact_with_a_job_entry_deletes_it_in_the_same_step(led: Ledger) -> None:
    """compact.lua's last argument: the job's stream entry id, or '-' for a call that is
    not a job. An entry that exists is deleted with the effect; one that is gone makes
    the call reply outcome=already and change nothing, whatever its op id."""
    sid = "entry-check"
    jobs.open_compaction(led, sid)
    s = led.session(sid)
    [(eid, _)] = jobs.entries_for(led, sid)
    call = protocol.compact(s.keys, "op-a", s.epoch, ["old0"], Item("sum-a", 10), job=eid)
    first = led.run(call)
    assert first.outcome in ("compacted", "failed") and first.dropped == 250
    assert eid not in [e for e, _ in jobs.entries_for(led, sid)]
    before = jobs.session_hash(led, sid)
    before.pop("xp", None)
    # the same op id replays its stored outcome
    assert led.run(call) == first
    # another op id naming the same (gone) entry changes nothing
    again = protocol.compact(s.keys, "op-b", s.epoch, ["old1"], Item("sum-b", 10), job=eid)
    got = led.run(again)
    assert (got.outcome, got.compacted, got.dropped, got.escalated) == ("already", False, 0, False)
    after = jobs.session_hash(led, sid)
    after.pop("xp", None)
    assert after == before
    # an entry that never existed is "gone" too
    never = protocol.compact(s.keys, "op-c", s.epoch, ["old1"], None, job="1-1")
    assert led.run(never).outcome == "already"
    # '-': an agent's own compaction, no entry involved
    assert led.run(protocol.compact(s.keys, "op-d", s.epoch, ["old1"], None)).dropped == 250


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "1",
        "1-",
        "-1",
        "a-1",
        "1-1-1",
        "1.5-0",
        " 1-0",
        "1-0\n",
        "9" * 21 + "-0",
        "9" * 20 + "-0",
        "*",
    ],
)
def test_compact_refuses_a_malformed_job_entry_id(led: Ledger, bad: str) -> None:
    sid = "bad-entry"
    jobs.open_compaction(led, sid)
    s = led.session(sid)
    call = protocol.compact(s.keys, new_op_id(), s.epoch, ["old0"], None)
    args = [*call.args[:-2], bad, call.args[-1]]  # (the summary text is last)
    stream = jobs.jobs_of(led, sid)
    before = (jobs.session_hash(led, sid), led.client.xrange(stream, "-", "+"))
    with pytest.raises(redis.exceptions.ResponseError, match=r"^LEDGER_BADARG job entry id"):
        led._scripts["compact"](keys=list(call.keys), args=args)
    assert (jobs.session_hash(led, sid), led.client.xrange(stream, "-", "+")) == before
    with pytest.raises(InvalidArgument, match="job entry id"):  # checked before sending too
        protocol.compact(s.keys, new_op_id(), s.epoch, ["old0"], None, job=bad)


def test_queued_compactions_after_an_escalation_do_not_run(led: Ledger) -> None:
    """A compactor that always fails, max_failed_compactions=3 and six compaction jobs
    queued: three failures recorded, one hard reset; the rest are skipped."""
    sid = "escalate-once"
    jobs.open_compaction(led, sid)
    [(_, fields)] = jobs.entries_for(led, sid)
    for _ in range(5):
        led.client.xadd(jobs.jobs_of(led, sid), fields)
    worker = jobs.new_worker(led)
    jobs.never_enough.calls.pop(sid, None)
    jobs.drain(led, worker)

    h = jobs.session_hash(led, sid)
    got = (h["x:failed_compactions"], h["x:escalations"], h["x:resets"], h["ep"], h["kf"])
    assert got == ("3", "1", "1", "2", "0"), h
    assert jobs.never_enough.calls[sid] == 3
    reg = worker.metrics.registry
    assert reg.get_sample_value("ledger_jobs_processed_total", {"kind": "hard_reset"}) == 1
    # the three follow-ups of the first three and the five queued: three ran, the rest skipped
    skipped = reg.get_sample_value("ledger_jobs_skipped_total", {"kind": "compact"})
    assert skipped is not None and skipped >= 3
    assert led.audit(sid).clean


def test_compact_counts_no_failure_past_the_escalation(led: Ledger) -> None:
    """An agent committing failed compactions itself: the counters stop at the maximum
    once a hard reset is requested, until the reset."""
    sid = "agent-escalates"
    s = led.open_session(sid, jobs.BUDGET)
    s.admit("working_memory", jobs.WM_ITEMS)
    replies = [s.compact([], None) for _ in range(5)]
    assert [r.escalated for r in replies] == [False, False, True, False, False]
    assert [r.failures for r in replies] == [1, 2, 3, 3, 3]
    assert jobs.counters(led, sid, "kf", "x:failed_compactions", "x:escalations", "rq") == (
        "3",
        "3",
        "1",
        "1",
    )
    # one retry job after the first failure (none was queued), none while it is queued,
    # then one hard reset; nothing after it
    kinds = [f["kind"] for _, f in jobs.entries_for(led, sid)]
    assert kinds == ["compact", "hard_reset"]
    s.reset("operator")
    s.refresh()
    assert jobs.counters(led, sid, "kf", "rq") == ("0", "0")
    s.admit("working_memory", jobs.WM_ITEMS)
    assert s.compact([], None).failures == 1


def test_an_outcome_outlives_a_rotation_and_is_dropped_after_the_next(led: Ledger) -> None:
    """Outcomes live in two generations: a call after the op retention moves the current
    one to the previous one, where a retry still gets its reply and is not applied
    again; the next rotation (or the previous generation's TTL) drops it."""
    sid = f"gen-{uuid.uuid4().hex[:8]}"
    s = led.open_session(sid, jobs.BUDGET)
    keys = led.keyspace.session(sid)
    first = s.admit("scratchpad", [Item("kept", 10)], op_id="op-kept")
    assert jobs.stored_outcome(led, sid, "op-kept")
    time.sleep(1.1)  # past the op retention: the next call rotates
    s.release("scratchpad", ["kept"])
    old = [
        op
        for b in led.client.hvals(keys.outcomes_old)
        for op, _, _ in stored_outcomes(jobs.text(b))
    ]
    assert jobs.op_key("op-kept") in old and 0 < led.client.pttl(keys.outcomes_old) <= 1000
    assert s.admit("scratchpad", [Item("kept", 10)], op_id="op-kept") == first
    assert s.snapshot().used[Consumer.SCRATCHPAD] == 0  # the retry applied nothing
    with pytest.raises(OperationIdReused):
        s.admit("scratchpad", [Item("other", 10)], op_id="op-kept")
    assert jobs.forget_outcome(led, sid, "op-kept") >= 0
    assert not jobs.stored_outcome(led, sid, "op-kept")


def test_a_growing_generation_widens_its_buckets_and_answers_every_retry(led: Ledger) -> None:
    """Past 8,192 outcomes a generation writes to buckets of three hex digits (so a call
    rewrites a bucket of a few dozen outcomes, never of thousands): an outcome stored
    before the widening and one after are both replayed, a turn rolled back drops its
    outcomes from the wide buckets too, and a rotation starts narrow again."""
    sid = f"wide-{uuid.uuid4().hex[:8]}"
    s = led.open_session(sid, jobs.BUDGET)
    out = led.keyspace.session(sid).outcomes
    before = s.admit("scratchpad", [Item("a", 10)], op_id="op-narrow")
    led.client.hset(out, "k", 8192)  # as if 8,192 outcomes were kept
    wide = s.admit("scratchpad", [Item("b", 10)], op_id="op-wide")
    h = hashlib.sha1(b"op-wide").hexdigest()
    assert led.client.hget(out, h[:3]) and int(led.client.hget(out, "k") or 0) == 8193
    assert h[2:16] not in jobs.text(led.client.hget(out, h[:2]) or b"")
    assert s.admit("scratchpad", [Item("a", 10)], op_id="op-narrow") == before
    assert s.admit("scratchpad", [Item("b", 10)], op_id="op-wide") == wide
    assert s.snapshot().used[Consumer.SCRATCHPAD] == 20  # neither retry applied again
    with pytest.raises(OperationIdReused):
        s.admit("scratchpad", [Item("c", 10)], op_id="op-wide")
    # a turn's outcome in a wide bucket goes with the turn when it is rolled back
    t = s.begin_turn(0, lease_ms=60_000)
    s.admit("scratchpad", [Item("t", 10)], op_id="op-in-turn", turn=t.turn)
    assert jobs.stored_outcome(led, sid, "op-in-turn")
    s.abort_turn(t.turn)
    assert not jobs.stored_outcome(led, sid, "op-in-turn")
    time.sleep(1.1)  # past the op retention: the next call rotates, to narrow buckets
    s.release("scratchpad", ["a"], op_id="op-after")
    a = hashlib.sha1(b"op-after").hexdigest()
    assert led.client.hmget(out, "k", "g") == [b"1", b"1"] and led.client.hget(out, a[:2])
    assert s.admit("scratchpad", [Item("b", 10)], op_id="op-wide") == wide  # from the old
