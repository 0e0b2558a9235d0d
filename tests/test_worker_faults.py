"""The worker keeps running whatever Redis answers (issue 11, items 2 and 3).

A job stream deleted under it (NOGROUP from XREADGROUP, XAUTOCLAIM, XPENDING; XINFO
on a missing key), Redis out of memory at start and in the middle of a job, and every
other Redis condition (READONLY, LOADING, BUSY, unreachable, a ledger error): the
loop logs and counts it, backs off and goes on; a bug is logged with its traceback.
Jobs still there are done once, and Redis trouble does not count as a delivery.

The real-server tests use their own redis-server (they change its maxmemory).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.exceptions as rex
from redis._parsers.base import BaseParser

from ledger import Ledger, LedgerSettings
from ledger.errors import BackendUnavailable, LedgerError, UnknownSession
from ledger.testing import WorkerProc, spawn_worker
from ledger.workers.trouble import TRANSIENT, Backoff, kind_of
from tests.support import jobs, servers

PARTITIONS = 4


@pytest.fixture(scope="module")
def server() -> Iterator[servers.RedisProcess]:
    with servers.standalone() as s:
        yield s


@pytest.fixture
def admin(server: servers.RedisProcess) -> Iterator[redis.Redis]:
    r = server.client()
    jobs.set_maxmemory(r, 0)
    yield r
    jobs.set_maxmemory(r, 0)
    r.close()


@pytest.fixture
def led(server: servers.RedisProcess) -> Iterator[Ledger]:
    settings = LedgerSettings(
        redis_url=server.url, prefix=f"f{uuid.uuid4().hex[:12]}", partitions=PARTITIONS
    )
    with Ledger.from_settings(settings) as ledger:
        yield ledger


def fast_worker(led: Ledger, **kw: Any) -> Any:
    return jobs.new_worker(led, **{"backoff_initial": 0.01, "backoff_max": 0.05, **kw})


def done_once(led: Ledger, sids: list[str]) -> None:
    for sid in sids:
        assert jobs.counters(led, sid, "ep", "x:resets") == ("2", "1"), sid


def dead_letters(led: Ledger) -> int:
    return sum(int(led.client.xlen(f"{led.keyspace.tag(p)}:dead")) for p in range(PARTITIONS))


# --- pure: kinds and backoff ------------------------------------------------------------


def reply_error(text: str) -> BaseException:
    """The exception redis-py raises for an error reply."""
    return BaseParser.parse_error(text)


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (reply_error("OOM command not allowed when used memory > 'maxmemory'."), "oom"),
        (reply_error("READONLY You can't write against a read only replica."), "readonly"),
        (reply_error("LOADING Redis is loading the dataset in memory"), "loading"),
        (reply_error("BUSY Redis is busy running a script."), "busy"),
        (reply_error("MASTERDOWN Link with MASTER is down"), "masterdown"),
        (reply_error("CLUSTERDOWN The cluster is down"), "clusterdown"),
        (reply_error("TRYAGAIN Multiple keys request during rehashing of slot"), "tryagain"),
        (reply_error("MISCONF Redis is configured to save RDB snapshots"), "misconf"),
        (reply_error("NOGROUP No such key 'x' or consumer group 'g'"), "nogroup"),
        (reply_error("NOPERM this user has no permissions to run the 'xadd' command"), "noperm"),
        (reply_error("WRONGTYPE Operation against a key holding the wrong kind"), "wrongtype"),
        (reply_error("ERR something else"), "redis"),
        (reply_error("LEDGER_BADARG epoch must be an integer"), "ledger"),
        (rex.ConnectionError("refused"), "unavailable"),
        (rex.TimeoutError("timed out"), "unavailable"),
        (BackendUnavailable("Redis unavailable: gone"), "unavailable"),
        (UnknownSession("no session"), "ledger"),
        (LedgerError("Redis refused the call: OOM command not allowed"), "oom"),
        (TypeError("a bug"), None),
        (KeyError("session"), None),
    ],
    ids=lambda v: v if isinstance(v, str) or v is None else type(v).__name__,
)
def test_kind_of(exc: BaseException, kind: str | None) -> None:
    assert kind_of(exc) == kind


def test_kind_of_looks_through_the_ledgers_translation() -> None:
    """Ledger.run raises LedgerError or BackendUnavailable from the driver's error: the
    driver's error decides (redis-py strips the code from the message)."""
    for text, kind in (("OOM command not allowed", "oom"), ("LOADING loading", "loading")):
        cause = reply_error(text)
        try:
            try:
                raise cause
            except rex.RedisError as e:
                raise (BackendUnavailable if kind == "loading" else LedgerError)(str(e)) from e
        except LedgerError as outer:
            assert kind_of(outer) == kind
    assert {"oom", "readonly", "loading", "busy", "unavailable"} <= TRANSIENT
    assert not {"nogroup", "noperm", "ledger", "redis"} & TRANSIENT


