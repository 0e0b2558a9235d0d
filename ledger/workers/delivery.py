"""Running the jobs read: those of one session one after the other, up to
``max_in_flight`` sessions at once; each job acknowledged and deleted when done, left
pending (its delivery uncounted) when Redis could not serve it or its session's turn
stayed open, recorded when it failed, and dead-lettered after ``max_deliveries``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis.exceptions as rex

from ledger import schema
from ledger.workers.jobs import CompactionDeferred, JobEffect
from ledger.workers.logs import describe
from ledger.workers.streams import Groups
from ledger.workers.trouble import TRANSIENT, kind_of

if TYPE_CHECKING:
    from ledger.workers.runner import Worker

log = logging.getLogger("ledger.worker")


class Delivery:
    """A worker's job threads and the life of each job it reads."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.pool = ThreadPoolExecutor(worker.settings.max_in_flight, "ledger-job")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def run_groups(self, groups: Groups) -> int:
        """Run the jobs read, those of one session one after the other."""
        if not groups:
            return 0
        done = 0
        if len(groups) == 1 or self.w.settings.max_in_flight == 1:
            for (p, _), jobs in groups.items():
                try:
                    done += self.deliver_all(p, jobs)
                except Exception as exc:
                    self.w.streams.partition_trouble(p, exc)
            return done
        futures = {
            self.pool.submit(self.deliver_all, p, jobs): p for (p, _), jobs in groups.items()
        }
        whole: BaseException | None = None
        for fut, p in futures.items():
            try:
                done += fut.result()
            except Exception as exc:
                try:
                    self.w.streams.partition_trouble(p, exc)
                except Exception as again:
                    whole = whole or again
        if whole is not None:
            raise whole
        return done

    def deliver_all(self, p: int, jobs: list[tuple[bytes | str, Any, bool]]) -> int:
        """Do one session's jobs in order. When Redis trouble ends the run, the jobs
        after the one that met it were read (their delivery counted) but not tried: each
        gets its count back, so that an outage does not push them to the dead letters."""
        done = 0
        for i, (eid, fields, claimed) in enumerate(jobs):
            try:
                done += self.deliver(p, eid, fields, claimed=claimed)
            except Exception:
                for rest, _, was_claimed in jobs[i + 1 :]:
                    self.uncount_untried(p, schema.text(rest), was_claimed)
                raise
        return done

    def uncount_untried(self, p: int, eid: str, claimed: bool) -> None:
        """Take back the delivery a read (or a claim) counted for a job never tried."""
        deliveries = 1
        if claimed:  # a claim counted one more than the attempts before it
            with contextlib.suppress(rex.RedisError):
                s, stream = self.w.settings, self.w.streams.stream(p)
                info = self.w.ledger.client.xpending_range(stream, s.group, eid, eid, 1)
                deliveries = int(info[0]["times_delivered"]) if info else 1
        self.uncount(self.w.streams.stream(p), eid, deliveries)

    def deliver(
        self,
        partition: int,
        entry_id: bytes | str,
        raw: Mapping[bytes | str, bytes | str],
        claimed: bool,
    ) -> int:
        s, client, stream = self.w.settings, self.w.ledger.client, self.w.streams.stream(partition)
        eid = schema.text(entry_id)
        fields = {schema.text(k): schema.text(v) for k, v in raw.items()}
        kind = fields.get(schema.JOB_KIND, "?")
        deliveries = 1
        if claimed:
            info = client.xpending_range(stream, s.group, min=eid, max=eid, count=1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            self.w.metrics.retried.inc()
            if deliveries > s.max_deliveries:
                self.bury(partition, eid, fields, f"delivered {deliveries} times")
                return 0
        started = time.monotonic()
        try:
            outcome = self.w.handle(eid, fields)
        except CompactionDeferred as exc:
            # Not a failure: the session's turn is still running. The job stays pending
            # (its delivery uncounted, so it is never dead-lettered for it) for a claim.
            self.uncount(stream, eid, deliveries)
            self.w.metrics.deferred.inc()
            log.info("job deferred", extra={"job": eid, "kind": kind, "why": str(exc)})
            return 0
        except Exception as exc:
            trouble = kind_of(exc)
            if trouble in TRANSIENT:
                # Redis could not serve the job now: not a failure of the job. It stays
                # pending, this delivery uncounted, for a later claim.
                self.uncount(stream, eid, deliveries)
                if trouble != "oom":
                    raise  # the partition's pass ends here
                # Out of memory: the next job may need no memory, or free some.
                self.w.troubles.met(trouble, exc, partition=partition, job=eid)
                return 0
            # The job's own failure: it stays pending; a later claim retries it.
            self.w.metrics.failed.labels(kind).inc()
            log.warning(
                "job failed",
                extra={"job": eid, "kind": kind, "error": describe(exc)},
                exc_info=exc if trouble is None else None,  # not a Redis error: show where
            )
            error = repr(exc)[:500]  # the job's value in the errors hash (schema.JOB_ERROR)
            try:
                client.hset(self.w.streams.errors_hash(partition), eid, error)
            except Exception as rec:
                if kind_of(rec) is None:
                    raise
                self.w.troubles.met(kind_of(rec) or "redis", rec, partition=partition, job=eid)
            return 0
        # Delete before acknowledging: a crash in between leaves a pending entry whose
        # body is gone, which the next claim acknowledges (the other order would leave
        # an acknowledged entry in the stream for ever). compact.lua deleted it already.
        client.xdel(stream, eid)
        client.xack(stream, s.group, eid)
        if claimed:  # an earlier attempt may have recorded an error
            client.hdel(self.w.streams.errors_hash(partition), eid)
        took = time.monotonic() - started
        self.w.metrics.processed.labels(kind).inc()
        self.w.metrics.duration.labels(kind).observe(took)
        if outcome.effect == JobEffect.SKIPPED:
            self.w.metrics.skipped.labels(kind).inc()
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

    def uncount(self, stream: str, eid: str, deliveries: int) -> None:
        """Give a pending entry back the delivery count it had before this delivery
        (XCLAIM RETRYCOUNT to itself), so that Redis trouble does not dead-letter it.
        Best effort: with Redis unreachable the count stays one higher."""
        with contextlib.suppress(rex.RedisError):
            self.w.ledger.client.xclaim(
                stream,
                self.w.settings.group,
                self.w.settings.consumer,
                min_idle_time=0,
                message_ids=[eid],
                retrycount=max(0, deliveries - 1),
                justid=True,
            )

    def bury(self, partition: int, eid: str, fields: dict[str, str], why: str) -> None:
        client, s = self.w.ledger.client, self.w.settings
        errors = self.w.streams.errors_hash(partition)
        last = client.hget(errors, eid)
        entry = schema.DeadLetterEntry(fields, job=eid, why=why, error=schema.text(last or ""))
        client.xadd(
            self.w.streams.dead_letter(partition),
            entry.to_fields(),  # type: ignore[arg-type]
            maxlen=s.dead_letter_max,
            approximate=True,
        )
        client.xdel(self.w.streams.stream(partition), eid)
        client.xack(self.w.streams.stream(partition), s.group, eid)
        client.hdel(errors, eid)
        self.w.metrics.dead.inc()
        kind = fields.get(schema.JOB_KIND)
        log.error("job dead-lettered", extra={"job": eid, "kind": kind, "why": why})
