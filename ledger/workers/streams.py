"""The job streams: one per partition, shared by the workers through one consumer
group. Their names, the group made (and made again when a stream is lost), a worker's
consumer removed at a clean stop, the reads of new jobs (one XREADGROUP over every
stream on one server, a reader thread per partition on a cluster: ``Readers``), the jobs
left pending longer than ``claim_idle_ms`` (by a worker that died, or after a failed
attempt) taken over (``Takeover``: XAUTOCLAIM in the partitions whose stream holds an
entry, one XREAD finds them on one server, every partition every ``EVERY_PARTITION``-th
time), and the jobs read grouped by session (``collect``)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Mapping
from typing import cast

import redis.exceptions as rex
from redis.cluster import RedisCluster

from ledger import backends, schema
from ledger.errors import translated
from ledger.workers.calls import LedgerCalls
from ledger.workers.logs import Troubles, describe
from ledger.workers.metrics import Metrics
from ledger.workers.settings import WorkerSettings
from ledger.workers.trouble import WHOLE_PASS, kind_of

log = logging.getLogger("ledger.worker")
# A stream entry as redis-py reads it (bytes, or str with decode_responses).
EntryId = bytes | str
Fields = Mapping[bytes | str, bytes | str]
Entry = tuple[EntryId, Fields]
# The jobs read, by (partition, session): (entry id, fields, claimed), in order.
Groups = dict[tuple[int, str], list[tuple[EntryId, Fields, bool]]]
# What a cluster reader brought from a partition: its entries, or the error it met.
ReadResult = list[Entry] | BaseException


def entries_of(reply: object) -> list[Entry]:
    """The entries of an XREADGROUP reply over one stream (None: nothing new)."""
    got = cast(list[tuple[EntryId, list[Entry]]] | None, reply)
    return [entry for _, entries in got or [] for entry in entries]


class JobStreams:
    """A worker's view of the partitions' job streams, their consumer group, their
    errors hashes and dead-letter streams: every stream command the worker sends is
    sent from here."""

    def __init__(
        self,
        calls: LedgerCalls,
        settings: WorkerSettings,
        metrics: Metrics,
        troubles: Troubles,
    ) -> None:
        self.client = calls.client
        self.keyspace = calls.keyspace
        self.partitions = calls.partitions
        self.one_node = calls.one_node
        self.socket_timeout = calls.settings.socket_timeout
        self.settings = settings
        self.metrics = metrics
        self.troubles = troubles
        self.partition_of = {self.stream(p): p for p in self.partitions}
        self.groups: set[int] = set()  # partitions whose group this worker made or saw

    def stream(self, partition: int) -> str:
        return self.keyspace.jobs(partition)

    def dead_letter(self, partition: int) -> str:
        return self.keyspace.dead_letters(partition)

    def errors_hash(self, partition: int) -> str:
        return self.keyspace.job_errors(partition)

    def ensure_group(self, partition: int) -> None:
        """Make the partition's stream and group (nothing if the group exists); raises
        what Redis answers otherwise (e.g. OOM)."""
        try:
            self.client.xgroup_create(
                self.stream(partition), self.settings.group, id="0", mkstream=True
            )
        except rex.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.groups.add(partition)

    def leave_groups(self, stale_ms: int = 86_400_000) -> int:
        """At a clean stop: remove this worker's consumer from each partition's group when
        it holds no pending job, and any other consumer idle for `stale_ms` that holds
        none (a worker that stopped long ago); a consumer with pending jobs stays, so
        that they can be claimed. Returns the consumers removed; raises the ledger's
        errors (run() logs them: a stop never fails for it)."""
        client, s, removed = self.client, self.settings, 0
        with translated():
            for p in self.partitions:
                try:
                    consumers = client.xinfo_consumers(self.stream(p), s.group)
                except rex.ResponseError as exc:
                    if "no such key" in str(exc).lower() or "NOGROUP" in str(exc):
                        continue  # the stream or its group is gone: nothing to tidy
                    raise
                for c in consumers:
                    name = schema.text(c["name"])
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

    def stream_lost(self, partition: int, exc: BaseException) -> None:
        """NOGROUP: the stream, or its group, is gone. Say so loudly once per loss (the
        jobs in it may be lost); the caller makes the group again (on a stream a script
        has made anew since, the group starts at its first entry)."""
        self.metrics.errors.labels("nogroup").inc()
        if partition in self.groups:
            self.groups.discard(partition)
            self.metrics.streams_lost.inc()
            log.warning(
                "job stream lost: the stream or its consumer group is gone (a DEL, FLUSHDB, "
                "eviction, or a restart without persistence); jobs it held may be lost with "
                "it; making the group again",
                extra={
                    "stream": self.stream(partition),
                    "partition": partition,
                    "kind": "nogroup",
                    "error": describe(exc),
                },
            )

    def partition_trouble(self, p: int, exc: BaseException) -> None:
        """A Redis error met in one partition: counted and logged; NOGROUP reported as a
        lost stream and the group made again. A bug, Redis unreachable or an ACL
        refusal is raised."""
        kind = "nogroup" if stream_gone(exc) else kind_of(exc)
        if kind is None or kind in WHOLE_PASS:
            raise exc
        if kind != "nogroup":
            self.troubles.met(kind, exc, partition=p)
            return
        self.stream_lost(p, exc)
        try:
            self.ensure_group(p)
        except Exception as again:
            kind = kind_of(again)
            if kind is None or kind in WHOLE_PASS:
                raise
            self.troubles.met(kind, again, partition=p)  # made on a later pass

    # --- reads of new jobs -------------------------------------------------------------------

    def read_partition(self, p: int, count: int | None = None) -> list[Entry]:
        """New jobs of a partition (no wait), at most ``count`` (default ``batch``)."""
        s = self.settings
        if p not in self.groups:  # not made yet (e.g. Redis was out of memory at start)
            self.ensure_group(p)
        got = self.client.xreadgroup(
            s.group, s.consumer, {self.stream(p): ">"}, count=count or s.batch
        )
        return entries_of(got)

    def read_blocking(self, block: float, count: int) -> Groups | None:
        """Wait up to ``block`` seconds for new jobs in any partition, at most ``count``,
        with one XREADGROUP ... BLOCK over every partition's stream. Returns the jobs
        read, by session; None when a stream or group was found missing (the caller then
        reads each partition, ``Worker.gather``, which reports the loss and makes the
        group again)."""
        s = self.settings
        streams: dict[str, str] = {self.stream(p): ">" for p in self.partitions}
        ms = max(1, int(1000 * min(block, s.block, self.socket_timeout / 2)))
        try:
            reply = self.client.xreadgroup(
                s.group,
                s.consumer,
                streams,  # type: ignore[arg-type]
                count=per_stream(count, len(streams), s.batch),
                block=ms,
            )
        except rex.ResponseError as exc:
            if not stream_gone(exc):
                raise
            return None
        got = cast(list[tuple[EntryId, list[Entry]]] | None, reply)
        groups: Groups = {}
        for stream, entries in got or []:
            collect(groups, self.partition_of[schema.text(stream)], entries, claimed=False)
        return groups

    def read_results(self, got: list[tuple[int, ReadResult]], groups: Groups) -> None:
        """The jobs the cluster's readers brought, added to ``groups``; a reader's error
        is handled as in a pass (an unreachable server or an ACL refusal raised once)."""
        whole: BaseException | None = None
        for p, result in got:
            if not isinstance(result, BaseException):
                collect(groups, p, result, claimed=False)
                continue
            try:
                self.partition_trouble(p, result)
            except Exception as exc:
                whole = whole or exc
        if whole is not None:
            raise whole

    # --- jobs idle elsewhere -----------------------------------------------------------------

    def with_entries(self) -> list[int]:
        """Partitions whose job stream holds an entry (done jobs are deleted: an entry
        is a job waiting or pending): one XREAD over every stream on one server, every
        partition on a cluster."""
        if not self.one_node:
            return list(self.partitions)
        streams = {self.stream(p): "0-0" for p in self.partitions}
        reply = self.client.xread(streams, count=1)  # type: ignore[arg-type]
        got = cast(list[tuple[EntryId, list[Entry]]] | None, reply)
        return sorted(self.partition_of[schema.text(stream)] for stream, _ in got or [])

    def autoclaim(self, p: int, count: int) -> list[Entry]:
        """A partition's jobs idle ``claim_idle_ms`` elsewhere, claimed by this consumer
        (XAUTOCLAIM), at most ``count``; an entry deleted while pending (its job done by a
        worker that died before acknowledging it) is acknowledged, not returned."""
        s, stream = self.settings, self.stream(p)
        reply = self.client.xautoclaim(
            stream, s.group, s.consumer, s.claim_idle_ms, start_id="0-0", count=count
        )
        auto = cast(tuple[EntryId, list[tuple[EntryId, Fields | None]]], reply)
        out: list[Entry] = []
        for entry_id, fields in auto[1]:
            if fields is None:  # deleted while pending (Redis 6.2; 7 drops them itself)
                self.client.xack(stream, s.group, entry_id)
                continue
            out.append((entry_id, fields))
        return out

    def renew(self, p: int, eids: list[str]) -> None:
        """Reset the idle time of jobs in hand (XCLAIM ... JUSTID to this consumer, their
        delivery count unchanged)."""
        s = self.settings
        stream = self.stream(p)
        self.client.xclaim(stream, s.group, s.consumer, 0, eids, justid=True)  # type: ignore[arg-type]

    # --- one job's life ----------------------------------------------------------------------

    def deliveries(self, p: int, eid: str) -> int:
        """How many times the job has been delivered (XPENDING; 1 if not pending)."""
        info = self.client.xpending_range(self.stream(p), self.settings.group, eid, eid, 1)
        return int(info[0]["times_delivered"]) if info else 1

    def uncount(self, p: int, eid: str, deliveries: int) -> None:
        """Give a pending entry back the delivery count it had before this delivery
        (XCLAIM RETRYCOUNT to itself), so that Redis trouble does not dead-letter it.
        Best effort: with Redis unreachable the count stays one higher."""
        with contextlib.suppress(rex.RedisError):
            self.client.xclaim(
                self.stream(p),
                self.settings.group,
                self.settings.consumer,
                min_idle_time=0,
                message_ids=[eid],
                retrycount=max(0, deliveries - 1),
                justid=True,
            )

    def record_error(self, p: int, eid: str, error: str) -> None:
        """The job's last error, in the partition's errors hash (schema.JOB_ERROR)."""
        self.client.hset(self.errors_hash(p), eid, error)

    def done(self, p: int, eid: str, claimed: bool) -> None:
        """A job done: its entry deleted, then acknowledged (a crash in between leaves a
        pending entry whose body is gone, which the next claim acknowledges; the other
        order would leave an acknowledged entry in the stream for ever), and its error
        recorded by an earlier attempt removed."""
        stream, group = self.stream(p), self.settings.group
        self.client.xdel(stream, eid)
        self.client.xack(stream, group, eid)
        if claimed:  # an earlier attempt may have recorded an error
            self.client.hdel(self.errors_hash(p), eid)

    def last_error(self, p: int, eid: str) -> str:
        return schema.text(self.client.hget(self.errors_hash(p), eid) or "")

    def bury(self, p: int, eid: str, entry: schema.DeadLetterEntry) -> None:
        """A job moved to the partition's dead letters (XADD, capped at
        ``dead_letter_max``), then deleted, acknowledged and its error removed."""
        s, stream = self.settings, self.stream(p)
        self.client.xadd(
            self.dead_letter(p),
            entry.to_fields(),  # type: ignore[arg-type]
            maxlen=s.dead_letter_max,
            approximate=True,
        )
        self.client.xdel(stream, eid)
        self.client.xack(stream, s.group, eid)
        self.client.hdel(self.errors_hash(p), eid)

    # --- what the metrics pass reads ---------------------------------------------------------

    def lag_and_pending(self, p: int) -> tuple[int, int]:
        """The group's lag and pending count on the partition's stream (0, 0 when the
        stream is gone: the next poll reports it and makes it again)."""
        try:
            groups = self.client.xinfo_groups(self.stream(p))
        except rex.ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            return 0, 0
        for g in groups:
            if schema.text(g["name"]) == self.settings.group:
                return int(g.get("lag") or 0), int(g.get("pending") or 0)
        return 0, 0

    def dead_letters_depth(self, p: int) -> int:
        return int(self.client.xlen(self.dead_letter(p)))


# --- taking over jobs idle elsewhere ----------------------------------------------------

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


def per_stream(free: int, streams: int, batch: int) -> int:
    """COUNT of one XREADGROUP over several streams (it applies to each): the free slots
    shared out, so that a read takes about as many jobs as there are slots (at least one
    a stream)."""
    return max(1, min(batch, -(-free // streams)))


def stream_gone(exc: BaseException) -> bool:
    """NOGROUP (a stream or its group is missing), or UNBLOCKED (a stream deleted while
    a read was blocked on it)."""
    return kind_of(exc) == "nogroup" or str(exc).startswith("UNBLOCKED")


class Readers:
    """Blocking reads of new jobs on a cluster, where a command stays within one hash
    slot: a thread per partition sends XREADGROUP ... BLOCK on its stream, through a
    client of their own whose socket timeout is the ledger's plus the block. What a read
    brings (entries, or its error) waits for the worker loop, which reads the partition
    again (again()) once it has done them; an empty read is sent again at once."""

    def __init__(self, streams: JobStreams, calls: LedgerCalls, settings: WorkerSettings) -> None:
        self.streams, self.settings = streams, settings
        more = {"socket_timeout": calls.settings.socket_timeout + settings.block}
        made = backends.sync_client(calls.settings.model_copy(update=more))
        self.client = cast(RedisCluster, made)  # (made for a cluster only)
        self.results: queue.SimpleQueue[tuple[int, ReadResult]] = queue.SimpleQueue()
        self.go = {p: threading.Event() for p in calls.partitions}
        self.closed = False
        for p, go in self.go.items():
            go.set()
            threading.Thread(
                target=self._read, args=(p,), name=f"ledger-read-{p}", daemon=True
            ).start()

    def _read(self, p: int) -> None:
        s, stream = self.settings, self.streams.stream(p)
        ms = int(1000 * s.block)
        while self.go[p].wait() and not self.closed:
            result: ReadResult
            try:
                # Sent to the stream's node by name: redis-py would otherwise ask the
                # server for the keys of each XREADGROUP (COMMAND GETKEYS, twice).
                node = self.client.get_node_from_key(stream)  # type: ignore[no-untyped-call]
                got = self.client.execute_command(  # type: ignore[no-untyped-call]
                    *("XREADGROUP", "GROUP", s.group, s.consumer, "COUNT", s.batch),
                    *("BLOCK", ms, "STREAMS", stream, ">"),
                    target_nodes=node,
                )
            except Exception as exc:
                result = exc
            else:
                result = entries_of(got)
                if not result:
                    continue
            if self.closed:
                return  # entries read now are taken over after claim_idle_ms
            self.go[p].clear()
            self.results.put((p, result))

    def take(self, timeout: float) -> list[tuple[int, ReadResult]]:
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


def collect(groups: Groups, p: int, entries: list[Entry], claimed: bool) -> None:
    """Add a partition's entries read to the jobs by (partition, session), in order. An
    entry already there (read by this pass, then claimed by it as idle: reading the other
    partitions took longer than claim_idle_ms) is done once."""
    for entry_id, fields in entries:
        jobs = groups.setdefault((p, field_of(fields, schema.JOB_SESSION)), [])
        if all(schema.text(e) != schema.text(entry_id) for e, _, _ in jobs):
            jobs.append((entry_id, fields, claimed))


def field_of(fields: Fields | None, name: str) -> str:
    for k, v in (fields or {}).items():
        if schema.text(k) == name:
            return schema.text(v)
    return ""
