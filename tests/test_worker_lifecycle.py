"""The background worker's life (ledger/workers/runner.py) on a real Redis: a compactor
that cannot work stops it at start, /healthz fails when its job loop is wedged, a clean
stop leaves the consumer groups where it holds nothing, and a worker without a compactor
leaves compactions to one with.

Every test uses its own key prefix on the session's ``redis_server`` and ``PARTITIONS``
partitions; the helpers (compactors named by import path, job streams, backlogs) are in
tests/support/worker_scenarios.py, the ``led`` fixture in tests/conftest.py.
"""

from __future__ import annotations

import time
import uuid

import pytest

from ledger import Ledger
from ledger.workers.runner import Worker, WorkerSettings
from tests.support import jobs
from tests.support.jobs import GROUP, session_hash
from tests.support.worker_scenarios import (
    drain_in_process,
    in_process_worker,
    open_compaction,
    open_resets,
    views_dead,
)

pytestmark = pytest.mark.redis


def test_a_compactor_that_cannot_work_stops_the_worker_at_start(
    led: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """openai_from_env without its endpoint: the worker refuses to start (the CLI exits
    2) instead of reading jobs it would fail until they are dead-lettered."""
    from ledger import ConfigurationError, cli
    from ledger.adapters import summarizer

    monkeypatch.delenv("LEDGER_SUMMARIZER_BASE_URL", raising=False)
    monkeypatch.setattr(summarizer.openai_from_env, "_made", None)
    with pytest.raises(ConfigurationError, match="LEDGER_SUMMARIZER_BASE_URL"):
        Worker(led, WorkerSettings(compactor="ledger.adapters.summarizer:openai_from_env"))
    argv = ["--url", led.settings.redis_url or "", "--prefix", led.settings.prefix]
    code = cli.main(
        [*argv, "worker", "--once", "--compactor", "ledger.adapters.summarizer:openai_from_env"]
    )
    assert code == cli.EXIT_USAGE
    # with them it starts (nothing is called until a job comes)
    monkeypatch.setenv("LEDGER_SUMMARIZER_BASE_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("LEDGER_SUMMARIZER_MODEL", "stub")
    Worker(led, WorkerSettings(compactor="ledger.adapters.summarizer:openai_from_env"))


def test_healthz_fails_when_the_job_loop_is_wedged(
    led: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/healthz reads the loop's heartbeat, not the HTTP thread's: a loop stuck in a step
    makes it 503 while /metrics still answers; /readyz needs Redis's last pass too."""
    import threading
    import urllib.error
    import urllib.request

    from ledger.workers.http import serve

    worker = in_process_worker(led, poll_interval=0.01, sweep_interval=0.05)
    wedge, release = threading.Event(), threading.Event()
    real = worker.sweep

    def sweep(partitions: list[int] | None = None) -> int:
        if wedge.is_set():
            release.wait(30)  # a step that never returns (a hung call)
        return real(partitions)

    worker.sweep = sweep  # type: ignore[method-assign]
    server = serve(worker, 0, stale_s=0.5, host="127.0.0.1")
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(base + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    stop = threading.Event()
    loop = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    try:
        assert get("/readyz")[0] == 503  # not started yet
        loop.start()
        deadline = time.monotonic() + 10
        while get("/readyz")[0] != 200:
            assert time.monotonic() < deadline, get("/readyz")
            time.sleep(0.05)
        code, why = get("/healthz")
        assert code == 200 and why.startswith("ok: Redis answered"), why
        # the container's probe finds the endpoint from the worker's settings
        from ledger.workers.http import probe

        monkeypatch.setenv("LEDGER_WORKER_METRICS_PORT", str(server.server_address[1]))
        monkeypatch.setenv("LEDGER_WORKER_METRICS_HOST", "127.0.0.1")
        assert probe("healthz") == 0 and probe("readyz") == 0
        code, body = get("/metrics")
        assert code == 200 and "ledger_redis_up 1.0" in body and "ledger_build_info" in body
        assert get("/other")[0] == 404
        wedge.set()
        time.sleep(1.0)  # more than stale_s without a turn of the loop
        code, why = get("/healthz")
        assert code == 503 and "has not turned" in why
        assert probe("healthz") == 1
        assert get("/readyz")[0] == 503 and get("/metrics")[0] == 200
    finally:
        release.set()
        stop.set()
        loop.join(10)
        server.shutdown()
        server.server_close()


def test_a_stopping_worker_leaves_its_groups_unless_it_holds_jobs(led: Ledger) -> None:
    """A clean stop removes the worker's consumer from every group where it holds no
    pending job (restarts do not pile consumers up); one holding a job stays, so that
    the job can be claimed; another worker's long idle empty consumer goes too."""
    w = in_process_worker(led, consumer="leaver")
    w.ensure_groups()
    busy = f"leave-{uuid.uuid4().hex[:6]}"
    open_resets(led, [busy])
    p = led.keyspace.partition_of(busy)
    led.client.xreadgroup(GROUP, "leaver", {led.keyspace.jobs(p): ">"}, count=1)
    for q in w.partitions:  # a worker that has read every stream is a consumer of each
        led.client.xgroup_createconsumer(led.keyspace.jobs(q), GROUP, "leaver")
    removed = w.leave_groups()
    left = {
        q: [c["name"] for c in led.client.xinfo_consumers(led.keyspace.jobs(q), GROUP)]
        for q in w.partitions
    }
    assert removed == len(w.partitions) - 1
    assert [q for q, names in left.items() if b"leaver" in names or "leaver" in names] == [p]


def test_a_worker_without_compactor_leaves_compactions_to_one_with(led: Ledger) -> None:
    """--compactor none: a compaction job of a worker-owned session is not its job. It
    stays pending with its delivery uncounted (never dead-lettered for it, however often
    it comes back), and a worker with a compactor takes it over and compacts."""
    open_compaction(led, "none-1")
    none = in_process_worker(led, compactor="none", max_deliveries=1, claim_idle_ms=10)
    none.ensure_groups()
    for _ in range(4):  # read, then claimed again and again: more than max_deliveries
        none.poll_once()
        time.sleep(0.03)
    assert jobs.metric(none, "ledger_jobs_deferred_total") == 4
    assert jobs.metric(none, "ledger_jobs_failed_total", kind="compact") == 0
    assert views_dead(led) == 0 and session_hash(led, "none-1")["kn"] == "0"
    good = in_process_worker(led, claim_idle_ms=10)
    time.sleep(0.03)
    drain_in_process(led, good)
    assert session_hash(led, "none-1")["kn"] == "1"
