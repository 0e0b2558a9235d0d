"""The job streams: one per partition, shared by the workers through one consumer
group. Their names, the group made (and made again when a stream is lost), a worker's
consumer removed at a clean stop, the reads of new jobs (one XREADGROUP over every
stream on one server, a reader thread per partition on a cluster: ``Readers``), and the
jobs read grouped by session (``collect``)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

import redis.exceptions as rex

from ledger import backends, schema
from ledger.errors import translated
from ledger.workers.logs import describe
from ledger.workers.trouble import WHOLE_PASS, kind_of

if TYPE_CHECKING:
    from ledger.workers.runner import Worker

log = logging.getLogger("ledger.worker")
# The jobs read, by (partition, session): (entry id, fields, claimed), in order.
Groups = dict[tuple[int, str], list[tuple[Any, Any, bool]]]


class JobStreams:
    """A worker's view of the partitions' job streams and its consumer group."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.partition_of = {self.stream(p): p for p in worker.partitions}
        self.groups: set[int] = set()  # partitions whose group this worker made or saw

    def stream(self, partition: int) -> str:
        return self.w.ledger.keyspace.jobs(partition)

    def dead_letter(self, partition: int) -> str:
        return self.w.ledger.keyspace.dead_letters(partition)

    def errors_hash(self, partition: int) -> str:
        return self.w.ledger.keyspace.job_errors(partition)

    def ensure_group(self, partition: int) -> None:
        """Make the partition's stream and group (nothing if the group exists); raises
        what Redis answers otherwise (e.g. OOM)."""
        try:
            self.w.ledger.client.xgroup_create(
                self.stream(partition), self.w.settings.group, id="0", mkstream=True
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
        client, s, removed = self.w.ledger.client, self.w.settings, 0
        with translated():
            for p in self.w.partitions:
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
            for p in self.w.partitions:
                self.ensure_group(p)

    def stream_lost(self, partition: int, exc: BaseException) -> None:
        """NOGROUP: the stream, or its group, is gone. Say so loudly once per loss (the
        jobs in it may be lost); the caller makes the group again (on a stream a script
        has made anew since, the group starts at its first entry)."""
        self.w.metrics.errors.labels("nogroup").inc()
        if partition in self.groups:
            self.groups.discard(partition)
            self.w.metrics.streams_lost.inc()
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
            self.w.troubles.met(kind, exc, partition=p)
            return
        self.stream_lost(p, exc)
        try:
            self.ensure_group(p)
        except Exception as again:
            kind = kind_of(again)
            if kind is None or kind in WHOLE_PASS:
                raise
            self.w.troubles.met(kind, again, partition=p)  # made on a later pass

    def read_partition(self, p: int, count: int | None = None) -> list[tuple[Any, Any]]:
        """New jobs of a partition (no wait), at most ``count`` (default ``batch``)."""
        s = self.w.settings
        if p not in self.groups:  # not made yet (e.g. Redis was out of memory at start)
            self.ensure_group(p)
        got: Any = self.w.ledger.client.xreadgroup(
            s.group, s.consumer, {self.stream(p): ">"}, count=count or s.batch
        )
        return [entry for _, entries in got or [] for entry in entries]

    def read_blocking(self, block: float, count: int) -> Groups:
        """Wait up to ``block`` seconds for new jobs in any partition, at most ``count``,
        with one XREADGROUP ... BLOCK over every partition's stream. A stream or group
        found missing sends a read of each partition (``Worker.gather``), which reports
        the loss and makes the group again. Returns the jobs read, by session."""
        s = self.w.settings
        streams: dict[Any, Any] = {self.stream(p): ">" for p in self.w.partitions}
        ms = max(1, int(1000 * min(block, s.block, self.w.ledger.settings.socket_timeout / 2)))
        try:
            got: Any = self.w.ledger.client.xreadgroup(
                s.group,
                s.consumer,
                streams,
                count=per_stream(count, len(streams), s.batch),
                block=ms,
            )
        except rex.ResponseError as exc:
            if not stream_gone(exc):
                raise
            return self.w.gather(count)
        groups: Groups = {}
        for stream, entries in got or []:
            collect(groups, self.partition_of[schema.text(stream)], entries, claimed=False)
        return groups

    def read_results(self, got: list[tuple[int, Any]], groups: Groups) -> None:
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


def collect(groups: Groups, p: int, entries: list[tuple[Any, Any]], claimed: bool) -> None:
    """Add a partition's entries read to the jobs by (partition, session), in order. An
    entry already there (read by this pass, then claimed by it as idle: reading the other
    partitions took longer than claim_idle_ms) is done once."""
    for entry_id, fields in entries:
        jobs = groups.setdefault((p, field_of(fields, schema.JOB_SESSION)), [])
        if all(schema.text(e) != schema.text(entry_id) for e, _, _ in jobs):
            jobs.append((entry_id, fields, claimed))


def field_of(fields: Any, name: str) -> str:
    for k, v in (fields or {}).items():
        if schema.text(k) == name:
            return schema.text(v)
    return ""
