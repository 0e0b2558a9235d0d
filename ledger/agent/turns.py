"""What an agent's operations answer: a turn's state (:class:`TurnState`), what was
admitted, a tool result's outcome, a compaction, a model call's hold."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ledger.agent.effects import Obj
from ledger.errors import (
    AdmissionRefused,
)
from ledger.models import (
    CallCost,
    CompactionOutcome,
    Consumer,
    Settled,
    TurnAborted,
    TurnReport,
    TurnStarted,
    Usage,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class BillingCheck:
    """One model call's prompt as the ledger counted it against what the provider billed
    for it (its reported input tokens)."""

    turn: int
    counted: int
    billed: int
    tolerance: int  # the difference allowed: billing_tolerance of the counted prompt
    flagged: bool  # |billed - counted| > tolerance
    plausible: bool  # a ratio an estimate can be off by (0.5..2 of each kind's prior)
    learned: Mapping[str, float] | None  # the factors this report taught, by kind

    @property
    def difference(self) -> int:
        return self.billed - self.counted


def default_summary(summary_id: str, text: str) -> Obj:
    """The app object a worker's summary becomes: a system message dict."""
    return {"id": summary_id, "role": "system", "content": text}


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission(Generic[T]):
    """Which app objects made it into the prompt."""

    kept: tuple[T, ...]  # admitted now or already held: put these in the prompt
    refused: tuple[T, ...]  # not admitted: leave them out
    reason: str | None  # why the first refused one was refused (a refusal reason), or None
    charged: int
    free: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolOutcome(Generic[T]):
    """A tool result admitted whole, or spilled: ``text`` is what goes in the prompt
    (the whole result, or a preview cut to the preview budget with the handle)."""

    result: T
    text: str
    spilled: bool
    handle: str | None  # read the whole result back with Agent.read_spill(handle)
    tokens: int  # the whole result's tokens
    charged: int  # tokens the prompt holds for it
    evicted: tuple[Obj, ...]  # memory items that gave way: drop them from the prompt
    unresolved: tuple[tuple[Consumer, str], ...]  # evicted items this worker cannot name
    # refused (not even its preview fits): ``text`` is a short note saying so, which the
    # ledger holds in the result's place (a tool call answered, never a result cut)
    refused: bool = False
    reason: str | None = None
    # sent with the turn's end (``tool_result(..., defer=True)``): ``text`` is the whole
    # result; if it did not go in whole then, ``turn.tools`` holds what it became
    deferred: bool = False


@dataclass(frozen=True, slots=True)
class Deferred:
    """A tool result to admit whole with the turn's end (``finish_turn``)."""

    index: int  # its place in ``TurnState.tools``
    result: Obj
    item: str
    tokens: int
    text: str
    keep: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Compacted:
    compacted: bool
    outcome: CompactionOutcome
    dropped: tuple[Obj, ...]  # app objects the summary replaced: drop them
    summary: Obj | None
    occupancy: int


@dataclass(frozen=True, slots=True)
class CallHold:
    """A model call's worst case, held before the call (docs/ceilings.md#in-an-adapter):
    ``tokens`` (its output reserve) in the session's window, as working memory, and
    ``cost`` (the prompt counted and the output reserve) in ``scopes``, the tenant first,
    in the same script. Settled with the billed usage after the call, voided on failure."""

    id: str
    tokens: int
    cost: CallCost
    scopes: tuple[str, ...]


@dataclass
class TurnState:
    """What one turn did; the faces' Turn objects expose it."""

    started: TurnStarted
    dropped: list[Obj] = field(default_factory=list)  # reclaimed at begin_turn: drop them
    unresolved: list[tuple[Consumer, str]] = field(default_factory=list)
    admissions: list[Admission[Any]] = field(default_factory=list)
    tools: list[ToolOutcome[Any]] = field(default_factory=list)
    prompt_tokens: int | None = None
    report: TurnReport | None = None
    # the worker's summaries delivered to this turn: put them in the prompt (``dropped``
    # holds the objects they replaced)
    summaries: list[Obj] = field(default_factory=list)
    # delivered summaries this agent counts otherwise than their compactor did: (id, its
    # count), each corrected in the ledger as the turn begins
    recounts: list[tuple[str, int]] = field(default_factory=list)
    # every (consumer, ledger id) this turn must drop from the app's state: reclaimed at
    # begin_turn and replaced by the delivered summaries (what ``dropped`` resolves)
    drop_refs: list[tuple[Consumer, str]] = field(default_factory=list)
    # each delivered summary's id -> the (consumer, id) pairs it replaced, in order
    replaced_by: dict[str, list[tuple[Consumer, str]]] = field(default_factory=dict)
    aborted: TurnAborted | None = None  # the turn was rolled back (turn.abort, an error)
    waited_compaction: float = 0.0  # seconds begin waited for a pending compaction
    billing: list[BillingCheck] = field(default_factory=list)  # this turn's reports
    # the calibration factor changed since this process last counted: the app's held
    # objects count otherwise now (an adapter reconciles the ledger to them)
    recalibrated: bool = False
    # the adapter's recount after a recalibration was refused (it did not fit): the ledger
    # keeps the old counts, the drift shows at end_turn; the turn goes on
    unreconciled: AdmissionRefused | None = None
    # the tokens of the tool schemas the last prompt sent, as the adapter counted them
    framing: int = 0
    # with a tenant named: each model call's settle (``over``: billed past its hold,
    # charged all the same)
    settled: list[Settled] = field(default_factory=list)
    # with a tenant named: the usage this turn's model calls were billed (the sum of their
    # settles: what each reported, or the worst case held when it reported none); None:
    # no call was settled
    usage: Usage | None = None
    # tool results sent with the turn's end (two-call turn, docs/agent.md)
    deferred: list[Deferred] = field(default_factory=list)
    # the epoch this agent's handle had when a hard reset (docs/rules.md) found it: the
    # turn began at the session's new epoch, the ledger holding no item; None: no reset
    # (docs/agent.md#after-a-hard-reset)
    reset_from_epoch: int | None = None

    @property
    def turn(self) -> int:
        return self.started.turn

    @property
    def rolled_back(self) -> int | None:
        """The dead turn that was undone to start this one (a crash, a takeover)."""
        return self.started.rolled_back

    @property
    def reset(self) -> bool:
        """The session was hard-reset since this agent's last turn: the ledger held none of
        the prompt's objects as the turn began (each admission of it charges again; an
        adapter reconciles the ledger to its state)."""
        return self.reset_from_epoch is not None
