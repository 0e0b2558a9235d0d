"""The background worker (ledger/workers/runner.py) in process on a real Redis: duplicate
delivery changes state once, the lease sweep releases expired reservations, the metrics
and the fleet's indicators, and a failing compactor retried.

Every test uses its own key prefix on the session's ``redis_server`` and ``PARTITIONS``
partitions; the helpers (compactors named by import path, job streams, backlogs) are in
tests/support/worker_scenarios.py, the ``led`` fixture in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from prometheus_client import generate_latest

from ledger import Item, Ledger, SessionBudget
from ledger.errors import (
    AdmissionRefused,
    ReservationExpired,
    UnknownReservation,
)
from ledger.workers.runner import Worker
from tests.support.jobs import BUDGET, GROUP, session_hash
from tests.support.worker_scenarios import (
    PARTITIONS,
    dead_letters,
    drain_in_process,
    entries_for,
    in_process_worker,
    open_compaction,
    open_resets,
    signature,
    wait_until,
)

pytestmark = pytest.mark.redis


# --- in process ----------------------------------------------------------------------


def test_duplicate_delivery_changes_state_once(led: Ledger) -> None:
    worker = in_process_worker(led)
    # hard reset
    open_resets(led, ["dup-reset"])
    [(eid, fields)] = entries_for(led, "dup-reset")
    worker.handle(eid, fields)
    worker.handle(eid, fields)
    h = session_hash(led, "dup-reset")
    assert (h["ep"], h["x:resets"]) == ("2", "1")

    # a compaction that succeeds: the second delivery finds nothing pending
    sid = "easy-dup"  # compacted under H at the first try
    open_compaction(led, sid)
    [(eid, fields)] = entries_for(led, sid)
    assert worker.handle(eid, fields).effect == "applied"
    after_first = signature(led, sid)
    assert worker.handle(eid, fields).effect == "already"
    assert signature(led, sid) == after_first
    h = session_hash(led, sid)
    assert (h["kn"], h["cd"], h.get("x:failed_compactions", "0")) == ("1", "0", "0")

    # a compaction that fails: still pending, so the second delivery runs the compactor
    # again; the op id (the entry id) makes it change nothing and enqueue nothing
    sid = "stuck-dup"
    open_compaction(led, sid)
    [(eid, fields)] = entries_for(led, sid)
    worker.handle(eid, fields)
    after_first = signature(led, sid)
    # the job's entry went with its effect; its follow-up is enqueued
    [(follow_up, _)] = entries_for(led, sid)
    assert follow_up != eid
    worker.handle(eid, fields)
    assert signature(led, sid) == after_first
    assert [e for e, _ in entries_for(led, sid)] == [follow_up]  # one follow-up, not two
    h = session_hash(led, sid)
    assert (h["kf"], h["cd"], h["x:failed_compactions"]) == ("1", "1", "1")


def test_concurrent_duplicate_delivery(led: Ledger) -> None:
    """Two workers handle the same entries at once (a takeover racing a slow worker)."""
    sids = [f"race-{i}" for i in range(30)]
    ids = open_resets(led, sids)
    entries = [e for sid in sids for e in entries_for(led, sid)]
    assert [e for e, _ in entries] == [eid for _, eid in ids]
    workers = [in_process_worker(led), in_process_worker(led)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(w: Worker) -> None:
        try:
            barrier.wait()
            for eid, fields in entries:
                w.handle(eid, fields)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    for sid in sids:
        h = session_hash(led, sid)
        assert (h["ep"], h["x:resets"]) == ("2", "1"), sid


def test_expired_reservation_released_by_sweep(led: Ledger) -> None:
    s = led.open_session("lease", BUDGET)
    free = s.snapshot().free
    s.reserve("scratchpad", "r1", 300, lease_ms=30)
    s.reserve("scratchpad", "r2", 200, lease_ms=30)
    s.reserve("scratchpad", "keep", 100, lease_ms=60_000)
    time.sleep(0.1)
    with pytest.raises(ReservationExpired):  # past its deadline, not yet swept
        s.settle("r1", 250, "item1")
    worker = in_process_worker(led)
    assert worker.sweep() == 2
    assert worker.metrics.registry.get_sample_value("ledger_reservations_expired_total") == 2
    snap = s.snapshot()
    assert (snap.open_reservations, snap.expirations, snap.free) == (1, 2, free - 100)
    for rid in ("r1", "r2"):
        with pytest.raises(UnknownReservation):
            s.settle(rid, 10, f"late-{rid}")
    assert worker.sweep() == 0
    assert s.settle("keep", 100, "kept").charged == 100
    assert led.audit("lease").clean


def test_run_loop_sweeps_leases(led: Ledger) -> None:
    s = led.open_session("lease-loop", BUDGET)
    worker = in_process_worker(led, sweep_interval=0.05)
    stop = threading.Event()
    t = threading.Thread(target=worker.run, args=(stop,))
    t.start()
    try:
        s.reserve("working_memory", "r1", 100, lease_ms=50)
        wait_until(lambda: s.snapshot().open_reservations == 0, 5, "the sweep")
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    with pytest.raises(UnknownReservation):
        s.settle("r1", 100, "late")
    assert s.snapshot().expirations == 1


def test_metrics(led: Ledger) -> None:
    worker = in_process_worker(led)
    open_resets(led, [f"m-reset-{i}" for i in range(3)])
    for i in range(2):
        open_compaction(led, f"stuck-m{i}")
    drain_in_process(led, worker)
    reg = worker.metrics.registry

    def sample(metric: str, **labels: str) -> float | None:
        return reg.get_sample_value(metric, labels)

    # 3 resets + 2 escalations; 3 failed compactions per stuck session
    assert sample("ledger_jobs_processed_total", kind="hard_reset") == 5
    assert sample("ledger_jobs_processed_total", kind="compact") == 6
    assert sample("ledger_jobs_failed_total", kind="compact") is None
    assert sample("ledger_jobs_dead_lettered_total") == 0

    # four jobs waiting in one partition, one delivered and not acknowledged
    waiting = [f"m-wait-{i}" for i in range(40)]
    target = led.keyspace.partition_of(waiting[0])
    waiting = [sid for sid in waiting if led.keyspace.partition_of(sid) == target][:4]
    assert len(waiting) == 4
    open_resets(led, waiting)
    led.client.xreadgroup(GROUP, "someone", {led.keyspace.jobs(target): ">"}, count=1)
    worker.observe()
    assert sample("ledger_observer") == 1  # the only worker: it holds the lease
    assert sample("ledger_indicator_total", name="failed_compactions") == 6
    assert sample("ledger_indicator_total", name="escalations") == 2
    assert sample("ledger_indicator_total", name="resets") == 5
    assert sample("ledger_partition_lag", partition=str(target)) == 3
    assert sample("ledger_partition_pending", partition=str(target)) == 1
    for p in set(range(PARTITIONS)) - {target}:
        assert sample("ledger_partition_lag", partition=str(p)) == 0
        assert sample("ledger_partition_pending", partition=str(p)) == 0
    text = generate_latest(reg).decode()
    assert 'ledger_jobs_processed_total{kind="hard_reset"} 5.0' in text
    assert 'ledger_indicator_total{name="failed_compactions"} 6.0' in text


def test_indicators_are_counted_once_for_the_fleet_and_never_drop(led: Ledger) -> None:
    """Two workers: the one holding the observer lease counts what the sessions'
    telemetry counters grew by; the other exports none, so a sum over workers counts
    each change once. A deleted session keeps what it counted; a counter only grows;
    the lease passes to the other worker when its holder stops renewing it."""
    a = in_process_worker(led, consumer="obs-a")
    b = in_process_worker(led, consumer="obs-b")
    open_resets(led, [f"ind-{i}" for i in range(3)])
    drain_in_process(led, a)

    def value(w: Worker, name: str = "resets") -> float:
        got = w.metrics.registry.get_sample_value("ledger_indicator_total", {"name": name})
        return got or 0.0

    a.observe()
    b.observe()
    assert (value(a), value(b)) == (3, 0)
    assert a.metrics.registry.get_sample_value("ledger_observer") == 1
    assert b.metrics.registry.get_sample_value("ledger_observer") == 0
    led.session("ind-0").delete()  # gone: its reset stays counted
    open_resets(led, ["ind-3"])
    drain_in_process(led, a)
    a.observe()
    assert value(a) == 4  # one more, none lost
    a.observe()
    assert value(a) == 4  # nothing grew: nothing counted twice
    led.client.delete(led.keyspace.observer())  # the holder's lease lapsed
    b.observe()
    assert b.metrics.registry.get_sample_value("ledger_observer") == 1
    a.observe()
    assert a.metrics.registry.get_sample_value("ledger_observer") == 0


def test_the_metrics_pass_reads_the_tallies_not_the_sessions(led: Ledger) -> None:
    """The fleet's indicators come from one tally per partition, kept by the scripts: a
    pass reads as many hashes with 200 sessions as with none, and its totals equal the
    sessions' own counters summed, also after sessions are deleted."""
    w = in_process_worker(led, consumer="obs-tally")
    r = led.client

    def pass_reads() -> int:
        r.config_resetstat()
        w.observe()
        stats = r.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("hgetall", "scan"))

    w.observe()  # the first pass searches for budget scopes (one SCAN, then every minute)
    assert pass_reads() == PARTITIONS  # one HGETALL a partition, no SCAN
    budget = SessionBudget(window=1_000, system_prompt=100)
    sessions = [led.open_session(f"tally-{i}", budget) for i in range(200)]
    for s in sessions:
        with contextlib.suppress(AdmissionRefused):
            s.admit("retrieval", [Item("big", 950)])  # refused: one indicator each
    assert pass_reads() == PARTITIONS
    got = w.metrics.registry.get_sample_value("ledger_indicator_total", {"name": "refused"})
    assert got == 200 == sum(s.snapshot().raw["x:refused"] for s in sessions)
    for s in sessions[:150]:
        s.delete()
    w.observe()  # what deleted sessions counted stays counted
    assert w.metrics.registry.get_sample_value("ledger_indicator_total", {"name": "refused"}) == 200


def test_failing_compactor_is_retried_then_succeeds(led: Ledger) -> None:
    open_compaction(led, "flaky-1")
    worker = in_process_worker(led, compactor="tests.support.worker_scenarios:flaky_compactor")
    drain_in_process(led, worker)
    reg = worker.metrics.registry
    assert reg.get_sample_value("ledger_jobs_failed_total", {"kind": "compact"}) == 1
    assert reg.get_sample_value("ledger_jobs_taken_over_total") >= 1  # type: ignore[operator]
    h = session_hash(led, "flaky-1")
    assert h["cd"] == "0" and h["kn"] == "1"
    assert dead_letters(led) == []
