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
A compaction job's entry is deleted by ``compact.lua`` in the same step as its
effect, so it applies once for its whole life in the stream, even when taken over
after the op retention; a hard-reset job needs no such check (a reset at epoch e
moves the session to e + 1, so the job, fenced at e, can apply only once).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.exceptions as rex
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledger import protocol
from ledger.client import Ledger
from ledger.errors import (
    BackendUnavailable,
    LedgerError,
    OperationIdReused,
    StaleEpoch,
    UnknownSession,
)
from workers import compactors

log = logging.getLogger("ledger.worker")


class WorkerSettings(BaseSettings):
    """Worker options, from ``LEDGER_WORKER_*`` environment variables or flags."""

    model_config = SettingsConfigDict(env_prefix="LEDGER_WORKER_", frozen=True, extra="forbid")

    group: str = "ledger-workers"
    consumer: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    poll_interval: float = Field(default=0.1, gt=0, description="seconds to sleep when idle")
    claim_idle_ms: int = Field(default=5_000, ge=10, description="take over jobs idle this long")
    max_deliveries: int = Field(default=5, ge=1, description="then dead-letter the job")
    batch: int = Field(default=16, ge=1, le=1000)
    sweep_interval: float = Field(default=1.0, gt=0, description="seconds between lease sweeps")
    compactor: str = "workers.compactors:simulated"
    metrics_port: int = Field(default=0, ge=0, le=65535, description="0: no metrics endpoint")


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
        self.indicator = Gauge(
            "ledger_indicator",
            "Seeds' leading indicators, summed over sessions",
            ["name"],
            registry=r,
        )
        self.skipped = Counter(
            "ledger_jobs_skipped",
            "Jobs acknowledged without running: session gone, or a hard reset requested",
            ["kind"],
            registry=r,
        )


@dataclass
class JobOutcome:
    kind: str
    effect: str  # applied | already | skipped


