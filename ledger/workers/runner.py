"""The background worker: jobs from Redis Streams consumer groups, and lease expiry.

Every partition has one job stream, written by the Lua scripts in the same atomic
step as the state change that needs the job (a compaction becoming pending, a hard
reset after repeated failed compactions). Workers share the streams through one
consumer group: each entry goes to one worker; an entry left pending by a dead
worker is taken over with XAUTOCLAIM after ``claim_idle_ms``; an entry delivered
``max_deliveries`` times without success goes to the partition's dead-letter
stream with its error. Effects are idempotent: the stream entry id is the
operation id of the ledger call the job makes, and every call is fenced by the
epoch the job was enqueued at, so a job delivered twice changes the state once.

An idle worker costs little: it waits for new jobs in blocking reads (on one server
one XREADGROUP ... BLOCK names every partition's stream; on a cluster, where a
command stays within one hash slot, a reader thread per partition blocks on its
stream), and looks for stuck jobs and expired leases on timers. On one server each
timer is one command over every partition (XREAD: which streams hold an entry;
EXISTS: whether any deadline index does), the sweep every ``sweep_interval``. On a
cluster each partition is checked every ``check_every`` seconds, max(claim_idle_ms,
partitions / cluster_checks), by one read-only script (``worker_check.lua``: its
earliest lease deadline, and whether a job has been pending ``claim_idle_ms``), the
partitions in slices spread over that interval: the worker sweeps a partition when
the deadline it learnt is due, and claims (XAUTOCLAIM) only where a job is idle.
Idle, that is at most cluster_checks checks (each one EVALSHA running two reads) and
partitions / block reads per second (64 partitions, the defaults: 3 checks, 9
commands counted by the server, and 6.4 reads). A lease at least ``check_every`` long
is seen by a check before it is due and released when due; a shorter lease of length
L, taken just after its partition's check, can be released up to ``check_every`` - L
late, and a dead worker's job is taken over within claim_idle_ms + ``check_every``.
A compaction job's entry is deleted by ``compact.lua`` in the same step as its
effect, so it applies once for its whole life in the stream, even when taken over
after the op retention; a hard-reset job needs no such check (a reset at epoch e
moves the session to e + 1, so the job, fenced at e, can apply only once).

No Redis condition stops the loop. Out of memory, a read-only replica, loading,
busy, an unreachable server: the job in hand stays pending without counting as a
delivery, the condition is logged and counted (``ledger_worker_errors{kind}``), and
the worker waits (bounded exponential backoff) and tries again, serving meanwhile
whatever still works. A job stream found missing (NOGROUP: deleted, evicted, lost in
a restart without persistence) is reported loudly, as its jobs may be lost with it,
and its group is made again. Anything else that escapes (a bug) is logged with its
traceback and counted as ``internal``. The Redis settings the ledger needs
(noeviction, persistence, no evictions so far) are checked at start and every
``health_interval`` seconds (:mod:`ledger.health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import inspect
import json
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.cluster
import redis.exceptions as rex
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledger import __version__, backends, health, protocol
from ledger.client import Ledger
from ledger.core import new_op_id
from ledger.errors import (
    ConfigurationError,
    LedgerError,
    OperationIdReused,
    StaleEpoch,
    UnknownSession,
    translated,
)
from ledger.extras import missing
from ledger.models import Compaction
from ledger.workers import compactors
from ledger.workers.trouble import TRANSIENT, Backoff, kind_of

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
    from prometheus_client.core import CounterMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # the worker's metrics: the `worker` extra
    raise missing("prometheus-client", "worker", "the ledger worker") from exc

log = logging.getLogger("ledger.worker")
T = TypeVar("T")


class WorkerSettings(BaseSettings):
    """Worker options, from ``LEDGER_WORKER_*`` environment variables or flags."""

    model_config = SettingsConfigDict(env_prefix="LEDGER_WORKER_", frozen=True, extra="forbid")

    group: str = "ledger-workers"
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    poll_interval: float = Field(
        default=0.1,
        gt=0,
        description="seconds to sleep when idle on the embedded backend (its reads do not block)",
    )
    block: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="longest wait of one blocking read of new jobs (XREADGROUP ... BLOCK) "
        "before it is sent again. On one server one read covers every partition and also "
        "ends for the timers (lease sweep, takeover, health) and below the socket timeout; "
        "on a cluster each partition has its own reader (a client whose socket timeout is "
        "the ledger's plus this): an idle cost of partitions / block reads per second",
    )
    claim_idle_ms: int = Field(default=5_000, ge=10, description="take over jobs idle this long")
    cluster_checks: float = Field(
        default=3.0,
        gt=0,
        description="on a cluster, partition checks (worker_check.lua: one EVALSHA that "
        "runs two reads) per second at most, spread evenly: each partition is checked "
        "every max(claim_idle_ms, partitions / cluster_checks); unused on one server",
    )
    max_deliveries: int = Field(default=5, ge=1, description="then dead-letter the job")
    dead_letter_max: int = Field(
        default=10_000,
        ge=1,
        description="dead letters kept per partition (the oldest go first, XADD MAXLEN ~)",
    )
    batch: int = Field(default=16, ge=1, le=1000)
    sweep_interval: float = Field(
        default=1.0,
        gt=0,
        description="seconds between lease sweeps on one server; on a cluster a partition "
        "is swept when the earliest deadline its check read is due, and again no sooner "
        "than this when a sweep leaves it overdue",
    )
    compactor: str | None = Field(
        default=None,
        description="import path 'module:attr' of the compactor for worker-owned sessions, "
        "or 'none' (this worker serves no compaction: a fleet of agent-owned sessions). No "
        "default: the worker refuses to start without one named explicitly",
    )
    max_in_flight: int = Field(
        default=16, ge=1, le=1024, description="compactions running at once in this worker"
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="0: no HTTP endpoint; else /metrics, /healthz and /readyz on this port",
    )
    health_stale_seconds: float = Field(
        default=90.0,
        gt=0,
        description="/healthz fails once the job loop has not turned for this long (it "
        "turns at least every claim_idle_ms / 4 and health_interval)",
    )
    backoff_initial: float = Field(
        default=0.1, gt=0, description="seconds to wait after a pass that met a Redis error"
    )
    backoff_max: float = Field(
        default=5.0, gt=0, description="longest wait while Redis errors go on (doubling)"
    )
    health_interval: float = Field(
        default=60.0, gt=0, description="seconds between checks of the Redis settings"
    )
    observe_interval: float = Field(
        default=15.0,
        gt=0,
        description="seconds between two metrics passes (with metrics_port): lag and "
        "dead-letter gauges per partition, and, on the one worker holding the observer "
        "lease, the fleet's indicators. The pass runs in its own thread, never in the job loop",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="the lowest level of the worker's JSON log lines"
    )
    turn_wait: float = Field(
        default=30.0,
        gt=0,
        description="seconds a compaction ready to commit waits for the session's open turn "
        "to end (it never changes the prompt under a running turn); then the job is left "
        "pending, uncounted, for a later claim",
    )


class FleetIndicators(Collector):
    """``ledger_indicator_total{name}``: the fleet's indicators as the partitions' tallies
    hold them (docs/protocol.md#indicators-the-partition-tally), exported by the one
    worker holding the observer lease (``values`` set by its metrics pass; None on every
    other worker, which exports no sample). A counter's value is the tally itself, kept in
    Redis: sessions that expire or are deleted keep what they counted, a new holder
    exports the same totals, and ``sum(rate(...))`` over workers counts each change once."""

    values: dict[str, int] | None = None

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for name, value in sorted((self.values or {}).items()):
            family.add_metric([name], value)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "ledger_indicator",
            "Leading indicators of the rules (docs/rules.md), for the fleet: the partitions' "
            "tallies, kept by the scripts as they count, exported by the observer lease's holder",
            labels=["name"],
        )


class Metrics:
    """The worker's Prometheus metrics, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.processed = Counter("ledger_jobs_processed", "Jobs done", ["kind"], registry=r)
        self.failed = Counter(
            "ledger_jobs_failed", "Job attempts that raised", ["kind"], registry=r
        )
        self.retried = Counter("ledger_jobs_retried", "Jobs delivered again", registry=r)
        self.duration = Histogram(
            "ledger_job_duration_seconds",
            "Time a job took, from its delivery to its acknowledgement (jobs done)",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.dead = Counter("ledger_jobs_dead_lettered", "Jobs moved to dead letter", registry=r)
        self.takeovers = Counter(
            "ledger_jobs_taken_over", "Jobs claimed from idle consumers", registry=r
        )
        self.expired = Counter("ledger_reservations_expired", "Leases released", registry=r)
        self.lag = Gauge(
            "ledger_partition_lag", "Entries not yet delivered", ["partition"], registry=r
        )
        self.pending = Gauge(
            "ledger_partition_pending", "Entries delivered, not acked", ["partition"], registry=r
        )
        self.indicators = FleetIndicators()
        r.register(self.indicators)
        self.observer = Gauge(
            "ledger_observer",
            "1 while this worker holds the observer lease (it exports the fleet's indicators)",
            registry=r,
        )
        self.skipped = Counter(
            "ledger_jobs_skipped",
            "Jobs acknowledged without running: session gone, or a hard reset requested",
            ["kind"],
            registry=r,
        )
        self.dead_depth = Gauge(
            "ledger_dead_letters",
            "Jobs in the partition's dead-letter stream (ledger dead list / replay / purge)",
            ["partition"],
            registry=r,
        )
        self.redis_up = Gauge(
            "ledger_redis_up", "1 when Redis answered the job loop's last pass", registry=r
        )
        self.heartbeat = Gauge(
            "ledger_worker_heartbeat_timestamp_seconds",
            "Unix time the job loop last turned",
            registry=r,
        )
        self.info = Info("ledger_build", "The ledger's version", registry=r)
        self.info.info({"version": __version__})
        self.errors = Counter(
            "ledger_worker_errors",
            "Errors the worker met and survived, by kind (oom, readonly, loading, busy, "
            "unavailable, nogroup, noperm, internal, ...)",
            ["kind"],
            registry=r,
        )
        self.streams_lost = Counter(
            "ledger_job_streams_lost",
            "Job streams (or their consumer group) found missing: their jobs may be lost",
            registry=r,
        )
        self.waited_turns = Counter(
            "ledger_compactions_waited_for_turn",
            "Compaction commits that found the session's turn open and waited for it to end",
            registry=r,
        )
        self.deferred = Counter(
            "ledger_jobs_deferred",
            "Jobs left pending because the session's turn stayed open past turn_wait",
            registry=r,
        )
        self.rolled_back = Counter(
            "ledger_turns_rolled_back",
            "Turns rolled back by the worker because their lease lapsed (a dead owner)",
            registry=r,
        )
        self.config_ok = Gauge(
            "ledger_redis_config_ok",
            "1: the Redis settings the ledger needs are verified (noeviction, persistence, no "
            "evicted keys); 0: a problem found; -1: could not be verified",
            registry=r,
        )


@dataclass
class JobOutcome:
    kind: str
    effect: str  # applied | already | skipped


class CompactionDeferred(LedgerError):
    """A compaction ready to commit found the session's turn still open after
    ``turn_wait``: the job stays pending, its delivery uncounted, for a later claim."""


# What the worker says when it meets each kind of Redis trouble (the log line's msg).
MESSAGES = {
    "oom": "Redis is out of memory (OOM: used memory is above maxmemory) and refuses "
    "writes: jobs wait and are retried with backoff; free memory or raise maxmemory "
    "(keep maxmemory-policy noeviction)",
    "readonly": "Redis refused a write (READONLY: the server is a replica, e.g. after a "
    "failover): retrying with backoff",
    "loading": "Redis is loading its dataset (LOADING): retrying with backoff",
    "busy": "Redis is busy running a script (BUSY): retrying with backoff",
    "masterdown": "Redis replica lost its primary (MASTERDOWN): retrying with backoff",
    "clusterdown": "Redis Cluster is down (CLUSTERDOWN): retrying with backoff",
    "tryagain": "Redis Cluster slot is moving (TRYAGAIN): retrying with backoff",
    "cluster": "Redis Cluster error: retrying with backoff",
    "misconf": "Redis refuses writes because it cannot persist (MISCONF): retrying with backoff",
    "noreplicas": "Redis refuses writes: not enough replicas (NOREPLICAS): retrying with backoff",
    "noscript": "Redis lost the ledger's scripts (NOSCRIPT): retrying with backoff",
    "unavailable": "Redis unavailable: retrying with backoff",
    "noperm": "Redis refused a command (ACL, NOPERM): check the worker's ACL user",
    "wrongtype": "a ledger key holds the wrong type (WRONGTYPE): something else wrote to it",
    "redis": "Redis error: retrying with backoff",
    "ledger": "ledger error: retrying with backoff",
}

# Conditions that concern every partition alike: they end a pass (and reach whoever
# called poll_once or sweep directly); the loop counts them and backs off.
_WHOLE_PASS = frozenset({"unavailable", "noperm"})

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _ledger_errors(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """A public step of the worker raises the ledger's errors (``PermissionDenied``,
    ``BackendUnavailable``, ...), the driver's as their cause, never a bare driver error."""

    @functools.wraps(method)
    def typed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with translated():
            return method(*args, **kwargs)

    return typed


class Worker:
    def __init__(
        self,
        ledger: Ledger,
        settings: WorkerSettings | None = None,
        metrics: Metrics | None = None,
        compactor: compactors.AnyCompactor | None = None,
    ) -> None:
        self.ledger = ledger
        self.settings = settings or WorkerSettings()
        self.metrics = metrics or Metrics()
        # A compactor object given in code (in-process use) wins over settings.compactor.
        if compactor is None and self.settings.compactor is None:
            raise ConfigurationError(compactors.NO_COMPACTOR)
        self.compactor: compactors.AnyCompactor | None = compactor
        if compactor is None and self.settings.compactor != "none":
            self.compactor = compactors.load(str(self.settings.compactor))
        # A compactor that can tell it cannot work says so now, not at the first job.
        check = getattr(self.compactor, "check", None)
        if callable(check):
            check()
        self.partitions = range(ledger.keyspace.partitions)
        self._partition_of = {self.stream(p): p for p in self.partitions}
        self.beat: float | None = None  # monotonic time the job loop last turned
        self.redis_ok = False  # Redis answered the loop's last pass
        self._last_kind: str | None = None
        # One command may name every partition's keys only outside a cluster (there a
        # command stays within one hash slot, and each partition has its own).
        url = ledger.settings.redis_url
        self._one_node = url is not None and backends.parse_url(url).kind != "cluster"
        # Blocking reads on a real server (a reader per partition on a cluster); the
        # embedded backend polls.
        self._blocking = self._one_node and type(ledger.client) is redis.Redis
        self._on_cluster = isinstance(ledger.client, redis.cluster.RedisCluster)
        self._last_sweep = 0.0
        self._due: dict[int, float] = {}  # cluster: partition -> when its first lease is due
        self._idle: set[int] = set()  # cluster: partitions holding a job to take over
        self._next_check: dict[int, float] = {}  # cluster: slice -> when it is checked next
        self._last_health = float("-inf")
        self._health_said: tuple[str, ...] | None = None
        self._groups: set[int] = set()  # partitions whose group this worker made or saw
        self._troubled = False  # this pass met a Redis error: back off before the next
        self._said: dict[str, float] = {}  # kind -> when it was last logged
        self._unsaid: dict[str, int] = {}  # kind -> occurrences not logged since
        self._pool = ThreadPoolExecutor(self.settings.max_in_flight, "ledger-job")
        self._loop: asyncio.AbstractEventLoop | None = None  # for async compactors
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    def close(self) -> None:
        """Stop the job threads and the async compactors' event loop."""
        self._pool.shutdown(wait=True)
        with self._loop_lock:
            loop, thread, self._loop = self._loop, self._loop_thread, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def _run_compactor(
        self, compactor: compactors.AnyCompactor, request: compactors.CompactionRequest
    ) -> compactors.CompactionPlan:
        """A sync compactor in this job thread; an async one on the worker's event loop
        (one loop, many summaries in flight), this thread waiting for its result."""
        got = compactor(request)
        if not inspect.isawaitable(got):
            return got
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(
                    target=loop.run_forever, name="ledger-compact", daemon=True
                )
                self._loop_thread.start()
                self._loop = loop
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(_awaited(got), loop).result()

    # --- streams ---------------------------------------------------------------------

    def stream(self, partition: int) -> str:
        return self.ledger.keyspace.jobs(partition)

    def dead_letter(self, partition: int) -> str:
        return self.ledger.keyspace.dead_letters(partition)

    def _errors_hash(self, partition: int) -> str:
        return f"{self.ledger.keyspace.tag(partition)}:errors"

    def ensure_group(self, partition: int) -> None:
        """Make the partition's stream and group (nothing if the group exists); raises
        what Redis answers otherwise (e.g. OOM)."""
        try:
            self.ledger.client.xgroup_create(
                self.stream(partition), self.settings.group, id="0", mkstream=True
            )
        except rex.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(partition)

    def leave_groups(self, stale_ms: int = 86_400_000) -> int:
        """At a clean stop: remove this worker's consumer from each partition's group when
        it holds no pending job, and any other consumer idle for `stale_ms` that holds
        none (a worker that stopped long ago); a consumer with pending jobs stays, so
        that they can be claimed. Returns the consumers removed; raises the ledger's
        errors (run() logs them: a stop never fails for it)."""
        client, s, removed = self.ledger.client, self.settings, 0
        with translated():
            for p in self.partitions:
                try:
                    consumers = client.xinfo_consumers(self.stream(p), s.group)
                except rex.ResponseError as exc:
                    if "no such key" in str(exc).lower() or "NOGROUP" in str(exc):
                        continue  # the stream or its group is gone: nothing to tidy
                    raise
                for c in consumers:
                    name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
                    idle, pending = int(c.get("idle") or 0), int(c.get("pending") or 0)
                    if pending == 0 and (name == s.consumer or idle >= stale_ms):
                        gone = client.xgroup_delconsumer(self.stream(p), s.group, name)
                        removed += int(gone == 0)
        return removed

    def ensure_groups(self) -> None:
        """Every partition's stream and group; raises the first error, as the ledger's
        (``PermissionDenied``, ``BackendUnavailable``, ...; see run(), which does not)."""
        with translated():
            for p in self.partitions:
                self.ensure_group(p)

    def _stream_lost(self, partition: int, exc: BaseException) -> None:
        """NOGROUP: the stream, or its group, is gone. Say so loudly once per loss (the
        jobs in it may be lost); the caller makes the group again (on a stream a script
        has made anew since, the group starts at its first entry)."""
        self.metrics.errors.labels("nogroup").inc()
        if partition in self._groups:
            self._groups.discard(partition)
            self.metrics.streams_lost.inc()
            log.warning(
                "job stream lost: the stream or its consumer group is gone (a DEL, FLUSHDB, "
                "eviction, or a restart without persistence); jobs it held may be lost with "
                "it; making the group again",
                extra={
                    "stream": self.stream(partition),
                    "partition": partition,
                    "kind": "nogroup",
                    "error": _describe(exc),
                },
            )

    @_ledger_errors
    def poll_once(self) -> int:
        """One pass over every partition: new jobs, then jobs idle too long elsewhere.

        The jobs read are run up to ``max_in_flight`` at once, those of one session one
        after the other, in the order read (a 2 s summarizer does not hold up the
        fleet's other sessions). A Redis error in one partition is counted and logged and
        the pass goes on with the next (an unreachable server or an ACL refusal ends the
        pass: it is raised); a job stream found missing is reported and its group made
        again. Returns the number of jobs done."""
        groups: _Groups = {}
        failed = set()
        for p in self.partitions:
            try:
                _collect(groups, p, self._read_partition(p), claimed=False)
            except Exception as exc:
                failed.add(p)
                self._partition_trouble(p, exc)
        self._claim_into(groups, skip=failed, every=True)
        return self._run_groups(groups)

    @_ledger_errors
    def take_over(self, every: bool = False, partitions: list[int] | None = None) -> int:
        """Jobs left pending longer than ``claim_idle_ms`` (by a worker that died, or a
        failed attempt): claimed and done. Returns the number done. Only partitions whose
        stream holds an entry are looked at, unless ``every``: an entry deleted while
        pending (its job done, by a worker that died before acknowledging it) is no
        longer in its stream, and is acknowledged by the claim that finds it. Given
        ``partitions``, only those are looked at."""
        groups: _Groups = {}
        self._claim_into(groups, skip=set(), every=every, only=partitions)
        return self._run_groups(groups)

    def _claim_into(
        self, groups: _Groups, skip: set[int], every: bool, only: list[int] | None = None
    ) -> None:
        try:
            candidates = (
                only
                if only is not None
                else list(self.partitions)
                if every
                else self._with_entries()
            )
        except Exception as exc:  # the check failed: look at every partition
            kind = kind_of(exc)
            if kind is None or kind in _WHOLE_PASS:
                raise
            self._trouble(kind, exc, where="take over")
            candidates = list(self.partitions)
        for p in candidates:
            if p in skip:
                continue
            try:
                _collect(groups, p, self._claim_partition(p), claimed=True)
            except Exception as exc:
                self._partition_trouble(p, exc)

    def _with_entries(self) -> list[int]:
        """Partitions whose job stream holds an entry (done jobs are deleted: an entry
        is a job waiting or pending): one XREAD over every stream on one server, every
        partition on a cluster."""
        if not self._one_node:
            return list(self.partitions)
        streams: dict[Any, Any] = {self.stream(p): "0-0" for p in self.partitions}
        got: Any = self.ledger.client.xread(streams, count=1)
        return sorted(self._partition_of[_str(stream)] for stream, _ in got or [])

    def _read_blocking(self, block: float) -> int:
        """Wait up to ``block`` seconds for new jobs in any partition, with one
        XREADGROUP ... BLOCK over every partition's stream, and do them. A stream or
        group found missing sends a pass over each partition (poll_once), which reports
        the loss and makes the group again. Returns the number of jobs done."""
        s = self.settings
        streams: dict[Any, Any] = {self.stream(p): ">" for p in self.partitions}
        ms = max(1, int(1000 * min(block, s.block, self.ledger.settings.socket_timeout / 2)))
        try:
            got: Any = self.ledger.client.xreadgroup(
                s.group, s.consumer, streams, count=s.batch, block=ms
            )
        except rex.ResponseError as exc:
            if not _stream_gone(exc):
                raise
            return self.poll_once()
        groups: _Groups = {}
        for stream, entries in got or []:
            _collect(groups, self._partition_of[_str(stream)], entries, claimed=False)
        return self._run_groups(groups)

    def _read_results(self, got: list[tuple[int, Any]]) -> int:
        """Do the jobs the cluster's readers brought; a reader's error is handled as in
        a pass (an unreachable server or an ACL refusal raised once)."""
        groups: _Groups = {}
        whole: BaseException | None = None
        for p, result in got:
            if not isinstance(result, BaseException):
                _collect(groups, p, result, claimed=False)
                continue
            try:
                self._partition_trouble(p, result)
            except Exception as exc:
                whole = whole or exc
        done = self._run_groups(groups)
        if whole is not None:
            raise whole
        return done

    def _run_groups(self, groups: _Groups) -> int:
        """Run the jobs read, those of one session one after the other."""
        if not groups:
            return 0
        done = 0
        if len(groups) == 1 or self.settings.max_in_flight == 1:
            for (p, _), jobs in groups.items():
                try:
                    done += self._deliver_all(p, jobs)
                except Exception as exc:
                    self._partition_trouble(p, exc)
            return done
        futures = {
            self._pool.submit(self._deliver_all, p, jobs): p for (p, _), jobs in groups.items()
        }
        whole: BaseException | None = None
        for fut, p in futures.items():
            try:
                done += fut.result()
            except Exception as exc:
                try:
                    self._partition_trouble(p, exc)
                except Exception as again:
                    whole = whole or again
        if whole is not None:
            raise whole
        return done

    def _deliver_all(self, p: int, jobs: list[tuple[bytes | str, Any, bool]]) -> int:
        """Do one session's jobs in order. When Redis trouble ends the run, the jobs
        after the one that met it were read (their delivery counted) but not tried: each
        gets its count back, so that an outage does not push them to the dead letters."""
        done = 0
        for i, (eid, fields, claimed) in enumerate(jobs):
            try:
                done += self._deliver(p, eid, fields, claimed=claimed)
            except Exception:
                for rest, _, was_claimed in jobs[i + 1 :]:
                    self._uncount_untried(p, _str(rest), was_claimed)
                raise
        return done

    def _uncount_untried(self, p: int, eid: str, claimed: bool) -> None:
        """Take back the delivery a read (or a claim) counted for a job never tried."""
        deliveries = 1
        if claimed:  # a claim counted one more than the attempts before it
            with contextlib.suppress(rex.RedisError):
                s, stream = self.settings, self.stream(p)
                info = self.ledger.client.xpending_range(stream, s.group, eid, eid, 1)
                deliveries = int(info[0]["times_delivered"]) if info else 1
        self._uncount(self.stream(p), eid, deliveries)

    def _partition_trouble(self, p: int, exc: BaseException) -> None:
        """A Redis error met in one partition: counted and logged; NOGROUP reported as a
        lost stream and the group made again. A bug, Redis unreachable or an ACL
        refusal is raised."""
        kind = "nogroup" if _stream_gone(exc) else kind_of(exc)
        if kind is None or kind in _WHOLE_PASS:
            raise exc
        if kind != "nogroup":
            self._trouble(kind, exc, partition=p)
            return
        self._stream_lost(p, exc)
        try:
            self.ensure_group(p)
        except Exception as again:
            kind = kind_of(again)
            if kind is None or kind in _WHOLE_PASS:
                raise
            self._trouble(kind, again, partition=p)  # made on a later pass

    def _read_partition(self, p: int) -> list[tuple[Any, Any]]:
        """New jobs of a partition (no wait)."""
        s = self.settings
        if p not in self._groups:  # not made yet (e.g. Redis was out of memory at start)
            self.ensure_group(p)
        got: Any = self.ledger.client.xreadgroup(
            s.group, s.consumer, {self.stream(p): ">"}, count=s.batch
        )
        return [entry for _, entries in got or [] for entry in entries]

    def _claim_partition(self, p: int) -> list[tuple[Any, Any]]:
        """A partition's jobs idle too long elsewhere (taken over)."""
        s, client, out = self.settings, self.ledger.client, []
        stream = self.stream(p)
        auto: Any = client.xautoclaim(
            stream, s.group, s.consumer, s.claim_idle_ms, start_id="0-0", count=s.batch
        )
        for entry_id, fields in auto[1]:
            if fields is None:  # deleted while pending (Redis 6.2; 7 drops them itself)
                client.xack(stream, s.group, entry_id)
                continue
            self.metrics.takeovers.inc()
            out.append((entry_id, fields))
        return out

    def _deliver(
        self,
        partition: int,
        entry_id: bytes | str,
        raw: Mapping[bytes | str, bytes | str],
        claimed: bool,
    ) -> int:
        s, client, stream = self.settings, self.ledger.client, self.stream(partition)
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        fields = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        kind = fields.get("kind", "?")
        deliveries = 1
        if claimed:
            info = client.xpending_range(stream, s.group, min=eid, max=eid, count=1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            self.metrics.retried.inc()
            if deliveries > s.max_deliveries:
                self._bury(partition, eid, fields, f"delivered {deliveries} times")
                return 0
        started = time.monotonic()
        try:
            outcome = self.handle(eid, fields)
        except CompactionDeferred as exc:
            # Not a failure: the session's turn is still running. The job stays pending
            # (its delivery uncounted, so it is never dead-lettered for it) for a claim.
            self._uncount(stream, eid, deliveries)
            self.metrics.deferred.inc()
            log.info("job deferred", extra={"job": eid, "kind": kind, "why": str(exc)})
            return 0
        except Exception as exc:
            trouble = kind_of(exc)
            if trouble in TRANSIENT:
                # Redis could not serve the job now: not a failure of the job. It stays
                # pending, this delivery uncounted, for a later claim.
                self._uncount(stream, eid, deliveries)
                if trouble != "oom":
                    raise  # the partition's pass ends here
                # Out of memory: the next job may need no memory, or free some.
                self._trouble(trouble, exc, partition=partition, job=eid)
                return 0
            # The job's own failure: it stays pending; a later claim retries it.
            self.metrics.failed.labels(kind).inc()
            log.warning(
                "job failed",
                extra={"job": eid, "kind": kind, "error": _describe(exc)},
                exc_info=exc if trouble is None else None,  # not a Redis error: show where
            )
            fields["error"] = repr(exc)[:500]
            try:
                client.hset(self._errors_hash(partition), eid, fields["error"])
            except Exception as rec:
                if kind_of(rec) is None:
                    raise
                self._trouble(kind_of(rec) or "redis", rec, partition=partition, job=eid)
            return 0
        # Delete before acknowledging: a crash in between leaves a pending entry whose
        # body is gone, which the next claim acknowledges (the other order would leave
        # an acknowledged entry in the stream for ever). compact.lua deleted it already.
        client.xdel(stream, eid)
        client.xack(stream, s.group, eid)
        if claimed:  # an earlier attempt may have recorded an error
            client.hdel(self._errors_hash(partition), eid)
        took = time.monotonic() - started
        self.metrics.processed.labels(kind).inc()
        self.metrics.duration.labels(kind).observe(took)
        if outcome.effect == "skipped":
            self.metrics.skipped.labels(kind).inc()
        log.info(
            "job done",
            extra={
                "job": eid,
                "kind": kind,
                "session": fields.get("session"),
                "effect": outcome.effect,
                "duration_ms": round(took * 1000, 1),
            },
        )
        return 1

    def _uncount(self, stream: str, eid: str, deliveries: int) -> None:
        """Give a pending entry back the delivery count it had before this delivery
        (XCLAIM RETRYCOUNT to itself), so that Redis trouble does not dead-letter it.
        Best effort: with Redis unreachable the count stays one higher."""
        with contextlib.suppress(rex.RedisError):
            self.ledger.client.xclaim(
                stream,
                self.settings.group,
                self.settings.consumer,
                min_idle_time=0,
                message_ids=[eid],
                retrycount=max(0, deliveries - 1),
                justid=True,
            )

    def _bury(self, partition: int, eid: str, fields: dict[str, str], why: str) -> None:
        client, s = self.ledger.client, self.settings
        errors = self._errors_hash(partition)
        last = client.hget(errors, eid)
        entry: dict[Any, Any] = {
            **fields,
            "job": eid,
            "why": why,
            "error": (last.decode() if isinstance(last, bytes) else str(last or "")),
        }
        client.xadd(self.dead_letter(partition), entry, maxlen=s.dead_letter_max, approximate=True)
        client.xdel(self.stream(partition), eid)
        client.xack(self.stream(partition), s.group, eid)
        client.hdel(errors, eid)
        self.metrics.dead.inc()
        log.error("job dead-lettered", extra={"job": eid, "kind": fields.get("kind"), "why": why})

    # --- job kinds ---------------------------------------------------------------------

    def handle(self, job_id: str, fields: Mapping[str, str]) -> JobOutcome:
        kind = fields.get("kind", "")
        if kind == "hard_reset":
            return self._hard_reset(job_id, fields)
        if kind == "compact":
            return self._compact(job_id, fields)
        raise ValueError(f"unknown job kind {kind!r}")

    def _same_incarnation(self, snap: Any, f: Mapping[str, str]) -> bool:
        """A job belongs to the session it was enqueued for, not to a later one that was
        opened under the same id after the first was closed or expired."""
        inc = int(f.get("inc") or 0)
        return inc == 0 or snap.raw.get("inc", 0) == inc

    def _hard_reset(self, job_id: str, f: Mapping[str, str]) -> JobOutcome:
        # Applied once however late it is delivered again, even after the op retention
        # dropped its stored outcome: the reset moves the session from the job's epoch e
        # to e + 1, and reset.lua refuses a call fenced at e as stale from then on.
        keys = self.ledger.keyspace.session(f["session"])
        try:
            snap = self.ledger.run(protocol.snapshot(keys))
        except UnknownSession:
            return JobOutcome("hard_reset", "skipped")
        if not self._same_incarnation(snap, f):
            return JobOutcome("hard_reset", "skipped")
        call = protocol.reset(keys, f"job-{job_id}", int(f["epoch"]), f.get("reason") or "job")
        try:
            self.ledger.run(call)
        except (StaleEpoch, UnknownSession, OperationIdReused):
            return JobOutcome("hard_reset", "already")
        return JobOutcome("hard_reset", "applied")

    def _compact(self, job_id: str, f: Mapping[str, str]) -> JobOutcome:
        sid, epoch = f["session"], int(f["epoch"])
        keys = self.ledger.keyspace.session(sid)
        try:
            snap = self.ledger.run(protocol.snapshot(keys))
        except UnknownSession:
            return JobOutcome("compact", "skipped")
        if not self._same_incarnation(snap, f):
            return JobOutcome("compact", "skipped")
        if snap.epoch != epoch or not snap.compaction_pending:
            return JobOutcome("compact", "already")
        if snap.raw.get("ca"):
            # The agent compacts this session inline (a job from before an ownership
            # change, or written by hand): the worker keeps out.
            return JobOutcome("compact", "skipped")
        if self.compactor is None:
            raise ConfigurationError(
                f"worker-owned session {sid!r} has a compaction due and this worker runs no "
                "compactor (--compactor none): run a worker with a compactor"
            )
        if snap.raw.get("rq"):
            # Failed compactions escalated: a hard reset is coming, which drops what a
            # compaction would replace. Running the compactor again would only count
            # failures past the maximum.
            return JobOutcome("compact", "skipped")
        turn, items = self._history(keys.session)
        contents = self._contents(keys.content, items)
        compactor = self.compactor
        self._mark_compacting(keys, int(snap.raw.get("ttl") or 86_400_000))
        try:
            return self._compact_with(
                compactor, keys, job_id, sid, epoch, snap, turn, items, contents
            )
        finally:
            # (if this fails, the mark says so until its time is up)
            with contextlib.suppress(LedgerError), translated():
                self.ledger.client.hdel(keys.compacted, "~")

    def _mark_compacting(self, keys: Any, ttl_ms: int) -> None:
        """Say (field '~' of the session's summaries hash) that this worker computes the
        session's compaction, until when on Redis's clock: an agent beginning a turn waits
        for a compaction a worker is on, not for one nobody picked up."""
        client = self.ledger.client
        with translated():
            sec, usec = client.time()
            until = sec * 1000 + usec // 1000 + int(1000 * (self.settings.turn_wait + 60))
            pipe = client.pipeline(transaction=False)
            pipe.hset(keys.compacted, "~", f"{self.settings.consumer}|{until}")
            pipe.pexpire(keys.compacted, ttl_ms)
            pipe.execute()

    def _compact_with(
        self,
        compactor: compactors.AnyCompactor,
        keys: Any,
        job_id: str,
        sid: str,
        epoch: int,
        snap: Any,
        turn: int,
        items: tuple[Any, ...],
        contents: dict[str, str],
    ) -> JobOutcome:
        """Plan (the compactor) and commit, between turns. A commit that had to wait for a
        turn is planned again on the history that turn left: judged on its own end state
        (the post-condition), a plan made before a turn would count that turn's items as
        its failure."""
        for _attempt in range(4):
            plan = self._run_compactor(
                compactor,
                compactors.CompactionRequest(
                    sid, epoch, turn, items, snap.occupancy, snap.high_water_mark, snap.window,
                    contents,
                ),
            )  # fmt: skip
            # Each replaced item at the version the compactor read: one released and
            # admitted again since (with other text) stays.
            seqs = {(i.consumer, i.id): i.seq for i in items}
            replaced = [
                (c, i, seqs[(c, i)]) if (c, i) in seqs else (c, i) for c, i in plan.replaced
            ]
            # The job's entry id goes with the call: compact.lua deletes the entry with the
            # effect, and answers 'already' when it is gone (committed before, by a worker
            # that died before acknowledging it), whatever the op retention. The summary's
            # text goes with it: stored with the effect, the replaced versions' texts
            # removed with it (an item admitted again since keeps its new text).
            text = plan.summary_text if plan.summary is not None else None
            call = protocol.compact(
                keys, f"job-{job_id}", epoch, replaced, plan.summary, job=job_id,
                summary_text=text,
            )  # fmt: skip
            try:
                done = self._commit_between_turns(keys, call)
            except (StaleEpoch, UnknownSession, OperationIdReused):
                return JobOutcome("compact", "already")
            if done is not None:
                return JobOutcome("compact", "already" if done.outcome == "already" else "applied")
            # a turn ran meanwhile: plan again on what it left (if still due)
            snap = self.ledger.run(protocol.snapshot(keys))
            if snap.epoch != epoch or not snap.compaction_pending:
                return JobOutcome("compact", "already")
            turn, items = self._history(keys.session)
            contents = self._contents(keys.content, items)
        raise CompactionDeferred(
            f"session {keys.session_id!r}: a turn began before each of 4 plans could commit"
        )

    def _history(self, session_key: str) -> tuple[int, tuple[Any, ...]]:
        """The turn the compaction prepares (the open one, else the next) and the items of
        the session's committed turns, from one HGETALL: an open turn's own items may yet
        be rolled back, so no summary may hold them."""
        with translated():
            fields = self.ledger.client.hgetall(session_key)
        text = {_str(k): _str(v) for k, v in fields.items() if _str(k) in ("tn", "lo")}
        tn = int(text.get("tn") or 0)
        return (tn if "lo" in text else tn + 1), tuple(protocol.committed_items(fields))

    def _commit_between_turns(self, keys: Any, call: Any) -> Compaction | None:
        """Commit a compaction, unless the session's turn is open: compact.lua changes
        nothing while a turn holds the lease (outcome turn_open). A live turn is waited
        for, up to ``turn_wait`` seconds (then CompactionDeferred: the job stays pending),
        then None: the plan is made again on what the turn left. A lapsed lease is rolled
        back (expire.lua), and the commit tried again: the history is what it was."""
        deadline = time.monotonic() + self.settings.turn_wait
        done: Compaction = self.ledger.run(call)
        while done.outcome == "turn_open":
            self.metrics.waited_turns.inc()
            while True:
                snap = self.ledger.run(protocol.snapshot(keys))
                if snap.turn_owner is None:
                    return None  # the turn ended: what it committed changes the plan
                left = snap.lease_left_ms or 0
                if left < 0:  # its owner died: rolled back, the history is as planned
                    self.ledger.run(protocol.expire(keys, new_op_id(), [protocol.LEASE_MEMBER]))
                    done = self.ledger.run(call)
                    break
                if time.monotonic() >= deadline:
                    raise CompactionDeferred(
                        f"session {keys.session_id!r}: turn {snap.turn} of {snap.turn_owner} "
                        f"still open after {self.settings.turn_wait:g} s"
                    )
                time.sleep(min(0.05, left / 1000, max(deadline - time.monotonic(), 0.001)))
        return done

    def _contents(self, key: str, items: tuple[Any, ...]) -> dict[str, str]:
        """The stored texts of the held items ('<c>:<id>' -> text)."""
        if not items:
            return {}
        fields = [f"{i.consumer.code}:{i.id}" for i in items]
        values = self.ledger.client.hmget(key, fields)
        return {f: _str(v) for f, v in zip(fields, values, strict=True) if v is not None}

    # --- leases, metrics, health, loop -------------------------------------------------

    @_ledger_errors
    def sweep(self, partitions: list[int] | None = None) -> int:
        """Release expired leases in every partition (or those given); a Redis error in
        one partition is counted and the sweep goes on (an unreachable server or an ACL
        refusal ends it)."""
        released = 0
        for p in self._with_leases() if partitions is None else partitions:
            try:
                reservations, turns = self.ledger.sweep_partition(p)
                released += reservations + turns
                self.metrics.rolled_back.inc(turns)
            except Exception as exc:
                kind = kind_of(exc)
                if kind is None or kind in _WHOLE_PASS:
                    raise
                self._trouble(kind, exc, partition=p, where="sweep")
        self.metrics.expired.inc(released)
        return released

    def _with_leases(self) -> list[int]:
        """Partitions whose deadline index exists (an empty sorted set is no key): one
        EXISTS over every partition on one server, one each (pipelined) on a cluster."""
        client, names = self.ledger.client, self.ledger.keyspace.deadlines
        if self._one_node:
            return list(self.partitions) if client.exists(*map(names, self.partitions)) else []
        pipe = client.pipeline(transaction=False)
        for p in self.partitions:
            pipe.exists(names(p))
        return [p for p, n in zip(self.partitions, pipe.execute(), strict=True) if n]

    def check(self, partitions: Iterable[int], swept: bool = False) -> int:
        """Cluster: read each partition's earliest lease deadline and whether a job there
        is idle ``claim_idle_ms`` (``worker_check.lua``, one call each), and remember
        them. A partition left overdue by a sweep (``swept``) is swept again after
        ``sweep_interval``; one whose check fails is swept and claimed from as if due.
        Returns the number checked."""
        s, n = self.settings, 0
        for p in partitions:
            try:
                got = self.ledger.check_partition(p, s.group, s.claim_idle_ms)
                due, idle = got.due_ms, got.idle
            except Exception as exc:
                kind = kind_of(exc)
                if kind is None or kind in _WHOLE_PASS:
                    raise
                self._trouble(kind, exc, partition=p, where="check")
                due, idle = (None if swept else 0), True
            now = time.monotonic()
            if due is None:
                self._due.pop(p, None)
            else:
                self._due[p] = now + (s.sweep_interval if swept and due == 0 else due / 1000)
            if idle:
                self._idle.add(p)
            else:
                self._idle.discard(p)
            n += 1
        return n

    def _observer_lease(self) -> bool:
        """Whether this worker keeps the fleet's indicators for the next pass: one worker
        at a time does (SET NX PX, renewed by its holder), so a sum over workers counts
        each change once. A dead holder's lease lapses after three passes."""
        key, ms = self.ledger.keyspace.observer(), int(self.settings.observe_interval * 3000)
        me = self.settings.consumer
        holder = self.ledger.client.set(key, me, nx=True, px=ms, get=True)
        if holder is None:
            return True
        if (holder.decode() if isinstance(holder, bytes) else holder) == me:
            self.ledger.client.pexpire(key, ms)
            return True
        return False

    def _observe_loop(self, stop: threading.Event) -> None:
        """The metrics passes, every observe_interval, in their own thread: a slow Redis
        never holds up a job, a lease or SIGTERM."""
        while not stop.is_set():
            try:
                self.observe()
            except Exception as exc:  # counted and logged; the job loop is not disturbed
                kind = kind_of(exc) or "internal"
                self.metrics.errors.labels(kind).inc()
                log.warning(
                    "metrics pass failed; the next one runs on schedule",
                    extra={"where": "observe", "kind": kind, "error": _describe(exc)},
                )
            stop.wait(self.settings.observe_interval)

    def tallies(self) -> dict[str, int]:
        """The fleet's indicators: every partition's tally (one small hash each, kept by
        the scripts as they count), summed; one pipeline, whatever the sessions."""
        client, ks = self.ledger.client, self.ledger.keyspace
        pipe = client.pipeline(transaction=False)
        for p in range(ks.partitions):
            pipe.hgetall(ks.tally(p))
        total: dict[str, int] = {}
        for got in pipe.execute():
            for k, v in got.items():
                name = k.decode() if isinstance(k, bytes) else k
                total[name] = total.get(name, 0) + int(v)
        return total

    @_ledger_errors
    def observe(self) -> None:
        """Refresh the lag and dead-letter gauges; on the observer lease's holder, read
        the fleet's indicators from the partitions' tallies (no session is read)."""
        client, s = self.ledger.client, self.settings
        for p in self.partitions:
            try:
                groups = client.xinfo_groups(self.stream(p))
            except rex.ResponseError as exc:
                if "no such key" not in str(exc).lower():
                    raise
                groups = []  # the stream is gone: the next poll reports it and makes it again
            lag = pending = 0
            for g in groups:
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == s.group:
                    lag, pending = int(g.get("lag") or 0), int(g.get("pending") or 0)
            self.metrics.lag.labels(str(p)).set(lag)
            self.metrics.pending.labels(str(p)).set(pending)
            self.metrics.dead_depth.labels(str(p)).set(client.xlen(self.dead_letter(p)))
        held = self._observer_lease()
        self.metrics.observer.set(1 if held else 0)
        self.metrics.indicators.values = self.tallies() if held else None

    def check_redis(self) -> health.HealthReport:
        """Check the Redis settings the ledger needs; log a warning when what is wrong
        changes (and at the first check), set ``ledger_redis_config_ok``."""
        report = health.check(self.ledger.client, self.ledger.settings.redis_url)
        self.metrics.config_ok.set(1 if report.embedded else report.gauge)
        said = tuple(health.describe(report))
        if said != self._health_said:
            if said:
                log.warning(
                    "Redis settings put the ledger's data at risk: "
                    + "; ".join(said)
                    + " (see docs/operations.md)",
                    extra={"problems": report.problems, "unknown": report.unknown},
                )
            elif not report.embedded:
                log.info("Redis settings checked: noeviction, persistence on, no evicted keys")
            self._health_said = said
        return report

    def _trouble(self, kind: str, exc: BaseException, **where: object) -> None:
        """Count a Redis error the worker survives; log it (each kind at most every 10 s,
        with the number of occurrences not logged in between)."""
        self._troubled = True
        self.metrics.errors.labels(kind).inc()
        now = time.monotonic()
        if now - self._said.get(kind, float("-inf")) < 10:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return
        self._said[kind] = now
        log.warning(
            MESSAGES.get(kind, MESSAGES["redis"]),
            extra={
                "kind": kind,
                "error": _describe(exc),
                "not_logged_since": self._unsaid.pop(kind, 0),
                **where,
            },
        )

    def _redis_ok_despite_trouble(self) -> bool:
        """After a troubled pass: whether Redis still answered (the trouble was a job's
        or a bug's, not an outage or a refusal)."""
        return self._last_kind not in _WHOLE_PASS

    def health(self, stale_s: float) -> tuple[bool, bool, str]:
        """(healthy, ready, why) for /healthz and /readyz: healthy while the job loop
        turned within ``stale_s`` seconds; ready when healthy, started and Redis answered
        its last pass."""
        if self.beat is None:
            return True, False, "starting"
        age = time.monotonic() - self.beat
        if age > stale_s:
            return False, False, f"the job loop has not turned for {age:.1f} s"
        if not self.redis_ok:
            return True, False, "Redis did not answer the last pass (or refused it)"
        return True, True, "ok"

    def _survive(self, exc: BaseException, where: str) -> None:
        """Whatever escaped a step of the loop: a Redis or ledger error is counted and
        logged by kind, anything else (a bug) logged with its traceback, as internal."""
        kind = kind_of(exc)
        self._last_kind = kind
        if kind is None:
            self._troubled = True
            self.metrics.errors.labels("internal").inc()
            log.error(
                "unexpected error in the worker loop (a bug?); going on after a backoff",
                extra={"where": where, "kind": "internal", "error": _describe(exc)},
                exc_info=exc,
            )
        else:
            self._trouble(kind, exc, where=where)

    def _guard(self, step: Callable[[], object], where: str) -> object:
        """step(), with whatever escapes it counted and logged (see _survive)."""
        try:
            return step()
        except Exception as exc:
            self._survive(exc, where)
            return None

    def run(self, stop: threading.Event, once: bool = False) -> None:
        s = self.settings
        backoff = Backoff(s.backoff_initial, max(s.backoff_initial, s.backoff_max))
        self._troubled = False
        log.info(
            "worker starting",
            extra={
                "url": mask_url(self.ledger.settings.redis_url or ""),
                "prefix": self.ledger.settings.prefix,
                "partitions": len(self.partitions),
                "compactor": s.compactor or f"{type(self.compactor).__name__} (in code)",
                "max_in_flight": s.max_in_flight,
                "consumer": s.consumer,
                "group": s.group,
            },
        )
        for p in self.partitions:  # a partition whose group is not made is tried each pass
            try:
                self.ensure_group(p)
            except Exception as exc:
                self._survive(exc, "start")
                if kind_of(exc) in _WHOLE_PASS:
                    break
        self._guard(self.check_redis, "health")
        self._last_health = time.monotonic()
        log.info(
            "worker started",
            extra={"consumer": self.settings.consumer, "partitions": len(self.partitions)},
        )
        last_claim = float("-inf")
        observer = None
        if s.metrics_port and not once:
            observer = threading.Thread(
                target=self._observe_loop, args=(stop,), name="ledger-observe", daemon=True
            )
            observer.start()
        # A dead worker's job waits < 1.25 claim_idle_ms on one server (one XREAD finds
        # the partitions to claim from); on a cluster < claim_idle_ms + check_every.
        claim_every = s.claim_idle_ms / 4000
        claims = 0
        readers = _Readers(self) if self._on_cluster and not once else None
        slices = self._check_slices(time.monotonic()) if readers is not None else []
        taken: list[int] = []  # partitions whose readers' results were taken
        while not stop.is_set():
            self._troubled = False
            now = time.monotonic()
            self.beat = now  # the job loop is turning (what /healthz reads)
            if now - self._last_health >= s.health_interval:
                self._last_health = now
                self._guard(self.check_redis, "health")
            if readers is not None:
                self._checked(now, slices)
            elif now - self._last_sweep >= s.sweep_interval:
                self._last_sweep = now
                self._guard(self.sweep, "sweep")
            if readers is not None:
                readers.again(taken)  # after the backoff, if any
            if once or not (self._blocking or readers):
                worked = self._guard(self.poll_once, "poll")  # new jobs, then stuck ones
            else:
                if readers is None and now - last_claim >= claim_every:
                    last_claim = now
                    # every 16th time, each partition: entries pending without a body
                    every = not self._one_node or claims % _EVERY_PARTITION == 0
                    claims += 1
                    self._guard(functools.partial(self.take_over, every), "take over")
                timers = [self._last_health + s.health_interval]
                if readers is None:
                    timers += [self._last_sweep + s.sweep_interval, last_claim + claim_every]
                else:
                    timers += [*self._next_check.values(), *self._due.values()]
                wait = max(0.001, min(timers) - time.monotonic())
                if readers is None:
                    worked = self._guard(functools.partial(self._read_blocking, wait), "poll")
                else:
                    got = readers.take(wait)
                    taken = [p for p, _ in got]
                    worked = self._guard(functools.partial(self._read_results, got), "poll")
            self.redis_ok = not self._troubled or self._redis_ok_despite_trouble()
            self.metrics.redis_up.set(1 if self.redis_ok else 0)
            self.metrics.heartbeat.set(time.time())
            if once:
                break
            if self._troubled:
                stop.wait(backoff.next())
            else:
                backoff.reset()
                if not worked and not (self._blocking or readers):
                    stop.wait(s.poll_interval)
        if readers is not None:
            readers.close()
        if observer is not None:
            observer.join(self.settings.observe_interval + 5)
        left = self._guard(self.leave_groups, "leave") if not once else 0
        log.info("worker stopped", extra={"consumer": self.settings.consumer, "left": left})

    @property
    def check_every(self) -> float:
        """Cluster: seconds between two checks of one partition, max(claim_idle_ms,
        partitions / cluster_checks)."""
        s = self.settings
        return max(s.claim_idle_ms / 1000, len(self.partitions) / s.cluster_checks)

    def _check_slices(self, now: float) -> list[list[int]]:
        """Cluster: the partitions cut into about one slice per second of
        ``check_every``, each slice checked in turn, the first now and the others spread
        over the interval, so that checks come at an even rate instead of in bursts."""
        every, parts = self.check_every, self.partitions
        n = max(1, min(len(parts), math.ceil(every)))
        slices = [list(parts[k::n]) for k in range(n)]
        self._next_check = {k: now + every * k / n for k in range(n)}
        return slices

    def _checked(self, now: float, slices: list[list[int]]) -> None:
        """Cluster: check the slices whose turn has come (a slice whose round fails is
        tried again next pass); sweep the partitions whose first lease is due and check
        them again; claim where a job is idle."""
        for k, at in list(self._next_check.items()):
            if at <= now and self._guard(functools.partial(self.check, slices[k]), "check"):
                self._next_check[k] = next_round(at, now, self.check_every)
        due = sorted(p for p, at in self._due.items() if at <= now)
        if due:
            self._guard(functools.partial(self.sweep, due), "sweep")
            self._guard(functools.partial(self.check, due, swept=True), "check")
        if self._idle:
            idle, self._idle = sorted(self._idle), set()
            self._guard(functools.partial(self.take_over, partitions=idle), "take over")


def next_round(at: float, now: float, every: float) -> float:
    """The first time after ``now`` in the cycle ``at + k * every`` (k >= 1): a slice
    checked late, or after rounds missed in an outage, keeps its place in the cycle, so
    the slices stay spread instead of falling due together."""
    return at + every * max(1, math.floor((now - at) / every) + 1)


def _stream_gone(exc: BaseException) -> bool:
    """NOGROUP (a stream or its group is missing), or UNBLOCKED (a stream deleted while
    a read was blocked on it)."""
    return kind_of(exc) == "nogroup" or str(exc).startswith("UNBLOCKED")


class _Readers:
    """Blocking reads of new jobs on a cluster, where a command stays within one hash
    slot: a thread per partition sends XREADGROUP ... BLOCK on its stream, through a
    client of their own whose socket timeout is the ledger's plus the block. What a read
    brings (entries, or its error) waits for the worker loop, which reads the partition
    again (again()) once it has done them; an empty read is sent again at once."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        ls, s = worker.ledger.settings, worker.settings
        more = {"socket_timeout": ls.socket_timeout + s.block}
        self.client: Any = backends.sync_client(ls.model_copy(update=more))  # a cluster
        self.results: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.go = {p: threading.Event() for p in worker.partitions}
        self.closed = False
        for p, go in self.go.items():
            go.set()
            threading.Thread(
                target=self._read, args=(p,), name=f"ledger-read-{p}", daemon=True
            ).start()

    def _read(self, p: int) -> None:
        s, stream = self.worker.settings, self.worker.stream(p)
        ms = int(1000 * s.block)
        while self.go[p].wait() and not self.closed:
            try:
                # Sent to the stream's node by name: redis-py would otherwise ask the
                # server for the keys of each XREADGROUP (COMMAND GETKEYS, twice).
                got: Any = self.client.execute_command(
                    *("XREADGROUP", "GROUP", s.group, s.consumer, "COUNT", s.batch),
                    *("BLOCK", ms, "STREAMS", stream, ">"),
                    target_nodes=self.client.get_node_from_key(stream),
                )
            except Exception as exc:
                result: Any = exc
            else:
                result = [entry for _, entries in got or [] for entry in entries]
                if not result:
                    continue
            if self.closed:
                return  # entries read now are taken over after claim_idle_ms
            self.go[p].clear()
            self.results.put((p, result))

    def take(self, timeout: float) -> list[tuple[int, Any]]:
        """What the reads brought: waits up to timeout for the first."""
        try:
            got = [self.results.get(timeout=timeout)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(self.results.get_nowait())
        return got

    def again(self, partitions: list[int]) -> None:
        for p in partitions:
            self.go[p].set()

    def close(self) -> None:
        """Stop the readers: a read blocked now ends with its connection."""
        self.closed = True
        for go in self.go.values():
            go.set()
        self.client.close()


_EVERY_PARTITION = 16  # every how many takeover checks all partitions are claimed from
_Groups = dict[tuple[int, str], list[tuple[Any, Any, bool]]]


def _collect(groups: _Groups, p: int, entries: list[tuple[Any, Any]], claimed: bool) -> None:
    """Add a partition's entries read to the jobs by (partition, session), in order. An
    entry already there (read by this pass, then claimed by it as idle: reading the other
    partitions took longer than claim_idle_ms) is done once."""
    for entry_id, fields in entries:
        jobs = groups.setdefault((p, _field(fields, "session")), [])
        if all(_str(e) != _str(entry_id) for e, _, _ in jobs):
            jobs.append((entry_id, fields, claimed))


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


def _str(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _field(fields: Any, name: str) -> str:
    for k, v in (fields or {}).items():
        if _str(k) == name:
            return _str(v)
    return ""


def mask_url(url: str) -> str:
    """The URL with its password (if any) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _describe(exc: BaseException) -> str:
    """'Type: message' (redis-py's repr of its errors omits the message)."""
    return f"{type(exc).__name__}: {exc}"[:500]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and any extra fields."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        data = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        data.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        if record.exc_info:
            data["traceback"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
