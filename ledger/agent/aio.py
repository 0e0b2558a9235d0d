"""The agent layer's asyncio face: :class:`AsyncAgent` and its per-turn :class:`AsyncTurn`.

This file is the source of both faces: ``ledger/agent/sync.py`` is generated from it
(``python -m ledger._unasync``; a test checks it is up to date). Both drive the
same operations of :mod:`ledger.agent.core`, which hold every decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ledger.agent.core import (
    Admission,
    AgentCore,
    Compacted,
    Fetch,
    Held,
    Obj,
    Op,
    Store,
    ToolOutcome,
    TurnState,
    drive_async,
)
from ledger.aio import AsyncSession
from ledger.errors import ContextDrift, InvalidArgument, translated
from ledger.models import Consumer, Reconciled, TurnReport

T = TypeVar("T")


def _text(x: object) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class AsyncAgent:
    """Governs one agent session's context with the ledger (asyncio).

    ``counter`` counts a text's tokens (e.g. :class:`~ledger.agent.TiktokenCounter`);
    ``id_of`` / ``text_of`` read an app object's id and text (defaults understand
    ``id`` / ``tool_call_id`` / ``call_id`` and ``content`` / ``page_content`` /
    ``text``); ``item_overhead`` tokens are added to every item (per-message framing).
    """

    def __init__(
        self, session: AsyncSession, counter: Callable[[str], int], **options: Any
    ) -> None:
        self.session = session
        self.core = AgentCore(session, counter, **options)
        self._ttl_ms: int | None = None

    async def run(self, op: Op[T]) -> T:
        return await drive_async(op, self.session.ledger.run, asyncio.sleep, self._io)

    async def _io(self, effect: Held | Store | Fetch) -> Any:
        """The reads and writes outside the ledger's scripts: which items are held, the
        content store (texts for the worker's compactor), the worker's summaries."""
        self.session.ledger.check_open()
        client, keys = self.session.ledger.client, self.session.keys
        with translated():
            if isinstance(effect, Held):
                values = await client.hmget(keys.session, effect.fields)
                return [v is not None for v in values]
            if isinstance(effect, Store):
                if self._ttl_ms is None:
                    self._ttl_ms = int(await client.hget(keys.session, "ttl") or 86_400_000)
                if effect.texts:
                    pipe = client.pipeline(transaction=False)
                    pipe.hset(keys.content, mapping=dict(effect.texts))
                    pipe.pexpire(keys.content, self._ttl_ms)
                    await pipe.execute()
                return None
            raw = await client.hgetall(keys.compacted)
            return {_text(k): _text(v) for k, v in raw.items()}

    def turn(self, working_set: int = 0, output_reserve: int | None = None) -> AsyncTurn:
        """``async with agent.turn(working_set) as turn:`` runs begin_turn on entry and end_turn
        on a clean exit, with the prompt given to :meth:`Turn.prompt`."""
        return AsyncTurn(self, working_set, output_reserve)

    def track(self, consumer: Consumer | str, objs: Sequence[Obj]) -> None:
        self.core.track(consumer, objs)

    async def read_spill(self, handle: str) -> str | None:
        """A spilled tool result's whole text, from any worker (None once expired)."""
        data = await self.session.ledger.read_spill(self.session.id, handle)
        return None if data is None else data.decode()

    async def reconcile(self, held: Mapping[Consumer | str, Sequence[Obj]]) -> Reconciled:
        """Set the ledger to exactly the app objects the prompt holds (per consumer named)."""
        return await self.run(self.core.reconcile(held))


class AsyncTurn:
    """One turn: begin_turn on entry, end_turn on a clean exit. ``dropped`` are the app
    objects the ledger reclaimed to start the turn: take them out of the prompt."""

    def __init__(self, agent: AsyncAgent, working_set: int, output_reserve: int | None) -> None:
        self.agent = agent
        self._begin = (working_set, output_reserve)
        self.state: TurnState | None = None
        self._prompt: int | None = None

    async def __aenter__(self) -> AsyncTurn:
        self.state = await self.agent.run(self.agent.core.begin(*self._begin))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None and self._state.report is None:
            await self.end()

    @property
    def _state(self) -> TurnState:
        if self.state is None:
            raise InvalidArgument(
                "the turn has not begun: use it as `async with agent.turn() as turn:`"
            )
        return self.state

    @property
    def number(self) -> int:
        return self._state.turn

    @property
    def dropped(self) -> list[Obj]:
        return self._state.dropped

    @property
    def report(self) -> TurnReport | None:
        return self._state.report

    @property
    def summaries(self) -> list[Obj]:
        """The worker's summaries committed since this agent's last turn: put them in the
        prompt (the objects they replaced are in ``dropped``)."""
        return self._state.summaries

    async def admit(
        self, consumer: Consumer | str, objs: Sequence[Obj], priority: int = 0
    ) -> Admission[Any]:
        """Admit app objects (the longest prefix that fits); ``kept`` go in the prompt.
        Retrieval and recall wait (bounded) for a pending compaction first."""
        got = await self.agent.run(self.agent.core.admit(consumer, objs, priority))
        self._state.admissions.append(got)
        return got

    async def tool_result(self, result: Obj, text: str | None = None) -> ToolOutcome[Any]:
        """Admit a tool result whole, or spill it: put ``outcome.text`` in the prompt and
        drop ``outcome.evicted``."""
        got = await self.agent.run(self.agent.core.tool_result(result, text))
        self._state.tools.append(got)
        return got

    async def release(self, objs: Sequence[Obj]) -> list[Obj]:
        return await self.agent.run(self.agent.core.release(objs))

    async def compact(self, replaced: Sequence[Obj], summary: Obj | None) -> Compacted:
        return await self.agent.run(self.agent.core.compact(replaced, summary))

    def prompt(self, prompt: int | str | Sequence[Obj]) -> int:
        """Give the real prompt (its tokens, its text, or the objects it is made of)."""
        self._prompt = self.agent.core.prompt_tokens(prompt)
        self._state.prompt_tokens = self._prompt
        return self._prompt

    async def end(self, prompt: int | str | Sequence[Obj] | None = None) -> TurnReport:
        if prompt is not None:
            self.prompt(prompt)
        if self._prompt is None:
            raise InvalidArgument("end_turn needs the real prompt: call turn.prompt(...) first")
        try:
            report = await self.agent.run(self.agent.core.end(self._state.turn, self._prompt))
        except ContextDrift as exc:
            # The turn has ended (drift_action="raise"): keep its report all the same.
            if isinstance(exc.report, TurnReport):
                self._state.report = exc.report
            raise
        self._state.report = report
        return report
