"""The ledger calls the worker's parts make, each one named (``LedgerCalls``): the
scripts a job runs (snapshot, reset, compact), what a compaction reads besides (the
session's committed history, the stored texts) and the mark it leaves while it runs, the
lease sweep and a cluster partition's check, the observer lease and the fleet's tallies,
the Redis settings' health. The parts get this object in their constructor and send no
raw command of their own, except ``streams.py``, the one owner of the stream commands
(XREADGROUP, XACK, XCLAIM, XADD, ...)."""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.cluster

from ledger import backends, health, protocol, schema, scope_reads
from ledger.client import Ledger
from ledger.errors import translated
from ledger.keys import KeySpace, SessionKeys
from ledger.models import (
    Compaction,
    HeldItem,
    Item,
    PartitionCheck,
    ResetDone,
    ScopeUsage,
    Snapshot,
)
from ledger.protocol import Replaced


class LedgerCalls:
    """A ledger (the sync face) seen from the worker: its keys, its topology and the
    calls the worker makes, by name."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.client: backends.SyncClient = ledger.client
        self.keyspace: KeySpace = ledger.keyspace
        self.settings = ledger.settings
        self.partitions = range(ledger.keyspace.partitions)
        # One command may name every partition's keys only outside a cluster (there a
        # command stays within one hash slot, and each partition has its own).
        url = ledger.settings.redis_url
        self.one_node = url is not None and backends.parse_url(url).kind != "cluster"
        # Blocking reads on a real server (a reader per partition on a cluster); the
        # embedded backend polls.
        self.blocking = self.one_node and type(ledger.client) is redis.Redis
        self.on_cluster = isinstance(ledger.client, redis.cluster.RedisCluster)

    # --- a job's scripts -------------------------------------------------------------------

    def session_keys(self, session_id: str) -> SessionKeys:
        return self.keyspace.session(session_id)

    def snapshot(self, keys: SessionKeys) -> Snapshot:
        return self.ledger.run(protocol.snapshot(keys))

    def reset(
        self, keys: SessionKeys, op_id: str, epoch: int, reason: str, wait_ms: int = 0
    ) -> ResetDone:
        return self.ledger.run(protocol.reset(keys, op_id, epoch, reason, wait_ms))

    def compact(
        self,
        keys: SessionKeys,
        op_id: str,
        epoch: int,
        replaced: Sequence[Replaced],
        summary: Item | None,
        job: str,
        summary_text: str | None = None,
        read: int | None = None,
    ) -> Compaction:
        """``compact.lua``: the plan committed (or staged while a turn is open), the job's
        stream entry deleted with it; nothing replaced and no summary: a failed one."""
        call = protocol.compact(
            keys, op_id, epoch, replaced, summary, job=job, summary_text=summary_text, read=read
        )
        return self.ledger.run(call)

    # --- what a compaction reads and marks -------------------------------------------------

    def history(self, keys: SessionKeys) -> tuple[int, tuple[HeldItem, ...]]:
        """The turn a compaction prepares (the open one, else the next) and the items of
        the session's committed turns, from one HGETALL: an open turn's own items may yet
        be rolled back, so no summary may hold them."""
        with translated():
            fields = self.client.hgetall(keys.session)
        wanted = (schema.TURN, schema.TURN_OWNER)
        text = {
            schema.text(k): schema.text(v) for k, v in fields.items() if schema.text(k) in wanted
        }
        tn = int(text.get(schema.TURN) or 0)
        turn = tn if schema.TURN_OWNER in text else tn + 1
        return turn, tuple(protocol.committed_items(fields))

    def contents(self, keys: SessionKeys, items: Sequence[HeldItem]) -> dict[str, str]:
        """The stored texts of the held items ('<c>:<id>' -> text)."""
        if not items:
            return {}
        fields = [schema.content_field(i.consumer.code, i.id) for i in items]
        values = self.client.hmget(keys.content, fields)
        return {f: schema.text(v) for f, v in zip(fields, values, strict=True) if v is not None}

    def mark_compacting(self, keys: SessionKeys, holder: str, for_s: float, ttl_ms: int) -> None:
        """Say (field '~' of the session's summaries hash: schema.COMPACTING) that
        ``holder`` computes the session's compaction, for ``for_s`` seconds on Redis's
        clock: an agent beginning a turn waits for a compaction a worker is on, not for
        one nobody picked up."""
        with translated():
            sec, usec = self.client.time()
            until = sec * 1000 + usec // 1000 + int(1000 * for_s)
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(keys.compacted, schema.COMPACTING, f"{holder}|{until}")
            pipe.pexpire(keys.compacted, ttl_ms)
            pipe.execute()

    def unmark_compacting(self, keys: SessionKeys) -> None:
        with translated():
            self.client.hdel(keys.compacted, schema.COMPACTING)

    # --- leases ------------------------------------------------------------------------------

    def sweep_partition(self, partition: int) -> tuple[int, int]:
        """The partition's expired reservations released and lapsed turns rolled back."""
        return self.ledger.sweep_partition(partition)

    def check_partition(self, partition: int, group: str, idle_ms: int) -> PartitionCheck:
        """Cluster: ``worker_check.lua`` on one partition."""
        return self.ledger.check_partition(partition, group, idle_ms)

    def partitions_with_leases(self) -> list[int]:
        """Partitions whose deadline index exists (an empty sorted set is no key): one
        EXISTS over every partition on one server, one each (pipelined) on a cluster."""
        names, parts = self.keyspace.deadlines, self.partitions
        if self.one_node:
            return list(parts) if self.client.exists(*map(names, parts)) else []
        pipe = self.client.pipeline(transaction=False)
        for p in parts:
            pipe.exists(names(p))
        return [p for p, n in zip(parts, pipe.execute(), strict=True) if n]

    # --- the observer ------------------------------------------------------------------------

    def observer_lease(self, holder: str, ms: int) -> bool:
        """Whether ``holder`` keeps the fleet's indicators for the next ``ms``: one worker
        at a time does (SET NX PX, renewed by its holder)."""
        key = self.keyspace.observer()
        got = self.client.set(key, holder, nx=True, px=ms, get=True)
        if got is None:
            return True
        if schema.text(got) == holder:
            self.client.pexpire(key, ms)
            return True
        return False

    def tallies(self) -> dict[str, int]:
        """The fleet's indicators: every partition's tally (one small hash each, kept by
        the scripts as they count), summed; one pipeline, whatever the sessions."""
        pipe = self.client.pipeline(transaction=False)
        for p in self.partitions:
            pipe.hgetall(self.keyspace.tally(p))
        total: dict[str, int] = {}
        for got in pipe.execute():
            for k, v in got.items():
                name = schema.text(k)
                total[name] = total.get(name, 0) + int(v)
        return total

    # --- the deployment ----------------------------------------------------------------------

    def check_health(self) -> health.HealthReport:
        """The Redis settings the ledger needs (:mod:`ledger.health`)."""
        return health.check(self.client, self.settings.redis_url)

    # --- the budget scopes, for the metrics pass ------------------------------------------

    def scope_names(self) -> list[str]:
        """Every scope with ceilings set (one SCAN with a MATCH on their key prefix)."""
        return scope_reads.scope_names(self.ledger)

    def scope_usages(
        self, names: Sequence[str], damaged: dict[str, str] | None = None
    ) -> list[ScopeUsage]:
        return scope_reads.scope_usages(self.ledger, names, damaged)

    def scope_refusals(self, names: Sequence[str]) -> int:
        return scope_reads.scope_refusals(self.ledger, names)
