"""The LangGraph adapter's asyncio face: :class:`AsyncLedgerGraph`.

This file is the source of both faces: ``ledger/_sync/langgraph.py`` (``LedgerGraph``)
is generated from it (``python tools/unasync.py``; a test checks it is up to date). What
is decided without I/O is in :mod:`ledger.adapters.graph_core`; this face does the I/O
(the ledger's calls, the checkpointer, the nodes and the chat model) with ``await``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, RemoveMessage, ToolMessage
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from ledger.adapters.graph_core import (
    FACES,
    TURN_KEY,
    GraphCore,
    GraphTurn,
    Removed,
    before_governed,
    billed_usage,
    checkpoint_id,
    flag_lost,
    model_name,
    pinned,
    start_after,
    thread_of,
)
from ledger.agent import AsyncAgent, AsyncTurn
from ledger.agent.core import Obj
from ledger.agent.counters import count
from ledger.errors import AdmissionRefused, InvalidArgument, LedgerError
from ledger.models import Consumer, Reconciled


class AsyncLedgerGraph(GraphCore):
    """Governs a LangGraph graph's state with an :class:`~ledger.agent.AsyncAgent` (asyncio).

    ``summarize(objects) -> str``: when the ledger has a compaction pending, the first
    node of the next turn replaces everything but the last ``keep_messages`` messages
    (and every earlier document) by one summary message. Without it, a pending
    compaction is left to the ledger's worker, and retrieval waits for it.
    """

    def __init__(
        self,
        agent: AsyncAgent,
        *,
        checkpointer: Any = None,
        messages_key: str = "messages",
        retrieval_keys: Sequence[str] = ("docs",),
        summarize: Callable[[list[Obj]], str] | None = None,
        keep_messages: int = 4,
        tenant: str | None = None,
        scopes: Sequence[str] = (),
        model: str | None = None,
    ) -> None:
        if not isinstance(agent, AsyncAgent):
            raise InvalidArgument(f"{FACES}; got a {type(agent).__name__}")
        # the tenant's ceilings (else as the agent names them)
        agent.core.adapter_tenant(tenant, scopes, model)
        super().__init__(
            agent.core, checkpointer, messages_key, retrieval_keys, summarize, keep_messages
        )
        self.agent = agent
        self.current: AsyncTurn | None = None

    # --- the graph ---------------------------------------------------------------------

    def govern(self, builder: Any) -> Any:
        """Wrap every node of a ``StateGraph`` builder (call before ``compile()``)."""
        for spec in builder.nodes.values():
            spec.runnable = self.node(spec.runnable)
        return builder

    def node(self, fn: Any) -> Callable[[Any, RunnableConfig], Any]:
        """Wrap one node: its update passes through the ledger."""
        runnable = fn if isinstance(fn, Runnable) else RunnableLambda(fn)

        async def governed(state: Any, config: RunnableConfig) -> Any:
            turn = self._turn()
            pre: dict[str, list[Any]] = {}
            if self._fresh:
                # The turn's first node, whichever it is: the deliveries (what the ledger
                # reclaimed, the worker's summaries) reach the state the node sees, so
                # that a model call in it already has the compacted history.
                pre = await self._start(turn, state)
                state = self._merged(state, pre)
            self._track(state)
            update = await runnable.ainvoke(state, config)
            return await self._apply(turn, state, update, pre)

        return governed

    def model(self, chat_model: Any) -> Runnable[Any, Any]:
        """Wrap a chat model: each prompt it is sent is counted (the real prompt), and the
        input tokens its answer reports (``usage_metadata``) are checked against that
        count (``turn.billed``). With a tenant named (``Agent(..., tenant=)``), each call
        holds its worst case in the tenant's ceilings before it, settles the billed usage
        after it and voids the hold when it raises (docs/ceilings.md#in-an-adapter)."""
        core = self.core

        async def call(messages: Any, config: RunnableConfig) -> Any:
            msgs, prompt, tally = self._prompt_of(messages)  # a guard acts before the call
            turn = self.current
            hold = None
            if core.tenant is not None:  # the tenant's ceilings: no call escapes them
                if turn is None:
                    raise InvalidArgument(
                        f"a model call of tenant {core.tenant!r} belongs inside `gov.turn()`"
                    )
                hold = await turn.hold(prompt, self._output_reserve(), model_name(chat_model))
            try:
                answer = await chat_model.ainvoke(msgs, config)
            except BaseException:
                if hold is not None and turn is not None:  # (else it lapses at its deadline)
                    with contextlib.suppress(LedgerError):
                        await turn.void_hold(hold)
                raise
            if hold is not None and turn is not None:
                named = answer if getattr(answer, "id", None) else None
                await turn.settle_hold(hold, named, billed_usage(answer))
            self.last_prompt = prompt + core.prompt_tokens([answer])
            billed = (getattr(answer, "usage_metadata", None) or {}).get("input_tokens")
            if self.current is not None and type(billed) is int and billed > 0:
                await self.current.billed(billed, prompt, tally)  # what the provider billed
            return answer

        return RunnableLambda(call)

    @contextlib.asynccontextmanager
    async def turn(
        self,
        working_set: int = 0,
        output_reserve: int | None = None,
        *,
        config: RunnableConfig | None = None,
        wait: float = 0.0,
        takeover: bool = False,
    ) -> AsyncIterator[GraphTurn]:
        """One graph invocation as one ledger turn: begin_turn (the turn lease), then
        end_turn with the real prompt (the last one the model was sent, plus its answer)
        and, with a checkpointer, the checkpoint the turn committed. Invoke the graph with
        ``turn.config``: ``config`` pinned to the last committed checkpoint, or to a
        checkpoint written on top of it between turns. An exception rolls the turn back.
        ``wait`` / ``takeover``: see ``Agent.turn``."""
        async with self.agent.turn(
            working_set, output_reserve, wait=wait, takeover=takeover
        ) as turn:
            snap = await self.agent.session.snapshot()
            reserve = snap.output_reserve if output_reserve is None else output_reserve
            self.limit, self.window = snap.window - reserve, snap.window
            self.current, self.last_prompt, self._fresh = turn, None, True
            self._gone = []
            try:
                yield GraphTurn(turn, await self._pinned(turn, config))
                if self.last_prompt is None:
                    raise InvalidArgument(
                        "the turn called no governed model: wrap it with gov.model()"
                    )
                await turn.end(self.last_prompt, mark=await self._committed(turn, config))
            finally:
                self.current = None

    async def _pinned(
        self, turn: AsyncTurn, config: RunnableConfig | None
    ) -> RunnableConfig | None:
        """The config that starts this turn: from the checkpoint the last ended turn
        recorded, or the newest written on top of it between turns (``update_state``: what
        that write removed is noted, to be given back); before any turn ended, the state
        before the first governed turn (one that died left checkpoints nobody committed)."""
        if config is None or self.checkpointer is None:
            return config
        base = thread_of(config)
        newer: list[Any] = []
        async with contextlib.aclosing(self.checkpointer.alist(base)) as found:
            async for tup in found:  # newest first, down to the mark
                if turn.mark is not None and checkpoint_id(tup) == turn.mark:
                    break
                newer.append(tup)
        if turn.mark is None:
            return pinned(config, before_governed(newer), turn.number)
        start = start_after(turn.mark, newer)
        flag_lost(turn.mark, newer, turn.number)
        if start != turn.mark:  # written between turns: what it removed is given back
            committed = await self.checkpointer.aget_tuple(pinned(config, turn.mark, 0))
            adopted = next(t for t in newer if checkpoint_id(t) == start)
            self._gone = self.removed_between(committed, adopted)
        return pinned(config, start, turn.number)

    async def _committed(self, turn: AsyncTurn, config: RunnableConfig | None) -> str | None:
        """The checkpoint this turn ends on: the newest this turn wrote (its metadata names
        the turn; a zombie's on a dead branch names another), the mark end_turn records."""
        if config is None or self.checkpointer is None:
            return None
        mine = {TURN_KEY: turn.number}
        async with contextlib.aclosing(
            self.checkpointer.alist(thread_of(config), filter=mine, limit=1)
        ) as found:
            async for tup in found:
                return checkpoint_id(tup)
        return None

    async def reconcile(self, state: Any) -> Reconciled:
        """Set the ledger to exactly what the graph's state holds (its messages, by kind,
        and its documents): the repair of a flagged drift. ``state``: the state's values,
        or the graph's config (read from the checkpointer: the latest checkpoint)."""
        if isinstance(state, dict) and "configurable" in state:
            if self.checkpointer is None:
                raise InvalidArgument(
                    "reconcile(config) needs the checkpointer: LedgerGraph(..., checkpointer=)"
                )
            latest = await self.checkpointer.aget_tuple(thread_of(state))
            state = {} if latest is None else latest.checkpoint["channel_values"]
        return await self.agent.reconcile(self.held(state))

    # --- one node's update -------------------------------------------------------------

    def _turn(self) -> AsyncTurn:
        if self.current is None:
            raise InvalidArgument("a governed node ran outside `with gov.turn():`")
        return self.current

    async def _start(self, turn: AsyncTurn, state: Any) -> dict[str, list[Any]]:
        """The turn's first node: what a write between turns removed given back, the
        deliveries as an update of the state, the messages that entered the state outside
        a node admitted, a pending compaction done if asked for."""
        self._fresh = False  # before any wait: a parallel node does not start it again
        ts = turn.state
        assert ts is not None
        if self._gone and not ts.reset:  # (after a hard reset the ledger holds none)
            await turn.release(self._gone)
        self._gone = []
        pre, adopt = self._deliveries(ts, state)
        if adopt:
            await self._admit_messages(turn, adopt)
        if ts.recalibrated or ts.reset:
            # the session's calibration changed (its objects count otherwise now), or a
            # hard reset dropped every item (docs/agent.md#after-a-hard-reset): set to the
            # state as this turn holds it (its deliveries applied, not before them)
            await self._recount(turn, self._merged(state, pre))
        if self.summarize is not None and self.core.compaction_pending:
            plan = self._to_compact(ts, self._merged(state, pre))
            if plan is not None:
                old, summary = plan
                done = await turn.compact(old, summary)
                self._removals(pre, list(done.dropped))
                if done.summary is not None and done.dropped:
                    pre.setdefault(self.messages_key, []).append(summary)
        return pre

    async def _recount(self, turn: AsyncTurn, state: Any) -> None:
        """The ledger set to the state recounted; a refusal is kept on the turn
        (``turn.state.unreconciled``; its drift shows at end_turn), never raised out of the
        graph's run."""
        assert turn.state is not None
        try:
            await self.reconcile(state)
        except AdmissionRefused as exc:
            turn.state.unreconciled = exc

    async def _apply(
        self, turn: AsyncTurn, state: Any, update: Any, pre: dict[str, list[Any]]
    ) -> Any:
        if update is None and not pre:
            return update
        if update is not None and not isinstance(update, dict):
            return update  # a Command or another update the adapter does not read
        out = dict(update or {})
        extra: dict[str, list[Any]] = {}
        msgs = out.get(self.messages_key)
        if msgs is not None:
            out[self.messages_key] = await self._messages(
                turn, msgs if isinstance(msgs, list) else [msgs], extra
            )
        for key in self.retrieval_keys:
            docs = out.get(key)
            if docs is not None:
                out[key] = await self._documents(turn, docs)
        for key, vals in (*pre.items(), *extra.items()):
            out[key] = [*vals, *out.get(key, [])]
        return out

    async def _documents(self, turn: AsyncTurn, docs: list[Any]) -> list[Any]:
        got = await turn.admit(Consumer.RETRIEVAL, [d for d in docs if not isinstance(d, Removed)])
        return [*got.kept, *(d for d in docs if isinstance(d, Removed))]

    async def _messages(
        self, turn: AsyncTurn, msgs: list[Any], extra: dict[str, list[Any]]
    ) -> list[Any]:
        core = self.core
        out: list[Any] = []
        new: list[BaseMessage] = []
        for m in msgs:
            if isinstance(m, RemoveMessage):
                out.append(m)
                continue
            m = self._new_message(m)
            if isinstance(m, ToolMessage):
                res = await turn.tool_result(m)
                if res.spilled or res.refused:  # the preview, or the note, in its place
                    m = m.model_copy(update={"content": res.text})
                    core.known[(Consumer.SCRATCHPAD, core.item_id(m))] = m
                self._removals(extra, list(res.evicted))
            else:
                new.append(m)
            out.append(m)
        if new:
            await self._admit_messages(turn, new)
        return out

    async def _admit_messages(self, turn: AsyncTurn, msgs: list[BaseMessage]) -> None:
        """Admit messages to working memory: all of them, or a refusal."""
        core = self.core
        got = await turn.admit(Consumer.WORKING_MEMORY, msgs)
        if got.refused:
            raise AdmissionRefused(
                got.reason or "token_budget_exhausted",
                sum(count(core.counter, core.text_of(m), "a message") for m in got.refused),
                got.free,
                {"reason": got.reason or "token_budget_exhausted"},
            )


__all__ = ["AsyncLedgerGraph"]
