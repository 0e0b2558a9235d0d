"""The background worker's loop (ledger/workers/runner.py) and its reads on a real Redis:
blocking reads on one server and on a cluster, few commands while idle, the check's
slices, and ``ledger worker --check``.

Every test uses its own key prefix on the session's ``redis_server`` and ``PARTITIONS``
partitions; the helpers (compactors named by import path, job streams, backlogs) are in
tests/support/worker_scenarios.py, the ``led`` fixture in tests/conftest.py.
"""

from __future__ import annotations

import time

import pytest
import redis

from ledger import Ledger, protocol, scripts
from ledger.errors import (
    InvalidArgument,
)
from ledger.models import PartitionCheck
from ledger.workers.runner import next_round
from tests.conftest import backend_url, make_settings
from tests.support import jobs
from tests.support.jobs import BUDGET
from tests.support.servers import RedisProcess
from tests.support.worker_scenarios import (
    wait_until,
)

pytestmark = pytest.mark.redis


# --- the loop's reads: blocking, on one server and on a cluster --------------------------


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ],
)
def test_loop_picks_up_jobs_sweeps_leases_and_stops_promptly(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The loop blocks in its reads (one XREADGROUP over every stream on one server, a
    reader per partition on a cluster), with a block longer than the test: jobs are done
    as they come, a lease is released, a job left by a dead consumer is taken over, and
    a stop ends the loop at once however long the reads block."""
    settings = make_settings(backend_url(request, kind), partitions=8)
    with Ledger.from_settings(settings) as led:
        worker = jobs.new_worker(led, block=30.0, claim_idle_ms=100)
        loop = jobs.LoopThread(worker)
        with loop:
            wait_until(lambda: bool(led.client.exists(led.keyspace.jobs(7))), 5, "the groups")
            time.sleep(0.3)  # the reads are blocked now
            sids = [f"blk-{i}" for i in range(12)]
            jobs.open_resets(led, sids)
            wait_until(lambda: jobs.busy(led) == 0, 10, "the jobs")
            s = led.open_session("blk-lease", BUDGET)
            s.reserve("working_memory", "r1", 100, lease_ms=50)
            wait_until(lambda: s.snapshot().open_reservations == 0, 10, "the sweep")
            [(sid, _)] = jobs.open_resets(led, ["blk-dead"])
            led.client.xreadgroup(jobs.GROUP, "dead-one", {jobs.jobs_of(led, sid): ">"})
            wait_until(lambda: jobs.busy(led) == 0, 10, "the takeover")
            t0 = time.monotonic()
        assert time.monotonic() - t0 < 3, "the stop waited for the blocked reads"
        for sid in [*sids, "blk-dead"]:
            assert jobs.counters(led, sid, "ep", "x:resets") == ("2", "1"), sid


def _calls(nodes: list[RedisProcess]) -> dict[str, int]:
    """Commands each kind the cluster's nodes have run (INFO commandstats), summed."""
    out: dict[str, int] = {}
    for node in nodes:
        admin = redis.Redis.from_url(node.url)
        try:
            for name, stats in admin.info("commandstats").items():
                out[name] = out.get(name, 0) + int(stats["calls"])
        finally:
            admin.close()
    return out


@pytest.mark.cluster
def test_an_idle_loop_on_a_cluster_sends_few_commands_and_still_releases_leases(
    redis_cluster: list[RedisProcess],
) -> None:
    """Idle on a cluster, the loop checks (EVALSHA of worker_check.lua) at most
    cluster_checks partitions per second, in slices spread over check_every, and keeps
    one blocking read per partition, whatever the sweep interval: no per-sweep command
    per partition. Leases shorter and longer than check_every are still released."""
    partitions, period, window, sweep, rate = 8, 0.5, 3.0, 0.02, 4.0
    settings = make_settings(
        f"redis+cluster://127.0.0.1:{redis_cluster[0].port}", partitions=partitions
    )
    with Ledger.from_settings(settings) as led:
        worker = jobs.new_worker(
            led,
            block=30.0,
            claim_idle_ms=int(1000 * period),
            cluster_checks=rate,
            sweep_interval=sweep,
            health_interval=600.0,
        )
        assert worker.check_every == partitions / rate  # 2 s: more than claim_idle_ms
        with jobs.LoopThread(worker):
            wait_until(lambda: bool(led.client.exists(led.keyspace.jobs(7))), 5, "the groups")
            time.sleep(0.3)  # the reads are blocked now
            before = _calls(redis_cluster)
            time.sleep(window)
            after = _calls(redis_cluster)
            sent = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
            for own in ("cmdstat_info", "cmdstat_hello"):  # this test's reads of the stats
                sent.pop(own, None)
            # the rate, and one slice (of 8 / ceil(2 s) = 2 partitions) early at most
            checks = int(rate * window) + 2
            reads = partitions  # a blocked read counts once, when it ends
            assert 0 < sent.get("cmdstat_evalsha", 0) <= checks, sent
            # a check every claim_idle_ms per partition would be this many
            assert partitions * window / period > 1.5 * checks
            # each check is an EVALSHA and the ZRANGEBYSCORE and XPENDING it runs (counted too)
            assert sum(sent.values()) <= 3 * checks + reads, sent
            # a sweep per partition every sweep_interval would be this many commands
            assert partitions * window / sweep > 4 * (checks + reads)
            s = led.open_session("idle-lease", BUDGET)
            s.reserve("working_memory", "r1", 100, lease_ms=3000)
            s.reserve("working_memory", "r2", 100, lease_ms=50)
            wait_until(lambda: s.snapshot().open_reservations == 0, 10, "the sweep")
        assert worker.metrics.expired._value.get() == 2


def test_check_slices_keep_their_places_in_the_cycle_after_an_outage() -> None:
    """A slice checked late, or after rounds missed while Redis was away, is next due
    at its own place in the cycle: the slices stay spread over check_every instead of
    falling due together after the outage."""
    every, n = 21.0, 21
    due = [every * k / n for k in range(n)]
    for now in (0.0, 0.4, 20.9, 21.0, 63.5, 1000.0):
        for at in (t for t in due if t <= now):
            nxt = next_round(at, now, every)
            assert now < nxt <= now + every
            rounds = (nxt - at) / every
            assert rounds >= 1 and abs(rounds - round(rounds)) < 1e-9
    # an outage of 40 s: every slice overdue, then each checked once
    after = [next_round(at, 40.0, every) for at in due]
    assert len({round(t % every, 6) for t in after}) == n  # n distinct phases, as before
    assert all(40.0 < t <= 61.0 for t in after)


@pytest.mark.redis
def test_worker_check_refuses_keys_of_two_partitions_and_bad_arguments(
    redis_server: RedisProcess,
) -> None:
    with Ledger.from_settings(make_settings(redis_server.url)) as led:
        k, src = led.keyspace, scripts.source("worker_check")
        v = str(protocol.VERSION)
        for keys, args in [
            ((k.deadlines(1), k.jobs(2)), (v, "g", "5")),
            ((k.jobs(1), k.deadlines(1)), (v, "g", "5")),
            ((k.deadlines(1), k.jobs(1)), (v, "g{x}", "5")),
            ((k.deadlines(1), k.jobs(1)), (v, "g", "-1")),
        ]:
            with pytest.raises(redis.ResponseError, match=r"^LEDGER_BADARG"):
                led.client.eval(src, 2, *keys, *args)
        with pytest.raises(InvalidArgument):
            led.check_partition(k.partitions, "g", 5)
        assert led.check_partition(1, "g", 5) == PartitionCheck(None, True)  # no group yet
