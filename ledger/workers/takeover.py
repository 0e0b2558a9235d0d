"""Taking over jobs left pending longer than ``claim_idle_ms`` (by a worker that died, or
after a failed attempt): XAUTOCLAIM in the partitions whose stream holds an entry (one
XREAD finds them on one server), every partition every ``EVERY_PARTITION``-th time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ledger import schema
from ledger.workers.streams import Groups, collect
from ledger.workers.trouble import WHOLE_PASS, kind_of

if TYPE_CHECKING:
    from ledger.workers.runner import Worker

EVERY_PARTITION = 16  # every how many takeover checks all partitions are claimed from


class Takeover:
    """A worker's claims of idle jobs."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker

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
        try:
            candidates = (
                only
                if only is not None
                else list(self.w.partitions)
                if every
                else self.with_entries()
            )
        except Exception as exc:  # the check failed: look at every partition
            kind = kind_of(exc)
            if kind is None or kind in WHOLE_PASS:
                raise
            self.w.troubles.met(kind, exc, where="take over")
            candidates = list(self.w.partitions)
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
                self.w.streams.partition_trouble(p, exc)

    def with_entries(self) -> list[int]:
        """Partitions whose job stream holds an entry (done jobs are deleted: an entry
        is a job waiting or pending): one XREAD over every stream on one server, every
        partition on a cluster."""
        if not self.w.one_node:
            return list(self.w.partitions)
        streams: dict[Any, Any] = {self.w.streams.stream(p): "0-0" for p in self.w.partitions}
        got: Any = self.w.ledger.client.xread(streams, count=1)
        return sorted(self.w.streams.partition_of[schema.text(stream)] for stream, _ in got or [])

    def claim_partition(self, p: int, limit: int | None = None) -> list[tuple[Any, Any]]:
        """A partition's jobs idle too long elsewhere (taken over), at most ``limit``."""
        s, client, out = self.w.settings, self.w.ledger.client, []
        stream = self.w.streams.stream(p)
        auto: Any = client.xautoclaim(
            stream,
            s.group,
            s.consumer,
            s.claim_idle_ms,
            start_id="0-0",
            count=min(s.batch, limit or s.batch),
        )
        for entry_id, fields in auto[1]:
            if fields is None:  # deleted while pending (Redis 6.2; 7 drops them itself)
                client.xack(stream, s.group, entry_id)
                continue
            self.w.metrics.takeovers.inc()
            out.append((entry_id, fields))
        return out
