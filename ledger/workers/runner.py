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

No job holds the loop: the jobs read run in job threads beside it (at most
``max_in_flight`` in hand, those of one session in order), kept from looking idle while
they run; the loop goes on reading into the free slots, sweeping, claiming and beating.
At a stop it reads nothing more and gives the jobs in hand ``drain_seconds``; a job
still running then stays pending for another worker (see ``Worker.run``).

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

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import ParamSpec, TypeVar

from ledger import health
from ledger.client import Ledger
from ledger.errors import ConfigurationError, translated
from ledger.workers import compactors
from ledger.workers.calls import LedgerCalls
from ledger.workers.delivery import Delivery
from ledger.workers.jobs import CompactionDeferred, JobOutcome, Jobs
from ledger.workers.leases import Leases, next_round
from ledger.workers.logs import MESSAGES, JsonFormatter, Troubles, mask_url
from ledger.workers.metrics import FleetIndicators, Metrics, Observer
from ledger.workers.settings import WorkerSettings
from ledger.workers.streams import (
    EVERY_PARTITION,
    Groups,
    JobStreams,
    Readers,
    ReadResult,
    Takeover,
    collect,
)
from ledger.workers.trouble import WHOLE_PASS, Backoff, kind_of

# The names other modules, the tests and the docs import from here.
__all__ = [
    "Worker",
    "WorkerSettings",
    "Metrics",
    "FleetIndicators",
    "JobOutcome",
    "CompactionDeferred",
    "MESSAGES",
    "JsonFormatter",
    "mask_url",
    "next_round",
]

