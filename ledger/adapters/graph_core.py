"""What both faces of the LangGraph and LangChain adapters share, with no I/O.

The faces (``ledger/_async/langgraph.py`` and ``ledger/_async/langchain.py``, written
by hand for asyncio; ``ledger/_sync/langgraph.py`` and ``ledger/_sync/langchain.py``
generated from them by ``tools/unasync.py``) do the I/O: the ledger's calls through the
agent layer's face, the graph's checkpointer, the chat model and the nodes. Everything
decided without I/O is here, once: the documents reducer, which state a turn starts
from, the update a turn's deliveries make to the state, how a state is merged.
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ledger.agent.core import AgentCore, Obj, TurnState, default_summary
from ledger.agent.counters import Tally
from ledger.errors import InvalidArgument, LostWriteWarning
from ledger.extras import missing
from ledger.models import Consumer, Usage

try:
    from langchain_core.documents import Document
    from langchain_core.messages import BaseMessage, RemoveMessage, SystemMessage, ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("langgraph", "langgraph", "the LangGraph adapter") from exc

TURN_KEY = "ledger_turn"  # a checkpoint's metadata: the ledger turn that wrote it
FACES = "LedgerGraph governs an Agent, AsyncLedgerGraph an AsyncAgent"


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


def consumer_of(msg: BaseMessage) -> Consumer:
    return Consumer.SCRATCHPAD if isinstance(msg, ToolMessage) else Consumer.WORKING_MEMORY


def billed_usage(answer: Any) -> Usage | None:
    """What a LangChain answer reports billed (``usage_metadata``; its input tokens count
    the cached reads too), as the ledger settles it; None when it reports none."""
    meta = getattr(answer, "usage_metadata", None) or {}
    i, o = meta.get("input_tokens"), meta.get("output_tokens")
    if type(i) is not int or type(o) is not int or i < 0 or o < 0:
        return None
    read = (meta.get("input_token_details") or {}).get("cache_read")
    cached = min(read, i) if type(read) is int and read > 0 else 0
    return Usage(input=i - cached, output=o, cached_input=cached)


def model_name(model: Any) -> str | None:
    """The name a chat model calls its model (prices it in the tenant's table), if any."""
    for attr in ("model_name", "model", "model_id"):
        v = getattr(model, attr, None)
        if isinstance(v, str) and v:
            return v
    return None


def get(state: Any, key: str) -> Any:
    return state.get(key) if isinstance(state, dict) else getattr(state, key, None)


def checkpoint_id(tup: Any) -> str:
    return str(tup.config["configurable"]["checkpoint_id"])


def thread_of(config: RunnableConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config naming the thread only (every checkpoint of it)."""
    conf = config.get("configurable") or {}
    if "thread_id" not in conf:
        raise InvalidArgument("the graph's config needs configurable.thread_id")
    return {"configurable": {"thread_id": conf["thread_id"]}}


def _roots(mark: str, newer: Sequence[Any]) -> dict[str, str | None]:
    """Where each checkpoint newer than ``mark`` leads, following its parents: to ``mark``
    itself (written on top of it), to a checkpoint a governed turn wrote (the metadata
    names its turn), or None (another branch)."""
    parents = {
        checkpoint_id(t): (
            None
            if t.parent_config is None
            else str(t.parent_config["configurable"]["checkpoint_id"])
        )
        for t in newer
    }
    by_turn = {checkpoint_id(t) for t in newer if TURN_KEY in (t.metadata or {})}
    roots: dict[str, str | None] = {}
    for tup in newer:
        at: str | None = checkpoint_id(tup)
        while at is not None and at != mark and at not in by_turn:
            at = parents.get(at)
        roots[checkpoint_id(tup)] = at
    return roots


def start_after(mark: str, newer: Sequence[Any]) -> str:
    """The checkpoint a turn starts from, given the one the last ended turn committed
    (``mark``) and the thread's checkpoints newer than it (newest first, as a
    checkpointer lists them). A checkpoint written between turns the framework's own
    way (``graph.update_state``, ``agent.update_state``) on top of the committed one is
    the state the turn starts from, so what it added is admitted like the graph's
    input; one a governed turn wrote (a turn that died, a zombie's) is on a dead branch,
    as is everything written on top of it."""
    roots = _roots(mark, newer)
    return next((at for at in roots if roots[at] == mark), mark)


def flag_lost(mark: str, newer: Sequence[Any], number: int) -> list[str]:
    """Warn of the checkpoints written between turns (not by a turn) that turn ``number``
    does not start from because they are on a dead branch: written on top of a
    checkpoint of a turn that was rolled back. Their ids (newest first)."""
    roots = _roots(mark, newer)
    lost = [at for at, root in roots.items() if root not in (None, mark, at)]
    if lost:
        warnings.warn(
            LostWriteWarning(
                lost,
                f"turn {number} starts from checkpoint {mark}, the last committed: "
                f"{len(lost)} checkpoint(s) written between turns ({', '.join(lost[:3])}) "
                "are on top of a turn that was rolled back, so not in its state: add what "
                "they wrote again once this turn has ended",
            ),
            stacklevel=4,
        )
    return lost


def before_governed(tuples: Sequence[Any]) -> str | None:
    """No turn has committed a checkpoint yet (``tuples``: the thread's, newest first). If
    governed turns wrote some (they died: rolled back), the checkpoint before the first
    of them; None for a fresh thread or one whose history came before the ledger."""
    first = None
    for tup in tuples:
        if TURN_KEY in (tup.metadata or {}):
            first = tup
    if first is None:
        return None
    parent = first.parent_config
    if parent is not None:
        return str(parent["configurable"]["checkpoint_id"])
    return checkpoint_id(first)  # the thread's very first


def pinned(config: RunnableConfig, start: str | None, number: int) -> RunnableConfig:
    """``config`` starting from checkpoint ``start``, its checkpoints naming turn ``number``."""
    conf = dict(config.get("configurable") or {})
    conf.pop("checkpoint_id", None)
    if start is not None:
        conf["checkpoint_id"] = start
    meta = {**(config.get("metadata") or {}), TURN_KEY: number}
    return {**config, "configurable": conf, "metadata": meta}


class GraphTurn:
    """One governed graph invocation: the agent layer's turn (``report``, ``number``,
    ``dropped``, ``summaries``, ``rolled_back``...; ``Turn`` or ``AsyncTurn``) and the
    ``config`` to invoke the graph with (pinned to the last committed checkpoint)."""

    def __init__(self, turn: Any, config: RunnableConfig | None) -> None:
        self.turn = turn
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.turn, name)


class GraphCore:
    """The settings and the I/O-free steps of ``LedgerGraph`` and ``AsyncLedgerGraph``.

    ``summarize(objects) -> str``: when the ledger has a compaction pending, the first
    node of the next turn replaces everything but the last ``keep_messages`` messages
    (and every earlier document) by one summary message. Without it, a pending
    compaction is left to the ledger's worker, and retrieval waits for it.
    """

    def __init__(
        self,
        core: AgentCore,
        checkpointer: Any,
        messages_key: str,
        retrieval_keys: Sequence[str],
        summarize: Callable[[list[Obj]], str] | None,
        keep_messages: int,
    ) -> None:
        self.core = core
        # The graph's checkpointer (a BaseCheckpointSaver): each ended turn records the
        # checkpoint it committed, and the next turn starts from it (turn.config).
        self.checkpointer = checkpointer
        self.messages_key = messages_key
        self.retrieval_keys = tuple(retrieval_keys)
        self.summarize = summarize
        self.keep_messages = keep_messages
        if core.summary_of is default_summary:
            # the worker's summaries enter the state as system messages
            core.summary_of = lambda sid, text: SystemMessage(content=text, id=sid)
        self.last_prompt: int | None = None  # the last prompt sent, plus its answer
        self.limit: int | None = None  # window minus output reserve, for this turn
        self.window: int | None = None  # the session's window, for this turn
        self._fresh = False  # the turn's first node has not run yet
        self._gone: list[Any] = []  # what a write between turns removed: given back

    def held(self, state: Any) -> dict[Consumer | str, list[Any]]:
        """What the graph's state holds, by consumer (what ``reconcile`` sets)."""
        held: dict[Consumer | str, list[Any]] = {c: [] for c in Consumer}
        for msg in get(state, self.messages_key) or []:
            held[consumer_of(msg)].append(msg)
        for key in self.retrieval_keys:
            held[Consumer.RETRIEVAL] += list(get(state, key) or [])
        return held

    def removed_between(self, committed: Any, adopted: Any) -> list[Any]:
        """What a write between turns took out of the state: the messages and documents
        the committed checkpoint holds and the adopted one (written on top of it) does
        not. The turn's first node gives them back to the ledger."""

        def held(tup: Any) -> dict[tuple[Consumer, str], Any]:
            values = {} if tup is None else tup.checkpoint.get("channel_values") or {}
            out = {
                (consumer_of(m), self.core.item_id(m)): m
                for m in get(values, self.messages_key) or []
                if isinstance(m, BaseMessage) and m.id
            }
            for key in self.retrieval_keys:
                out |= {
                    (Consumer.RETRIEVAL, self.core.item_id(d)): d
                    for d in get(values, key) or []
                    if doc_id(d)
                }
            return out

        now = held(adopted)
        gone = {ref: obj for ref, obj in held(committed).items() if ref not in now}
        self.core.known.update(gone)  # (released under the consumer that held them)
        return list(gone.values())

    def _track(self, state: Any) -> None:
        core = self.core
        for msg in get(state, self.messages_key) or []:
            if msg.id:
                core.known[(consumer_of(msg), core.item_id(msg))] = msg
        for key in self.retrieval_keys:
            core.track(Consumer.RETRIEVAL, get(state, key) or [])

    def _deliveries(self, ts: TurnState, state: Any) -> tuple[dict[str, list[Any]], list[Any]]:
        """The turn's deliveries as an update of the state (reclaimed and replaced objects
        out, the worker's summaries in where the history they replace began), and the
        messages to admit: those that entered the state outside a node (the graph's
        input, a checkpoint written between turns; those the ledger holds already are
        duplicates, charged nothing)."""
        self._fresh = False
        core = self.core
        msgs = list(get(state, self.messages_key) or [])
        pre: dict[str, list[Any]] = {}
        kept = core.apply(ts, msgs)
        if kept != msgs:
            if ts.summaries:  # placed where the history they replace began: a rewrite
                pre[self.messages_key] = [RemoveMessage(id=REMOVE_ALL_MESSAGES), *kept]
            else:
                ids = {id(m) for m in kept}
                pre[self.messages_key] = [
                    RemoveMessage(id=m.id) for m in msgs if id(m) not in ids and m.id
                ]
        for key in self.retrieval_keys:
            docs = list(get(state, key) or [])
            ids = {id(d) for d in core.apply(ts, docs)}
            gone = [Removed(d.id) for d in docs if id(d) not in ids and d.id]
            if gone:
                pre[key] = gone
        summary_ids = {core.item_id(o) for o in ts.summaries}
        adopt = [
            m
            for m in kept
            if isinstance(m, BaseMessage)
            and m.id
            and not isinstance(m, ToolMessage)
            and core.item_id(m) not in summary_ids
        ]
        for summary in ts.summaries:
            core.known[(Consumer.WORKING_MEMORY, core.item_id(summary))] = summary
        return pre, adopt

    def _merged(self, state: Any, pre: Mapping[str, list[Any]]) -> Any:
        """The state with an update applied, as the graph's reducers apply it."""
        if not pre:
            return state
        new: dict[str, Any] = {}
        for key, vals in pre.items():
            old = get(state, key) or []
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

    def _to_compact(self, ts: TurnState, state: Any) -> tuple[list[Obj], SystemMessage] | None:
        """Inline compaction (``summarize``): what it replaces, and its summary message."""
        msgs = list(get(state, self.messages_key) or [])
        cut = max(len(msgs) - self.keep_messages, 0)
        while 0 < cut < len(msgs) and isinstance(msgs[cut], ToolMessage):
            cut -= 1  # keep a tool result with the call that asked for it
        old: list[Obj] = list(msgs[:cut])
        for key in self.retrieval_keys:
            old += list(get(state, key) or [])
        summarize = self.summarize
        if not old or summarize is None:
            return None
        self._track(state)
        summary = SystemMessage(
            content=summarize(old), id=f"summary-{ts.turn}-{uuid.uuid4().hex[:8]}"
        )
        return old, summary

    def _removals(self, update: dict[str, list[Any]], objs: Sequence[Obj]) -> None:
        for o in objs:
            if isinstance(o, BaseMessage) and o.id:
                update.setdefault(self.messages_key, []).append(RemoveMessage(id=o.id))
            elif isinstance(o, Document) and o.id:
                key = self.retrieval_keys[0]
                update.setdefault(key, []).append(Removed(o.id))

    def _new_message(self, m: Any) -> BaseMessage:
        if not isinstance(m, BaseMessage):
            raise InvalidArgument(f"a messages update holds a {type(m).__name__}, not a message")
        if not m.id:
            return m.model_copy(update={"id": uuid.uuid4().hex})
        return m

    def _prompt_of(self, messages: Any) -> tuple[list[Any], int, Tally]:
        """A governed model call's messages, their tokens and the tally of that count (its
        kinds, which a billing report teaches); refused over the limit."""
        msgs = messages.to_messages() if hasattr(messages, "to_messages") else messages
        if not isinstance(msgs, list):
            raise InvalidArgument("the governed model takes a list of messages")
        with self.core.counter.measure() as tally:
            prompt = self.core.prompt_tokens(msgs)
        self._guard(prompt, tally)
        return msgs, prompt, tally

    def _output_reserve(self) -> int:
        """This turn's output reserve (what a tenant's hold adds to the prompt)."""
        if self.window is None or self.limit is None:
            return 0
        return self.window - self.limit

    def _guard(self, prompt: int, tally: Tally) -> None:
        """A prompt over the window minus the output reserve, or whose stated upper bound is
        over the window, is refused before the call (``AgentCore.guard``)."""
        self.core.guard(prompt, self.limit, self.window, tally)
