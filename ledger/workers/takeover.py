"""Taking over jobs left pending longer than ``claim_idle_ms`` (by a worker that died, or
after a failed attempt): XAUTOCLAIM in the partitions whose stream holds an entry (one
XREAD finds them on one server), every partition every ``EVERY_PARTITION``-th time."""

from __future__ import annotations

from ledger.workers.logs import Troubles
from ledger.workers.metrics import Metrics
from ledger.workers.settings import WorkerSettings
from ledger.workers.streams import Entry, Groups, JobStreams, collect
from ledger.workers.trouble import WHOLE_PASS, kind_of

EVERY_PARTITION = 16  # every how many takeover checks all partitions are claimed from


class Takeover:
    """A worker's claims of idle jobs."""

    def __init__(
        self,
        streams: JobStreams,
        settings: WorkerSettings,
        metrics: Metrics,
        troubles: Troubles,
    ) -> None:
        self.streams = streams
        self.settings = settings
        self.metrics = metrics
        self.troubles = troubles

    def claim_into(
        self,
        groups: Groups,
        skip: set[int],
        every: bool,
        only: list[int] | None = None,
        limit: int | None = None,
    ) -> None:
        """Claim idle jobs into ``groups``: at most ``limit`` (None: up to ``batch`` a
        partition; the loop claims no more than it has free slots for)."""
        if limit is not None and limit <= 0:
            return
        partitions = self.streams.partitions
        try:
            candidates = (
                only
                if only is not None
                else list(partitions)
                if every
                else self.streams.with_entries()
            )
        except Exception as exc:  # the check failed: look at every partition
            kind = kind_of(exc)
            if kind is None or kind in WHOLE_PASS:
                raise
            self.troubles.met(kind, exc, where="take over")
            candidates = list(partitions)
        for p in candidates:
            if p in skip:
                continue
            if limit is not None and limit <= 0:
                return
            try:
                got = self.claim_partition(p, limit)
                collect(groups, p, got, claimed=True)
                limit = None if limit is None else limit - len(got)
            except Exception as exc:
                self.streams.partition_trouble(p, exc)

    def claim_partition(self, p: int, limit: int | None = None) -> list[Entry]:
        """A partition's jobs idle too long elsewhere (taken over), at most ``limit``."""
        batch = self.settings.batch
        out = self.streams.autoclaim(p, min(batch, limit or batch))
        self.metrics.takeovers.inc(len(out))
        return out
