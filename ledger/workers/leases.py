"""Lease expiry and, on a cluster, the partition checks: the sweep that releases
expired reservations and rolls back lapsed turns, and the timers that tell, on a
cluster, when each partition's first lease is due and where a job waits to be taken
over (``worker_check.lua``, the partitions checked in slices spread over
``check_every``)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable

from ledger.workers.calls import LedgerCalls
from ledger.workers.logs import Troubles
from ledger.workers.metrics import Metrics
from ledger.workers.settings import WorkerSettings
from ledger.workers.trouble import WHOLE_PASS, kind_of


class Leases:
    """A worker's lease sweeps and cluster checks."""

    def __init__(
        self,
        calls: LedgerCalls,
        settings: WorkerSettings,
        metrics: Metrics,
        troubles: Troubles,
    ) -> None:
        self.calls = calls
        self.partitions = calls.partitions
        self.settings = settings
        self.metrics = metrics
        self.troubles = troubles
        self.due: dict[int, float] = {}  # cluster: partition -> when its first lease is due
        self.idle: set[int] = set()  # cluster: partitions holding a job to take over
        self.next_check: dict[int, float] = {}  # cluster: slice -> when it is checked next

    def sweep(self, partitions: list[int] | None = None) -> int:
        """Release expired leases in every partition (or those given); a Redis error in
        one partition is counted and the sweep goes on (an unreachable server or an ACL
        refusal ends it)."""
        released = 0
        for p in self.with_leases() if partitions is None else partitions:
            try:
                reservations, turns = self.calls.sweep_partition(p)
                released += reservations + turns
                self.metrics.rolled_back.inc(turns)
            except Exception as exc:
                kind = kind_of(exc)
                if kind is None or kind in WHOLE_PASS:
                    raise
                self.troubles.met(kind, exc, partition=p, where="sweep")
        self.metrics.expired.inc(released)
        return released

    def with_leases(self) -> list[int]:
        """Partitions whose deadline index exists (see ``LedgerCalls.partitions_with_leases``)."""
        return self.calls.partitions_with_leases()

    def check(self, partitions: Iterable[int], swept: bool = False) -> int:
        """Cluster: read each partition's earliest lease deadline and whether a job there
        is idle ``claim_idle_ms`` (``worker_check.lua``, one call each), and remember
        them. A partition left overdue by a sweep (``swept``) is swept again after
        ``sweep_interval``; one whose check fails is swept and claimed from as if due.
        Returns the number checked."""
        s, n = self.settings, 0
        for p in partitions:
            try:
                got = self.calls.check_partition(p, s.group, s.claim_idle_ms)
                due, idle = got.due_ms, got.idle
            except Exception as exc:
                kind = kind_of(exc)
                if kind is None or kind in WHOLE_PASS:
                    raise
                self.troubles.met(kind, exc, partition=p, where="check")
                due, idle = (None if swept else 0), True
            now = time.monotonic()
            if due is None:
                self.due.pop(p, None)
            else:
                self.due[p] = now + (s.sweep_interval if swept and due == 0 else due / 1000)
            if idle:
                self.idle.add(p)
            else:
                self.idle.discard(p)
            n += 1
        return n

    @property
    def check_every(self) -> float:
        """Cluster: seconds between two checks of one partition, max(claim_idle_ms,
        partitions / cluster_checks)."""
        s = self.settings
        return max(s.claim_idle_ms / 1000, len(self.partitions) / s.cluster_checks)

    def slices(self, now: float) -> list[list[int]]:
        """Cluster: the partitions cut into about one slice per second of
        ``check_every``, each slice checked in turn, the first now and the others spread
        over the interval, so that checks come at an even rate instead of in bursts."""
        every, parts = self.check_every, self.partitions
        n = max(1, min(len(parts), math.ceil(every)))
        slices = [list(parts[k::n]) for k in range(n)]
        self.next_check = {k: now + every * k / n for k in range(n)}
        return slices

    def checked(
        self,
        now: float,
        slices: list[list[int]],
        sweep: Callable[[list[int]], int],
        take_over: Callable[[list[int]], int],
    ) -> None:
        """Cluster: check the slices whose turn has come (a slice whose round fails is
        tried again next pass); sweep (``sweep``) the partitions whose first lease is due
        and check them again; claim and run (``take_over``) where a job is idle."""
        for k, at in list(self.next_check.items()):
            if at <= now and self.troubles.guard(functools.partial(self.check, slices[k]), "check"):
                self.next_check[k] = next_round(at, now, self.check_every)
        due = sorted(p for p, at in self.due.items() if at <= now)
        if due:
            self.troubles.guard(functools.partial(sweep, due), "sweep")
            self.troubles.guard(functools.partial(self.check, due, swept=True), "check")
        if self.idle:
            idle, self.idle = sorted(self.idle), set()
            self.troubles.guard(functools.partial(take_over, idle), "take over")


def next_round(at: float, now: float, every: float) -> float:
    """The first time after ``now`` in the cycle ``at + k * every`` (k >= 1): a slice
    checked late, or after rounds missed in an outage, keeps its place in the cycle, so
    the slices stay spread instead of falling due together."""
    return at + every * max(1, math.floor((now - at) / every) + 1)
