"""LangGraph / langchain-core adapter: the ledger governs a graph's context.

Glue, beyond the graph itself::

    gov = LedgerGraph(Agent(session, TiktokenCounter()), checkpointer=saver)
    docs: Annotated[list[Document], merge_docs]      # in the graph's state
    model = gov.model(chat_model)                    # measures every real prompt
    graph = gov.govern(builder).compile(checkpointer=saver)
    with gov.turn(working_set=2_000, config=config) as turn:   # around each invoke
        graph.invoke({...}, turn.config)

In a fleet every process serves any turn: the conversation lives in the graph's
checkpointer, the budget in the ledger, and each ended turn records the checkpoint it
committed in the ledger (its commit mark). The next turn, on any process, starts from
that checkpoint (``turn.config`` pins it): a turn whose process died mid-way is rolled
back in the ledger and its checkpoints are left on a dead branch, so both start again
from the last committed turn.

Every node's update passes through the ledger before it reaches the state: new
messages are admitted to working memory, ``ToolMessage`` results are admitted whole
or spilled (their content becomes the preview, naming the handle), documents under
the retrieval keys are admitted (those refused never reach the state), and items the
ledger reclaimed, evicted or compacted away leave the state (``RemoveMessage`` /
:class:`Removed`). The model wrapper counts each prompt actually sent; the turn ends
with the last prompt plus the answer it produced, so drift shows on that turn.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ledger.agent.core import Obj, default_summary
from ledger.agent.counters import count
from ledger.agent.sync import Agent, Turn
from ledger.errors import (
    AdmissionRefused,
    InvalidArgument,
    WorkingMemoryStarvation,
)
from ledger.extras import missing
from ledger.models import Consumer, Reconciled

try:
    from langchain_core.documents import Document
    from langchain_core.messages import (
        BaseMessage,
        RemoveMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda
    from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langgraph", "langgraph", "the LangGraph adapter") from exc


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


class GraphTurn:
    """One governed graph invocation: the agent layer's :class:`~ledger.agent.Turn`
    (``report``, ``number``, ``dropped``, ``summaries``, ``rolled_back``...) and the
    ``config`` to invoke the graph with (pinned to the last committed checkpoint)."""

    def __init__(self, turn: Turn, config: RunnableConfig | None) -> None:
        self.turn = turn
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.turn, name)


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
        checkpointer: Any = None,
        messages_key: str = "messages",
        retrieval_keys: Sequence[str] = ("docs",),
        summarize: Callable[[list[Obj]], str] | None = None,
        keep_messages: int = 4,
    ) -> None:
        self.agent = agent
        # The graph's checkpointer (a BaseCheckpointSaver): each ended turn records the
        # checkpoint it committed, and the next turn starts from it (turn.config).
        self.checkpointer = checkpointer
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
        self.window: int | None = None
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
            pre: dict[str, list[Any]] = {}
            if self._fresh:
                # The turn's first node, whichever it is: the deliveries (what the ledger
                # reclaimed, the worker's summaries) reach the state the node sees, so
                # that a model call in it already has the compacted history.
                pre = self._start(turn, state)
                state = self._merged(state, pre)
            self._track(state)
            update = runnable.invoke(state, config)
            return self._apply(turn, state, update, pre)

        return governed

    def model(self, chat_model: Any) -> Runnable[Any, Any]:
        """Wrap a chat model: each prompt it is sent is counted (the real prompt), and the
        input tokens its answer reports (``usage_metadata``) are checked against that
        count (``turn.billed``)."""
        core = self.agent.core

        def call(messages: Any, config: RunnableConfig) -> Any:
            msgs = messages.to_messages() if hasattr(messages, "to_messages") else messages
            if not isinstance(msgs, list):
                raise InvalidArgument("the governed model takes a list of messages")
            with core.counter.measure() as tally:
                prompt = core.prompt_tokens(msgs)
            core.guard(prompt, self.limit, self.window, tally)  # a guard acts before the call
            answer = chat_model.invoke(msgs, config)
            self.last_prompt = prompt + core.prompt_tokens([answer])
            billed = (getattr(answer, "usage_metadata", None) or {}).get("input_tokens")
            if self.current is not None and type(billed) is int and billed > 0:
                self.current.billed(billed, prompt, tally)  # what the provider billed for it
            return answer

        return RunnableLambda(call)

    @contextmanager
    def turn(
        self,
        working_set: int = 0,
        output_reserve: int | None = None,
        *,
        config: RunnableConfig | None = None,
        wait: float = 0.0,
        takeover: bool = False,
    ) -> Iterator[GraphTurn]:
        """One graph invocation as one ledger turn: begin_turn (the turn lease), then
        end_turn with the real prompt (the last one the model was sent, plus its answer)
        and, with a checkpointer, the checkpoint the turn committed. Invoke the graph with
        ``turn.config``: ``config`` pinned to the last committed checkpoint. An exception
        rolls the turn back. ``wait`` / ``takeover``: see ``Agent.turn``."""
        with self.agent.turn(working_set, output_reserve, wait=wait, takeover=takeover) as turn:
            snap = self.agent.session.snapshot()
            reserve = snap.output_reserve if output_reserve is None else output_reserve
            self.limit, self.window = snap.window - reserve, snap.window
            self.current, self.last_prompt, self._fresh = turn, None, True
            try:
                yield GraphTurn(turn, self._pinned(turn, config))
                if self.last_prompt is None:
                    raise InvalidArgument(
                        "the turn called no governed model: wrap it with gov.model()"
                    )
                turn.end(self.last_prompt, mark=self._committed(turn, config))
            finally:
                self.current = None

    def _pinned(self, turn: Turn, config: RunnableConfig | None) -> RunnableConfig | None:
        """The config that starts this turn from the last committed checkpoint: the one
        the last ended turn recorded; before any turn ended, the state before the first
        governed turn (one that died left checkpoints nobody committed)."""
        if config is None or self.checkpointer is None:
            return config
        conf = dict(config.get("configurable") or {})
        if "thread_id" not in conf:
            raise InvalidArgument("the graph's config needs configurable.thread_id")
        conf.pop("checkpoint_id", None)
        start = turn.mark or self._before_governed(conf)
        if start is not None:
            conf["checkpoint_id"] = start
        meta = {**(config.get("metadata") or {}), "ledger_turn": turn.number}
        return {**config, "configurable": conf, "metadata": meta}

    def _before_governed(self, conf: dict[str, Any]) -> str | None:
        """No turn has committed a checkpoint yet. If governed turns wrote some (they
        died: rolled back), start from the checkpoint before the first of them."""
        base = {"configurable": {"thread_id": conf["thread_id"]}}
        first = None
        for tup in self.checkpointer.list(base):  # newest first
            if "ledger_turn" in (tup.metadata or {}):
                first = tup
        if first is None:
            return None  # a fresh thread, or one whose history came before the ledger
        parent = first.parent_config
        if parent is not None:
            return str(parent["configurable"]["checkpoint_id"])
        return str(first.config["configurable"]["checkpoint_id"])  # the thread's very first

    def _committed(self, turn: Turn, config: RunnableConfig | None) -> str | None:
        """The checkpoint this turn ends on: the newest this turn wrote (its metadata names
        the turn; a zombie's on a dead branch names another), the mark end_turn records."""
        if config is None or self.checkpointer is None:
            return None
        base = {"configurable": {"thread_id": (config.get("configurable") or {})["thread_id"]}}
        for tup in self.checkpointer.list(base, filter={"ledger_turn": turn.number}, limit=1):
            return str(tup.config["configurable"]["checkpoint_id"])
        return None

    def reconcile(self, state: Any) -> Reconciled:
        """Set the ledger to exactly what the graph's state holds (its messages, by kind,
        and its documents): the repair of a flagged drift. ``state``: the state's values,
        or the graph's config (read from the checkpointer: the latest checkpoint)."""
        if isinstance(state, dict) and "configurable" in state:
            if self.checkpointer is None:
                raise InvalidArgument(
                    "reconcile(config) needs the checkpointer: LedgerGraph(..., checkpointer=)"
                )
            conf = {"configurable": {"thread_id": state["configurable"]["thread_id"]}}
            latest = self.checkpointer.get_tuple(conf)
            state = {} if latest is None else latest.checkpoint["channel_values"]
        held: dict[Consumer | str, list[Any]] = {c: [] for c in Consumer}
        for msg in _get(state, self.messages_key) or []:
            held[_consumer(msg)].append(msg)
        for key in self.retrieval_keys:
            held[Consumer.RETRIEVAL] += list(_get(state, key) or [])
        return self.agent.reconcile(held)

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
        """The turn's first node: the deliveries as an update of the state (reclaimed and
        replaced objects out, the worker's summaries in where the history they replace
        began), the graph's input admitted, and a pending compaction done if asked for."""
        self._fresh = False
        assert turn.state is not None
        core = self.agent.core
        msgs = list(_get(state, self.messages_key) or [])
        pre: dict[str, list[Any]] = {}
        kept = turn.apply(msgs)
        if kept != msgs:
            if turn.summaries:  # placed where the history they replace began: a rewrite
                pre[self.messages_key] = [RemoveMessage(id=REMOVE_ALL_MESSAGES), *kept]
            else:
                ids = {id(m) for m in kept}
                pre[self.messages_key] = [
                    RemoveMessage(id=m.id) for m in msgs if id(m) not in ids and m.id
                ]
        for key in self.retrieval_keys:
            docs = list(_get(state, key) or [])
            ids = {id(d) for d in turn.apply(docs)}
            gone = [Removed(d.id) for d in docs if id(d) not in ids and d.id]
            if gone:
                pre[key] = gone
        # Messages that entered the state as the graph's input, not through a node:
        # admitted now (those the ledger holds already are duplicates, charged nothing).
        summary_ids = {core.item_id(o) for o in turn.summaries}
        adopt = [
            m
            for m in kept
            if isinstance(m, BaseMessage)
            and m.id
            and not isinstance(m, ToolMessage)
            and core.item_id(m) not in summary_ids
        ]
        if adopt:
            self._admit_messages(turn, adopt)
        for summary in turn.summaries:
            core.known[(Consumer.WORKING_MEMORY, core.item_id(summary))] = summary
        if turn.state.recalibrated:
            # the session's calibration changed: its objects count otherwise now, set to
            # the state as this turn holds it (its deliveries applied, not before them)
            self._recount(turn, self._merged(state, pre))
        if self.summarize is not None and core.compaction_pending:
            self._compact(turn, self._merged(state, pre), pre)
        return pre

    def _recount(self, turn: Turn, state: Any) -> None:
        """The ledger set to the state recounted; a refusal is kept on the turn
        (``turn.state.unreconciled``; its drift shows at end_turn), never raised out of the
        graph's run."""
        assert turn.state is not None
        try:
            self.reconcile(state)
        except AdmissionRefused as exc:
            turn.state.unreconciled = exc

    def _merged(self, state: Any, pre: Mapping[str, list[Any]]) -> Any:
        """The state with an update applied, as the graph's reducers apply it."""
        if not pre:
            return state
        new: dict[str, Any] = {}
        for key, vals in pre.items():
            old = _get(state, key) or []
            new[key] = (
                add_messages(old, vals) if key == self.messages_key else merge_docs(old, vals)
            )
        if isinstance(state, dict):
            return {**state, **new}
        if dataclasses.is_dataclass(state) and not isinstance(state, type):
            return dataclasses.replace(state, **new)
        if hasattr(state, "model_copy"):
            return state.model_copy(update=new)
        raise InvalidArgument(f"cannot update a graph state of type {type(state).__name__}")

    def _compact(self, turn: Turn, state: Any, pre: dict[str, list[Any]]) -> None:
        msgs = list(_get(state, self.messages_key) or [])
        cut = max(len(msgs) - self.keep_messages, 0)
        while 0 < cut < len(msgs) and isinstance(msgs[cut], ToolMessage):
            cut -= 1  # keep a tool result with the call that asked for it
        old: list[Obj] = list(msgs[:cut])
        for key in self.retrieval_keys:
            old += list(_get(state, key) or [])
        summarize = self.summarize
        if not old or summarize is None:
            return
        self._track(state)
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
                if res.spilled or res.refused:  # the preview, or the note, in its place
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
