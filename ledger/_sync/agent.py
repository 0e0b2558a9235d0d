# GENERATED from ledger/_async/agent.py by tools/unasync.py: edit that file, not this one.
"""The agent layer's synchronous face: :class:`Agent` and its per-turn :class:`Turn`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ledger import schema
from ledger._sync.client import Session
from ledger.agent.core import (
    Admission,
    AgentCore,
    Batch,
    BillingCheck,
    CallHold,
    Compacted,
    Effect,
    Fetch,
    Held,
    Note,
    Obj,
    Op,
    Sleep,
    Store,
    ToolOutcome,
    TurnState,
)
from ledger.agent.counters import Tally
from ledger.agent.lease import Heartbeat
from ledger.agent.telemetry import recording_span, usage_attributes
from ledger.errors import ContextDrift, InvalidArgument, LedgerError, TurnLost, translated
from ledger.models import Consumer, Reconciled, Settled, TurnAborted, TurnReport, Usage, Voided
from ledger.protocol import Call

T = TypeVar("T")


def drive(
    op: Op[T],
    run: Callable[[Call[Any]], Any],
    sleep: Callable[[float], None],
    io: Callable[[Effect], Any],
    run_many: Callable[..., list[Any]],
) -> T:
    """Run an operation of :mod:`ledger.agent.core` to its result: its calls with ``run``,
    its batches with ``run_many``, its waits with ``sleep`` and its reads and writes
    outside the ledger's scripts with ``io`` (sync)."""
    try:
        effect = next(op)
        while True:
            if isinstance(effect, Sleep):
                sleep(effect.seconds)
                effect = op.send(None)
                continue
            if isinstance(effect, (Held, Store, Fetch, Note)):
                effect = op.send(io(effect))
                continue
            if isinstance(effect, Batch):
                effect = op.send(run_many(list(effect.calls), return_exceptions=True))
                continue
            try:
                result = run(effect)
            except Exception as exc:
                effect = op.throw(exc)
                continue
            effect = op.send(result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


class Agent:
    """Governs one agent session's context with the ledger (sync).

    ``counter`` counts a text's tokens (e.g. :class:`~ledger.agent.TiktokenCounter`);
    ``id_of`` / ``text_of`` read an app object's id and text (defaults understand
    ``id`` / ``tool_call_id`` / ``call_id`` and ``content`` / ``page_content`` /
    ``text``); ``item_overhead`` tokens are added to every item (per-message framing).
    ``lease_ms`` is a turn's lease (renewed in the background every third of it while the
    turn runs, unless ``renew=False``); ``await_compaction`` the seconds a turn of a
    worker-owned session waits, before it begins, for a compaction the ledger reports
    pending, and ``compaction_pickup`` the seconds after its request past which one no
    worker picked up is not waited for (docs/agent.md).
    """

    def __init__(
        self, session: Session, counter: Callable[[str], int], **options: Any
    ) -> None:
        self.session = session
        self.core = AgentCore(session, counter, **options)
        self._ttl_ms: int | None = None

    def run(self, op: Op[T]) -> T:
        ledger = self.session.ledger
        return drive(op, ledger.run, time.sleep, self._io, ledger.run_many)

    def _io(self, effect: Held | Store | Fetch | Note) -> Any:
        """The reads and writes outside the ledger's scripts: which items are held, the
        content store (texts for the worker's compactor), the worker's summaries, the
        session's calibration and billing report."""
        self.session.ledger.check_open()
        client, keys = self.session.ledger.client, self.session.keys
        with translated():
            if isinstance(effect, Note):
                if self._ttl_ms is None:
                    self._ttl_ms = int(
                        client.hget(keys.session, schema.IDLE_TTL) or 86_400_000
                    )
                pipe = client.pipeline(transaction=False)
                pipe.hset(keys.compacted, mapping=dict(effect.fields))
                pipe.pexpire(keys.compacted, self._ttl_ms)
                pipe.execute()
                return None
            if isinstance(effect, Held):
                values = client.hmget(keys.session, effect.fields)
                return [v is not None for v in values]
            if isinstance(effect, Store):
                if self._ttl_ms is None:
                    self._ttl_ms = int(
                        client.hget(keys.session, schema.IDLE_TTL) or 86_400_000
                    )
                if effect.texts:
                    pipe = client.pipeline(transaction=False)
                    pipe.hset(keys.content, mapping=dict(effect.texts))
                    pipe.pexpire(keys.content, self._ttl_ms)
                    pipe.execute()
                return None
            if not effect.ids:
                return []
            raw = client.hmget(keys.compacted, effect.ids)
            return [None if v is None else schema.text(v) for v in raw]

    def turn(
        self,
        working_set: int = 0,
        output_reserve: int | None = None,
        *,
        wait: float = 0.0,
        takeover: bool = False,
        admit: Mapping[Consumer | str, Sequence[Obj]] | None = None,
    ) -> Turn:
        """``with agent.turn(working_set) as turn:`` takes the session's turn and
        runs begin_turn on entry; on a clean exit end_turn with the prompt given to
        :meth:`Turn.prompt`; on an exception the turn is rolled back
        (:meth:`Turn.abort`). A turn another process holds is waited for up to
        ``wait`` seconds, then :class:`~ledger.errors.TurnInProgress`; ``takeover`` rolls
        it back and takes it at once. ``admit`` (consumer -> app objects) admits the
        turn's first objects in the round trip that begins it: their results are
        :attr:`Turn.admissions`, in that order."""
        return Turn(
            self,
            working_set=working_set,
            output_reserve=output_reserve,
            wait=wait,
            takeover=takeover,
            admit=admit,
        )

    def track(self, consumer: Consumer | str, objs: Sequence[Obj]) -> None:
        self.core.track(consumer, objs)

    def read_spill(self, handle: str) -> str | None:
        """A spilled tool result's whole text, from any worker (None once expired)."""
        data = self.session.ledger.read_spill(self.session.id, handle)
        return None if data is None else data.decode()

    def reconcile(self, held: Mapping[Consumer | str, Sequence[Obj]]) -> Reconciled:
        """Set the ledger to exactly the app objects the prompt holds (per consumer named)."""
        return self.run(self.core.reconcile(held))


class Turn:
    """One turn: begin_turn on entry, end_turn on a clean exit, abort_turn on an error.
    ``dropped`` are the app objects the ledger reclaimed to start the turn (or a worker's
    summary replaced), ``summaries`` the summaries delivered to it: :meth:`apply` does
    both to the app's own objects, whichever process admitted them."""

    def __init__(
        self,
        agent: Agent,
        working_set: int,
        output_reserve: int | None,
        wait: float = 0.0,
        takeover: bool = False,
        admit: Mapping[Consumer | str, Sequence[Obj]] | None = None,
    ) -> None:
        self.agent = agent
        self._begin = (working_set, output_reserve)
        self._wait, self._takeover, self._admit = wait, takeover, admit
        self.state: TurnState | None = None
        self._prompt: int | None = None
        self._beat: Heartbeat | None = None

    def __enter__(self) -> Turn:
        core = self.agent.core
        self.state = self.agent.run(
            core.begin(*self._begin, wait=self._wait, takeover=self._takeover, admit=self._admit)
        )
        if core.renew_leases:
            self._beat = Heartbeat(self._renew, core.lease_ms / 3000)
            self._beat.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if kind is None and self._state.report is None and self._state.aborted is None:
                self.end()
        except BaseException:
            self._stop()
            self._abort_quietly()
            raise
        self._stop()
        if kind is not None:
            self._abort_quietly()

    def _stop(self) -> None:
        if self.state is not None:
            self.agent.core.live_turns.discard(self.state.turn)
        if self._beat is not None:
            self._beat.stop()

    def _renew(self) -> None:
        self.agent.run(self.agent.core.renew(self._state.turn))

    def _abort_quietly(self) -> None:
        """After an error: roll the turn back. If even that fails (Redis away), the lease
        lapses and the worker or the next turn rolls it back."""
        state = self._state
        if state.report is not None or state.aborted is not None:
            return
        with contextlib.suppress(LedgerError):
            self.abort()

    @property
    def _state(self) -> TurnState:
        if self.state is None:
            raise InvalidArgument(
                "the turn has not begun: use it as `with agent.turn() as turn:`"
            )
        return self.state

    @property
    def number(self) -> int:
        return self._state.turn

    @property
    def dropped(self) -> list[Obj]:
        return self._state.dropped

    @property
    def admissions(self) -> list[Admission[Any]]:
        """This turn's admissions, in order: first those of ``agent.turn(admit=...)``."""
        return self._state.admissions

    @property
    def tools(self) -> list[ToolOutcome[Any]]:
        """This turn's tool results, in order (a deferred one: what it became at the end)."""
        return self._state.tools

    @property
    def report(self) -> TurnReport | None:
        return self._state.report

    @property
    def usage(self) -> Usage | None:
        """With a tenant named: what this turn's model calls were billed, summed (input
        uncached, output, cached input; a call that reported no usage counts the worst case
        its hold charged); None while no call was settled. When the turn ends or is rolled
        back it is set on the current OpenTelemetry span, if one is recording
        (docs/ceilings.md#a-turns-usage-on-its-span)."""
        return self._state.usage

    @property
    def summaries(self) -> list[Obj]:
        """The worker's summaries delivered to this turn: put them in the prompt (the
        objects they replaced are in ``dropped``). Each is delivered to one turn of the
        session, once; if this turn is rolled back, to the next one."""
        return self._state.summaries

    @property
    def rolled_back(self) -> int | None:
        """The dead turn (a crash, a takeover) undone to start this one, or None."""
        return self._state.rolled_back

    @property
    def reset_from_epoch(self) -> int | None:
        """The epoch this agent's handle had when the session was hard-reset since its
        last turn (the turn began at the new one, the ledger holding no item), or None
        (docs/agent.md#after-a-hard-reset)."""
        return self._state.reset_from_epoch

    @property
    def mark(self) -> str | None:
        """The commit mark the last ended turn left (e.g. the app state's version)."""
        return self._state.started.mark

    @property
    def lost(self) -> TurnLost | None:
        """Set when a renewal found the turn taken over or rolled back."""
        return None if self._beat is None else self._beat.lost

    def billed(
        self, input_tokens: int, counted: int, tally: Tally | None = None
    ) -> BillingCheck:
        """Record what the provider billed for a prompt this turn sent (its reported input
        tokens) against the ledger's count of that prompt (``counted``): flagged beyond the
        agent's ``billing_tolerance``; an estimating counter is calibrated from it. ``tally``:
        what the count was made of (``agent.core.counter.measure()``), by default the
        last prompt measured."""
        return self.agent.run(
            self.agent.core.billed(self._state, input_tokens, counted, tally)
        )

    def hold(self, prompt: int, output: int, model: str | None = None) -> CallHold:
        """Before a model call, with a tenant named: hold its worst case (``prompt``
        counted plus ``output`` reserve) in the session and the tenant's scopes in one
        script; refused with ``CeilingReached`` (nothing held) when a ceiling would be
        passed (docs/ceilings.md#in-an-adapter)."""
        return self.agent.run(self.agent.core.hold(prompt, output, model, self._state.turn))

    def settle_hold(
        self, hold: CallHold, answer: Obj | None, billed: Usage | None
    ) -> Settled:
        """After the call: charge what the provider billed (None: the worst case held);
        the answer becomes its working-memory item in the same step."""
        return self.agent.run(self.agent.core.settle_hold(self._state, hold, answer, billed))

    def void_hold(self, hold: CallHold) -> Voided:
        """The call failed: give its hold back everywhere."""
        return self.agent.run(self.agent.core.void_hold(hold, self._state.turn))

    def apply(self, objs: Sequence[Obj]) -> list[Obj]:
        """The app's objects as this turn must hold them: what the ledger reclaimed and
        what a delivered summary replaced left out (by ledger id, whichever process
        admitted them), each delivered summary in the place of the first object it
        replaced. Objects with no id stay. Call it on the state the turn starts from."""
        return self.agent.core.apply(self._state, objs)

    def admit(
        self, consumer: Consumer | str, objs: Sequence[Obj], priority: int = 0
    ) -> Admission[Any]:
        """Admit app objects (the longest prefix that fits); ``kept`` go in the prompt.
        While a compaction is pending, retrieval and recall are judged on the
        post-compaction baseline (a refusal then says ``compaction_pending``)."""
        got = self.agent.run(
            self.agent.core.admit(consumer, objs, priority, self._state.turn)
        )
        self._state.admissions.append(got)
        return got

    def tool_result(
        self, result: Obj, text: str | None = None, *, defer: bool = False
    ) -> ToolOutcome[Any]:
        """Admit a tool result whole, or spill it: put ``outcome.text`` in the prompt and
        drop ``outcome.evicted``. ``defer``: no round trip now; the result is admitted
        whole with the turn's end, in the same call (a turn in two round trips,
        docs/agent.md); if it does not go in whole then, it is admitted as without
        ``defer`` and :attr:`tools` holds what it became, the prompt counted with that."""
        core = self.agent.core
        if defer:
            state = self._state
            got = core.defer_now(state, result, text)  # (no call to make: no generator)
            if got is None:
                got = self.agent.run(core.defer_tool(state, result, text))
            state.tools.append(got)
            return got
        got = self.agent.run(core.tool_result(result, text, self._state.turn))
        self._state.tools.append(got)
        return got

    def release(self, objs: Sequence[Obj]) -> list[Obj]:
        return self.agent.run(self.agent.core.release(objs, self._state.turn))

    def compact(self, replaced: Sequence[Obj], summary: Obj | None) -> Compacted:
        return self.agent.run(self.agent.core.compact(replaced, summary, self._state.turn))

    def renew(self) -> None:
        """Renew the turn's lease now (the background renewal does it every third of it)."""
        self._renew()

    def prompt(self, prompt: int | str | Sequence[Obj]) -> int:
        """Give the real prompt (its tokens, its text, or the objects it is made of)."""
        self._prompt = self.agent.core.prompt_tokens(prompt)
        self._state.prompt_tokens = self._prompt
        return self._prompt

    def end(
        self, prompt: int | str | Sequence[Obj] | None = None, *, mark: str | None = None
    ) -> TurnReport:
        """End and commit the turn with the real prompt; ``mark`` (an id) is the app
        state's version it commits, handed to the next turn (:attr:`mark`)."""
        if prompt is not None:
            self.prompt(prompt)
        if self._prompt is None:
            raise InvalidArgument("end_turn needs the real prompt: call turn.prompt(...) first")
        try:
            report = self.agent.run(
                self.agent.core.end(self._state.turn, self._prompt, mark, self._state)
            )
        except ContextDrift as exc:
            # The turn has ended (drift_action="raise"): keep its report all the same.
            if isinstance(exc.report, TurnReport):
                self._state.report = exc.report
                self._emit()
            raise
        self._state.report = report
        self._emit()
        return report

    def _emit(self) -> None:
        """The ended (or rolled back) turn's billed usage (:attr:`usage`) and the window's
        composition as attributes of the current OpenTelemetry span, when one is recording
        (one snapshot read more then; without it, the usage alone). Nothing without a
        settled call, a recording span or opentelemetry-api; never an error out of the
        ended turn."""
        usage = self._state.usage
        span = None if usage is None else recording_span()
        if span is None or usage is None:
            return
        session = self.agent.session
        snap = None
        with contextlib.suppress(LedgerError):
            snap = session.snapshot()
        span.set_attributes(usage_attributes(session.id, usage, snap, turn=self._state.turn))

    def abort(self) -> TurnAborted:
        """Roll the turn back (docs/agent.md#a-dead-turn-is-undone): the ledger is as the
        turn found it, its deliveries go to the next turn, its lease ends."""
        self._stop()
        done = self.agent.run(self.agent.core.abort(self._state.turn))
        self._state.aborted = done
        self._emit()  # its calls were billed all the same (a scope keeps a settle)
        return done
