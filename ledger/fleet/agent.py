"""The simulated agents: the package's agent layer (``ledger.agent``) on synthetic text.

Each simulated agent is an :class:`ledger.agent.Agent`, the code users adopt: turns
begin and end through it, it admits app objects by their token counts, waits (bounded)
for a pending compaction before it asks for retrieval or recall, spills oversized tool
results and hands back what the ledger reclaimed. The objects are synthetic: a
:class:`Doc` of n tokens has n characters of text and the counter is ``len``. The
wrapper here only counts what the demo measures (calls, refusals, waits) and adds
the two calls the agent layer leaves to the caller (``record_span``, and
``end_turn`` with a p99 trend).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ledger import schema
from ledger._sync.agent import drive
from ledger.agent import Admission, Agent, ToolOutcome, Turn
from ledger.agent.core import Op
from ledger.client import Ledger, Session
from ledger.errors import AdmissionRefused, FanoutRefused
from ledger.models import Consumer, SessionBudget, Snapshot, TurnReport, TurnStarted
from ledger.protocol import Call
from ledger.workers.compactors import CompactionPlan, CompactionRequest, simulated

T = TypeVar("T")
_FAILED = schema.COUNTER.of("failed_compactions")
POLL_S = 0.02


class Clock(Protocol):
    """The time an agent waits in: while it waits for a compaction (at a begin, or in
    the user's think time) the background worker does its jobs."""

    # after this many seconds a requested compaction no worker has picked up is not
    # waited for (the agent layer's compaction_pickup)
    pickup: float

    def sleep(self, seconds: float) -> None: ...

    def monotonic(self) -> float: ...


class RealClock:
    """Wall-clock time; the worker is a thread beside the agents (or another process)."""

    pickup = 1.0  # the agent layer's default

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()


class Stepper(Protocol):
    def poll_once(self) -> int: ...


class SteppedClock:
    """Simulated time, for a run that gives the same figures on any machine: the worker
    is not a thread but is stepped by the agents' waits. Each wait (the agent layer's
    poll interval at a begin, or the simulated user's think time in its polls) advances
    the clock; once the worker is free by then, it makes one pass over its jobs, as a
    worker polling at that interval would, and is busy for the simulated time its
    compactions take (:meth:`timed`). A compaction requested at a turn's end thus lands
    in a wait after it, however loaded the machine is, and never between two turns that
    do not wait; a job its jobs enqueue (a hard reset after failed compactions) in a
    later pass. Agents on one stepped clock run one after the other (see
    ``ledger.fleet.run``); :attr:`worker` is set once the worker is made."""

    # the worker picks a job up at the first wait after its request, however long ago
    # that was on the wall clock: a begin waits out its bound, never a pickup time
    pickup = float("inf")

    def __init__(self) -> None:
        self.worker: Stepper | None = None
        self.now = 0.0
        self.free_at = 0.0  # the worker is busy until then
        self.busy = 0.0  # the simulated seconds of the pass under way
        self.passes = 0

    def timed(
        self,
        compactor: Callable[[CompactionRequest], CompactionPlan],
        seconds: Callable[[CompactionRequest], float],
    ) -> Callable[[CompactionRequest], CompactionPlan]:
        """``compactor`` as a worker on this clock runs it: each call keeps the worker
        busy for ``seconds(request)`` of simulated time (a summarizer's model call)."""

        def run(request: CompactionRequest) -> CompactionPlan:
            self.busy += seconds(request)
            return compactor(request)

        return run

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.worker is None or self.now < self.free_at:
            return
        self.busy = 0.0
        self.worker.poll_once()
        self.passes += 1
        self.free_at = self.now + self.busy

    def monotonic(self) -> float:
        return self.now


REAL = RealClock()


def untagged(request: CompactionRequest) -> CompactionPlan:
    """The worker's compactor for scenarios 000, 002 and 004: the package's simulated
    summarizer (``ledger.workers.compactors:simulated``), which draws a summary's size
    from a hash of the session's id, given the id without the run's tag (``@<tag>``, new
    each run so that runs do not share sessions): a seed's sessions compact alike in
    every run, as scenario 001's summarizer does (``decay.summary_tokens``)."""
    return simulated(dataclasses.replace(request, session_id=request.session_id.rsplit("@", 1)[0]))


@dataclass(frozen=True, slots=True)
class Doc:
    """An app object of the simulation: an id and a size in tokens."""

    id: str
    tokens: int


def _text(obj: Any) -> str:
    tokens: int = obj.tokens
    return "x" * tokens  # one token a character: the counter is len


class _CountingAgent(Agent):
    """The agent layer, its ledger calls counted and its refusals kept."""

    def __init__(self, session: Session, compaction_wait: float, clock: Clock) -> None:
        super().__init__(
            session,
            len,
            id_of=lambda o: o.id,
            text_of=_text,
            await_compaction=compaction_wait,
            poll_interval=POLL_S,
            renew=False,  # a simulated turn takes milliseconds: no lease renewal
            # The synthetic texts are not stored for the worker: the demo's summarizers
            # work on sizes alone (and the agents need no summary text back).
            store_content=False,
            compaction_pickup=clock.pickup,
        )
        self.clock = clock
        self.calls = 0
        self.snapshots = 0
        self.refusals: list[AdmissionRefused] = []

    def run(self, op: Op[T]) -> T:
        return drive(op, self._send, self.clock.sleep, self._io, self.session.ledger.run_many)

    def _send(self, call: Call[Any]) -> Any:
        self.calls += 1
        if call.script == "snapshot":
            self.snapshots += 1
        try:
            return self.session.ledger.run(call)
        except AdmissionRefused as exc:
            self.refusals.append(exc)
            raise


class SimAgent:
    """One simulated agent session. After a hard reset its calls raise
    :class:`~ledger.errors.StaleEpoch`; :meth:`adopt_reset` takes the new epoch."""

    def __init__(
        self,
        ledger: Ledger,
        session_id: str,
        budget: SessionBudget,
        compaction_wait: float = 2.0,
        clock: Clock = REAL,
    ) -> None:
        self.session = ledger.open_session(session_id, budget)
        self.clock = clock
        self.agent = _CountingAgent(self.session, compaction_wait, clock)
        # A hard reset is raised to the scenario (StaleEpoch), which empties the simulated
        # context and counts it before the turn begins again (adopt_reset).
        self.agent.core.adopt_resets = False
        self.current: Turn | None = None
        self.waited = False  # waited for a compaction (at a begin) since the caller cleared it
        self.waited_s = 0.0  # seconds begins waited for a compaction (the agent's clock)

    @property
    def calls(self) -> int:
        return self.agent.calls + 1  # and the open

    @property
    def refusals(self) -> list[AdmissionRefused]:
        return self.agent.refusals

    @property
    def turn(self) -> Turn:
        if self.current is None:
            raise RuntimeError("no turn has begun")
        return self.current

    # --- a turn, through the agent layer -----------------------------------------------

    def begin(self, working_set: int, output_reserve: int | None = None) -> TurnStarted:
        """Begin a turn; a pending compaction is waited for first (bounded)."""
        turn = self.agent.turn(working_set, output_reserve)
        self.current = turn.__enter__()
        assert turn.state is not None
        self.waited = self.waited or turn.state.waited_compaction > 0
        self.waited_s += turn.state.waited_compaction
        return turn.state.started

    def admit(self, consumer: Consumer, docs: Sequence[Doc]) -> Admission[Any]:
        """The longest prefix that fits (a pending compaction was waited for at begin)."""
        return self.turn.admit(consumer, list(docs))

    def release(self, docs: Sequence[Doc]) -> None:
        if docs:
            self.turn.release(list(docs))

    def tool_result(self, doc: Doc) -> ToolOutcome[Any]:
        return self.turn.tool_result(doc)

    def span(self, kind: str, input_tokens: int, output_tokens: int) -> bool:
        """Account a memory-tool span before making the call; False: the fan-out guard
        says summarize and proceed instead."""
        self.agent.calls += 1
        try:
            self.session.record_span(self.turn.number, kind, input_tokens, output_tokens)
        except FanoutRefused:
            return False
        return True

    def end(self, prompt_tokens: int, p99_trend: int = 0) -> TurnReport:
        turn = self.turn
        if p99_trend == 0:
            report = turn.end(prompt_tokens)
        else:  # the agent layer passes no trend: the same end_turn, with one
            self.agent.calls += 1
            report = self.session.end_turn(turn.number, prompt_tokens, p99_trend=p99_trend)
            assert turn.state is not None
            turn.state.report = report
            self.agent.core.compaction_pending = report.compaction_due
        turn.__exit__(None, None, None)  # ended: the agent serves no turn now
        self.current = None
        return report

    def snapshot(self) -> Snapshot:
        self.agent.calls += 1
        return self.session.snapshot()

    # --- compactions run by the background worker --------------------------------------

    def wait_attempt(self, before: Snapshot, timeout_s: float) -> bool:
        """Wait (bounded) for the worker's next verdict on the pending compaction: a
        compaction, a failed one, or a hard reset (once the failures escalated to one,
        the reset itself), or a compaction staged under the last turn, which the next
        begin_turn lands. True if one arrived in time."""
        deadline = self.clock.monotonic() + timeout_s
        while self.clock.monotonic() < deadline:
            snap = self.snapshot()
            if (
                not snap.compaction_pending
                or self.session.ledger.client.hexists(
                    self.session.keys.session, schema.STAGED_COMPACTION
                )
                or snap.epoch != before.epoch
                or (
                    snap.raw.get(_FAILED, 0) != before.raw.get(_FAILED, 0)
                    and not snap.raw.get(schema.RESET_REQUESTED, 0)
                )
            ):
                return True
            self.clock.sleep(POLL_S)
        return False

    def adopt_reset(self) -> int:
        """After a hard reset: take the session's new epoch (its items are gone)."""
        self.current = None
        self.agent.core.live_turns.clear()  # the reset ended the open turn
        self.agent.calls += 1
        self.agent.core.compaction_pending = False
        return self.session.refresh()
