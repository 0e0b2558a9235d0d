"""The background worker (ledger/workers/runner.py) on a real Redis: regressions of bugs
found, each pinned.

Every test uses its own key prefix on the session's ``redis_server`` and ``PARTITIONS``
partitions; the helpers (compactors named by import path, job streams, backlogs) are in
tests/support/worker_scenarios.py, the ``led`` fixture in tests/conftest.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from ledger import Ledger
from tests.support.jobs import BUDGET, session_hash
from tests.support.worker_scenarios import (
    backlog,
    dead_letters,
    drain_in_process,
    in_process_worker,
    jobs_of,
    open_compaction,
    open_resets,
    reset_fields,
    wait_until,
)

pytestmark = pytest.mark.redis


# --- bugs, pinned --------------------------------------------------------------------


def test_simulated_compactor_chain_drains(led: Ledger) -> None:
    """The shipped compactor through the worker: a failed compaction's follow-up job
    commits (it once reused the summary id summary-e<epoch>-t<turn> and was refused with
    LEDGER_CONFLICT until dead-lettered), and every chain ends compacted or reset."""
    sids = [f"sim-{i}" for i in range(12)]
    for sid in sids:
        open_compaction(led, sid)
    worker = in_process_worker(
        led, compactor="ledger.workers.compactors:simulated", max_deliveries=2
    )
    drain_in_process(led, worker)
    assert dead_letters(led) == []
    assert (
        worker.metrics.registry.get_sample_value("ledger_jobs_failed_total", {"kind": "compact"})
        is None
    )
    hashes = [session_hash(led, sid) for sid in sids]
    assert all(h["cd"] == "0" and (h["kn"] == "1" or h["ep"] == "2") for h in hashes), hashes
    assert any(h.get("x:failed_compactions", "0") != "0" for h in hashes)  # retries happened
    for sid in sids:
        assert led.audit(sid).clean


def test_worker_survives_lost_consumer_group(led: Ledger) -> None:
    worker = in_process_worker(led)
    sid = "lost-group"
    epoch = led.open_session(sid, BUDGET).epoch
    stream = jobs_of(led, sid)
    stop, errors = threading.Event(), []

    def run() -> None:
        try:
            worker.run(stop)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until(lambda: bool(led.client.exists(stream)), 5, "the groups")
        time.sleep(0.05)
        led.client.delete(stream)  # as FLUSHDB or a restart without persistence would
        led.client.xadd(stream, reset_fields(sid, epoch))  # a script enqueues a job afterwards
        wait_until(
            lambda: bool(errors) or session_hash(led, sid)["ep"] == "2", 5, "the job or a crash"
        )
    finally:
        stop.set()
        t.join(10)
    if errors:
        raise errors[0]  # NOGROUP: the worker loop died
    assert session_hash(led, sid)["ep"] == "2"


def test_errors_hash_cleared_after_success(led: Ledger) -> None:
    sid = "flaky-2"
    open_compaction(led, sid)
    worker = in_process_worker(led, compactor="tests.support.worker_scenarios:flaky_compactor")
    drain_in_process(led, worker)
    assert session_hash(led, sid)["kn"] == "1"
    assert led.client.hlen(f"{led.keyspace.tag(led.keyspace.partition_of(sid))}:errors") == 0


class Killed(BaseException):
    """Stands for SIGKILL at one point of the worker's code."""


def test_no_entry_left_when_killed_between_ack_and_delete(
    led: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    [(sid, eid)] = open_resets(led, ["ack-gap"])
    dying = in_process_worker(led)

    def die(*_: object) -> None:
        raise Killed

    monkeypatch.setattr(led.client, "xdel", die)
    dying.ensure_groups()
    with pytest.raises(Killed):
        dying.poll_once()
    monkeypatch.undo()
    assert session_hash(led, sid)["ep"] == "2"  # the effect happened, the XACK too
    time.sleep(0.1)  # past claim_idle_ms
    other = in_process_worker(led)
    for _ in range(5):
        other.poll_once()
    left = backlog(led)
    assert left.clear  # nothing undelivered or pending ...
    assert (sid, eid) not in left.leftover  # ... and the entry is gone from the stream
