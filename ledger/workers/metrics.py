"""The worker's Prometheus metrics (``Metrics``, in their own registry) and the metrics
pass that refreshes the gauges read from Redis (``Observer``: lag, pending and dead
letters per partition, and on the one worker holding the observer lease the fleet's
indicators, ``FleetIndicators``, and the budget scopes' ceilings, ``ScopeMetrics``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ledger._version import __version__
from ledger.errors import translated
from ledger.extras import missing
from ledger.workers.calls import LedgerCalls
from ledger.workers.logs import describe
from ledger.workers.settings import WorkerSettings
from ledger.workers.trouble import kind_of

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # the worker's metrics: the `worker` extra
    raise missing("prometheus-client", "worker", "the ledger worker") from exc

if TYPE_CHECKING:  # (streams.py imports this module)
    from ledger.models import ScopeUsage
    from ledger.workers.streams import JobStreams

log = logging.getLogger("ledger.worker")


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


# ledger_scope_*{quantity}: a ScopeUsage's quantity -> the label, and the divisor to its unit
SCOPE_QUANTITIES = {
    "input": ("input", 1),
    "output": ("output", 1),
    "cached_input": ("cached_input", 1),
    "tokens": ("tokens", 1),
    "money": ("cents", 1_000_000),  # stored in micro-cents, exported in cents
}


class ScopeMetrics(Collector):
    """The budget scopes (docs/ceilings.md) as the observer lease's holder last read them:
    ``ledger_scope_remaining{scope,quantity}`` and ``ledger_scope_ceiling{scope,quantity}``
    for each ceiling set (quantity ``input``, ``output``, ``cached_input``, ``tokens``, or
    ``cents``), ``ledger_scope_refused_total{scope}`` (the scope's refusals, kept in its
    hash), and ``ledger_scopes{state}``: how many were ``exported`` by name and how many
    ``folded``. At most ``scope_metrics_max`` scopes are exported by name, tenants first, then the
    scopes within them, each set by name; the refusals of the others are summed under
    ``scope="other"`` (no remaining or ceiling: a sum of those would mean nothing). Every
    other worker exports no sample (``values`` None)."""

    def __init__(self) -> None:
        self.values: list[ScopeUsage] | None = None  # the scopes exported by name
        self.folded = 0  # how many scopes past the limit
        self.other_refused = 0  # their refusals, summed

    @staticmethod
    def order(names: Sequence[str]) -> list[str]:
        """Which scopes are exported first: tenants, then the scopes within them."""
        return sorted(names, key=lambda n: ("/" in n, n))

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "ledger_scope_remaining",
                "What is left under a budget scope's ceiling in its current window "
                "(tokens; quantity cents: money), by scope and quantity",
                labels=["scope", "quantity"],
            ),
            GaugeMetricFamily(
                "ledger_scope_ceiling",
                "A budget scope's ceiling for its window (tokens; quantity cents: money)",
                labels=["scope", "quantity"],
            ),
            GaugeMetricFamily(
                "ledger_scopes",
                "Budget scopes found: exported by name, or folded into scope='other'",
                labels=["state"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        remaining, ceiling, count = self._families()
        refused = CounterMetricFamily(
            "ledger_scope_refused",
            "Reservations a budget scope refused (CeilingReached), by scope; those of the "
            "scopes past the export limit summed under scope='other'",
            labels=["scope"],
        )
        if self.values is not None:
            for u in self.values:
                for q, left in sorted(u.remaining.items()):
                    label, unit = SCOPE_QUANTITIES[q]
                    remaining.add_metric([u.scope, label], left / unit)
                    ceiling.add_metric([u.scope, label], u.ceilings.get(q, 0) / unit)
                refused.add_metric([u.scope], u.refused)
            if self.folded:
                refused.add_metric(["other"], self.other_refused)
            count.add_metric(["exported"], len(self.values))
            count.add_metric(["folded"], self.folded)
        yield from (remaining, ceiling, refused, count)


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
        self.queue_wait = Histogram(
            "ledger_job_queue_wait_seconds",
            "Time a job waited before it started, from its enqueueing (its stream entry's "
            "time) to a job thread taking it up; first deliveries only",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.in_flight = Gauge(
            "ledger_jobs_in_flight",
            "Jobs this worker has in hand (running or waiting for their session's previous "
            "job), at most max_in_flight",
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
        self.scopes = ScopeMetrics()
        r.register(self.scopes)
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
            "Jobs left pending for a later claim because the session's turn was open: a "
            "compaction past turn_wait, a hard reset staged for the turn's end",
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


class Observer:
    """A worker's metrics passes, in a thread of their own (with ``metrics_port``)."""

    def __init__(
        self, calls: LedgerCalls, streams: JobStreams, settings: WorkerSettings, metrics: Metrics
    ) -> None:
        self.calls, self.streams, self.settings, self.metrics = calls, streams, settings, metrics
        self.scope_names: list[str] | None = None  # the last search's, on the lease holder
        self.scanned = 0.0  # when (time.monotonic())
        self.damaged: list[str] = []  # scopes whose hash did not read, at the last pass

    def lease(self) -> bool:
        """Whether this worker keeps the fleet's indicators for the next pass: one worker
        at a time does (SET NX PX, renewed by its holder), so a sum over workers counts
        each change once. A dead holder's lease lapses after three passes."""
        ms = int(self.settings.observe_interval * 3000)
        return self.calls.observer_lease(self.settings.consumer, ms)

    def loop(self, stop: threading.Event) -> None:
        """The metrics passes, every observe_interval, in their own thread: a slow Redis
        never holds up a job, a lease or SIGTERM."""
        while not stop.is_set():
            try:
                with translated():
                    self.observe()
            except Exception as exc:  # counted and logged; the job loop is not disturbed
                kind = kind_of(exc) or "internal"
                self.metrics.errors.labels(kind).inc()
                log.warning(
                    "metrics pass failed; the next one runs on schedule",
                    extra={"where": "observe", "kind": kind, "error": describe(exc)},
                )
            stop.wait(self.settings.observe_interval)

    def tallies(self) -> dict[str, int]:
        """The fleet's indicators (see ``LedgerCalls.tallies``)."""
        return self.calls.tallies()

    def observe(self) -> None:
        """Refresh the lag and dead-letter gauges; on the observer lease's holder, read
        the fleet's indicators from the partitions' tallies (no session is read)."""
        for p in self.streams.partitions:
            lag, pending = self.streams.lag_and_pending(p)
            self.metrics.lag.labels(str(p)).set(lag)
            self.metrics.pending.labels(str(p)).set(pending)
            self.metrics.dead_depth.labels(str(p)).set(self.streams.dead_letters_depth(p))
        held = self.lease()
        self.metrics.observer.set(1 if held else 0)
        self.metrics.indicators.values = self.tallies() if held else None
        if held and self.settings.scope_metrics_max:
            self.scopes()
        else:
            self.metrics.scopes.values = None

    def scopes(self) -> None:
        """Read the budget scopes for ``ScopeMetrics``: the scopes are searched for (one
        SCAN with a MATCH on their key prefix) at most every scope_scan_interval; at every
        pass the first scope_metrics_max of them are read whole (HGETALL and ZRANGE each,
        pipelined), and of the others only their refusals (one HGET each, pipelined)."""
        s, now, m = self.settings, time.monotonic(), self.metrics.scopes
        if self.scope_names is None or now - self.scanned >= s.scope_scan_interval:
            self.scope_names = m.order(self.calls.scope_names())
            self.scanned = now
        cap = s.scope_metrics_max
        shown, rest = self.scope_names[:cap], self.scope_names[cap:]
        damaged: dict[str, str] = {}
        values = self.calls.scope_usages(shown, damaged)
        other = self.calls.scope_refusals(rest)
        changed = len(rest) != m.folded or sorted(damaged) != self.damaged
        if changed and (rest or damaged):  # logged once each time the set changes
            log.warning(
                "budget scopes not exported by name: folded past scope_metrics_max, or damaged",
                extra={"folded": len(rest), "scope_metrics_max": cap, "damaged": damaged},
            )
        self.damaged = sorted(damaged)
        m.values, m.folded, m.other_refused = values, len(rest), other
