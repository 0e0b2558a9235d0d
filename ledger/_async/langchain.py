"""The LangChain middleware's asyncio face: :class:`AsyncLedgerMiddleware`.

This file is the source of both faces: ``ledger/_sync/langchain.py``
(``LedgerMiddleware``, the sync hooks) is generated from it (``python tools/unasync.py``;
a test checks it is up to date). The turn's logic is the LangGraph adapter's
(:class:`~ledger._async.langgraph.AsyncLedgerGraph`, its I/O-free part in
:mod:`ledger.adapters.graph_core`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, BaseMessage, RemoveMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.types import Command

from ledger._async.langgraph import AsyncLedgerGraph
from ledger.adapters.graph_core import GraphTurn, billed_usage, consumer_of, model_name
from ledger.agent import AsyncAgent
from ledger.agent.core import Obj
from ledger.agent.counters import count
from ledger.errors import LedgerError
from ledger.models import Consumer, Reconciled


class AsyncLedgerMiddleware(AgentMiddleware):
    """Governs a ``langchain.agents.create_agent`` agent's context with the ledger
    (an :class:`~ledger.agent.AsyncAgent`: its hooks ``abefore_model``, ``awrap_model_call``,
    ``aafter_model``, ``awrap_tool_call``)."""

    def __init__(
        self,
        agent: AsyncAgent,
        *,
        checkpointer: Any = None,
        summarize: Callable[[list[Obj]], str] | None = None,
        keep_messages: int = 4,
        tenant: str | None = None,
        scopes: Sequence[str] = (),
        model: str | None = None,
    ) -> None:
        super().__init__()
        self.graph = AsyncLedgerGraph(
            agent,
            checkpointer=checkpointer,
            summarize=summarize,
            keep_messages=keep_messages,
            tenant=tenant,
            scopes=scopes,
            model=model,
        )
        self.agent = agent
        self._held: dict[tuple[Consumer, str], BaseMessage] = {}  # this turn's view

    @property
    def name(self) -> str:
        return "LedgerMiddleware"

    @contextlib.asynccontextmanager
    async def turn(
        self,
        working_set: int = 0,
        output_reserve: int | None = None,
        *,
        config: Any = None,
        wait: float = 0.0,
        takeover: bool = False,
    ) -> AsyncIterator[GraphTurn]:
        """One agent invocation as one ledger turn (see ``LedgerGraph.turn``): invoke with
        ``turn.config``, pinned to the checkpoint the last ended turn committed (or one
        written on top of it between turns)."""
        self._held = {}
        async with self.graph.turn(
            working_set, output_reserve, config=config, wait=wait, takeover=takeover
        ) as turn:
            yield turn

    async def reconcile(self, state: Any) -> Reconciled:
        """Set the ledger to exactly what the agent's state holds (its messages), the
        repair of a flagged drift; ``state`` may be the agent's config (read from the
        checkpointer)."""
        return await self.graph.reconcile(state)

    # --- the agent's hooks -----------------------------------------------------------

    async def abefore_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        gov = self.graph
        turn = gov._turn()
        core = self.agent.core
        update: dict[str, list[Any]] = {}
        fresh = gov._fresh
        if fresh:  # the turn's first model call: its deliveries, and the input admitted
            update = await gov._start(turn, state)
            state = gov._merged(state, update)
        msgs = [m for m in state.get(gov.messages_key) or [] if isinstance(m, BaseMessage)]
        gov._track(state)
        now = {(consumer_of(m), core.item_id(m)): m for m in msgs if m.id}
        if fresh:
            self._held = now
            return update or None
        # What another middleware took out of the state since the last look: given back.
        gone = [m for key, m in self._held.items() if key not in now]
        if gone:
            await turn.release(gone)
        new = [
            m
            for key, m in now.items()
            if key not in self._held and not isinstance(m, ToolMessage) and m.id
        ]
        if new:
            await gov._admit_messages(turn, new)
        self._held = now
        return update or None

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        gov = self.graph
        turn = gov._turn()
        core = self.agent.core
        msgs = [*([request.system_message] if request.system_message else []), *request.messages]
        with core.counter.measure() as tally:
            framing = self.tool_tokens(request.tools)
            prompt = core.prompt_tokens(msgs) + framing
        if turn.state is not None:
            turn.state.framing = framing
        gov._guard(prompt, tally)  # a guard acts before the call
        hold = None
        if core.tenant is not None:  # the tenant's ceilings: the worst case held first
            name = model_name(getattr(request, "model", None))
            hold = await turn.hold(prompt, gov._output_reserve(), name)
        try:
            response = await handler(request)
        except BaseException:
            if hold is not None:  # (else it lapses at its deadline)
                with contextlib.suppress(LedgerError):
                    await turn.void_hold(hold)
            raise
        answers = [m for m in getattr(response, "result", [response]) if isinstance(m, AIMessage)]
        if hold is not None:
            first = answers[0] if answers else None
            named = first if first is not None and first.id else None
            await turn.settle_hold(hold, named, billed_usage(first))
        gov.last_prompt = prompt + core.prompt_tokens(answers)
        for answer in answers[:1]:
            usage: dict[str, Any] = dict(answer.usage_metadata or {})
            billed = usage.get("input_tokens")
            if type(billed) is int and billed > 0:
                await turn.billed(billed, prompt, tally)  # what the provider billed for it
        return response

    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """The model's answer: admitted to working memory (the turn may end with it)."""
        gov = self.graph
        turn = gov._turn()
        core = self.agent.core
        msgs: list[BaseMessage] = [
            m for m in state.get(gov.messages_key) or [] if isinstance(m, AIMessage) and m.id
        ]
        new = [m for m in msgs if (Consumer.WORKING_MEMORY, core.item_id(m)) not in self._held]
        if new:
            await gov._admit_messages(turn, new)
            self._held.update({(Consumer.WORKING_MEMORY, core.item_id(m)): m for m in new})
        return None

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        """A tool's result: admitted whole, or spilled (the preview takes its place), before
        it reaches the state; memory it evicted leaves the state."""
        gov = self.graph
        turn = gov._turn()
        result = await handler(request)
        if not isinstance(result, ToolMessage):
            return result
        got = await turn.tool_result(result)
        shown = got.spilled or got.refused  # the preview, or the refusal note, in its place
        msg = result.model_copy(update={"content": got.text}) if shown else result
        self.agent.core.known[(Consumer.SCRATCHPAD, self.agent.core.item_id(msg))] = msg
        self._held[(Consumer.SCRATCHPAD, self.agent.core.item_id(msg))] = msg
        removed = [
            RemoveMessage(id=o.id) for o in got.evicted if isinstance(o, BaseMessage) and o.id
        ]
        if not removed:
            return msg
        return Command(update={gov.messages_key: [*removed, msg]})

    def tool_tokens(self, tools: Any) -> int:
        """The tokens of the tool schemas a model call sends (their OpenAI function form):
        billed with every prompt, the budget's ``tool_framing``."""
        total = 0
        for t in tools or []:
            schema = t if isinstance(t, dict) else convert_to_openai_tool(t)
            total += count(
                self.agent.core.counter, json.dumps(schema, sort_keys=True), "a tool schema"
            )
        return total


__all__ = ["AsyncLedgerMiddleware"]
