"""Readings: a session's snapshot and audit, a budget scope's usage, a partition's check
by the worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ledger.models.enums import Consumer

# What ``ledger.models`` (and so ``ledger``) exports of this module: its classes.
__all__ = [
    "Snapshot",
    "StagedReset",
    "AuditReport",
    "ScopeUsage",
    "PartitionCheck",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StagedReset:
    """A hard reset waiting for the open turn's end (docs/rules.md#a-reset-waits-for-the-turns-end):
    its reason, and when it is due (Redis's clock): from then on a reset call applies it
    whatever is open."""

    reason: str
    due_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """A consistent reading of one session, taken in one atomic step."""

    now_ms: int
    epoch: int
    turn: int
    window: int
    system_prompt: int
    tool_framing: int
    output_reserve: int
    working_memory_floor: int
    min_memory: int
    high_water_mark: int
    eviction_threshold: int
    free: int
    used: dict[Consumer, int]
    reserved: dict[Consumer, int]
    items: dict[Consumer, int]
    open_reservations: int
    refusals: int
    expirations: int
    compaction_pending: bool
    failed_compactions: int
    raw: dict[str, int] = field(repr=False)
    last_prompt: int = 0  # the real prompt at the last end_turn (0: none yet)
    drift: int = 0  # that prompt minus occupancy then
    drift_flagged: bool = False  # beyond the tolerance or over the window, not reconciled
    framing_tolerance: int | None = None
    turn_owner: str | None = None  # who holds the open turn (None: no turn is open)
    lease_until_ms: int = 0  # when the open turn's lease ends (Redis's clock)
    last_ended_turn: int = 0
    compacting: bool = False  # a worker is computing this session's compaction now
    mark: str | None = None  # the commit mark of the last ended turn
    reset_staged: StagedReset | None = None  # a hard reset waiting for the turn's end

    @property
    def turn_open(self) -> bool:
        return self.turn_owner is not None

    @property
    def lease_left_ms(self) -> int | None:
        """Milliseconds the open turn's lease has left (negative: lapsed), None if none."""
        return None if self.turn_owner is None else self.lease_until_ms - self.now_ms

    @property
    def occupancy(self) -> int:
        """Tokens actually taken: system prompt, framing, items and open reservations."""
        return (
            self.system_prompt
            + self.tool_framing
            + sum(self.used.values())
            + sum(self.reserved.values())
        )

    @property
    def utilization(self) -> float:
        return self.occupancy / self.window

    @property
    def residual_working_memory(self) -> int:
        """Tokens working memory could hold now: the window minus every other claim."""
        memory = (
            self.used[Consumer.RETRIEVAL]
            + self.reserved[Consumer.RETRIEVAL]
            + self.used[Consumer.RECALL]
            + self.reserved[Consumer.RECALL]
        )
        return (
            self.window
            - self.system_prompt
            - self.tool_framing
            - self.output_reserve
            - max(memory, self.min_memory)
            - self.used[Consumer.SCRATCHPAD]
            - self.reserved[Consumer.SCRATCHPAD]
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
    """Whether a session's counters equal its items, and which leases are overdue."""

    session_id: str
    clean: bool
    problems: tuple[str, ...]
    overdue: tuple[str, ...]
    now_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeUsage:
    """A budget scope as read at ``now_ms`` (Redis's clock): per quantity ('input',
    'output', 'cached_input', 'money' in micro-cents) what its current window has
    charged (``charged``: open holds and billed usage), of which ``held`` by open holds
    (holds past their deadline are not counted); ``remaining`` per ceiling set ('tokens'
    for the token ceiling; never below 0); ``buckets``: bucket start (ms) -> billed usage
    per quantity (and 'over', 'over_money': billed past the holds), for every bucket
    kept; ``open_holds``, ``refused``, and ``over`` /
    ``over_money``: what settles billed past their holds, ever; ``ceilings``: each
    ceiling set, by the names of ``remaining``."""

    scope: str
    now_ms: int
    window_ms: int
    bucket_ms: int
    charged: Mapping[str, int]
    held: Mapping[str, int]
    remaining: Mapping[str, int]
    buckets: Mapping[int, Mapping[str, int]]
    open_holds: int
    refused: int
    over: int
    over_money: int
    ceilings: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PartitionCheck:
    """What ``worker_check`` read of one partition: ms until its earliest lease deadline
    (0: passed; None: no lease), and whether a job has been pending long enough to take
    over (or its stream or group is missing)."""

    due_ms: int | None
    idle: bool