class Worker:
    def __init__(
        self, ledger: Ledger, settings: WorkerSettings | None = None, metrics: Metrics | None = None
    ) -> None:
        self.ledger = ledger
        self.settings = settings or WorkerSettings()
        self.metrics = metrics or Metrics()
        self.compactor = compactors.load(self.settings.compactor)
        self.partitions = range(ledger.keyspace.partitions)
        self._last_sweep = 0.0

    # --- streams ---------------------------------------------------------------------

    def stream(self, partition: int) -> str:
        return self.ledger.keyspace.jobs(partition)

    def dead_letter(self, partition: int) -> str:
        return f"{self.ledger.keyspace.tag(partition)}:dead"

    def ensure_groups(self) -> None:
        for p in self.partitions:
            try:
                self.ledger.client.xgroup_create(
                    self.stream(p), self.settings.group, id="0", mkstream=True
                )
            except rex.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def poll_once(self) -> int:
        """One pass over every partition: new jobs, then jobs idle too long elsewhere."""
        s, client, done = self.settings, self.ledger.client, 0
        for p in self.partitions:
            stream = self.stream(p)
            try:
                got: Any = client.xreadgroup(s.group, s.consumer, {stream: ">"}, count=s.batch)
            except rex.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                # The stream was deleted (a flush, a restart without persistence) and a
                # script made it anew: make the group again and read it next pass.
                self.ensure_groups()
                continue
            for _, entries in got or []:
                for entry_id, fields in entries:
                    done += self._deliver(p, entry_id, fields, claimed=False)
            auto: Any = client.xautoclaim(
                stream, s.group, s.consumer, s.claim_idle_ms, start_id="0-0", count=s.batch
            )
            claimed = auto[1]
            for entry_id, fields in claimed:
                if fields is None:  # deleted while pending
                    client.xack(stream, s.group, entry_id)
                    continue
                self.metrics.takeovers.inc()
                done += self._deliver(p, entry_id, fields, claimed=True)
        return done

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
        if claimed:
            info = client.xpending_range(stream, s.group, min=eid, max=eid, count=1)
            deliveries = int(info[0]["times_delivered"]) if info else 1
            self.metrics.retried.inc()
            if deliveries > s.max_deliveries:
                self._bury(partition, eid, fields, f"delivered {deliveries} times")
                return 0
        try:
            outcome = self.handle(eid, fields)
        except BackendUnavailable:
            raise
        except Exception as exc:  # the job stays pending; a later claim retries it
            self.metrics.failed.labels(kind).inc()
            log.warning("job failed", extra={"job": eid, "kind": kind, "error": repr(exc)})
            fields["error"] = repr(exc)[:500]
            client.hset(f"{self.ledger.keyspace.tag(partition)}:errors", eid, fields["error"])
            return 0
        # Delete before acknowledging: a crash in between leaves a pending entry whose
        # body is gone, which the next claim acknowledges (the other order would leave
        # an acknowledged entry in the stream for ever). compact.lua deleted it already.
        client.xdel(stream, eid)
        client.xack(stream, s.group, eid)
        if claimed:  # an earlier attempt may have recorded an error
            client.hdel(f"{self.ledger.keyspace.tag(partition)}:errors", eid)
        self.metrics.processed.labels(kind).inc()
        if outcome.effect == "skipped":
            self.metrics.skipped.labels(kind).inc()
        log.info(
            "job done",
            extra={
                "job": eid,
                "kind": kind,
                "session": fields.get("session"),
                "effect": outcome.effect,
            },
        )
        return 1

    def _bury(self, partition: int, eid: str, fields: dict[str, str], why: str) -> None:
        client, s = self.ledger.client, self.settings
        errors = f"{self.ledger.keyspace.tag(partition)}:errors"
        last = client.hget(errors, eid)
        entry: dict[Any, Any] = {
            **fields,
            "job": eid,
            "why": why,
            "error": (last.decode() if isinstance(last, bytes) else str(last or "")),
        }
        client.xadd(self.dead_letter(partition), entry)
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
        if snap.raw.get("rq"):
            # Failed compactions escalated: a hard reset is coming, which drops what a
            # compaction would replace. Running the compactor again would only count
            # failures past the maximum.
            return JobOutcome("compact", "skipped")
        items = tuple(self.ledger.items(sid))
        plan = self.compactor(
            compactors.CompactionRequest(
                sid, epoch, snap.turn, items, snap.occupancy, snap.high_water_mark, snap.window
            )
        )
        # The job's entry id goes with the call: compact.lua deletes the entry with the
        # effect, and answers 'already' when it is gone (committed before, by a worker
        # that died before acknowledging it), whatever the op retention.
        call = protocol.compact(
            keys, f"job-{job_id}", epoch, plan.replaced, plan.summary, job=job_id
        )
        try:
            done = self.ledger.run(call)
        except (StaleEpoch, UnknownSession, OperationIdReused):
            return JobOutcome("compact", "already")
        return JobOutcome("compact", "already" if done.outcome == "already" else "applied")

    # --- leases, metrics, loop ---------------------------------------------------------

    def sweep(self) -> int:
        released = sum(self.ledger.expire_due(p) for p in self.partitions)
        self.metrics.expired.inc(released)
        return released

    def observe(self) -> None:
        """Refresh lag gauges and the seeds' leading indicators (a SCAN: not every poll)."""
        client, s = self.ledger.client, self.settings
        for p in self.partitions:
            for g in client.xinfo_groups(self.stream(p)):
                name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
                if name == s.group:
                    self.metrics.lag.labels(str(p)).set(int(g.get("lag") or 0))
                    self.metrics.pending.labels(str(p)).set(int(g.get("pending") or 0))
        totals: dict[str, int] = {}
        for sid in self.ledger.session_ids():
            raw = client.hgetall(self.ledger.keyspace.session(sid).session)
            for k, v in raw.items():
                name = k.decode() if isinstance(k, bytes) else k
                if name.startswith("x:") and name != "x:last_reset":
                    totals[name[2:]] = totals.get(name[2:], 0) + int(v)
        for name, value in totals.items():
            self.metrics.indicator.labels(name).set(value)

    def run(self, stop: threading.Event, once: bool = False) -> None:
        self.ensure_groups()
        log.info(
            "worker started",
            extra={"consumer": self.settings.consumer, "partitions": len(self.partitions)},
        )
        last_observe = 0.0
        while not stop.is_set():
            try:
                now = time.monotonic()
                if now - self._last_sweep >= self.settings.sweep_interval:
                    self.sweep()
                    self._last_sweep = now
                if self.settings.metrics_port and now - last_observe >= 15:
                    self.observe()
                    last_observe = now
                worked = self.poll_once()
            except (BackendUnavailable, rex.ConnectionError, rex.TimeoutError) as exc:
                log.warning("redis unavailable", extra={"error": repr(exc)})
                worked = 0
            except LedgerError as exc:
                log.error("ledger error", extra={"error": repr(exc)})
                worked = 0
            if once:
                break
            if not worked:
                stop.wait(self.settings.poll_interval)
        log.info("worker stopped", extra={"consumer": self.settings.consumer})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, message and any extra fields."""

    _skip = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        data.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        return json.dumps(data, default=str)
