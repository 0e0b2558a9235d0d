"""The results of a turn's calls: its start (the begin-turn gate), renewal, abort, spans,
end (``TurnReport``), reconciliation, tool results and compactions."""

from __future__ import annotations

from dataclasses import dataclass

from ledger.models.enums import (
    Classification,
    CompactionOutcome,
    Consumer,
    DriftFlag,
    Regime,
    ToolResultOutcome,
)

# What ``ledger.models`` (and so ``ledger``) exports of this module: its classes.
__all__ = [
    "TurnStarted",
    "TurnAborted",
    "TurnRenewed",
    "SpanRecorded",
    "TurnReport",
    "TurnFinished",
    "Reconciled",
    "Compaction",
    "ToolResult",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnStarted:
    """The begin-turn gate's verdict (docs/rules.md#working-memory-starvation), and what
    was reclaimed to reach it.

    ``reclaimed`` names every item released to make room, so the agent drops exactly
    those from its prompt; ``rotated`` counts tokens released because their consumer
    is released each turn.
    """

    regime: Regime
    turn: int
    residual: int
    need: int
    utilization: float
    reclaimed: tuple[tuple[Consumer, str], ...]
    rotated: int
    released: int
    compaction_due: bool
    rollup_hint: bool
    free: int
    epoch: int
    # The deliveries (docs/compaction.md): summaries of compactions committed since the
    # last turn, and the items they replaced. Delivered to this turn once; queued again
    # if this turn is rolled back.
    summaries: tuple[str, ...] = ()
    dropped: tuple[tuple[Consumer, str], ...] = ()
    lease_until_ms: int = 0  # when the turn lease ends unless renewed (Redis's clock)
    rolled_back: int | None = None  # the dead turn undone to start this one
    mark: str | None = None  # the commit mark of the last ended turn (e.g. a checkpoint id)
    # the outcome of a worker's compaction staged while the last turn was open and landed
    # by this begin_turn (a CompactionOutcome, or ``stale``); None when none was staged
    landed: str | None = None
    # the new epoch when a hard reset staged while the last turn was open applied with this
    # begin_turn (docs/rules.md#a-reset-waits-for-the-turns-end): the turn begins at it
    # (``epoch``), nothing held; None when none applied
    reset: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnAborted:
    """``abort_turn``: the turn rolled back (None when it was no longer open); ``reset``:
    the new epoch when a staged hard reset applied with it, else None."""

    rolled_back: int | None
    turn: int
    free: int
    epoch: int
    reset: int | None = None


@dataclass(frozen=True, slots=True)
class TurnRenewed:
    """``renew_turn``: the turn's lease now ends at ``lease_until_ms`` (Redis's clock)."""

    turn: int
    lease_until_ms: int
    epoch: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SpanRecorded:
    turn: int
    spans: int
    span_input: int
    ratio: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnReport:
    """A turn's amplification ratio and class (docs/rules.md#amplification)."""

    turn: int
    ratio: float
    classification: Classification
    utilization: float
    utilization_delta: float
    spans: int
    span_input: int
    compaction_due: bool
    rollup_hint: bool
    epoch: int
    occupancy: int = 0
    drift: int = 0  # the real prompt minus occupancy
    tolerance: int | None = None
    flag: DriftFlag = DriftFlag.NONE
    # the new epoch when a hard reset staged while the turn was open applied as it ended
    # (docs/rules.md#a-reset-waits-for-the-turns-end), else None: ``epoch`` is the turn's
    reset: int | None = None

    @property
    def flagged(self) -> bool:
        return self.flag != DriftFlag.NONE


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnFinished:
    """A turn ended with its tool results in one call (``finish_turn``,
    docs/protocol.md#a-turn-in-two-calls): the turn's report, and each tool result's
    call id with the tokens it was charged (0: held already)."""

    report: TurnReport
    tools: tuple[tuple[str, int], ...]
    free: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconciled:
    """The ledger set to the items the prompt really holds (``reconcile``)."""

    added: int
    resized: int
    kept: int
    removed: tuple[tuple[Consumer, str], ...]
    delta: int  # tokens the named consumers' items changed by
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Compaction:
    """A committed compaction, judged against the high-water mark
    (docs/rules.md#compaction-credit)."""

    compacted: bool  # False: a failed compaction (above the mark, too small a gain, no fit)
    outcome: CompactionOutcome
    occupancy: int
    high_water_mark: int
    dropped: int
    summary: int
    missing: tuple[tuple[Consumer, str], ...]  # replaced items that were not held
    failures: int
    escalated: bool  # a hard-reset job was enqueued in the same step
    free: int
    epoch: int
    turn: int
    gain: int = 0  # occupancy before minus after (0 when nothing was applied)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """A tool result admitted whole, spilled to a handle with a preview, or a duplicate."""

    outcome: ToolResultOutcome
    item: str
    charged: int
    tokens: int
    preview_tokens: int
    evicted: tuple[tuple[Consumer, str], ...]
    free: int
    epoch: int
    turn: int

    @property
    def spilled(self) -> bool:
        return self.outcome == ToolResultOutcome.SPILLED
