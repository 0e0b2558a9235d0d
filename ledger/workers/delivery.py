"""Running the jobs read, beside the job loop: those of one session one after the other,
up to ``max_in_flight`` jobs at once, each in a job thread of its own (a sync compactor
runs there; an async one as a task on the worker's event loop, the thread waiting for
it). The loop hands jobs over (``submit``) and goes on reading, sweeping, heartbeating and
taking over: no job holds it. Each job is acknowledged and deleted when done, left
pending (its delivery uncounted) when Redis could not serve it or its session's turn
stayed open, recorded when it failed, and dead-lettered after ``max_deliveries`` (a
compaction's death committed as a failed compaction first, see ``bury``). At a stop
(``drain``) no job starts any more; those running get a deadline, and what is not done
by then stays pending for another worker to take over."""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis.exceptions as rex

from ledger import schema
from ledger.errors import OperationIdReused, StaleEpoch, UnknownSession
from ledger.models import JobKind
from ledger.workers.calls import LedgerCalls
from ledger.workers.jobs import JobDeferred, JobEffect, Jobs
from ledger.workers.logs import Troubles, describe
from ledger.workers.metrics import Metrics
from ledger.workers.settings import WorkerSettings
from ledger.workers.streams import EntryId, Fields, Groups, JobStreams
from ledger.workers.trouble import TRANSIENT, kind_of

log = logging.getLogger("ledger.worker")


@dataclass
class Batch:
    """Jobs handed over by a caller that waits for them (``run_groups``: ``poll_once``,
    ``take_over``): how many are left, how many were done, the first error that ends a
    pass (Redis unreachable, an ACL refusal, a bug), raised to that caller."""

    left: int
    done: int = 0
    error: BaseException | None = None
    finished: threading.Event = field(default_factory=threading.Event)


@dataclass
class Entry:
    """A job read and handed over, not yet started."""

    partition: int
    eid: EntryId
    fields: Fields
    claimed: bool
    batch: Batch | None


