"""The asyncio face: :class:`AsyncLedger` and :class:`AsyncSession`.

This file is the source of both faces: ``ledger/_sync/client.py`` (:class:`~ledger.Ledger`,
:class:`~ledger.Session`) is generated from it (``python tools/unasync.py``; a test
checks it is up to date). Both share everything but the I/O (``ledger.core``,
``ledger.protocol``): each method builds the same :class:`~ledger.protocol.Call`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self, TypeVar

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, MovedError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ledger import backends, protocol, schema, scripts
from ledger.backends import AsyncClient, async_client, async_primary
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


class AsyncLedger(LedgerCore):
    """A token-budget ledger on one Redis deployment (asyncio)."""

    def __init__(self, client: AsyncClient, settings: LedgerSettings | None = None) -> None:
        super().__init__(settings or LedgerSettings())
        backends.check_durability(self.settings, client)
        self.client = client
        self._scripts: dict[str, AsyncScript] = {
            n: client.register_script(scripts.source(n)) for n in scripts.NAMES
        }
        # durable writes (replica_acks): WAIT after each write, on its own connection
        self._wait = (self.settings.replica_acks, self.settings.replica_ack_timeout_ms)
        self._nodes: dict[str, Any] = {}  # on a cluster: a plain client per primary
        self._stale = False  # a primary did not answer: read the slot map before the next write
        self._cluster: tuple[object, bool] = (None, False)  # (the client, on a cluster)

    @classmethod
    def from_settings(cls, settings: LedgerSettings) -> Self:
        return cls(async_client(settings), settings)

    async def run(self, call: Call[T]) -> T:
        """Send one script call, retrying transient failures with the same op id."""
        call = self.check_call(call)
        return call.parse(protocol.decode(await self._send(call)))

    async def _send(self, call: Call[Any]) -> object:
        """The raw reply of one call; transient failures retried, errors translated."""
        return await self._sent(self._evalsha, self._scripts[call.script], call)

    async def _sent(self, send: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await send(*args)``, and after a failure the tries that ``retried`` asks for
        (the same call again), waiting with ``asyncio.sleep``; errors translated. The
        first try makes nothing else: the retry's callable only after a failure."""
        try:
            return await send(*args)
        except Exception as exc:
            first = exc
        tries = self.retried(first, functools.partial(send, *args))
        try:
            step = next(tries)
            while True:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    step = tries.send(None)
                    continue
                try:
                    reply = await step()
                except Exception as exc:
                    step = tries.throw(exc)
                else:
                    step = tries.send(reply)
        except StopIteration as done:
            return done.value

    async def run_many(
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
            return collect(batch, [await self._try(c) for c in batch], return_exceptions)
        if self._wait[0] and any(c.script not in scripts.READ_ONLY for c in batch):
            raws = await self._sent(self._send_batch, batch, True, True)
            return collect(batch, raws, return_exceptions)
        return collect(batch, await self._sent(self._send_batch, batch), return_exceptions)

    def _on_cluster(self) -> bool:
        """Whether the client is a Redis Cluster's (asked once per client: redis-py's
        cluster class is a Protocol, whose isinstance check is slow)."""
        client = self.client
        if client is not self._cluster[0]:
            self._cluster = (client, isinstance(client, AsyncRedisCluster))
        return self._cluster[1]

    async def _try(self, call: Call[Any]) -> object:
        """The raw reply of one call of a batch, or its refusal; an outage stops the batch."""
        try:
            return await self._send(call)
        except (BackendUnavailable, PermissionDenied):
            raise
        except LedgerError as exc:
            return exc

    async def _send_batch(
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
            async with self.client.pipeline(transaction=transaction and not acked) as pipe:
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
                replies = await pipe.execute(raise_on_error=False)
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
                script.sha = await self.client.script_load(script.script)
        raise NoScriptError("the ledger's scripts were flushed again while loading them")

    async def _evalsha_acked(self, script: AsyncScript, call: Call[Any]) -> Any:
        """EVALSHA then WAIT on one connection of the primary that runs it (a plain
        pipeline): the reply once ``replica_acks`` replicas hold the write, else
        :class:`NotReplicated`."""
        key, refresh = call.keys[0], self._stale
        for _ in range(3):
            client = await async_primary(self.client, self.settings, key, self._nodes, refresh)
            self._stale = False
            try:
                async with client.pipeline(transaction=False) as pipe:
                    pipe.evalsha(script.sha, *protocol.evalsha_args(call))
                    pipe.wait(*self._wait)
                    reply, acked = await pipe.execute(raise_on_error=False)
            except (RedisConnectionError, RedisTimeoutError):
                # The primary does not answer: on a cluster it may be dead, a replica
                # promoted in its place. The next try (the retry policy's) reads the
                # slot map again and sends to the slot's primary then, not to this node.
                if client is not self.client:
                    self._stale = True
                    backends.forget(self._nodes, client)
                    await client.aclose()
                raise
            if isinstance(reply, NoScriptError):
                script.sha = await client.script_load(script.script)
                continue
            refresh = isinstance(reply, MovedError | AskError)
            if refresh:
                continue  # the slot moved: read the slot map again, send to its primary
            if isinstance(reply, Exception):
                raise reply
            self.check_acked(call, acked)
            return reply
        raise NoScriptError("the ledger's script was flushed again, or its slot kept moving")

    async def _evalsha(self, script: AsyncScript, call: Call[Any]) -> Any:
        """EVALSHA, and on NOSCRIPT load the script and send it again: what calling the
        ``AsyncScript`` does, without its per-call import and copy of the arguments."""
        if self._wait[0] and call.script not in scripts.READ_ONLY:
            return await self._evalsha_acked(script, call)
        args = protocol.evalsha_args(call)
        try:
            return await self.client.evalsha(script.sha, *args)
        except NoScriptError:
            script.sha = await self.client.script_load(script.script)
            return await self.client.evalsha(script.sha, *args)

    async def open_session(
        self,
        session_id: str,
        budget: SessionBudget,
        *,
        owner: str | None = None,
        owner_token: str | None = None,
        op_id: str | None = None,
    ) -> AsyncSession:
        """Open (or re-attach to an identically configured) session. ``owner`` names this
        handle in the turn leases it takes (default: host, pid and a random suffix);
        ``owner_token`` is its secret (default: a fresh one; see ``SessionCore``)."""
        opened = await self.run(self.open_call(session_id, budget, op_id))
        keys = self.keyspace.session(session_id)
        return AsyncSession(self, keys, opened.epoch, owner=owner, owner_token=owner_token)

    async def session(
        self, session_id: str, *, owner: str | None = None, owner_token: str | None = None
    ) -> AsyncSession:
        """Attach to an open session at its current epoch."""
        keys = self.keyspace.session(session_id)
        s = AsyncSession(self, keys, 0, owner=owner, owner_token=owner_token)
        await s.refresh()
        return s

    async def session_ids(self) -> list[str]:
        """Every open session of this prefix (SCAN; on a cluster, every primary). Closed
        sessions whose tombstone still keeps their last outcome are left out."""
        keys: dict[str, str] = {}
        self.check_open()
        with translated():
            async for k in self.client.scan_iter(match=self.keyspace.session_pattern(), count=500):
                name = k.decode() if isinstance(k, bytes) else str(k)
                sid = self.keyspace.session_id_of(name)
                if sid is not None:
                    keys[name] = sid
            pipe = self.client.pipeline(transaction=False)
            for name in keys:
                pipe.hexists(name, schema.EPOCH)
            alive = await pipe.execute()
        return sorted(sid for sid, ok in zip(keys.values(), alive, strict=True) if ok)

    async def items(self, session_id: str) -> list[HeldItem]:
        """Every item a session holds, oldest first (one atomic HGETALL)."""
        self.check_open()
        with translated():
            fields = await self.client.hgetall(self.keyspace.session(session_id).session)
        return protocol.held_items(fields)

    async def read_spill(self, session_id: str, call_id: str) -> bytes | None:
        """The content of a spilled tool result (None once its spill TTL has passed, or
        once the session was deleted)."""
        call = protocol.read_spill(self.keyspace.session(session_id), call_id)
        value = await self._send(self.check_call(call))  # the content itself, not k=v
        if value is None or isinstance(value, bytes):
            return value
        return str(value).encode()

    async def set_scope(
        self, name: str, budget: ScopeBudget, *, op_id: str | None = None
    ) -> ScopeSet:
        """Set a budget scope's window, ceilings and price table (docs/ceilings.md): a
        tenant, or '<tenant>/<name>' within it. Its counters are kept."""
        return await self.run(protocol.set_scope(self.keyspace, op_id or new_op_id(), name, budget))

    async def scope_usage(self, name: str) -> ScopeUsage:
        """A budget scope's window as it stands (Redis's TIME, HGETALL, ZRANGE: a view,
        not one atomic read)."""
        self.check_open()
        sk = self.keyspace.scope(name)
        with translated():
            sec, usec = await self.client.time()
            fields = await self.client.hgetall(sk.hash)
            holds = await self.client.zrange(sk.holds, 0, -1, withscores=True)
        return protocol.scope_usage(sk.name, fields, holds, sec * 1000 + usec // 1000)

    async def audit(self, session_id: str) -> AuditReport:
        return await self.run(protocol.audit(self.keyspace.session(session_id)))

    async def expire_due(self, partition: int, limit: int = 500) -> int:
        """Release every lease of a partition whose deadline passed: reservations, and
        turns (rolled back, docs/agent.md#a-dead-turn-is-undone); returns how many."""
        reservations, turns = await self.sweep_partition(partition, limit)
        return reservations + turns

    async def sweep_partition(self, partition: int, limit: int = 500) -> tuple[int, int]:
        """:meth:`expire_due`, the reservations released and the turns rolled back apart."""
        self.check_open()
        with translated():
            sec, usec = await self.client.time()
            due = await self.client.zrangebyscore(
                self.keyspace.deadlines(partition),
                "-inf",
                sec * 1000 + usec // 1000,
                start=0,
                num=limit,
            )
        total, turns = 0, 0
        for sid, rids in self.plan_expiry(due).items():
            done: Expired = await self.run(
                protocol.expire(self.keyspace.session(sid), new_op_id(), rids)
            )
            total += done.expired
            turns += done.rolled_back is not None
        return total, turns

    async def check_partition(self, partition: int, group: str, idle_ms: int) -> PartitionCheck:
        """One partition's earliest lease deadline and whether a job of ``group`` has
        been pending ``idle_ms`` (``worker_check.lua``, read-only): the worker's look at
        a partition on a cluster."""
        self.check_open()
        k = self.keyspace
        if type(partition) is not int or not 0 <= partition < k.partitions:
            raise InvalidArgument(f"partition must be in 0..{k.partitions - 1}, got {partition!r}")
        call = protocol.worker_check(k.deadlines(partition), k.jobs(partition), group, idle_ms)
        return call.parse(protocol.decode(await self._send(call)))

    async def aclose(self) -> None:
        """Close the connection; every later call raises :class:`LedgerClosed`."""
        self.closed = True
        for node in self._nodes.values():
            await node.aclose()
        await self.client.aclose()

    async def __aenter__(self) -> AsyncLedger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSession(SessionCore):
    """One agent session's budget, shared by every worker that serves it (asyncio)."""

    def __init__(
        self,
        ledger: AsyncLedger,
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

    async def refresh(self) -> int:
        """Adopt the session's current epoch (after a StaleEpoch); returns it. A turn of
        this handle that is no longer open is forgotten."""
        snap = await self.snapshot()
        self.epoch = snap.epoch
        if snap.turn_owner != self.owner or snap.turn != self.turn:
            self.turn = None
        return self.epoch

    async def audit(self) -> AuditReport:
        return await self.ledger.audit(self.id)


__all__ = ["AsyncLedger", "AsyncSession"]
