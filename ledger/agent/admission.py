"""Admission: an agent's operations that put app objects into the session, take them
out or replace them (admit, tool results, release, compact, reconcile)."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from ledger import schema
from ledger.agent.counters import count
from ledger.agent.effects import Held, Obj, Op, Store
from ledger.agent.ids import ledger_id
from ledger.agent.items import AgentBase
from ledger.agent.turns import Admission, Compacted, Deferred, ToolOutcome, TurnState
from ledger.errors import (
    AdmissionRefused,
    InvalidArgument,
)
from ledger.models import (
    Admitted,
    BegunBy,
    Consumer,
    Item,
    Reconciled,
    ToolResultOutcome,
)
from ledger.protocol import Call


class Admissions(AgentBase):
    """The agent's admission operations (each a generator of calls, no I/O)."""

    def apply(self, state: TurnState, objs: Sequence[Obj]) -> list[Obj]:
        """The app's objects as this turn must hold them: those the ledger reclaimed or a
        delivered summary replaced left out (matched by ledger id: any worker's state),
        each delivered summary in the place of the first object it replaced (at the end
        when none is there). Objects without an id (a system prompt string) stay. Safe to
        call more than once: a summary already there is not added again."""
        gone = {iid for _, iid in state.drop_refs}
        out: list[Obj] = []
        first: dict[str, int] = {}
        place = {iid: sid for sid, refs in state.replaced_by.items() for _, iid in refs}
        present: set[str] = set()
        for o in objs:
            try:
                iid = self.item_id(o)
            except InvalidArgument:
                out.append(o)
                continue
            present.add(iid)
            if iid in gone:
                sid = place.get(iid)
                if sid is not None and sid not in first:
                    first[sid] = len(out)
                continue
            out.append(o)
        tail: list[Obj] = []
        inserts: list[tuple[int, Obj]] = []
        for summary in state.summaries:
            sid = self.item_id(summary)
            if sid in present:
                continue
            if sid in first:
                inserts.append((first[sid], summary))
            else:
                tail.append(summary)
        for at, summary in sorted(inserts, key=lambda x: x[0], reverse=True):
            out.insert(at, summary)
        return out + tail

    def _texts(
        self, planned: Sequence[tuple[Item, Obj]]
    ) -> Generator[Call[Any], Any, list[str] | None]:
        """The texts to send with an admission (its script stores those of the items it
        admits, in the same step), or None when texts are not stored."""
        if not (yield from self._storing()):
            return None
        return [self.text_of(o) for _, o in planned]

    def admit(
        self,
        consumer: Consumer | str,
        objs: Sequence[Obj],
        priority: int = 0,
        turn: int | None = None,
    ) -> Op[Admission[Any]]:
        c = Consumer.parse(consumer)
        planned = self.items(objs, priority)
        answered: tuple[Obj, ...] = ()
        if c is Consumer.WORKING_MEMORY and self.answered:
            # an answer a settle made its item already: held, nothing to send for it
            held = {it.id for it, _ in planned if it.id in self.answered}
            answered = tuple(o for it, o in planned if it.id in held)
            for it, o in planned:
                if it.id in held:
                    self.known[(c, it.id)] = o
            self.answered -= held
            planned = [(it, o) for it, o in planned if it.id not in held]
        if not planned:
            return Admission(kept=answered, refused=(), reason=None, charged=0, free=-1)
        texts = yield from self._texts(planned)
        try:
            got = yield self._admission(c, planned, texts, turn)
        except AdmissionRefused as exc:
            done = yield from self._on_refusal(c, planned, exc)
        else:
            done = self._admitted(c, planned, got)
        if answered:
            done = dataclasses.replace(done, kept=(*answered, *done.kept))
        return done

    def _admission(
        self,
        c: Consumer,
        planned: list[tuple[Item, Obj]],
        texts: list[str] | None,
        turn: int | BegunBy | None,
    ) -> Call[Admitted]:
        """The call admitting planned objects: the longest prefix that fits."""
        items = [it for it, _ in planned]
        return self.session.admit_call(c, items, partial=True, texts=texts, turn=turn)

    def _on_refusal(
        self, c: Consumer, planned: list[tuple[Item, Obj]], exc: AdmissionRefused
    ) -> Generator[Held, Any, Admission[Any]]:
        if c in (Consumer.RETRIEVAL, Consumer.RECALL) and exc.reason == "compaction_pending":
            self.compaction_pending = True
        return (yield from self._refused(c, planned, exc))

    def _admitted(
        self, c: Consumer, planned: list[tuple[Item, Obj]], got: Admitted
    ) -> Admission[Any]:
        """Which planned objects made it in, from an admission's result."""
        memory = c in (Consumer.RETRIEVAL, Consumer.RECALL)
        known = self.known
        if not got.skipped:  # all of them (the common case: one pass)
            for it, o in planned:
                known[(c, it.id)] = o
            return Admission(
                kept=tuple([o for _, o in planned]), refused=(), reason=None,
                charged=got.charged, free=got.free,
            )  # fmt: skip
        skipped = set(got.skipped)
        kept = tuple(o for it, o in planned if it.id not in skipped)
        refused = tuple(o for it, o in planned if it.id in skipped)
        for it, o in planned:
            if it.id not in skipped:
                known[(c, it.id)] = o
        reason = None
        if refused:
            reason = (
                "compaction_pending"
                if memory and self.compaction_pending
                else "token_budget_exhausted"
            )
        return Admission(
            kept=kept, refused=refused, reason=reason, charged=got.charged, free=got.free
        )

    def _refused(
        self, c: Consumer, planned: list[tuple[Item, Obj]], exc: AdmissionRefused
    ) -> Generator[Held, Any, Admission[Any]]:
        """A refused admission: no new item fitted. Those already held stay in the prompt."""
        held: list[bool] = yield Held(tuple(schema.item_field(c.code, it.id) for it, _ in planned))
        kept = tuple(o for (_, o), h in zip(planned, held, strict=True) if h)
        refused = tuple(o for (_, o), h in zip(planned, held, strict=True) if not h)
        return Admission(kept=kept, refused=refused, reason=exc.reason, charged=0, free=exc.free)

    def tool_result(
        self, result: Obj, text: str | None = None, turn: int | None = None
    ) -> Op[ToolOutcome[Any]]:
        app_id = self.app_id(result)
        iid = ledger_id(app_id)
        body = self.text_of(result) if text is None else text
        if not isinstance(body, str):
            raise InvalidArgument(f"a tool result's text must be str, got {type(body).__name__}")
        what = lambda: f"tool result {app_id!s:.60}"  # noqa: E731
        tokens = self.counter.checked(body, what) + self.item_overhead
        if tokens == 0:
            raise InvalidArgument(f"tool result {app_id!s:.60} counts 0 tokens")
        keep = yield from self._storing()
        try:
            got = yield self.session.admit_tool_result_call(
                iid, tokens, body, keep_text=keep, turn=turn
            )
        except AdmissionRefused as exc:
            # No room for it, nor for its preview: the prompt gets a note saying so (the
            # tool call must be answered), which the ledger holds in its place.
            note = (
                f"[tool result {app_id!s:.80} refused by the ledger ({exc.reason}): {tokens} "
                "tokens and no room for them; ask for less]"
            )
            n = count(self.counter, note, "a refusal note") + self.item_overhead
            noted = yield self.session.admit_tool_result_call(
                iid, n, note, keep_text=keep, turn=turn
            )
            evicted, unknown = self.resolve(noted.evicted)
            self.known[(Consumer.SCRATCHPAD, iid)] = result
            return ToolOutcome(
                result=result,
                text=note,
                spilled=False,
                handle=None,
                tokens=tokens,
                charged=noted.charged,
                evicted=tuple(evicted),
                unresolved=tuple(unknown),
                refused=True,
                reason=exc.reason,
            )
        evicted, unknown = self.resolve(got.evicted)
        self.known[(Consumer.SCRATCHPAD, iid)] = result
        spilled = got.outcome == ToolResultOutcome.SPILLED or got.preview_tokens > 0
        return ToolOutcome(
            result=result,
            # (spilled, now or before: the prompt shows its preview and the handle)
            text=self.preview(app_id, body, tokens, got.preview_tokens, iid) if spilled else body,
            spilled=spilled,
            handle=iid if spilled else None,
            tokens=tokens,
            charged=got.charged,
            evicted=tuple(evicted),
            unresolved=tuple(unknown),
        )

    def defer_tool(
        self, state: TurnState, result: Obj, text: str | None = None
    ) -> Op[ToolOutcome[Any]]:
        """A tool result sent with the turn's end (no round trip now): counted here, put
        in the prompt whole, admitted whole by ``finish_turn`` with the turn's end."""
        iid, body, tokens = self._deferrable(state, result, text)
        keep = yield from self._storing()
        return self._deferred(state, result, iid, body, tokens, keep)

    def defer_now(
        self, state: TurnState, result: Obj, text: str | None = None
    ) -> ToolOutcome[Any] | None:
        """``defer_tool`` when it needs no call, as once a turn began (whether texts are
        stored is known): its outcome, with no generator to drive; else None."""
        keep = self.store_content if self.store_content is not None else self._worker
        if keep is None:
            return None
        iid, body, tokens = self._deferrable(state, result, text)
        return self._deferred(state, result, iid, body, tokens, keep)

    def _deferrable(self, state: TurnState, result: Obj, text: str | None) -> tuple[str, str, int]:
        """A tool result to defer, checked and counted: its item id, text and tokens."""
        app_id = self.app_id(result)
        iid = ledger_id(app_id)
        body = self.text_of(result) if text is None else text
        if not isinstance(body, str):
            raise InvalidArgument(f"a tool result's text must be str, got {type(body).__name__}")
        if any(d.item == iid for d in state.deferred):
            raise InvalidArgument(f"tool result {app_id!s:.60} is deferred twice in this turn")
        what = lambda: f"tool result {app_id!s:.60}"  # noqa: E731
        tokens = self.counter.checked(body, what) + self.item_overhead
        if tokens == 0:
            raise InvalidArgument(f"tool result {app_id!s:.60} counts 0 tokens")
        return iid, body, tokens

    @staticmethod
    def _deferred(
        state: TurnState, result: Obj, iid: str, body: str, tokens: int, keep: bool
    ) -> ToolOutcome[Any]:
        state.deferred.append(Deferred(len(state.tools), result, iid, tokens, body, keep))
        return ToolOutcome(result=result, text=body, spilled=False, handle=None, tokens=tokens,
                           charged=tokens, evicted=(), unresolved=(), deferred=True)  # fmt: skip

    def release(self, objs: Sequence[Obj], turn: int | None = None) -> Op[list[Obj]]:
        by: dict[Consumer, list[str]] = {}
        for o in objs:
            by.setdefault(self.consumer_of(o), []).append(self.item_id(o))
        out: list[Obj] = []
        for c, ids in by.items():
            yield self.session.release_call(c, ids, turn=turn)
            objs_c, _ = self.resolve([(c, i) for i in ids])
            out += objs_c
        return out

    def compact(
        self, replaced: Sequence[Obj], summary: Obj | None, turn: int | None = None
    ) -> Op[Compacted]:
        refs = list(dict.fromkeys((self.consumer_of(o), self.item_id(o)) for o in replaced))
        item = self.items([summary], priority=1000)[0][0] if summary is not None else None
        done = yield self.session.compact_call(refs, item, turn=turn)
        dropped: list[Obj] = []
        if done.dropped or done.compacted:
            dropped, _ = self.resolve(refs)
            if item is not None and done.summary:
                self.known[(Consumer.WORKING_MEMORY, item.id)] = summary
        self.compaction_pending = not done.compacted
        return Compacted(
            compacted=done.compacted,
            outcome=done.outcome,
            dropped=tuple(dropped),
            summary=summary,
            occupancy=done.occupancy,
        )

    def reconcile(self, held: Mapping[Consumer | str, Sequence[Obj]]) -> Op[Reconciled]:
        """Set the ledger to the app objects the prompt really holds, per consumer named."""
        plan: dict[Consumer, list[tuple[Item, Obj]]] = {}
        for consumer, objs in held.items():
            plan[Consumer.parse(consumer)] = self.items(objs)
        done: Reconciled = yield self.session.reconcile_call(
            {c: [it for it, _ in pairs] for c, pairs in plan.items()}
        )
        if (yield from self._storing()):  # (their texts too, once the ledger holds them: a
            # compaction after it reads them)
            yield Store(
                tuple(
                    (schema.content_field(c.code, it.id), self.text_of(o))
                    for c, pairs in plan.items()
                    for it, o in pairs
                )
            )
        for c, pairs in plan.items():
            for key in [k for k in self.known if k[0] == c]:
                del self.known[key]
            for it, o in pairs:
                self.known[(c, it.id)] = o
        return done
