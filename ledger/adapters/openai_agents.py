"""OpenAI Agents SDK adapter: the ledger governs every model call's input.

Glue, beyond the agent itself::

    gov = LedgerAgents(AsyncAgent(session, TiktokenCounter("o200k_base")))
    async with gov.turn(working_set=2_000):
        result = await Runner.run(agent, question, session=gov.session,
                                  run_config=gov.run_config(), hooks=gov.hooks)

``gov.session`` is the SDK's own ``Session`` (the conversation's history), kept in Redis
beside the ledger's session, so every process of a fleet reads the same history; each
ended turn commits a new version of it (the turn's commit mark) and a turn whose process
died leaves no trace in it. ``gov.document(doc_id, text)`` makes a retrieved chunk an
input item the ledger admits as retrieval (any id: a URL, a UUID...). The SDK's
``call_model_input_filter`` runs before each model call: the turn's deliveries are
applied (what the ledger reclaimed, what a worker's summary replaced, left out; the
summary put in their place), new items are admitted (messages to working memory,
function-call outputs whole or spilled, whose output becomes the preview naming the
handle; documents to retrieval, those refused left out), and the real prompt
(instructions, tool schemas and items) is counted; the run hooks compare it with the
input tokens each response reports as billed. The turn ends with the last prompt plus
the final answer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from ledger.adapters.openai_items import Entry as Entry
from ledger.adapters.openai_items import Piece, _summary_item, item_text, pieces, sdk_usage
from ledger.adapters.openai_items import item_consumer as item_consumer
from ledger.adapters.openai_session import LedgerSession
from ledger.agent.aio import AsyncAgent, AsyncTurn
from ledger.agent.core import CallHold, Obj, default_summary, ledger_id
from ledger.agent.counters import Tally, count
from ledger.errors import AdmissionRefused, InvalidArgument, LedgerError
from ledger.extras import missing
from ledger.models import Consumer, Reconciled

try:
    from agents import RunConfig, RunHooks
    from agents.run_config import CallModelData, ModelInputData
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise missing("openai-agents", "openai-agents", "the OpenAI Agents adapter") from exc


class LedgerAgents:
    """Governs an Agents SDK run's model input with an :class:`~ledger.agent.AsyncAgent`.

    ``summarize(items) -> str``: on an agent-owned session, when the ledger has a
    compaction pending, the first model call of the next turn replaces every item but
    the last ``keep_items`` by one summary message. On a worker-owned session (the
    default) the worker's summaries are delivered to the turn and put in the input.
    """

    def __init__(
        self,
        agent: AsyncAgent,
        *,
        summarize: Callable[[list[dict[str, Any]]], str] | None = None,
        keep_items: int = 4,
        tenant: str | None = None,
        scopes: Sequence[str] = (),
        model: str | None = None,
    ) -> None:
        self.agent = agent
        # the tenant's ceilings (else as the agent names them)
        agent.core.adapter_tenant(tenant, scopes, model)
        self.summarize = summarize
        self.keep_items = keep_items
        if agent.core.summary_of is default_summary:
            agent.core.summary_of = _summary_item
        self.current: AsyncTurn | None = None
        self.dropped: set[tuple[Consumer, str]] = set()
        self.spilled: dict[str, str] = {}  # ledger id of a spilled output -> its preview
        self.last_input: list[Piece] = []
        self.last_prompt: int | None = None
        self.last_counted: int | None = None  # the last prompt sent, before its answer
        self.limit: int | None = None  # window minus output reserve, for this turn
        self.window: int | None = None
        self.tally: Tally | None = None  # what the last prompt's count was made of
        self.inserted: list[Piece] = []  # this turn's summaries, first in every later input
        self._fresh = False
        self.hold: CallHold | None = None  # a tenant's hold of the model call under way
        self.session = LedgerSession(self)
        self.hooks = LedgerHooks(self)

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

    def tool_tokens(self, agent: Any) -> int:
        """The tokens of the tool schemas a model call sends (name, description and JSON
        schema of each function tool): billed with every prompt, the budget's
        ``tool_framing``."""
        texts = [
            json.dumps(
                {
                    "name": getattr(t, "name", ""),
                    "description": getattr(t, "description", ""),
                    "parameters": getattr(t, "params_json_schema", {}),
                },
                sort_keys=True,
            )
            for t in getattr(agent, "tools", None) or []
        ]
        return sum(count(self.agent.core.counter, t, "a tool schema") for t in texts)

    @asynccontextmanager
    async def turn(
        self,
        working_set: int = 0,
        output_reserve: int | None = None,
        *,
        wait: float = 0.0,
        takeover: bool = False,
    ) -> AsyncIterator[AsyncTurn]:
        """One run as one ledger turn: begin_turn (the turn lease), then end_turn with the
        real prompt, committing the session's history (``gov.session``) as it stands. An
        exception rolls the turn back, the history with it."""
        async with self.agent.turn(
            working_set, output_reserve, wait=wait, takeover=takeover
        ) as turn:
            assert turn.state is not None
            snap = await self.agent.session.snapshot()
            reserve = snap.output_reserve if output_reserve is None else output_reserve
            self.limit, self.window = snap.window - reserve, snap.window
            self.current, self.last_prompt, self.last_counted, self._fresh = turn, None, None, True
            self.dropped = set(turn.state.drop_refs)
            self.spilled.clear()
            self.inserted = []
            self.last_input = []
            self.hold = None
            await self.session._begin(turn)
            try:
                yield turn
                if self.last_prompt is None:
                    raise InvalidArgument("the turn made no model call through gov.run_config()")
                await self._settle_open(turn)
                mark = await self.session._commit(turn)
                await turn.end(self.last_prompt, mark=mark)
            except BaseException:
                hold, self.hold = self.hold, None
                if hold is not None:  # the model call failed: its hold given back
                    with contextlib.suppress(LedgerError):  # (else it lapses at its deadline)
                        await turn.void_hold(hold)
                raise
            finally:
                self.current = None
                self.session._end()

    def _turn(self) -> AsyncTurn:
        if self.current is None:
            raise InvalidArgument("a governed model call ran outside `async with gov.turn():`")
        return self.current

    def governed(self, items: Sequence[Any]) -> list[Piece]:
        """Items as this turn must send them: the deliveries applied (reclaimed or replaced
        items out, each summary where the first item it replaced was), one of each item."""
        turn = self._turn()
        assert turn.state is not None
        rows: list[Piece] = []
        seen: set[tuple[Consumer, str]] = set()
        first: dict[str, int] = {}
        place = {ref: sid for sid, refs in turn.state.replaced_by.items() for ref in refs}
        for p in pieces(items):
            if p.key in self.dropped:
                sid = place.get(p.key)
                if sid is not None and sid not in first:
                    first[sid] = len(rows)
                continue
            if p.key not in seen:  # the ledger holds an item once
                seen.add(p.key)
                rows.append(p)
        inserts = []
        for summary in turn.summaries:
            (piece,) = pieces([summary])
            if piece.key not in seen:
                seen.add(piece.key)
                inserts.append((first.get(str(summary["id"]), 0), piece))
        for at, piece in sorted(inserts, key=lambda x: x[0], reverse=True):
            rows.insert(at, piece)
        return rows

    async def filter(self, data: CallModelData[Any]) -> ModelInputData:
        """``RunConfig.call_model_input_filter``: govern one model call's input."""
        turn = self._turn()
        rows = self.governed(data.model_data.input)
        seen = {p.key for p in rows}
        if self._fresh:
            self._fresh = False
            assert turn.state is not None
            # the session's calibration changed (recount), or a hard reset dropped every
            # item (docs/agent.md#after-a-hard-reset): the ledger set to what this turn sends
            if turn.state.recalibrated or turn.state.reset:
                try:  # (the deliveries applied: rows are what this turn sends)
                    await self.reconcile([p.item for p in rows])
                except AdmissionRefused as exc:  # kept on the turn, never raised out of the run
                    turn.state.unreconciled = exc
            rows = await self._compact(turn, rows)
        else:  # the run's own input lacks this turn's summary: put it back
            rows = [*(p for p in self.inserted if p.key not in seen), *rows]
        await self._admit(turn, rows)
        # A function call whose output left (reclaimed, compacted away) is not sent: the
        # SDK prunes such orphans from the history. The ledger gives it back too.
        outputs = {
            p.id for p in rows if p.consumer is Consumer.SCRATCHPAD and p.key not in self.dropped
        }
        orphans = [
            p
            for p in rows
            if p.item.get("type") == "function_call"
            and p.id not in outputs
            and p.key not in self.dropped
        ]
        if orphans:
            await turn.release(orphans)
            self.dropped |= {p.key for p in orphans}
        kept = []
        for p in rows:
            if p.key in self.dropped:
                continue
            if p.id in self.spilled and p.consumer is Consumer.SCRATCHPAD:
                p = Piece(
                    p.consumer, p.id, self.spilled[p.id], {**p.item, "output": self.spilled[p.id]}
                )
            kept.append(p)
        self.last_input = kept
        instructions = data.model_data.instructions
        core = self.agent.core
        with core.counter.measure() as self.tally:
            framing = self.tool_tokens(data.agent)
            self.last_prompt = self.last_counted = (
                self.tokens([p.content for p in kept] + ([instructions] if instructions else []))
                + framing
            )
        if turn.state is not None:
            turn.state.framing = framing
        core.guard(self.last_prompt, self.limit, self.window, self.tally)  # before the call
        if core.tenant is not None:  # the tenant's ceilings: the call's worst case held
            await self._settle_open(turn)
            assert self.window is not None and self.limit is not None
            model = getattr(data.agent, "model", None)
            name = model if isinstance(model, str) else getattr(model, "model", None)
            self.hold = await turn.hold(
                self.last_prompt, self.window - self.limit, name if isinstance(name, str) else None
            )
        return ModelInputData(input=[p.item for p in kept], instructions=instructions)  # type: ignore[misc]

    async def _settle_open(self, turn: AsyncTurn) -> None:
        """A hold no response settled (the run was not given ``hooks=gov.hooks``): charged
        its worst case, so that the tenant's ceilings never miss a call."""
        hold, self.hold = self.hold, None
        if hold is not None:
            await turn.settle_hold(hold, None, None)

    async def settle(self, response: Any) -> None:
        """After a model call (``gov.hooks``' ``on_llm_end``): its hold becomes the usage
        the response reports billed, and its first output item the item of the answer."""
        hold, self.hold = self.hold, None
        if hold is None or self.current is None:
            return
        answer = next(
            (
                p
                for p in pieces(response.to_input_items())
                if p.consumer is Consumer.WORKING_MEMORY and p.key not in self.dropped
            ),
            None,
        )
        await self.current.settle_hold(hold, answer, sdk_usage(getattr(response, "usage", None)))

    async def _admit(self, turn: AsyncTurn, rows: list[Piece]) -> None:
        by: dict[Consumer, list[Piece]] = {}
        for p in rows:
            if p.consumer is not Consumer.SCRATCHPAD:
                by.setdefault(p.consumer, []).append(p)
            elif p.id not in self.spilled:
                got = await turn.tool_result(p)
                self.dropped |= {(o.consumer, o.id) for o in got.evicted} | set(got.unresolved)
                if got.spilled or got.refused:  # the preview, or the refusal note, shown
                    self.spilled[p.id] = got.text
        for c, ps in by.items():
            ps = [p for p in ps if p.key not in self.dropped]
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
            core.known[p.key] = p
        text = summarize([p.item for p in old])
        item = {"role": "developer", "content": text, "id": f"summary-{turn.number}"}
        summary = Piece(Consumer.WORKING_MEMORY, ledger_id(item["id"]), text, item)
        done = await turn.compact(old, summary)
        gone = {(o.consumer, o.id) for o in done.dropped}
        self.dropped |= gone
        if not done.dropped:
            return rows
        self.inserted = [summary]
        return [summary, *(p for p in rows if p.key not in gone)]

    async def _answer(self, items: Sequence[Any]) -> list[Piece]:
        """Admit what the run produced after the last model call (its answer): the pieces
        of ``items`` not in that call's input and not dropped."""
        turn = self._turn()
        seen = {p.key for p in self.last_input}
        new = [p for p in pieces(items) if p.key not in seen and p.key not in self.dropped]
        if new and self.last_prompt is not None:
            adm = await turn.admit(Consumer.WORKING_MEMORY, new)
            if adm.refused:
                raise AdmissionRefused(adm.reason or "token_budget_exhausted", 0, adm.free, {})
            self.last_prompt += self.tokens([p.content for p in new])
        return new

    async def history(self, result: Any) -> list[dict[str, Any]]:
        """Without ``gov.session``: call inside the turn, after the run. Admits the run's
        final items (its answer) and returns the governed history for the next turn (what
        the model last saw, previews in place of spilled outputs, dropped items left out,
        and the answer)."""
        if self.current is None or self.last_prompt is None:
            raise InvalidArgument("gov.history(result) belongs inside `async with gov.turn():`")
        new = await self._answer(result.to_input_list())
        return [p.item for p in (*self.last_input, *new)]

    async def reconcile(self, items: Sequence[Any]) -> Reconciled:
        """Set the ledger to exactly these input items (the SDK's own, e.g. the history the
        model will be sent): each consumer's items become the listed ones."""
        held: dict[Consumer | str, list[Obj]] = {c: [] for c in Consumer}
        for p in pieces(items):
            held[p.consumer].append(p)
        core = self.agent.core
        saved = core.id_of, core.text_of
        core.id_of, core.text_of = (lambda p: p.id), (lambda p: p.content)
        try:
            return await self.agent.reconcile(held)
        finally:
            core.id_of, core.text_of = saved


class LedgerHooks(RunHooks[Any]):
    """Run hooks (``Runner.run(..., hooks=gov.hooks)``): each model response's reported
    input tokens (what the provider billed) against the ledger's count of the prompt it
    answered (docs/agent.md#what-the-model-billed)."""

    def __init__(self, gov: LedgerAgents) -> None:
        self.gov = gov

    async def on_llm_end(self, context: Any, agent: Any, response: Any) -> None:
        await self.gov.settle(response)  # with a tenant named: its hold settled
        usage = getattr(response, "usage", None)
        billed = getattr(usage, "input_tokens", 0) or 0
        gov = self.gov
        if gov.current is not None and gov.last_counted is not None and billed > 0:
            await gov.current.billed(int(billed), gov.last_counted, gov.tally)


__all__ = ["LedgerAgents", "LedgerHooks", "LedgerSession", "Piece", "item_text", "pieces"]
