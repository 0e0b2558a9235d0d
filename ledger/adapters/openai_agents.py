"""OpenAI Agents SDK adapter: the ledger governs every model call's input.

Glue, beyond the agent itself::

    gov = LedgerAgents(AsyncAgent(session, TiktokenCounter()), summarize=my_summarizer)
    async with gov.turn(working_set=2_000):
        result = await Runner.run(agent, history + new, run_config=gov.run_config())
    history = gov.history(result)            # instead of result.to_input_list()

``gov.document(doc_id, text)`` makes a retrieved chunk an input item the ledger
admits as retrieval (any id: a URL, a UUID...). The SDK's ``call_model_input_filter``
runs before each model call: new items are admitted (messages to working memory,
function-call outputs whole or spilled, whose output becomes the preview naming the
handle; documents to retrieval, those refused left out), items the ledger reclaimed,
evicted or compacted away are left out, and the real prompt (instructions and items)
is counted. The turn ends with the last prompt plus the final answer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ledger.agent.aio import AsyncAgent, AsyncTurn
from ledger.agent.core import ledger_id
from ledger.agent.counters import count
from ledger.errors import AdmissionRefused, ContextOverflow, InvalidArgument
from ledger.extras import missing
from ledger.models import Consumer

try:
    from agents import RunConfig
    from agents.run_config import CallModelData, ModelInputData
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("openai-agents", "openai-agents", "the OpenAI Agents adapter") from exc

Entry = Mapping[str, Any]
_DOC = re.compile(r"<document id=\"([^\"]+)\">")


def item_text(item: Entry) -> str:
    """The text a model is sent of one input item."""
    parts: list[str] = []
    for key in ("content", "output"):
        v = item.get(key)
        if isinstance(v, str):
            parts.append(v)
        elif isinstance(v, list):
            parts += [p.get("text", "") for p in v if isinstance(p, Mapping)]
    if item.get("type") == "function_call":
        parts.append(f"{item.get('name', '')}({item.get('arguments', '')})")
    return "\n".join(parts)


def item_consumer(item: Entry) -> Consumer:
    if item.get("type") == "function_call_output":
        return Consumer.SCRATCHPAD
    if isinstance(item.get("content"), str) and _DOC.match(item["content"]):
        return Consumer.RETRIEVAL
    return Consumer.WORKING_MEMORY


@dataclass(frozen=True, slots=True)
class Piece:
    """One input item as the ledger sees it: its consumer, ledger id and text."""

    consumer: Consumer
    id: str
    content: str
    item: dict[str, Any]


def pieces(items: Sequence[Any]) -> list[Piece]:
    """Each item with its consumer and ledger id: a call id, a document id, an item id,
    or (a user message has none) a digest of its role and text with its occurrence."""
    seen: dict[str, int] = {}
    out = []
    for raw in items:
        if not isinstance(raw, Mapping):
            raise InvalidArgument(f"an input item must be a mapping, got {type(raw).__name__}")
        it = dict(raw)
        c = item_consumer(it)
        m = _DOC.match(it["content"]) if c is Consumer.RETRIEVAL else None
        if m is not None:
            app: object = m.group(1)
        elif it.get("call_id"):
            app = it["call_id"]
        elif it.get("id"):
            app = it["id"]
        else:
            text = f"{it.get('role', '')}\x1f{item_text(it)}"
            base = "m." + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
            seen[base] = seen.get(base, 0) + 1
            app = f"{base}.{seen[base]}"
        out.append(Piece(c, ledger_id(app), item_text(it), it))
    return out


class LedgerAgents:
    """Governs an Agents SDK run's model input with an :class:`~ledger.agent.AsyncAgent`.

    ``summarize(items) -> str``: when the ledger has a compaction pending, the first
    model call of the next turn replaces every item but the last ``keep_items`` by one
    summary message. Without it a pending compaction is left to the ledger's worker.
    """

    def __init__(
        self,
        agent: AsyncAgent,
        *,
        summarize: Callable[[list[dict[str, Any]]], str] | None = None,
        keep_items: int = 4,
    ) -> None:
        self.agent = agent
        self.summarize = summarize
        self.keep_items = keep_items
        self.current: AsyncTurn | None = None
        self.dropped: set[tuple[Consumer, str]] = set()
        self.spilled: dict[str, str] = {}  # ledger id of a spilled output -> its preview
        self.last_input: list[Piece] = []
        self.last_prompt: int | None = None
        self.limit: int | None = None  # window minus output reserve, for this turn
        self.inserted: list[Piece] = []  # this turn's summary, first in every later input
        self._fresh = False

    @staticmethod
    def document(doc_id: object, text: str) -> dict[str, Any]:
        """A retrieved chunk as an input item the ledger admits as retrieval."""
        if not isinstance(text, str) or '"' in str(doc_id):
            raise InvalidArgument("a document needs str text and an id without double quotes")
        return {"role": "user", "content": f'<document id="{doc_id}">{text}</document>'}

    def run_config(self, **options: Any) -> RunConfig:
        """A RunConfig whose call_model_input_filter is this adapter's."""
        return RunConfig(call_model_input_filter=self.filter, **options)

    def tokens(self, texts: Sequence[str]) -> int:
        core = self.agent.core
        return sum(count(core.counter, t, "an input item") + core.item_overhead for t in texts)

    @asynccontextmanager
    async def turn(
        self, working_set: int = 0, output_reserve: int | None = None
    ) -> AsyncIterator[AsyncTurn]:
        """One run as one ledger turn: begin_turn, then end_turn with the real prompt."""
        turn = self.agent.turn(working_set, output_reserve)
        await turn.__aenter__()
        assert turn.state is not None
        snap = await self.agent.session.snapshot()
        reserve = snap.output_reserve if output_reserve is None else output_reserve
        self.limit = snap.window - reserve
        self.current, self.last_prompt, self._fresh = turn, None, True
        self.dropped = set(turn.state.drop_refs)
        self.spilled.clear()
        self.inserted = []
        try:
            yield turn
            if self.last_prompt is None:
                raise InvalidArgument("the turn made no model call through gov.run_config()")
            await turn.end(self.last_prompt)
        finally:
            self.current = None

    async def filter(self, data: CallModelData[Any]) -> ModelInputData:
        """``RunConfig.call_model_input_filter``: govern one model call's input."""
        turn = self.current
        if turn is None:
            raise InvalidArgument("a governed model call ran outside `async with gov.turn():`")
        rows, seen = [], set()
        for p in pieces(data.model_data.input):
            key = (p.consumer, p.id)
            if key not in self.dropped and key not in seen:  # the ledger holds an item once
                seen.add(key)
                rows.append(p)
        if self._fresh:
            self._fresh = False
            rows = await self._compact(turn, rows)
        else:  # the run's own input lacks this turn's summary: put it back
            rows = [*(p for p in self.inserted if (p.consumer, p.id) not in seen), *rows]
        await self._admit(turn, rows)
        kept = []
        for p in rows:
            if (p.consumer, p.id) in self.dropped:
                continue
            if p.id in self.spilled and p.consumer is Consumer.SCRATCHPAD:
                p = Piece(
                    p.consumer, p.id, self.spilled[p.id], {**p.item, "output": self.spilled[p.id]}
                )
            kept.append(p)
        self.last_input = kept
        instructions = data.model_data.instructions
        self.last_prompt = self.tokens(
            [p.content for p in kept] + ([instructions] if instructions else [])
        )
        if self.limit is not None and self.last_prompt > self.limit:
            raise ContextOverflow(self.last_prompt, self.limit)  # a guard acts before the call
        return ModelInputData(input=[p.item for p in kept], instructions=instructions)  # type: ignore[misc]

    async def _admit(self, turn: AsyncTurn, rows: list[Piece]) -> None:
        by: dict[Consumer, list[Piece]] = {}
        for p in rows:
            if p.consumer is not Consumer.SCRATCHPAD:
                by.setdefault(p.consumer, []).append(p)
            elif p.id not in self.spilled:
                got = await turn.tool_result(p)
                self.dropped |= {(o.consumer, o.id) for o in got.evicted} | set(got.unresolved)
                if got.spilled:
                    self.spilled[p.id] = got.text
        for c, ps in by.items():
            ps = [p for p in ps if (p.consumer, p.id) not in self.dropped]
            if not ps:
                continue
            adm = await turn.admit(c, ps)
            if adm.refused and c is Consumer.WORKING_MEMORY:
                raise AdmissionRefused(adm.reason or "token_budget_exhausted", 0, adm.free, {})
            self.dropped |= {(o.consumer, o.id) for o in adm.refused}

    async def _compact(self, turn: AsyncTurn, rows: list[Piece]) -> list[Piece]:
        core = self.agent.core
        summarize = self.summarize
        if summarize is None or not core.compaction_pending:
            return rows
        cut = max(len(rows) - self.keep_items, 0)
        while 0 < cut < len(rows) and rows[cut].consumer is Consumer.SCRATCHPAD:
            cut -= 1
        old = rows[:cut]
        if not old:
            return rows
        for p in old:
            core.known[(p.consumer, p.id)] = p
        text = summarize([p.item for p in old])
        item = {"role": "developer", "content": text, "id": f"summary-{turn.number}"}
        summary = Piece(Consumer.WORKING_MEMORY, ledger_id(item["id"]), text, item)
        done = await turn.compact(old, summary)
        gone = {(o.consumer, o.id) for o in done.dropped}
        self.dropped |= gone
        if not done.dropped:
            return rows
        self.inserted = [summary]
        return [summary, *(p for p in rows if (p.consumer, p.id) not in gone)]

    async def history(self, result: Any) -> list[dict[str, Any]]:
        """Call inside the turn, after the run: admits the run's final items (its answer)
        and returns the governed history for the next turn (what the model last saw,
        previews in place of spilled outputs, dropped items left out, and the answer)."""
        turn = self.current
        if turn is None or self.last_prompt is None:
            raise InvalidArgument("gov.history(result) belongs inside `async with gov.turn():`")
        seen = {(p.consumer, p.id) for p in self.last_input}
        new = [
            p
            for p in pieces(result.to_input_list())
            if (p.consumer, p.id) not in seen and (p.consumer, p.id) not in self.dropped
        ]
        if new:
            adm = await turn.admit(Consumer.WORKING_MEMORY, new)
            if adm.refused:
                raise AdmissionRefused(adm.reason or "token_budget_exhausted", 0, adm.free, {})
            self.last_prompt += self.tokens([p.content for p in new])
        return [p.item for p in (*self.last_input, *new)]


__all__ = ["LedgerAgents", "Piece", "item_text", "pieces"]
