# GENERATED from ledger/_async/client.py by tools/unasync.py: edit that file, not this one.
"""The synchronous face: :class:`Ledger` and :class:`Session`."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, Self, TypeVar

from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import AskError, MovedError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ledger import backends, protocol, schema, scripts
from ledger.backends import SyncClient, sync_client, sync_primary
from ledger.core import (
    LedgerCore,
    SessionCore,
    batch_loads,
    batch_replies,
    collect,
    new_op_id,
)
from ledger.errors import (
    BackendUnavailable,
    InvalidArgument,
    LedgerError,
    PermissionDenied,
    translated,
)
from ledger.models import (
    AuditReport,
    Expired,
    HeldItem,
    PartitionCheck,
    ScopeBudget,
    ScopeSet,
    ScopeUsage,
    SessionBudget,
)
from ledger.protocol import Call
from ledger.settings import LedgerSettings

T = TypeVar("T")


class Ledger(LedgerCore):
    """A token-budget ledger on one Redis deployment (sync)."""

    def __init__(self, client: SyncClient, settings: LedgerSettings | None = None) -> None:
        super().__init__(settings or LedgerSettings())
        backends.check_durability(self.settings, client)
        self.client = client
        self._scripts: dict[str, Script] = {
            n: client.register_script(scripts.source(n)) for n in scripts.NAMES
        }
        # durable writes (replica_acks): WAIT after each write, on its own connection
        self._wait = (self.settings.replica_acks, self.settings.replica_ack_timeout_ms)
        self._nodes: dict[str, Any] = {}  # on a cluster: a plain client per primary
        self._stale = False  # a primary did not answer: read the slot map before the next write
        self._cluster: tuple[object, bool] = (None, False)  # (the client, on a cluster)

    @classmethod
    def from_settings(cls, settings: LedgerSettings) -> Self:
        return cls(sync_client(settings), settings)

    def run(self, call: Call[T]) -> T:
        """Send one script call, retrying transient failures with the same op id."""
        call = self.check_call(call)
        return call.parse(protocol.decode(self._send(call)))

    def _send(self, call: Call[Any]) -> object:
        """The raw reply of one call; transient failures retried, errors translated."""
        return self._sent(self._evalsha, self._scripts[call.script], call)

    def _sent(self, send: Callable[..., Any], *args: Any) -> Any:
        """``send(*args)``, and after a failure the tries that ``retried`` asks for
        (the same call again), waiting with ``time.sleep``; errors translated. The
        first try makes nothing else: the retry's callable only after a failure."""
        try:
            return send(*args)
        except Exception as exc:
            first = exc
        tries = self.retried(first, functools.partial(send, *args))
        try:
            step = next(tries)
            while True:
                if isinstance(step, float):
                    time.sleep(step)
                    step = tries.send(None)
                    continue
                try:
                    reply = step()
                except Exception as exc:
                    step = tries.throw(exc)
                else:
                    step = tries.send(reply)
        except StopIteration as done:
            return done.value

    def run_many(
        self, calls: Iterable[Call[Any]], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Send many calls in one round trip and return their results in order.

        The batch is one MULTI/EXEC: its calls run in order, one after the other, with
        no other client's command between them; each still decides on its own (a
        refused call changes nothing, the others take effect). Calls of any sessions
        mix. A refused or failed call raises its error once every reply is read, or
        with ``return_exceptions=True`` takes its place in the list. Transient failures
        are retried like :meth:`run`; sending the same calls again is safe while their
        outcomes are kept (``op_retention_seconds``): each op id takes effect once and
        later sends get its stored outcome. At most 1,000 calls; keep batches to tens
        of calls: Redis serves no one else while one runs.

        On a Redis Cluster (where redis-py pipelines no EVALSHA) the calls are sent one
        after the other, each atomic on its own. An outage or a permission refusal
        stops a batch on either backend: it is raised whatever ``return_exceptions``.
        """
        batch = self.check_batch(calls)
        if not batch:
            return []
        if self._on_cluster():
            # redis-py pipelines no EVALSHA on a cluster: one call after the other.
            return collect(batch, [self._try(c) for c in batch], return_exceptions)
        if self._wait[0] and any(c.script not in scripts.READ_ONLY for c in batch):
            raws = self._sent(self._send_batch, batch, True, True)
            return collect(batch, raws, return_exceptions)
        return collect(batch, self._sent(self._send_batch, batch), return_exceptions)

    def _on_cluster(self) -> bool:
        """Whether the client is a Redis Cluster's (asked once per client: redis-py's
        cluster class is a Protocol, whose isinstance check is slow)."""
        client = self.client
        if client is not self._cluster[0]:
            self._cluster = (client, isinstance(client, RedisCluster))
        return self._cluster[1]

    def _try(self, call: Call[Any]) -> object:
        """The raw reply of one call of a batch, or its refusal; an outage stops the batch."""
        try:
            return self._send(call)
        except (BackendUnavailable, PermissionDenied):
            raise
        except LedgerError as exc:
            return exc

    def _send_batch(
        self, batch: list[Call[Any]], transaction: bool = True, acked: bool = False
    ) -> list[object]:
        """The raw replies of a batch sent as one MULTI/EXEC, in order, with no other
        client's command between its calls (see ``batch_loads`` for NOSCRIPT). Without
        ``transaction``, one plain pipeline (for read-only calls that need no order
        between them): a call that met NOSCRIPT is sent again once its script is loaded.
        With ``acked`` (``replica_acks``), the MULTI/EXEC is written out in a plain
        pipeline and followed by WAIT on the same connection: the batch returns once that
        many replicas hold its writes, else :class:`NotReplicated`."""
        load = batch_loads(batch) if transaction else []
        raws: list[object] = [None] * len(batch)
        todo = list(range(len(batch)))
        for _ in range(2):
            with self.client.pipeline(transaction=transaction and not acked) as pipe:
                for name in load:
                    pipe.script_load(self._scripts[name].script)
                if acked:
                    pipe.execute_command("MULTI")
                queue, scripts_ = pipe.execute_command, self._scripts
                for i in todo:  # (EVALSHA queued as pipe.evalsha queues it, with fewer hops)
                    c = batch[i]
                    queue("EVALSHA", scripts_[c.script].sha, *protocol.evalsha_args(c))
                if acked:
                    pipe.execute_command("EXEC")
                    pipe.execute_command("WAIT", *self._wait)
                replies = pipe.execute(raise_on_error=False)
            if acked:  # the loads, MULTI's OK and the QUEUEDs, EXEC's replies, WAIT's count
                *loaded, executed, count = replies
                if isinstance(executed, Exception):
                    raise executed
                self.check_acked(batch[todo[0]], count)
                replies = [*loaded[: len(load)], *executed]
            todo = batch_replies(replies, len(load), todo, raws, batch)
            if not todo:
                return raws
            for name in {batch[i].script for i in todo}:
                script = self._scripts[name]
                script.sha = self.client.script_load(script.script)
        raise NoScriptError("the ledger's scripts were flushed again while loading them")

    def _evalsha_acked(self, script: Script, call: Call[Any]) -> Any:
        """EVALSHA then WAIT on one connection of the primary that runs it (a plain
        pipeline): the reply once ``replica_acks`` replicas hold the write, else
        :class:`NotReplicated`."""
        key, refresh = call.keys[0], self._stale
        for _ in range(3):
            client = sync_primary(self.client, self.settings, key, self._nodes, refresh)
            self._stale = False
            try:
                with client.pipeline(transaction=False) as pipe:
                    pipe.evalsha(script.sha, *protocol.evalsha_args(call))
                    pipe.wait(*self._wait)
                    reply, acked = pipe.execute(raise_on_error=False)
            except (RedisConnectionError, RedisTimeoutError):
                # The primary does not answer: on a cluster it may be dead, a replica
                # promoted in its place. The next try (the retry policy's) reads the
                # slot map again and sends to the slot's primary then, not to this node.
                if client is not self.client:
                    self._stale = True
                    backends.forget(self._nodes, client)
                    client.close()
                raise
            if isinstance(reply, NoScriptError):
                script.sha = client.script_load(script.script)
                continue
            refresh = isinstance(reply, MovedError | AskError)
            if refresh:
                continue  # the slot moved: read the slot map again, send to its primary
            if isinstance(reply, Exception):
                raise reply
            self.check_acked(call, acked)
            return reply
        raise NoScriptError("the ledger's script was flushed again, or its slot kept moving")

    def _evalsha(self, script: Script, call: Call[Any]) -> Any:
        """EVALSHA, and on NOSCRIPT load the script and send it again: what calling the
        ``Script`` does, without its per-call import and copy of the arguments."""
        if self._wait[0] and call.script not in scripts.READ_ONLY:
            return self._evalsha_acked(script, call)
        args = protocol.evalsha_args(call)
        try:
            return self.client.evalsha(script.sha, *args)
        except NoScriptError:
            script.sha = self.client.script_load(script.script)
            return self.client.evalsha(script.sha, *args)

    def open_session(
        self,
        session_id: str,
        budget: SessionBudget,
        *,
        owner: str | None = None,
        owner_token: str | None = None,
        op_id: str | None = None,
    ) -> Session:
        """Open (or re-attach to an identically configured) session. ``owner`` names this
        handle in the turn leases it takes (default: host, pid and a random suffix);
        ``owner_token`` is its secret (default: a fresh one; see ``SessionCore``)."""
        opened = self.run(self.open_call(session_id, budget, op_id))
        keys = self.keyspace.session(session_id)
        return Session(self, keys, opened.epoch, owner=owner, owner_token=owner_token)

    def session(
        self, session_id: str, *, owner: str | None = None, owner_token: str | None = None
    ) -> Session:
        """Attach to an open session at its current epoch."""
        keys = self.keyspace.session(session_id)
        s = Session(self, keys, 0, owner=owner, owner_token=owner_token)
        s.refresh()
        return s

    def session_ids(self) -> list[str]:
        """Every open session of this prefix (SCAN; on a cluster, every primary). Closed
        sessions whose tombstone still keeps their last outcome are left out."""
        keys: dict[str, str] = {}
        self.check_open()
        with translated():
            for k in self.client.scan_iter(match=self.keyspace.session_pattern(), count=500):
                name = k.decode() if isinstance(k, bytes) else str(k)
                sid = self.keyspace.session_id_of(name)
                if sid is not None:
                    keys[name] = sid
            pipe = self.client.pipeline(transaction=False)
            for name in keys:
                pipe.hexists(name, schema.EPOCH)
            alive = pipe.execute()
        return sorted(sid for sid, ok in zip(keys.values(), alive, strict=True) if ok)

    def items(self, session_id: str) -> list[HeldItem]:
        """Every item a session holds, oldest first (one atomic HGETALL)."""
        self.check_open()
        with translated():
            fields = self.client.hgetall(self.keyspace.session(session_id).session)
        return protocol.held_items(fields)

    def read_spill(self, session_id: str, call_id: str) -> bytes | None:
        """The content of a spilled tool result (None once its spill TTL has passed, or
        once the session was deleted)."""
        call = protocol.read_spill(self.keyspace.session(session_id), call_id)
        value = self._send(self.check_call(call))  # the content itself, not k=v
        if value is None or isinstance(value, bytes):
            return value
        return str(value).encode()

    def set_scope(
        self, name: str, budget: ScopeBudget, *, op_id: str | None = None
    ) -> ScopeSet:
        """Set a budget scope's window, ceilings and price table (docs/ceilings.md): a
        tenant, or '<tenant>/<name>' within it. Its counters are kept."""
        return self.run(protocol.set_scope(self.keyspace, op_id or new_op_id(), name, budget))

    def scope_usage(self, name: str) -> ScopeUsage:
        """A budget scope's window as it stands (Redis's TIME, HGETALL, ZRANGE: a view,
        not one atomic read)."""
        self.check_open()
        sk = self.keyspace.scope(name)
        with translated():
            sec, usec = self.client.time()
            fields = self.client.hgetall(sk.hash)
            holds = self.client.zrange(sk.holds, 0, -1, withscores=True)
        return protocol.scope_usage(sk.name, fields, holds, sec * 1000 + usec // 1000)

    def audit(self, session_id: str) -> AuditReport:
        return self.run(protocol.audit(self.keyspace.session(session_id)))

    def expire_due(self, partition: int, limit: int = 500) -> int:
        """Release every lease of a partition whose deadline passed: reservations, and
        turns (rolled back, docs/agent.md#a-dead-turn-is-undone); returns how many."""
        reservations, turns = self.sweep_partition(partition, limit)
        return reservations + turns

    def sweep_partition(self, partition: int, limit: int = 500) -> tuple[int, int]:
        """:meth:`expire_due`, the reservations released and the turns rolled back apart."""
        self.check_open()
        with translated():
            sec, usec = self.client.time()
            due = self.client.zrangebyscore(
                self.keyspace.deadlines(partition),
                "-inf",
                sec * 1000 + usec // 1000,
                start=0,
                num=limit,
            )
        total, turns = 0, 0
        for sid, rids in self.plan_expiry(due).items():
            done: Expired = self.run(
                protocol.expire(self.keyspace.session(sid), new_op_id(), rids)
            )
            total += done.expired
            turns += done.rolled_back is not None
        return total, turns

    def check_partition(self, partition: int, group: str, idle_ms: int) -> PartitionCheck:
        """One partition's earliest lease deadline and whether a job of ``group`` has
        been pending ``idle_ms`` (``worker_check.lua``, read-only): the worker's look at
        a partition on a cluster."""
        self.check_open()
        k = self.keyspace
        if type(partition) is not int or not 0 <= partition < k.partitions:
            raise InvalidArgument(f"partition must be in 0..{k.partitions - 1}, got {partition!r}")
        call = protocol.worker_check(k.deadlines(partition), k.jobs(partition), group, idle_ms)
        return call.parse(protocol.decode(self._send(call)))

    def close(self) -> None:
        """Close the connection; every later call raises :class:`LedgerClosed`."""
        self.closed = True
        for node in self._nodes.values():
            node.close()
        self.client.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(SessionCore):
    """One agent session's budget, shared by every worker that serves it (sync)."""

    def __init__(
        self,
        ledger: Ledger,
        keys: Any,
        epoch: int,
        *,
        owner: str | None = None,
        owner_token: str | None = None,
    ) -> None:
        s = ledger.settings
        super().__init__(
            keys, epoch, s.drift_action, owner=owner, lease_ms=s.turn_lease_ms,
            owner_token=owner_token,
        )  # fmt: skip
        self.ledger = ledger

    def refresh(self) -> int:
        """Adopt the session's current epoch (after a StaleEpoch); returns it. A turn of
        this handle that is no longer open is forgotten."""
        snap = self.snapshot()
        self.epoch = snap.epoch
        if snap.turn_owner != self.owner or snap.turn != self.turn:
            self.turn = None
        return self.epoch

    def audit(self) -> AuditReport:
        return self.ledger.audit(self.id)


__all__ = ["Ledger", "Session"]
