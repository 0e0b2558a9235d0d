"""The OpenAI Agents adapter's ``Session``: the conversation's history in Redis, one
version a turn (``LedgerAgents.session``; :mod:`ledger.adapters.openai_agents`
re-exports it)."""

from __future__ import annotations

import copy
import json
import uuid
from typing import TYPE_CHECKING, Any

from ledger import schema
from ledger.agent.aio import AsyncTurn
from ledger.errors import InvalidArgument, translated

if TYPE_CHECKING:
    from ledger.adapters.openai_agents import LedgerAgents


class LedgerSession:
    """The SDK's ``Session`` protocol, governed by the ledger: the conversation's history,
    kept in Redis beside the ledger's session (``<prefix>:{p<N>}:history:<session>``),
    shared by every process. Each ended turn commits a new version of it (the turn's
    commit mark), so a turn whose process died leaves no trace: the next turn, on any
    process, reads the version the last ended turn committed, with that turn's deliveries
    applied (what the ledger reclaimed or a summary replaced out, the summary in). Use
    it inside ``gov.turn()``, where the runner reads and writes it."""

    def __init__(self, gov: LedgerAgents) -> None:
        self.gov = gov
        self.session_id = gov.agent.session.id
        self.session_settings: Any = None
        self._base: list[dict[str, Any]] | None = None  # the committed version, governed
        self._added: list[dict[str, Any]] = []  # what the runner added in this turn
        self._committed: str | None = None

    async def _read(self, version: str | None) -> list[dict[str, Any]]:
        if version is None:
            return []
        s = self.gov.agent.session
        s.ledger.check_open()
        with translated():
            raw = await s.ledger.client.hget(s.keys.history, version)
        if raw is None:
            return []
        items = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        return list(items) if isinstance(items, list) else []

    async def _begin(self, turn: AsyncTurn) -> None:
        self._committed = turn.mark
        base = await self._read(turn.mark)
        self._base = [p.item for p in self.gov.governed(base)]
        self._added = []

    def _end(self) -> None:
        self._base, self._added = None, []

    async def _commit(self, turn: AsyncTurn) -> str:
        """Write the history the turn ends with (what the model last saw, and the answer)
        as a new version; end_turn records it as the turn's mark."""
        gov = self.gov
        answer = await gov._answer(self._added)
        items = [p.item for p in (*gov.last_input, *answer)]
        version = f"v{turn.number}.{uuid.uuid4().hex[:12]}"
        s = gov.agent.session
        with translated():
            client = s.ledger.client
            old = [
                k.decode() if isinstance(k, bytes) else str(k)
                for k in await client.hkeys(s.keys.history)
            ]
            ttl = int(await client.hget(s.keys.session, schema.IDLE_TTL) or 86_400_000)
            pipe = client.pipeline(transaction=False)
            pipe.hset(s.keys.history, version, json.dumps(items))
            stale = [k for k in old if k not in (version, self._committed)]
            if stale:
                pipe.hdel(s.keys.history, *stale)
            pipe.pexpire(s.keys.history, ttl)
            await pipe.execute()
        return version

    async def get_items(self, limit: int | None = None) -> list[Any]:
        if self._base is None:  # outside a turn: the version the last ended turn committed
            items = await self._read((await self.gov.agent.session.snapshot()).mark)
        else:
            items = [*self._base, *self._added]
        items = copy.deepcopy(items)
        return items if limit is None else items[-limit:] if limit > 0 else []

    async def add_items(self, items: list[Any]) -> None:
        if self._base is None:
            raise InvalidArgument(
                "the governed session is written inside `async with gov.turn():` (each turn "
                "commits its history with the turn)"
            )
        self._added += [dict(i) for i in items]

    async def pop_item(self) -> Any | None:
        if self._base is None:
            raise InvalidArgument("pop_item belongs inside `async with gov.turn():`")
        if self._added:
            return self._added.pop()
        return self._base.pop() if self._base else None

    async def clear_session(self) -> None:
        """Forget the history: for every process, as the next turn starts afresh. Delete
        the ledger's session to give its budget back too."""
        s = self.gov.agent.session
        with translated():
            await s.ledger.client.delete(s.keys.history)
        if self._base is not None:
            self._base, self._added = [], []