log = logging.getLogger("ledger.worker")

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
    """The worker loop. Its parts, each built with what it uses: ``streams`` (the job
    streams and their reads), ``takeover`` (claims of idle jobs), ``delivery`` (running
    each job read), ``jobs`` (the job kinds), ``leases`` (lease sweeps and cluster checks),
    ``observer`` (the metrics passes) and ``troubles`` (the errors it survives)."""

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
        self.calls = LedgerCalls(ledger)
        self.partitions = self.calls.partitions
        self.beat: float | None = None  # monotonic time the job loop last turned
        self.stopping = False  # the loop ended: draining, then gone
        self.signals: list[str] = []  # the signals received (the CLI's handler adds them)
        self.redis_ok = False  # Redis answered the loop's last pass
        self.one_node = self.calls.one_node  # one server: one command names every partition
        self.blocking = self.calls.blocking  # blocking reads (the embedded backend polls)
        self.on_cluster = self.calls.on_cluster
        self._last_sweep = 0.0
        self._last_health = float("-inf")
        self._health_said: tuple[str, ...] | None = None
        # The parts, each built with what it uses (none holds the worker).
        calls, s, m = self.calls, self.settings, self.metrics
        self.troubles = Troubles(m)
        self.streams = JobStreams(calls, s, m, self.troubles)
        self.takeover = Takeover(self.streams, s, m, self.troubles)
        self.jobs = Jobs(calls, s, self.compactor)
        self.delivery = Delivery(self.streams, self.jobs, calls, s, m, self.troubles)
        self.leases = Leases(calls, s, m, self.troubles)
        self.observer = Observer(calls, self.streams, s, m)

    def close(self) -> None:
        """Stop the job threads and the async compactors' event loop."""
        self.delivery.close()
        self.jobs.close()

    # --- the parts' public steps ---------------------------------------------------------

    def stream(self, partition: int) -> str:
        return self.streams.stream(partition)

    def dead_letter(self, partition: int) -> str:
        return self.streams.dead_letter(partition)

    def ensure_group(self, partition: int) -> None:
        """Make the partition's stream and group (see ``JobStreams.ensure_group``)."""
        self.streams.ensure_group(partition)

    def ensure_groups(self) -> None:
        """Every partition's stream and group (see ``JobStreams.ensure_groups``)."""
        self.streams.ensure_groups()

    def leave_groups(self, stale_ms: int = 86_400_000) -> int:
        """At a clean stop, leave the groups (see ``JobStreams.leave_groups``)."""
        return self.streams.leave_groups(stale_ms)

    @_ledger_errors
    def poll_once(self) -> int:
        """One pass over every partition: new jobs, then jobs idle too long elsewhere,
        done before it returns (``--once``, tests; the loop hands jobs over and goes on).

        The jobs read are run up to ``max_in_flight`` at once, those of one session one
        after the other, in the order read (a 2 s summarizer does not hold up the
        fleet's other sessions). A Redis error in one partition is counted and logged and
        the pass goes on with the next (an unreachable server or an ACL refusal ends the
        pass: it is raised); a job stream found missing is reported and its group made
        again. Returns the number of jobs done."""
        return self.delivery.run_groups(self.gather(None))

    def gather(self, limit: int | None) -> Groups:
        """New jobs of each partition, then jobs idle too long elsewhere: at most
        ``limit`` in all (None: up to ``batch`` a partition), by session. A Redis error in
        one partition is handled as ``poll_once`` says."""
        groups: Groups = {}
        failed = set()
        left = limit
        for p in self.partitions:
            if left is not None and left <= 0:
                return groups
            try:
                got = self.streams.read_partition(p, left and min(left, self.settings.batch))
                collect(groups, p, got, claimed=False)
                left = None if left is None else left - len(got)
            except Exception as exc:
                failed.add(p)
                self.streams.partition_trouble(p, exc)
        self.takeover.claim_into(groups, skip=failed, every=True, limit=left)
        return groups

    @_ledger_errors
    def take_over(self, every: bool = False, partitions: list[int] | None = None) -> int:
        """Jobs left pending longer than ``claim_idle_ms`` (by a worker that died, or a
        failed attempt): claimed and done. Returns the number done. Only partitions whose
        stream holds an entry are looked at, unless ``every``: an entry deleted while
        pending (its job done, by a worker that died before acknowledging it) is no
        longer in its stream, and is acknowledged by the claim that finds it. Given
        ``partitions``, only those are looked at."""
        return self.delivery.run_groups(self.claimed(every, partitions, None))

    def claimed(self, every: bool, partitions: list[int] | None, limit: int | None) -> Groups:
        """Jobs idle too long elsewhere, claimed (at most ``limit``), by session."""
        groups: Groups = {}
        self.takeover.claim_into(groups, skip=set(), every=every, only=partitions, limit=limit)
        return groups

    def handle(self, job_id: str, fields: Mapping[str, str]) -> JobOutcome:
        """Run one job (see ``Jobs.handle``)."""
        return self.jobs.handle(job_id, fields)

    @_ledger_errors
    def sweep(self, partitions: list[int] | None = None) -> int:
        """Release expired leases (see ``Leases.sweep``)."""
        return self.leases.sweep(partitions)

    def check(self, partitions: Iterable[int], swept: bool = False) -> int:
        """Cluster: check partitions (see ``Leases.check``)."""
        return self.leases.check(partitions, swept)

    @property
    def check_every(self) -> float:
        """Cluster: seconds between two checks of one partition (see ``Leases``)."""
        return self.leases.check_every

    def tallies(self) -> dict[str, int]:
        """The fleet's indicators (see ``Observer.tallies``)."""
        return self.observer.tallies()

    @_ledger_errors
    def observe(self) -> None:
        """One metrics pass (see ``Observer.observe``)."""
        self.observer.observe()

    # --- health and the loop ---------------------------------------------------------------

    def check_redis(self) -> health.HealthReport:
        """Check the Redis settings the ledger needs; log a warning when what is wrong
        changes (and at the first check), set ``ledger_redis_config_ok``."""
        report = self.calls.check_health()
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

    def health(self, stale_s: float) -> tuple[bool, bool, str]:
        """(healthy, ready, why) for /healthz and /readyz. Healthy (live): the job loop
        turned within ``stale_s`` seconds; jobs run beside it, so a busy worker is live.
        Ready: live, started, not stopping, and Redis answered the loop's last pass (the
        loop's own commands; a job's failure is not Redis's). ``why`` says which."""
        jobs = self.delivery.in_flight()
        if self.beat is None:
            return True, False, "starting: the job loop has not turned yet"
        age = time.monotonic() - self.beat
        turned = f"the job loop turned {age:.1f} s ago, {jobs} jobs in flight"
        if age > stale_s:
            return (
                False,
                False,
                f"the job loop has not turned for {age:.1f} s ({jobs} jobs in flight)",
            )
        if self.stopping:
            return True, False, f"stopping: no new job is taken; {turned}"
        if not self.redis_ok:
            kind = self.troubles.last_kind or "error"
            return True, False, f"Redis did not answer the job loop's last pass ({kind}); {turned}"
        return True, True, f"ok: Redis answered the job loop's last pass; {turned}"

    def run(self, stop: threading.Event, once: bool = False) -> None:
        """The job loop: reads new jobs and hands them to job threads (at most
        ``max_in_flight`` in hand), takes over idle ones, sweeps leases, checks Redis's
        settings, and beats (``health``). No job holds it: it waits for jobs, its timers
        or a free slot, never for a job to end. Once ``stop`` is set it takes no job,
        and drains: the jobs running get ``drain_seconds`` to end, what is left stays
        pending for another worker (the log names it)."""
        s = self.settings
        backoff = Backoff(s.backoff_initial, max(s.backoff_initial, s.backoff_max))
        self.troubles.troubled = False
        self.stopping = False
        self.delivery.stop_event = stop
        self.delivery.stopping = False  # (a worker run again after a stop)
        log.info(
            "worker starting",
            extra={
                "url": mask_url(self.ledger.settings.redis_url or ""),
                "prefix": self.ledger.settings.prefix,
                "partitions": len(self.partitions),
                "compactor": s.compactor or f"{type(self.compactor).__name__} (in code)",
                "max_in_flight": s.max_in_flight,
                "drain_seconds": s.drain_seconds,
                "consumer": s.consumer,
                "group": s.group,
            },
        )
        for p in self.partitions:  # a partition whose group is not made is tried each pass
            try:
                self.ensure_group(p)
            except Exception as exc:
                self.troubles.survive(exc, "start")
                if kind_of(exc) in WHOLE_PASS:
                    break
        self.troubles.guard(self.check_redis, "health")
        self._last_health = time.monotonic()
        log.info(
            "worker started",
            extra={"consumer": self.settings.consumer, "partitions": len(self.partitions)},
        )
        last_claim = float("-inf")
        observer = None
        if s.metrics_port and not once:
            observer = threading.Thread(
                target=self.observer.loop, args=(stop,), name="ledger-observe", daemon=True
            )
            observer.start()
        # A dead worker's job waits < 1.25 claim_idle_ms on one server (one XREAD finds
        # the partitions to claim from); on a cluster < claim_idle_ms + check_every.
        claim_every = s.claim_idle_ms / 4000
        claims = 0
        readers = Readers(self.streams, self.calls, s) if self.on_cluster and not once else None
        slices = self.leases.slices(time.monotonic()) if readers is not None else []
        taken: list[int] = []  # partitions whose readers' results were taken
        down_since: float | None = None  # when the loop last found Redis not answering
        last_renew = float("-inf")
        while not stop.is_set():
            self.troubles.troubled = False
            now = time.monotonic()
            self.beat = now  # the job loop is turning (what /healthz reads)
            if now - self._last_health >= s.health_interval:
                self._last_health = now
                self.troubles.guard(self.check_redis, "health")
            if readers is not None:
                take = functools.partial(self.take_over, False)
                self.leases.checked(now, slices, self.sweep, take)
            elif now - self._last_sweep >= s.sweep_interval:
                self._last_sweep = now
                self.troubles.guard(self.sweep, "sweep")
            if readers is not None:
                readers.again(taken)  # after the backoff, if any
                taken = []
            if now - last_renew >= claim_every:
                last_renew = now
                self.troubles.guard(self.delivery.renew, "renew")
            free = self.delivery.free()
            worked: object = 0
            if once:
                worked = self.troubles.guard(self.poll_once, "poll")  # new jobs, then stuck ones
            elif not (self.blocking or readers):
                worked = self.troubles.guard(
                    functools.partial(self.handed, functools.partial(self.gather, free), free),
                    "poll",
                )
            else:
                if readers is None and now - last_claim >= claim_every and free > 0:
                    last_claim = now
                    # every 16th time, each partition: entries pending without a body
                    every = not self.one_node or claims % EVERY_PARTITION == 0
                    claims += 1
                    claim = functools.partial(self.claimed, every, None, free)
                    got = self.troubles.guard(
                        functools.partial(self.handed, claim, free), "take over"
                    )
                    free -= int(got or 0)  # type: ignore[call-overload]
                    if free <= 0:  # as many as there were slots: more may wait, claim again
                        last_claim = float("-inf")
                timers = [self._last_health + s.health_interval, last_renew + claim_every]
                if readers is None:
                    timers += [self._last_sweep + s.sweep_interval, last_claim + claim_every]
                else:
                    timers += [*self.leases.next_check.values(), *self.leases.due.values()]
                wait = max(0.001, min(timers) - time.monotonic())
                claim_due = readers is None and time.monotonic() - last_claim >= claim_every
                if free <= 0 or claim_due:
                    # Every slot taken: wait for one (or a timer), read nothing. A claim
                    # due goes first: jobs a dead worker left wait longest already.
                    self.delivery.wait_free(wait)
                elif readers is None:
                    read = functools.partial(self._read_blocking, wait, free)
                    worked = self.troubles.guard(functools.partial(self.handed, read, free), "poll")
                else:
                    got_read = readers.take(wait)
                    taken = [p for p, _ in got_read]
                    worked = self.troubles.guard(
                        functools.partial(
                            self.handed, functools.partial(self._results, got_read), free
                        ),
                        "poll",
                    )
            self.redis_ok = not self.troubles.troubled or self.troubles.redis_ok_despite_trouble()
            if not self.redis_ok and down_since is None:
                down_since = time.monotonic()
            elif self.redis_ok and down_since is not None:
                log.warning(
                    "Redis answers again",
                    extra={"down_seconds": round(time.monotonic() - down_since, 1)},
                )
                down_since = None
            self.metrics.redis_up.set(1 if self.redis_ok else 0)
            self.metrics.heartbeat.set(time.time())
            self.metrics.in_flight.set(self.delivery.in_flight())
            if once:
                break
            if self.troubles.troubled:
                stop.wait(backoff.next())
            else:
                backoff.reset()
                if not worked and not (self.blocking or readers):
                    stop.wait(s.poll_interval)
        self.stopping = True
        if readers is not None:
            readers.close()
        self._drain()
        if observer is not None:
            observer.join(self.settings.observe_interval + 5)
        left = self.troubles.guard(self.leave_groups, "leave") if not once else 0
        log.info("worker stopped", extra={"consumer": self.settings.consumer, "left": left})

    def _read_blocking(self, block: float, count: int) -> Groups:
        """New jobs (``JobStreams.read_blocking``); a stream found missing: a read of
        each partition (``gather``), which reports the loss and makes the group again."""
        got = self.streams.read_blocking(block, count)
        return self.gather(count) if got is None else got

    def _results(self, got: list[tuple[int, ReadResult]]) -> Groups:
        groups: Groups = {}
        self.streams.read_results(got, groups)
        return groups

    def handed(self, read: Callable[[], Groups], free: int) -> int:
        """Read jobs (``read``, at most ``free``) and hand them to the job threads;
        returns how many. A read that ends after the stop began hands nothing over: its
        jobs stay pending, their delivery uncounted, for another worker."""
        groups = read()
        return self.delivery.submit(groups)

    def _drain(self) -> None:
        """At a stop: no job starts; those running get ``drain_seconds``; what is still
        running then is left pending (said in the log, by job id)."""
        in_flight = self.delivery.in_flight()
        log.info(
            "worker stopping: no new job is taken; draining the jobs in flight",
            extra={
                "signal": self.signals[0] if self.signals else None,
                "in_flight": in_flight,
                "drain_seconds": self.settings.drain_seconds,
            },
        )
        started = time.monotonic()
        left = self.delivery.drain(self.settings.drain_seconds)
        if left:
            log.warning(
                "jobs still running at the drain deadline are left pending: another worker "
                "takes them over after claim_idle_ms",
                extra={"jobs": left, "drain_seconds": self.settings.drain_seconds},
            )
        else:
            log.info(
                "jobs in flight drained",
                extra={"in_flight": in_flight, "seconds": round(time.monotonic() - started, 2)},
            )