def test_backoff_is_exponential_bounded_and_resets() -> None:
    b = Backoff(0.1, 2.0, rand=lambda: 1.0)
    assert [round(b.next(), 3) for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    b.reset()
    assert b.next() == 0.1
    low = Backoff(0.1, 2.0, rand=lambda: 0.0)
    assert [low.next() for _ in range(3)] == [0.05, 0.1, 0.2]  # jitter: half to all of a step
    for _ in range(10_000):
        assert low.next() <= 2.0  # no overflow however long it lasts
    with pytest.raises(ValueError):
        Backoff(0, 1)


# --- in process, real Redis: every kind of error meets the loop ----------------------------


@pytest.mark.redis
def test_loop_survives_every_kind_of_redis_error_and_a_bug(
    led: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[BaseException] = [
        reply_error("OOM command not allowed when used memory > 'maxmemory'."),
        reply_error("READONLY You can't write against a read only replica."),
        reply_error("LOADING Redis is loading the dataset in memory"),
        reply_error("BUSY Redis is busy running a script. SCRIPT KILL or SHUTDOWN NOSAVE."),
        reply_error("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is no"),
        reply_error("WRONGTYPE Operation against a key holding the wrong kind of value"),
        rex.ConnectionError("Connection refused"),
        rex.TimeoutError("Timeout reading from socket"),
        BackendUnavailable("Redis unavailable: gone"),
        LedgerError("Redis client error: something"),
    ]
    todo = list(errors)
    real = led.client.xreadgroup

    def failing(*args: Any, **kw: Any) -> Any:
        if todo:
            raise todo.pop(0)
        return real(*args, **kw)

    bugs = [TypeError("a bug in the sweep")]
    worker = fast_worker(led, sweep_interval=0.01)
    real_sweep = worker.sweep

    def buggy_sweep() -> int:
        if bugs:
            raise bugs.pop()
        return real_sweep()

    monkeypatch.setattr(led.client, "xreadgroup", failing)
    monkeypatch.setattr(worker, "sweep", buggy_sweep)
    caplog.set_level(logging.INFO, logger="ledger.worker")
    with jobs.LoopThread(worker) as loop:
        jobs.wait_until(lambda: not todo and not bugs, 10, "every error to be raised")
        sids = [f"after-{i}" for i in range(4)]
        jobs.open_resets(led, sids)
        jobs.wait_until(lambda: jobs.busy(led) == 0, 10, "the jobs after the errors")
        assert loop.alive
    done_once(led, sids)
    kinds = ["oom", "readonly", "loading", "busy", "masterdown", "wrongtype", "unavailable"]
    for kind in kinds:
        assert jobs.metric(worker, "ledger_worker_errors_total", kind=kind) >= 1, kind
    assert jobs.metric(worker, "ledger_worker_errors_total", kind="unavailable") == 3
    assert jobs.metric(worker, "ledger_worker_errors_total", kind="ledger") == 1
    # the bug: counted, logged with its traceback
    assert jobs.metric(worker, "ledger_worker_errors_total", kind="internal") == 1
    [bug] = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert bug.exc_info is not None and isinstance(bug.exc_info[1], TypeError)
    assert "a bug" in caplog.text
    # Redis unreachable (ConnectionError, TimeoutError, BackendUnavailable), then back: said
    back = [r for r in caplog.records if r.getMessage() == "Redis answers again"]
    assert back and all(r.down_seconds >= 0 for r in back)  # type: ignore[attr-defined]


@pytest.mark.redis
def test_json_log_lines_carry_the_traceback() -> None:
    from ledger.workers.runner import JsonFormatter

    try:
        raise TypeError("a bug")
    except TypeError as exc:
        record = logging.LogRecord("w", logging.ERROR, "", 0, "boom", None, (TypeError, exc, None))
    line = JsonFormatter().format(record)
    assert '"traceback"' in line and "TypeError: a bug" in line


# --- NOGROUP: a job stream deleted under the worker ------------------------------------


def delete_after(
    monkeypatch: pytest.MonkeyPatch, led: Ledger, method: str, stream: str, times: int = 1
) -> list[int]:
    """Wrap a client method so that, after it answers, the stream is deleted (as a DEL
    or an eviction would between two commands of the worker)."""
    real = getattr(led.client, method)
    hits: list[int] = []

    def wrapped(*args: Any, **kw: Any) -> Any:
        got = real(*args, **kw)
        if len(hits) < times and (args[0] == stream or stream in str(args[:3])):
            hits.append(1)
            led.client.delete(stream)
        return got

    monkeypatch.setattr(led.client, method, wrapped)
    return hits


@pytest.mark.redis
@pytest.mark.parametrize("where", ["before XREADGROUP", "before XAUTOCLAIM", "before XPENDING"])
def test_stream_deleted_under_the_worker(
    led: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """The stream vanishes between two commands of the worker (after XREADGROUP, so
    that XAUTOCLAIM answers NOGROUP; after XAUTOCLAIM returned a job left by a dead
    consumer, so that XPENDING does): the loop goes on, says loudly that jobs may be
    lost, makes the group again, and jobs enqueued afterwards are done."""
    [(sid, _)] = jobs.open_resets(led, ["nogroup-victim"])
    stream = jobs.jobs_of(led, sid)
    worker = fast_worker(led, claim_idle_ms=10)
    worker.ensure_groups()
    hits: list[int] = []
    if where == "before XPENDING":  # a job left pending by a dead consumer, for XAUTOCLAIM
        led.client.xreadgroup(jobs.GROUP, "dead-one", {stream: ">"}, count=1)
        time.sleep(0.05)
        hits = delete_after(monkeypatch, led, "xautoclaim", stream)
    elif where == "before XAUTOCLAIM":
        hits = delete_after(monkeypatch, led, "xreadgroup", stream)
    caplog.set_level(logging.INFO, logger="ledger.worker")
    with jobs.LoopThread(worker) as loop:
        if where == "before XREADGROUP":
            time.sleep(0.1)
            led.client.delete(stream)
            hits.append(1)
        jobs.wait_until(lambda: bool(hits), 10, f"the stream to be deleted {where}")
        jobs.wait_until(
            lambda: jobs.metric(worker, "ledger_job_streams_lost_total") >= 1, 10, "the loss"
        )
        later = [f"later-{i}" for i in range(12)]
        jobs.open_resets(led, later)
        jobs.wait_until(lambda: jobs.busy(led) == 0, 10, "the jobs enqueued afterwards")
        assert loop.alive
    done_once(led, later)
    assert [jobs.text(g["name"]) for g in led.client.xinfo_groups(stream)] == [jobs.GROUP]
    assert jobs.metric(worker, "ledger_job_streams_lost_total") == 1
    # each call of the pass that met the missing group counts once (the read, and the
    # renewal of the jobs in hand when it fell in that pass): one loss, one recreation
    assert 1 <= jobs.metric(worker, "ledger_worker_errors_total", kind="nogroup") <= 2
    lost = [r for r in caplog.records if r.getMessage().startswith("job stream lost")]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING
    assert "may be lost" in lost[0].getMessage()
    assert getattr(lost[0], "stream", None) == stream


@pytest.mark.redis
def test_observe_with_a_missing_stream(led: Ledger) -> None:
    """The metrics refresh reads XINFO GROUPS of every stream: one that is gone counts
    as empty (the next poll reports it and makes it again)."""
    worker = fast_worker(led)
    worker.ensure_groups()
    jobs.open_resets(led, [f"obs-{i}" for i in range(8)])
    gone = led.keyspace.jobs(1)
    led.client.delete(gone)
    worker.observe()
    assert jobs.metric(worker, "ledger_partition_lag", partition="1") == 0
    assert sum(
        jobs.metric(worker, "ledger_partition_lag", partition=str(p)) for p in range(PARTITIONS)
    ) == 8 - sum(1 for i in range(8) if led.keyspace.partition_of(f"obs-{i}") == 1)


# --- out of memory, in process ----------------------------------------------------------


@pytest.mark.redis
def test_jobs_under_oom_wait_and_are_done_once(
    led: Ledger, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Hard resets of sessions without items need memory (their first write is an
    HINCRBY); recording a job's error needs memory too. Under OOM the loop goes on,
    says why, backs off; no attempt counts as a delivery, so with max_deliveries=2 and
    many takeovers nothing is dead-lettered; once memory is back every job is done once."""
    sids = [f"oom-{i}" for i in range(20)]
    jobs.open_resets(led, sids)
    worker = fast_worker(led, max_deliveries=2, claim_idle_ms=20)
    worker.ensure_groups()
    caplog.set_level(logging.INFO, logger="ledger.worker")
    with jobs.LoopThread(worker) as loop, jobs.out_of_memory(admin):
        jobs.wait_until(
            lambda: jobs.metric(worker, "ledger_worker_errors_total", kind="oom") >= 30,
            15,
            "many OOM replies (several takeovers of each job)",
        )
        assert jobs.metric(worker, "ledger_jobs_processed_total", kind="hard_reset") == 0
        assert loop.alive
    with jobs.LoopThread(worker) as loop:  # memory is back
        jobs.wait_until(lambda: jobs.busy(led) == 0, 15, "the jobs once memory is back")
        assert loop.alive
    done_once(led, sids)
    assert dead_letters(led) == 0
    assert jobs.metric(worker, "ledger_jobs_failed_total", kind="hard_reset") == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("OOM" in m and "maxmemory" in m for m in said), said


@pytest.mark.redis
def test_job_failure_recorded_under_oom_does_not_stop_the_loop(
    led: Ledger, admin: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that fails on its own while Redis is out of memory: its error cannot be
    written to the :errors hash (HSET answers OOM); the loop goes on."""
    jobs.open_resets(led, ["oom-fails"])
    worker = fast_worker(led)
    worker.ensure_groups()

    def broken(job_id: str, fields: Any) -> Any:
        raise RuntimeError("the job's own failure")

    monkeypatch.setattr(worker.jobs, "handle", broken)
    with jobs.out_of_memory(admin), jobs.LoopThread(worker) as loop:
        jobs.wait_until(
            lambda: (
                jobs.metric(worker, "ledger_jobs_failed_total", kind="hard_reset") >= 1
                and jobs.metric(worker, "ledger_worker_errors_total", kind="oom") >= 1
            ),
            10,
            "the failure and the refused record",
        )
        assert loop.alive


@pytest.mark.redis
def test_loop_starts_under_oom_and_makes_its_groups_later(led: Ledger, admin: redis.Redis) -> None:
    worker = fast_worker(led)
    with jobs.out_of_memory(admin), jobs.LoopThread(worker) as loop:
        jobs.wait_until(
            lambda: jobs.metric(worker, "ledger_worker_errors_total", kind="oom") >= 2,
            10,
            "XGROUP CREATE refused",
        )
        assert loop.alive
        assert not any(led.client.exists(led.keyspace.jobs(p)) for p in range(PARTITIONS))
    with jobs.LoopThread(worker) as loop:
        sids = [f"late-{i}" for i in range(8)]
        jobs.open_resets(led, sids)
        jobs.wait_until(lambda: jobs.busy(led) == 0, 10, "the jobs once memory is back")
        assert loop.alive
    done_once(led, sids)
    assert jobs.metric(worker, "ledger_job_streams_lost_total") == 0  # never made: not lost


# --- worker processes ------------------------------------------------------------------


def spawn(server: servers.RedisProcess, led: Ledger, logs: Path, name: str) -> WorkerProc:
    env = {
        "LEDGER_REDIS_URL": server.url,
        "LEDGER_PREFIX": led.settings.prefix,
        "LEDGER_PARTITIONS": str(PARTITIONS),
        "LEDGER_WORKER_CLAIM_IDLE_MS": "200",
        "LEDGER_WORKER_POLL_INTERVAL": "0.02",
        "LEDGER_WORKER_BACKOFF_MAX": "0.5",
    }
    return spawn_worker(name, env, logs / f"{name}.log")


@pytest.fixture
def procs() -> Iterator[list[WorkerProc]]:
    made: list[WorkerProc] = []
    yield made
    for w in made:
        w.kill()


@pytest.mark.redis
@pytest.mark.slow
def test_worker_process_survives_deleted_job_streams(
    server: servers.RedisProcess,
    led: Ledger,
    tmp_path: Path,
    procs: list[WorkerProc],
) -> None:
    """DEL of random job streams every ~50 ms for 3 s while jobs flow: the process stays
    up, reports each loss, and jobs enqueued after the last DEL are done once."""
    w = spawn(server, led, tmp_path, "dels")
    procs.append(w)
    w.wait_started()
    rng = random.Random(11)
    stop = threading.Event()
    fed: list[str] = []

    def feed() -> None:
        k = 0
        while not stop.wait(0.03):
            batch = [f"flow-{k + i}" for i in range(4)]
            jobs.open_resets(led, batch)
            fed.extend(batch)
            k += 4

    feeder = threading.Thread(target=feed)
    feeder.start()
    dels = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            dels += int(led.client.delete(led.keyspace.jobs(rng.randrange(PARTITIONS))))
            time.sleep(rng.uniform(0.02, 0.08))
            assert w.proc.poll() is None, w.tail()
    finally:
        stop.set()
        feeder.join(10)
    after = [f"after-{i}" for i in range(20)]
    jobs.open_resets(led, after)
    jobs.wait_until(lambda: jobs.busy(led) == 0, 20, "the jobs after the DELs")
    assert w.proc.poll() is None, w.tail()
    done_once(led, after)
    for sid in fed:  # a job lost with its stream is not done; none is done twice
        assert jobs.counters(led, sid, "x:resets")[0] in ("0", "1"), sid
    lost = w.messages(
        "job stream lost: the stream or its consumer group is gone (a DEL, FLUSHDB, eviction, "
        "or a restart without persistence); jobs it held may be lost with it; making the "
        "group again"
    )
    assert dels >= 10 and lost, (dels, w.tail())
    assert all(r["level"] == "warning" for r in lost)
    assert w.stop() == 0, w.tail()
    assert "Traceback" not in w.log.read_text()


@pytest.mark.redis
@pytest.mark.slow
def test_worker_process_starts_under_oom_and_serves_once_memory_is_back(
    server: servers.RedisProcess,
    led: Ledger,
    admin: redis.Redis,
    tmp_path: Path,
    procs: list[WorkerProc],
) -> None:
    sids = [f"oomproc-{i}" for i in range(10)]
    jobs.open_resets(led, sids[:5])  # streams exist; the group is made by the worker
    with jobs.out_of_memory(admin):
        w = spawn(server, led, tmp_path, "oom")
        procs.append(w)
        w.wait_started()
        time.sleep(1.5)
        assert w.proc.poll() is None, w.tail()
        warned = [r for r in w.records() if r["level"] == "warning" and r.get("kind") == "oom"]
        assert warned, w.tail()
        assert "OOM" in warned[0]["msg"] and "maxmemory" in warned[0]["msg"]
    jobs.open_resets(led, sids[5:])
    jobs.wait_until(lambda: jobs.busy(led) == 0, 20, "the jobs once memory is back")
    done_once(led, sids)
    assert w.proc.poll() is None
    assert w.stop() == 0, w.tail()


@pytest.mark.redis
def test_redis_trouble_uncounts_the_untried_jobs_of_the_batch_too(
    led: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient error on a session's first job ends the run: the jobs read with it
    keep the delivery count they had (0), so repeated outages never dead-letter them."""
    sid = "batch-trouble"
    [(_, first)] = jobs.open_resets(led, [sid])
    fields = {"kind": "hard_reset", "session": sid, "epoch": 1, "reason": "later", "op": "y"}
    stream = jobs.jobs_of(led, sid)
    later = [jobs.text(led.client.xadd(stream, fields)) for _ in range(2)]  # type: ignore[arg-type]
    worker = fast_worker(led, max_in_flight=1)
    calls: list[str] = []

    def unavailable(job_id: str, f: Any) -> Any:
        calls.append(job_id)
        raise rex.ConnectionError("Connection refused")

    monkeypatch.setattr(worker.jobs, "handle", unavailable)
    with contextlib.suppress(Exception):
        worker.poll_once()
    assert calls and set(calls) == {first}
    pending = led.client.xpending_range(stream, worker.settings.group, "-", "+", 10)
    counts = {jobs.text(r["message_id"]): int(r["times_delivered"]) for r in pending}
    assert counts == {first: 0, **dict.fromkeys(later, 0)}, counts