class Delivery:
    """A worker's job threads and the life of each job it reads."""

    def __init__(
        self,
        streams: JobStreams,
        jobs: Jobs,
        calls: LedgerCalls,
        settings: WorkerSettings,
        metrics: Metrics,
        troubles: Troubles,
    ) -> None:
        self.streams = streams
        self.jobs = jobs
        self.calls = calls
        self.settings = settings
        self.metrics = metrics
        self.troubles = troubles
        self.bound = settings.max_in_flight
        self.lock = threading.Condition()
        # Jobs handed over and not started, by (partition, session); a session here has a
        # job thread on it, or waits in `waiting` for one.
        self.sessions: dict[tuple[int, str], collections.deque[Entry]] = {}
        self.waiting: collections.deque[tuple[int, str]] = collections.deque()
        self.threads = 0  # job threads alive (at most `bound`)
        self.idle = 0  # of which waiting for a session
        self.busy = 0  # of which on a session
        self.accepted = 0  # jobs handed over and not finished: what `free` counts
        # Jobs by 'p<partition>:<entry id>' (an entry id is unique in its stream only):
        self.running: dict[str, str] = {}  # those running -> kind, for the drain's log
        self.held: dict[str, tuple[int, str]] = {}  # every job in hand -> (partition, id)
        self.stopping = False  # the drain deadline passed: no job starts any more
        self.stop_event: threading.Event | None = None  # the loop's stop (set by Worker.run)

    def close(self) -> None:
        """Nothing to wait for: job threads are daemons (a job still running at exit stays
        pending in the stream, for a takeover)."""

    def halted(self) -> bool:
        """No job is read any more: the loop's stop is set (by a signal: at once) or the
        drain ended."""
        return self.stopping or (self.stop_event is not None and self.stop_event.is_set())

    def in_job_thread(self) -> bool:
        return self.troubles.in_job_thread()

    def free(self) -> int:
        """How many more jobs the loop may read now (max_in_flight minus those in hand)."""
        with self.lock:
            return 0 if self.halted() else max(0, self.bound - self.accepted)

    def in_flight(self) -> int:
        with self.lock:
            return self.accepted

    def wait_free(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a slot (a job finishing)."""
        with self.lock:
            self.lock.wait_for(lambda: self.accepted < self.bound or self.halted(), timeout)

    def submit(self, groups: Groups, batch: Batch | None = None) -> int:
        """Hand the jobs read over to job threads, those of one session after the jobs of
        that session already in hand; returns how many. After ``drain`` began, nothing
        is taken: the jobs are given back (pending, their delivery uncounted). The loop
        reads no more once its stop is set (``free`` is 0): a read under way then is
        the last."""
        n = sum(len(jobs) for jobs in groups.values())
        if n == 0:
            return 0
        with self.lock:
            if not self.stopping:
                for (p, sid), jobs in groups.items():
                    queue = self.sessions.get((p, sid))
                    if queue is None:
                        queue = self.sessions[(p, sid)] = collections.deque()
                        self.waiting.append((p, sid))
                    for e, f, c in jobs:
                        if ref(p, e) in self.held:  # in hand already (claimed again)
                            n -= 1
                            continue
                        self.held[ref(p, e)] = (p, schema.text(e))
                        queue.append(Entry(p, e, f, c, batch))
                self.accepted += n
                if batch is not None:
                    batch.left = n
                    if n == 0:
                        batch.finished.set()
                self._start()
                return n
        for (p, _), jobs in groups.items():
            for eid, _, claimed in jobs:
                self.uncount_untried(p, schema.text(eid), claimed)
        if batch is not None:
            batch.finished.set()
        return 0

    def _start(self) -> None:
        """(lock held) Wake an idle job thread for the waiting sessions, or start one, up
        to the bound. The threads stay (daemons, idle between jobs): starting a thread
        per job costs a scheduling round on a loaded host."""
        if not self.waiting:
            return
        wanted = len(self.waiting) - self.idle
        while wanted > 0 and self.threads < self.bound:
            self.threads += 1
            self.idle += 1  # (counted idle until it takes a session)
            wanted -= 1
            threading.Thread(target=self._work, name="ledger-job", daemon=True).start()
        self.lock.notify_all()

    def _work(self) -> None:
        self.troubles.job_threads.job = True  # (see Troubles.in_job_thread)
        while True:
            with self.lock:
                self.lock.wait_for(lambda: bool(self.waiting) and not self.stopping)
                key = self.waiting.popleft()
                self.idle -= 1
                self.busy += 1
            try:
                self._session(key)
            finally:
                with self.lock:
                    self.busy -= 1
                    self.idle += 1
                    self.lock.notify_all()

    def _session(self, key: tuple[int, str]) -> None:
        """Do one session's jobs in order, those handed over meanwhile too. When Redis
        trouble ends the run (or a stop begins), the jobs not tried get their delivery
        back, so that an outage does not push them to the dead letters."""
        while True:
            with self.lock:
                queue = self.sessions[key]
                if not queue or self.stopping:
                    rest = list(queue)
                    del self.sessions[key]
                    break
                entry = queue.popleft()
                eid = schema.text(entry.eid)
                self.running[ref(entry.partition, eid)] = field_text(entry.fields, schema.JOB_KIND)
            done, failed = 0, False
            try:
                done = self.deliver(entry.partition, entry.eid, entry.fields, entry.claimed)
            except BaseException as exc:  # (not only Exception: the thread must not vanish)
                failed = True
                self._trouble(entry, exc)
            finally:
                self._finished(entry, done)
            if failed:
                with self.lock:
                    rest = list(self.sessions.pop(key))
                break
        for e in rest:
            self.uncount_untried(e.partition, schema.text(e.eid), e.claimed)
            self._finished(e, 0)

    def _finished(self, entry: Entry, done: int) -> None:
        with self.lock:
            self.running.pop(ref(entry.partition, entry.eid), None)
            self.held.pop(ref(entry.partition, entry.eid), None)
            self.accepted -= 1
            self.lock.notify_all()
            batch = entry.batch
            if batch is not None:
                batch.done += done
                batch.left -= 1
                if batch.left <= 0:
                    batch.finished.set()

    def _trouble(self, entry: Entry, exc: BaseException) -> None:
        """Redis trouble (or a bug) that ended a session's run: counted and logged as in a
        pass; what would end a pass goes to a waiting caller, if any."""
        try:
            if not isinstance(exc, Exception):
                raise exc
            self.streams.partition_trouble(entry.partition, exc)
        except BaseException as whole:
            batch = entry.batch
            if batch is not None:
                with self.lock:
                    batch.error = batch.error or whole
            elif isinstance(whole, Exception):
                self.troubles.survive(whole, "job")
            else:
                log.error(
                    "job thread interrupted", extra={"job": schema.text(entry.eid)}, exc_info=whole
                )

    def renew(self) -> None:
        """Keep the jobs in hand from looking idle: XCLAIM ... JUSTID to this consumer
        (their delivery count unchanged) resets each one's idle time, so that neither
        this worker's takeover nor another's claims a job that is only slow. Called by
        the loop every claim_idle_ms / 4."""
        with self.lock:
            by: dict[int, list[str]] = {}
            for p, eid in self.held.values():
                by.setdefault(p, []).append(eid)
        for p, eids in by.items():
            self.streams.renew(p, eids)

    def run_groups(self, groups: Groups) -> int:
        """Run the jobs read and wait for them (``poll_once``, ``take_over``, ``--once``):
        returns the number done; raises what ended a pass (see ``Batch``)."""
        n = sum(len(jobs) for jobs in groups.values())
        if n == 0:
            return 0
        batch = Batch(n)
        self.submit(groups, batch)
        batch.finished.wait()
        if batch.error is not None:
            raise batch.error
        return batch.done

    def drain(self, deadline: float) -> list[str]:
        """At a stop (the loop reads nothing more once its stop is set): wait up to
        ``deadline`` seconds for the jobs in hand; then no job starts any more (those
        handed over and not started are given back: pending, their delivery uncounted).
        Returns the ids of the jobs still running then (left pending in the stream:
        another worker takes them over after claim_idle_ms)."""
        with self.lock:
            self.lock.wait_for(lambda: self.busy == 0 and not self.waiting, max(0.0, deadline))
            self.stopping = True
            given: list[Entry] = []
            for key in list(self.waiting):
                given.extend(self.sessions.pop(key, ()))
            self.waiting.clear()
        for e in given:
            self.uncount_untried(e.partition, schema.text(e.eid), e.claimed)
            self._finished(e, 0)
        with self.lock:
            return sorted(self.running)

    def uncount_untried(self, p: int, eid: str, claimed: bool) -> None:
        """Take back the delivery a read (or a claim) counted for a job never tried."""
        deliveries = 1
        if claimed:  # a claim counted one more than the attempts before it
            with contextlib.suppress(rex.RedisError):
                deliveries = self.streams.deliveries(p, eid)
        self.streams.uncount(p, eid, deliveries)

    def deliver(
        self,
        partition: int,
        entry_id: EntryId,
        raw: Fields,
        claimed: bool,
    ) -> int:
        s, streams = self.settings, self.streams
        eid = schema.text(entry_id)
        fields = {schema.text(k): schema.text(v) for k, v in raw.items()}
        kind = fields.get(schema.JOB_KIND, "?")
        deliveries = 1
        if claimed:
            deliveries = streams.deliveries(partition, eid)
            self.metrics.retried.inc()
            if deliveries > s.max_deliveries:
                return self.bury(partition, eid, fields, f"delivered {deliveries} times")
        if not claimed:  # from its enqueueing (the entry id's time, Redis's clock) to now
            waited = time.time() - int(eid.split("-", 1)[0]) / 1000
            self.metrics.queue_wait.labels(kind).observe(max(0.0, waited))
        started = time.monotonic()
        try:
            outcome = self.jobs.handle(eid, fields)
        except JobDeferred as exc:
            # Not a failure: the session's turn is still running (a compaction waits to
            # commit, a hard reset is staged for its end). The job stays pending
            # (its delivery uncounted, so it is never dead-lettered for it) for a claim.
            streams.uncount(partition, eid, deliveries)
            self.metrics.deferred.inc()
            log.info("job deferred", extra={"job": eid, "kind": kind, "why": str(exc)})
            return 0
        except Exception as exc:
            trouble = kind_of(exc)
            if trouble in TRANSIENT:
                # Redis could not serve the job now: not a failure of the job. It stays
                # pending, this delivery uncounted, for a later claim.
                streams.uncount(partition, eid, deliveries)
                if trouble != "oom":
                    raise  # the partition's pass ends here
                # Out of memory: the next job may need no memory, or free some.
                self.troubles.met(trouble, exc, partition=partition, job=eid)
                return 0
            # The job's own failure: it stays pending; a later claim retries it.
            self.metrics.failed.labels(kind).inc()
            log.warning(
                "job failed",
                extra={"job": eid, "kind": kind, "error": describe(exc)},
                exc_info=exc if trouble is None else None,  # not a Redis error: show where
            )
            error = repr(exc)[:500]  # the job's value in the errors hash (schema.JOB_ERROR)
            try:
                streams.record_error(partition, eid, error)
            except Exception as rec:
                if kind_of(rec) is None:
                    raise
                self.troubles.met(kind_of(rec) or "redis", rec, partition=partition, job=eid)
            return 0
        # (compact.lua deleted a compaction's entry already)
        streams.done(partition, eid, claimed)
        took = time.monotonic() - started
        self.metrics.processed.labels(kind).inc()
        self.metrics.duration.labels(kind).observe(took)
        if outcome.effect == JobEffect.SKIPPED:
            self.metrics.skipped.labels(kind).inc()
        log.info(
            "job done",
            extra={
                "job": eid,
                "kind": kind,
                "session": fields.get(schema.JOB_SESSION),
                "effect": outcome.effect,
                "duration_ms": round(took * 1000, 1),
            },
        )
        return 1

    def bury(self, partition: int, eid: str, fields: dict[str, str], why: str) -> int:
        """Dead-letter a job delivered ``max_deliveries`` times. A compaction's death is
        first committed as a failed compaction (``fail_compaction``): a dead letter never
        leaves its session waiting for a compaction nobody will make. While the session's
        turn is open that commit is staged (``staged``): it is judged, and counted, when the
        session's next turn begins."""
        counted = self.fail_compaction(eid, fields)
        last = self.streams.last_error(partition, eid)
        if counted:
            why += f"; counted as a failed compaction ({counted})"
        entry = schema.DeadLetterEntry(fields, job=eid, why=why, error=last)
        self.streams.bury(partition, eid, entry)
        self.metrics.dead.inc()
        kind = fields.get(schema.JOB_KIND)
        log.error(
            "job dead-lettered",
            extra={"job": eid, "kind": kind, "session": fields.get(schema.JOB_SESSION), "why": why},
        )
        return 0

    def fail_compaction(self, eid: str, fields: Mapping[str, str]) -> str:
        """A compaction job that died (its compactor raised, or its commit failed, every
        delivery) is a failed compaction: committed as one through ``compact.lua`` with
        nothing replaced, under the job's entry id and epoch. The script judges it as any
        attempt: counted towards ``max_failed_compactions`` (the next attempt enqueued, or
        at the maximum the hard reset), or, if the session fell back under its mark
        meanwhile, a compaction that holds (nothing more due). Returns the outcome, or ''
        when there was nothing to commit (not a compaction, a malformed entry, the session
        gone, another incarnation, an agent-compacted session, the epoch moved on)."""
        try:
            job = schema.JobEntry.from_fields(fields)
        except (KeyError, ValueError):
            return ""
        if job.kind != JobKind.COMPACT:
            return ""
        keys = self.calls.session_keys(job.session)
        try:
            snap = self.calls.snapshot(keys)
            if not self.jobs.same_incarnation(snap, job) or snap.raw.get(schema.AGENT_COMPACTS):
                return ""
            if snap.epoch != job.epoch:
                return ""
            done = self.calls.compact(keys, f"job-{eid}", job.epoch, [], None, job=eid)
        except (StaleEpoch, UnknownSession, OperationIdReused):
            return ""
        log.warning(
            "dead compaction counted as a failed compaction",
            extra={
                "job": eid,
                "session": job.session,
                "outcome": str(done.outcome),
                "failures": done.failures,
                "escalated": done.escalated,
            },
        )
        return str(done.outcome)


def ref(partition: int, entry_id: EntryId) -> str:
    """A job's reference across partitions, as ``ledger dead`` writes it: 'p<N>:<id>'."""
    return f"p{partition}:{schema.text(entry_id)}"


def field_text(fields: Fields | None, name: str) -> str:
    for k, v in (fields or {}).items():
        if schema.text(k) == name:
            return schema.text(v)
    return "?"
