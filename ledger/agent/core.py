"""The agent layer's logic, written once with no I/O.

Each operation is a generator: it yields the ledger :class:`~ledger.protocol.Call` it
needs (or a :class:`Batch` of calls, a :class:`Sleep`), is sent the call's result (or
thrown its error; a batch is sent each call's result or error in its place), and
returns the operation's result. The asyncio face's ``drive`` (``ledger/_async/agent.py``)
runs it with ``await AsyncLedger.run`` and ``asyncio.sleep``, the sync face's (generated
from it, ``ledger/_sync/agent.py``) with ``Ledger.run`` and ``time.sleep``: the same
code decides for both.

App objects (retrieved chunks, messages, tool results) keep their own ids; the
ledger's item id is derived from the app id by :func:`ledger_id`, the same on every
worker, so no shared reverse map is needed: each worker maps ledger ids back to the
objects it knows (those it admitted, or was shown with :meth:`AgentCore.track`).

:class:`AgentCore` holds a turn's steps (begin, deliveries, end, abort, renew); its other
operations come from the modules of their job, as do the types: ``items``
(:class:`~ledger.agent.items.AgentBase`, the app objects an agent maps to items),
``admission``, ``billing``, ``calibration``, ``turns`` (the results), ``effects``,
``ids``. Every name is re-exported here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from ledger import schema
from ledger.agent.admission import Admissions
from ledger.agent.billing import BILLED, Billing, billing_message, framing_hint
from ledger.agent.calibration import CALIBRATION, _calibration
from ledger.agent.counters import count
from ledger.agent.effects import Batch, Effect, Fetch, Held, Note, Obj, Op, Sleep, Store
from ledger.agent.ids import default_id, default_text, ledger_id
from ledger.agent.items import AgentBase
from ledger.agent.turns import (
    Admission,
    BillingCheck,
    CallHold,
    Compacted,
    Deferred,
    ToolOutcome,
    TurnState,
    default_summary,
)
from ledger.core import new_op_id
from ledger.errors import (
    AdmissionRefused,
    CompactionPending,
    ContextDrift,
    ContextDriftWarning,
    LedgerError,
    StaleEpoch,
    TurnInProgress,
)
from ledger.models import (
    BegunBy,
    Consumer,
    Item,
    Snapshot,
    TurnAborted,
    TurnFinished,
    TurnRenewed,
    TurnReport,
    TurnStarted,
)

# The agent layer's names, each from the module of its job (see the module docstring).
__all__ = [
    "Admission",
    "Admissions",
    "AgentBase",
    "AgentCore",
    "Batch",
    "Billing",
    "BillingCheck",
    "CallHold",
    "Compacted",
    "Deferred",
    "Effect",
    "Fetch",
    "Held",
    "Note",
    "Obj",
    "Op",
    "Sleep",
    "Store",
    "ToolOutcome",
    "TurnState",
    "billing_message",
    "default_id",
    "default_summary",
    "default_text",
    "ledger_id",
]


class AgentCore(Admissions, Billing):
    """Maps app objects to ledger items for one session, and plans every call."""

    def begin(
        self,
        working_set: int,
        output_reserve: int | None,
        *,
        wait: float = 0.0,
        takeover: bool = False,
        admit: Mapping[Consumer | str, Sequence[Obj]] | None = None,
    ) -> Op[TurnState]:
        """Take the session's turn (its lease) and start it. Another process's live turn
        is waited for up to ``wait`` seconds (polling), then ``TurnInProgress``; with
        ``takeover`` it is rolled back and this turn starts at once. An agent serves one
        turn at a time: a second one while its first runs is refused the same way.

        ``admit`` (consumer -> app objects, in order): the turn's first admissions, sent
        in the round trip that begins it (each call names the turn by its begin's op id,
        so it lands in this turn or, when the begin is refused, nowhere); their
        :class:`Admission` results are the state's first ``admissions``."""
        if self.live_turns:
            held = min(self.live_turns)
            raise TurnInProgress(
                f"turn {held} is held by {self.session.owner} (lease {self.lease_ms} ms left): "
                "this agent serves it now; one agent (one session handle) serves one turn at "
                "a time: give each concurrent request its own"
            )
        self.answered.clear()
        if self.session.turn is not None:
            # a turn of this handle that its process left open (its abort failed): rolled
            # back now, so that beginning again never commits what it half did
            with contextlib.suppress(LedgerError):
                yield self.session.abort_turn_call(self.session.turn)
        worker = self._worker
        if worker is None:  # (asked of the session once)
            worker = yield from self._worker_owned()
        # The credit ordering, seen from the caller: a worker's compaction commits only
        # between turns, so a pending one is waited for (bounded) before the turn whose
        # retrieval it would make room for. begin_turn itself says whether one is pending
        # (asked of the ledger, as another process may have served the turn that made it
        # due): a turn with nothing pending costs no extra call.
        awaiting = worker and self.await_compaction > 0
        plans: list[tuple[Consumer, list[tuple[Item, Obj]], list[str] | None]] = []
        for consumer, objs in (admit or {}).items():
            texts: list[str] = []  # (each item's text, read once: counted, then sent)
            planned = self.items(objs, texts=texts)
            if planned:
                c = Consumer.parse(consumer)
                keep = self.store_content if self.store_content is not None else worker
                plans.append((c, planned, texts if keep else None))
        got: list[Any] = []
        waited_for = waited = 0.0
        # (a staged reset that applied as this agent's last turn ended: adopted then)
        reset_from, self.reset_at_end = self.reset_at_end, None
        adopted_at_end = reset_from is not None
        while True:
            before = self.session.epoch
            op_id = new_op_id()
            call = self.session.begin_turn_call(
                working_set,
                output_reserve,
                takeover=takeover,
                lease_ms=self.lease_ms,
                await_compaction=awaiting,
                op_id=op_id,
            )
            try:
                if plans:
                    got = yield Batch(
                        (call, *(self._admission(*plan, BegunBy(op_id)) for plan in plans))
                    )
                    if isinstance(got[0], BaseException):
                        raise got[0]
                    started: TurnStarted = got[0]
                else:
                    started = yield call
                break
            except CompactionPending as pending:
                self.compaction_pending = True
                # Not waited for past the bound, nor while no worker has picked it up
                # compaction_pickup after it was requested (none may be running): timed
                # from the request (Redis's clock), not from this wait, so a worker that
                # is late under load is waited for, while with no worker only the first
                # turn after the request waits and the next ones begin at once.
                asked = pending.requested_ms_ago
                age = waited_for if asked is None else asked / 1000
                if waited_for >= self.await_compaction or (
                    not pending.computing and age >= self.compaction_pickup
                ):
                    awaiting = False
                    continue
                yield Sleep(self.poll_interval)
                waited_for += self.poll_interval
            except StaleEpoch:
                # A hard reset (docs/rules.md) advanced the session's epoch since this
                # handle last saw it: its items are gone, its open turn ended. Nothing of
                # this turn was written before begin_turn (the admissions sent with it name
                # the begin by its op id: refused with it), so it is safe to adopt the
                # session's epoch and begin again, once; a second StaleEpoch is raised.
                if (reset_from is not None and not adopted_at_end) or not self.adopt_resets:
                    raise
                adopted_at_end = False
                old = self.session.epoch
                snap: Snapshot = yield self.session.snapshot_call()
                if snap.epoch <= old:
                    raise
                reset_from = old if reset_from is None else reset_from
                self.session.epoch = snap.epoch
                if snap.turn_owner != self.session.owner or snap.turn != self.session.turn:
                    self.session.turn = None
                self._forget()
            except TurnInProgress as busy:
                if waited >= wait:
                    raise TurnInProgress(
                        f"{busy} (waited {waited:g} s: begin the turn with wait=<seconds> to "
                        "wait for it longer, or takeover=True to roll it back and start now)"
                    ) from busy
                left = max(busy.lease_left_ms or 0, 0) / 1000
                step = min(
                    max(self.poll_interval, 0.001), wait - waited, left or self.poll_interval
                )
                yield Sleep(step)
                waited += step
        if started.reset is not None:
            # A hard reset staged while the last turn was open applied with this begin
            # (that turn ended or was rolled back by it): the turn began at the new epoch,
            # the ledger holding nothing; the admissions sent with it were of the old
            # epoch (refused, nothing written), and are sent again in the turn.
            reset_from = before if reset_from is None else reset_from
            self._forget()
            if plans:
                got = [started]
                for plan in plans:
                    try:
                        got.append((yield self._admission(*plan, started.turn)))
                    except AdmissionRefused as exc:
                        got.append(exc)
        self.compaction_pending = started.compaction_due
        self.live_turns.add(started.turn)
        state = TurnState(started, waited_compaction=waited_for, reset_from_epoch=reset_from)
        state.drop_refs = [*started.reclaimed, *started.dropped]
        if started.summaries or self.calibrate:
            yield from self._deliver(state)
        for sid, tokens in state.recounts:
            # The summary counted as this agent counts it (its counter, its framing), in
            # one call of this turn: its prompt and the ledger then agree (drift 0), on
            # whatever counter the worker's compactor used. (A recount that does not fit
            # changes nothing: the turn's drift then shows it.)
            yield self.session.compact_call(
                [(Consumer.WORKING_MEMORY, sid)],
                Item(sid, tokens, 1000),
                turn=started.turn,
            )
        state.dropped, state.unresolved = self.resolve(state.drop_refs)
        for (c, planned, _), result in zip(plans, got[1:], strict=True):
            if isinstance(result, AdmissionRefused):
                state.admissions.append((yield from self._on_refusal(c, planned, result)))
            elif isinstance(result, BaseException):
                raise result
            else:
                state.admissions.append(self._admitted(c, planned, result))
        return state

    def _forget(self) -> None:
        """After a hard reset: what this agent believed the ledger holds is dropped (the
        objects it admitted, the answers a settle made items, a pending compaction): the
        turn's admissions charge again for what the prompt really holds."""
        self.known.clear()
        self.answered.clear()
        self.compaction_pending = False

    def _deliver(self, state: TurnState) -> Generator[Fetch, Any, None]:
        """The summaries delivered to this turn, as app objects (``summary_of``), with the
        items each replaced, from the records the worker stored beside the session; and
        the session's calibration, when this agent calibrates."""
        ids = state.started.summaries
        extra = (CALIBRATION,) if self.calibrate else ()
        got: list[str | None] = yield Fetch((*ids, *extra))
        if self.calibrate:
            factors, self.reports = _calibration(got[-1])
            if factors != self.counter.factors:
                self.counter.factors, state.recalibrated = factors, True
            if ids:  # the worker counted its summaries with its own counter: recount
                state.recalibrated = True
        for sid, raw in zip(ids, got[: len(ids)], strict=True):
            if raw is None:
                continue  # a summary whose record expired or was never written: its drops stand
            try:
                rec = schema.SummaryRecord.from_json(raw)
                text = rec.text
                replaced = [(Consumer.from_code(code), iid) for code, iid in rec.replaced_items()]
            except (ValueError, KeyError):
                continue  # not a record this version wrote
            summary = self.summary_of(sid, text)
            self.known[(Consumer.WORKING_MEMORY, sid)] = summary
            state.summaries.append(summary)
            state.replaced_by[sid] = replaced
            if rec.tokens and (mine := self.tokens(summary)) != rec.tokens:
                state.recounts.append((sid, mine))  # the compactor counted it otherwise

    def end(
        self, turn: int, prompt_tokens: int, mark: str | None = None, state: TurnState | None = None
    ) -> Op[TurnReport]:
        if state is not None and state.billing:  # the turn's last report, for every process
            c = state.billing[-1]
            yield Note(((BILLED, f"{turn}|{c.counted}|{c.billed}|{int(c.flagged)}"),))
        try:
            if state is not None and state.deferred:
                report = yield from self._finish(state, turn, prompt_tokens, mark)
            else:
                report = yield self.session.end_turn_call(turn, prompt_tokens, mark=mark)
        except ContextDrift as exc:
            if isinstance(exc.report, TurnReport):
                self._reset_at_end(exc.report.reset, exc.report.epoch)
            hint = framing_hint(exc.report, state)
            if hint:
                raise ContextDrift(exc.report, f"{exc}; {hint}") from exc
            raise
        self.compaction_pending = report.compaction_due
        self._reset_at_end(report.reset, report.epoch)
        hint = framing_hint(report, state)
        if hint:
            warnings.warn(ContextDriftWarning(report, hint), stacklevel=4)
        return report

    def _finish(
        self, state: TurnState, turn: int, prompt_tokens: int, mark: str | None
    ) -> Generator[Any, Any, TurnReport]:
        """The turn's end with its deferred tool results, in one call; when one does not
        go in whole, each is admitted as ``tool_result`` admits it (spilled, or refused
        with a note) and the prompt counted with what it became, then ``end_turn``."""
        deferred, state.deferred = state.deferred, []
        tools = [(d.item, d.tokens, d.text) for d in deferred]
        keep = any(d.keep for d in deferred)
        try:
            done: TurnFinished = yield self.session.finish_turn_call(
                turn, prompt_tokens, tools, keep_text=keep, mark=mark
            )
        except AdmissionRefused as exc:
            if exc.reason != "not_whole":
                raise
        else:
            for d in deferred:
                self.known[(Consumer.SCRATCHPAD, d.item)] = d.result
            return done.report
        for d in deferred:
            out = yield from self.tool_result(d.result, d.text, turn)
            state.tools[d.index] = out
            if out.text != d.text:
                shown = count(self.counter, out.text, "a tool result's place") + self.item_overhead
                prompt_tokens += shown - d.tokens
        state.prompt_tokens = prompt_tokens
        report: TurnReport = yield self.session.end_turn_call(turn, prompt_tokens, mark=mark)
        return report

    def abort(self, turn: int) -> Op[TurnAborted]:
        """Roll the turn back: the ledger is as the turn found it (the objects this process
        keeps of it are a cache: ``turn.apply`` on the committed state is the truth)."""
        done: TurnAborted = yield self.session.abort_turn_call(turn)
        self._reset_at_end(done.reset, done.epoch)
        return done

    def _reset_at_end(self, reset: int | None, epoch: int) -> None:
        """A hard reset staged while the turn was open applied as it ended (``reset``: the
        new epoch; the handle took it): what this agent believed held is dropped now, and
        the next turn begins at the new epoch as the turn after a reset, no StaleEpoch on
        the way. A caller that adopts resets itself (``adopt_resets`` False) gets its
        StaleEpoch at the next begin, as before: the handle keeps the turn's epoch."""
        if reset is None:
            return
        if not self.adopt_resets:
            self.session.epoch = epoch
            return
        self._forget()
        self.reset_at_end = epoch

    def renew(self, turn: int) -> Op[TurnRenewed]:
        renewed: TurnRenewed = yield self.session.renew_turn_call(turn, self.lease_ms)
        return renewed

    # --- a tenant's ceilings around each model call (docs/ceilings.md#in-an-adapter) ----
