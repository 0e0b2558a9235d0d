"""LangGraph / langchain-core adapter: the ledger governs a graph's context.

Glue, beyond the graph itself::

    gov = LedgerGraph(Agent(session, TiktokenCounter()), summarize=my_summarizer)
    docs: Annotated[list[Document], merge_docs]      # in the graph's state
    model = gov.model(chat_model)                    # measures every real prompt
    gov.govern(builder)                              # before builder.compile()
    with gov.turn(working_set=2_000):                # around each graph.invoke
        graph.invoke({...})

Every node's update passes through the ledger before it reaches the state: new
messages are admitted to working memory, ``ToolMessage`` results are admitted whole
or spilled (their content becomes the preview, naming the handle), documents under
the retrieval keys are admitted (those refused never reach the state), and items the
ledger reclaimed, evicted or compacted away leave the state (``RemoveMessage`` /
:class:`Removed`). The model wrapper counts each prompt actually sent; the turn ends
with the last prompt plus the answer it produced, so drift shows on that turn.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ledger.agent.core import Obj, default_summary
from ledger.agent.counters import count
from ledger.agent.sync import Agent, Turn
from ledger.errors import (
    AdmissionRefused,
    ContextOverflow,
    InvalidArgument,
    WorkingMemoryStarvation,
)
from ledger.extras import missing
from ledger.models import Consumer

try:
    from langchain_core.documents import Document
    from langchain_core.messages import (
        BaseMessage,
        RemoveMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langchain-core", "langgraph", "the LangGraph adapter") from exc


@dataclass(frozen=True, slots=True)
class Removed:
    """In a documents update: remove the document with this id (see :func:`merge_docs`)."""

    id: str


def doc_id(doc: Any) -> str | None:
    v = getattr(doc, "id", None)
    return str(v) if v else None


def merge_docs(left: Sequence[Any] | None, right: Sequence[Any] | Any | None) -> list[Any]:
    """Reducer for a documents channel: add or replace documents by id, drop
    :class:`Removed` ones."""
    out = {doc_id(d) or str(i): d for i, d in enumerate(left or [])}
    if right is None:
        return list(out.values())
    for d in right if isinstance(right, (list, tuple)) else [right]:
        if isinstance(d, Removed):
            out.pop(d.id, None)
        else:
            out[doc_id(d) or uuid.uuid4().hex] = d
    return list(out.values())


def _consumer(msg: BaseMessage) -> Consumer:
    return Consumer.SCRATCHPAD if isinstance(msg, ToolMessage) else Consumer.WORKING_MEMORY


class LedgerGraph:
    """Governs a LangGraph graph's state with an :class:`~ledger.agent.Agent`.

    ``summarize(objects) -> str``: when the ledger has a compaction pending, the first
    node of the next turn replaces everything but the last ``keep_messages`` messages
    (and every earlier document) by one summary message. Without it, a pending
    compaction is left to the ledger's worker, and retrieval waits for it.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        messages_key: str = "messages",
        retrieval_keys: Sequence[str] = ("docs",),
        summarize: Callable[[list[Obj]], str] | None = None,
        keep_messages: int = 4,
    ) -> None:
        self.agent = agent
        self.messages_key = messages_key
        self.retrieval_keys = tuple(retrieval_keys)
        self.summarize = summarize
        self.keep_messages = keep_messages
        if agent.core.summary_of is default_summary:
            # the worker's summaries enter the state as system messages
            agent.core.summary_of = lambda sid, text: SystemMessage(content=text, id=sid)
        self.current: Turn | None = None
        self.last_prompt: int | None = None  # the last prompt sent, plus its answer
        self.limit: int | None = None  # window minus output reserve, for this turn
        self._fresh = False  # the turn's first node has not run yet

    # --- the graph ---------------------------------------------------------------------

    def govern(self, builder: Any) -> Any:
        """Wrap every node of a ``StateGraph`` builder (call before ``compile()``)."""
        for spec in builder.nodes.values():
            spec.runnable = self.node(spec.runnable)
        return builder

    def node(self, fn: Any) -> Callable[[Any, RunnableConfig], Any]:
        """Wrap one node: its update passes through the ledger."""
        runnable = fn if isinstance(fn, Runnable) else RunnableLambda(fn)

        def governed(state: Any, config: RunnableConfig) -> Any:
            turn = self._turn()
            self._track(state)
            pre = self._start(turn, state) if self._fresh else {}
            update = runnable.invoke(state, config)
            return self._apply(turn, state, update, pre)

        return governed

    def model(self, chat_model: Any) -> Runnable[Any, Any]:
        """Wrap a chat model: each prompt it is sent is counted (the real prompt)."""
        core = self.agent.core

        def call(messages: Any, config: RunnableConfig) -> Any:
            msgs = messages.to_messages() if hasattr(messages, "to_messages") else messages
            if not isinstance(msgs, list):
                raise InvalidArgument("the governed model takes a list of messages")
            prompt = core.prompt_tokens(msgs)
            if self.limit is not None and prompt > self.limit:
                raise ContextOverflow(prompt, self.limit)  # a guard acts before the call
            answer = chat_model.invoke(msgs, config)
            self.last_prompt = prompt + core.prompt_tokens([answer])
            return answer

        return RunnableLambda(call)

    @contextmanager
    def turn(self, working_set: int = 0, output_reserve: int | None = None) -> Iterator[Turn]:
        """One graph invocation as one ledger turn: begin_turn, then end_turn with the
        real prompt (the last one the model was sent, plus its answer)."""
        turn = self.agent.turn(working_set, output_reserve)
        turn.__enter__()
        snap = self.agent.session.snapshot()
        reserve = snap.output_reserve if output_reserve is None else output_reserve
        self.limit = snap.window - reserve
        self.current, self.last_prompt, self._fresh = turn, None, True
        try:
            yield turn
            if self.last_prompt is None:
                raise InvalidArgument("the turn called no governed model: wrap it with gov.model()")
            turn.end(self.last_prompt)
        finally:
            self.current = None

    # --- one node's update -------------------------------------------------------------

    def _turn(self) -> Turn:
        if self.current is None:
            raise InvalidArgument("a governed node ran outside `with gov.turn():`")
        return self.current

    def _track(self, state: Any) -> None:
        core = self.agent.core
        for msg in _get(state, self.messages_key) or []:
            if msg.id:
                core.known[(_consumer(msg), core.item_id(msg))] = msg
        for key in self.retrieval_keys:
            core.track(Consumer.RETRIEVAL, _get(state, key) or [])

    def _start(self, turn: Turn, state: Any) -> dict[str, list[Any]]:
        """The turn's first node: drop what begin_turn reclaimed, compact if pending."""
        self._fresh = False
        assert turn.state is not None
        objs, unknown = self.agent.core.resolve(turn.state.unresolved)
        turn.state.unresolved[:] = unknown
        drop = [*turn.dropped, *objs]
        pre: dict[str, list[Any]] = {}
        self._removals(pre, drop)
        # Messages that entered the state as the graph's input, not through a node:
        # admitted now (those the ledger holds already are duplicates, charged nothing).
        # By ledger id: the state's objects may be copies of those dropped (a checkpointer)
        gone_ids = {self.agent.core.item_id(o) for o in drop if getattr(o, "id", None)}
        adopt = [
            m
            for m in _get(state, self.messages_key) or []
            if m.id
            and self.agent.core.item_id(m) not in gone_ids
            and not isinstance(m, ToolMessage)
        ]
        if adopt:
            self._admit_messages(turn, adopt)
        for summary in turn.summaries:  # the worker's, committed since the last turn
            pre.setdefault(self.messages_key, []).append(summary)
        if self.summarize is not None and self.agent.core.compaction_pending:
            self._compact(turn, state, pre, {id(o) for o in drop})
        return pre

    def _compact(self, turn: Turn, state: Any, pre: dict[str, list[Any]], gone: set[int]) -> None:
        msgs = [m for m in _get(state, self.messages_key) or [] if id(m) not in gone]
        cut = max(len(msgs) - self.keep_messages, 0)
        while 0 < cut < len(msgs) and isinstance(msgs[cut], ToolMessage):
            cut -= 1  # keep a tool result with the call that asked for it
        old: list[Obj] = list(msgs[:cut])
        for key in self.retrieval_keys:
            old += [d for d in _get(state, key) or [] if id(d) not in gone]
        summarize = self.summarize
        if not old or summarize is None:
            return
        summary = SystemMessage(
            content=summarize(old), id=f"summary-{turn.number}-{uuid.uuid4().hex[:8]}"
        )
        done = turn.compact(old, summary)
        self._removals(pre, list(done.dropped))
        if done.summary is not None and done.dropped:
            pre.setdefault(self.messages_key, []).append(summary)

    def _removals(self, update: dict[str, list[Any]], objs: Sequence[Obj]) -> None:
        for o in objs:
            if isinstance(o, BaseMessage) and o.id:
                update.setdefault(self.messages_key, []).append(RemoveMessage(id=o.id))
            elif isinstance(o, Document) and o.id:
                key = self.retrieval_keys[0]
                update.setdefault(key, []).append(Removed(o.id))

    def _apply(self, turn: Turn, state: Any, update: Any, pre: dict[str, list[Any]]) -> Any:
        if update is None and not pre:
            return update
        if update is not None and not isinstance(update, dict):
            return update  # a Command or another update the adapter does not read
        out = dict(update or {})
        extra: dict[str, list[Any]] = {}
        msgs = out.get(self.messages_key)
        if msgs is not None:
            out[self.messages_key] = self._messages(
                turn, msgs if isinstance(msgs, list) else [msgs], extra
            )
        for key in self.retrieval_keys:
            docs = out.get(key)
            if docs is not None:
                got = turn.admit(
                    Consumer.RETRIEVAL, [d for d in docs if not isinstance(d, Removed)]
                )
                out[key] = [*got.kept, *(d for d in docs if isinstance(d, Removed))]
        for key, vals in (*pre.items(), *extra.items()):
            out[key] = [*vals, *out.get(key, [])]
        return out

    def _messages(self, turn: Turn, msgs: list[Any], extra: dict[str, list[Any]]) -> list[Any]:
        core = self.agent.core
        out: list[Any] = []
        new: list[BaseMessage] = []
        for m in msgs:
            if isinstance(m, RemoveMessage):
                out.append(m)
                continue
            if not isinstance(m, BaseMessage):
                raise InvalidArgument(
                    f"a messages update holds a {type(m).__name__}, not a message"
                )
            if not m.id:
                m = m.model_copy(update={"id": uuid.uuid4().hex})
            if isinstance(m, ToolMessage):
                res = turn.tool_result(m)
                if res.spilled:
                    m = m.model_copy(update={"content": res.text})
                    core.known[(Consumer.SCRATCHPAD, core.item_id(m))] = m
                self._removals(extra, list(res.evicted))
            else:
                new.append(m)
            out.append(m)
        if new:
            self._admit_messages(turn, new)
        return out

    def _admit_messages(self, turn: Turn, msgs: list[BaseMessage]) -> None:
        """Admit messages to working memory: all of them, or a refusal."""
        core = self.agent.core
        got = turn.admit(Consumer.WORKING_MEMORY, msgs)
        if got.refused:
            raise AdmissionRefused(
                got.reason or "token_budget_exhausted",
                sum(count(core.counter, core.text_of(m), "a message") for m in got.refused),
                got.free,
                {"reason": got.reason or "token_budget_exhausted"},
            )


def _get(state: Any, key: str) -> Any:
    return state.get(key) if isinstance(state, dict) else getattr(state, key, None)


__all__ = ["LedgerGraph", "Removed", "WorkingMemoryStarvation", "merge_docs"]
