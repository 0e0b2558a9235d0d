"""Budgets, items and results: plain data shared by the sync and asyncio clients.

A result of four fields or more is keyword-only (``kw_only=True``): it is built by name,
so a reordering of its fields cannot silently swap two of them. A closed set of wire
strings is a ``StrEnum`` (``Regime``, ``Classification``, ...): each member is its string.
"""

from __future__ import annotations

import decimal
import enum
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from ledger.errors import ConfigurationError, InvalidArgument

# Exported by ``ledger`` as they are: a new result model is added here, nowhere else.
__all__ = [
    "Consumer",
    "CompactionMode",
    "Regime",
    "Classification",
    "DriftFlag",
    "CompactionOutcome",
    "ToolResultOutcome",
    "JobKind",
    "SessionBudget",
    "Item",
    "BegunBy",
    "HeldItem",
    "Opened",
    "Admitted",
    "Released",
    "Reservation",
    "Settled",
    "Price",
    "ScopeBudget",
    "CallCost",
    "Usage",
    "ScopeSet",
    "ScopeUsage",
    "ChildOpened",
    "ChildDrawn",
    "Voided",
    "Expired",
    "PartitionCheck",
    "ResetDone",
    "TurnStarted",
    "TurnAborted",
    "TurnRenewed",
    "SpanRecorded",
    "TurnReport",
    "TurnFinished",
    "Reconciled",
    "Compaction",
    "ToolResult",
    "Deleted",
    "AuditReport",
    "Snapshot",
]

TOKENS_MAX = 100_000_000


class Consumer(enum.StrEnum):
    """The claims on a session's window that hold named items."""

    WORKING_MEMORY = "working_memory"
    RETRIEVAL = "retrieval"
    RECALL = "recall"
    SCRATCHPAD = "scratchpad"

    @property
    def code(self) -> str:
        """The one-letter code the Lua scripts use."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: str) -> Consumer:
        return _BY_CODE[code]

    @classmethod
    def parse(cls, value: Consumer | str) -> Consumer:
        """A Consumer from itself or its name; anything else is an InvalidArgument."""
        try:
            return _BY_VALUE[value]
        except (KeyError, TypeError):
            names = ", ".join(c.value for c in cls)
            raise InvalidArgument(f"unknown consumer {value!r}: use one of {names}") from None


_CODES = {
    Consumer.WORKING_MEMORY: "w",
    Consumer.RETRIEVAL: "r",
    Consumer.RECALL: "m",
    Consumer.SCRATCHPAD: "s",
}
_BY_CODE = {v: k for k, v in _CODES.items()}
_BY_VALUE: dict[object, Consumer] = {c.value: c for c in Consumer}


# The closed sets of the wire protocol (docs/protocol.md). Each is a StrEnum: a member
# is its wire string (``Regime.OK == "ok"``, ``str(Regime.OK) == "ok"``, JSON ``"ok"``).


class CompactionMode(enum.StrEnum):
    """Who compacts a session (``SessionBudget.compaction``)."""

    WORKER = "worker"  # the background worker runs its compactor on due compactions
    AGENT = "agent"  # the agent commits compactions inline; the worker never compacts it


class Regime(enum.StrEnum):
    """The begin-turn gate's regime (docs/rules.md#working-memory-starvation)."""

    OK = "ok"  # working memory fits
    STARVATION = "starvation"  # short, utilization at or below the eviction threshold
    LOUD = "loud"  # short, utilization above the eviction threshold


class Classification(enum.StrEnum):
    """A turn's amplification class (docs/rules.md#amplification)."""

    SATURATION = "saturation"
    FRAGMENTATION = "fragmentation"
    PATHOLOGICAL = "pathological"
    AMBIGUOUS = "ambiguous"


class DriftFlag(enum.StrEnum):
    """What ``end_turn`` judged of the real prompt against the ledger's occupancy."""

    NONE = "none"
    DRIFT = "drift"  # it differs by more than the framing tolerance
    OVER_WINDOW = "over_window"  # it is larger than the window


class CompactionOutcome(enum.StrEnum):
    """What a ``compact`` did (docs/rules.md#compaction-credit)."""

    COMPACTED = "compacted"
    FAILED = "failed"  # still above the high-water mark
    DEFERRED = "deferred"  # under the mark, but the gain is below compaction_min_gain
    DID_NOT_FIT = "did_not_fit"  # the summary does not fit: nothing replaced
    ALREADY = "already"  # the job was committed before: nothing changed
    STAGED = "staged"  # a job's compaction while a turn is open: lands at the next begin_turn
    RECOUNTED = "recounted"  # a summary replacing itself: the receiving agent's count


class JobKind(enum.StrEnum):
    """A job stream entry's kind (docs/protocol.md#the-job-stream)."""

    COMPACT = "compact"  # a due compaction: the worker's compactor, committed by compact.lua
    HARD_RESET = "hard_reset"  # failed compactions escalated: reset.lua


class ToolResultOutcome(enum.StrEnum):
    """What ``admit_tool_result`` did with a tool result."""

    ADMITTED = "admitted"
    SPILLED = "spilled"  # spilled to a handle; the prompt holds a preview
    DUPLICATE = "duplicate"  # already held


class SessionBudget(BaseModel):
    """How one session's token window is divided. All sizes are in tokens.

    The reserved floor (system prompt + tool framing + working-memory floor +
    minimum memory + output reserve) is subtracted before any dynamic allocation;
    a floor larger than the window is a configuration fault (docs/rules.md#budget-and-claims).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @field_validator("release_each_turn", mode="before")
    @classmethod
    def _consumers(cls, v: object) -> frozenset[Consumer]:
        if isinstance(v, (set, frozenset, list, tuple)):
            return frozenset(Consumer.parse(c) for c in v)
        raise ValueError("release_each_turn must be a set of consumers")

    window: int = Field(gt=0, le=TOKENS_MAX)
    system_prompt: int = Field(ge=0, le=TOKENS_MAX)
    working_memory_floor: int = Field(default=0, ge=0, le=TOKENS_MAX)
    min_memory: int = Field(default=0, ge=0, le=TOKENS_MAX)
    tool_framing: int = Field(default=0, ge=0, le=TOKENS_MAX)
    output_reserve: int = Field(default=0, ge=0, le=TOKENS_MAX)
    eviction_threshold: float = Field(default=0.90, gt=0.0, le=1.0)
    high_water_mark: float = Field(default=0.72, gt=0.0, le=1.0)
    idle_ttl_seconds: int = Field(default=86_400, ge=1, le=31_536_000)
    release_each_turn: frozenset[Consumer] = Field(
        default=frozenset(), description="consumers whose items are released at every begin_turn"
    )
    spill_preview_tokens: int = Field(default=256, gt=0, le=TOKENS_MAX)
    spill_ttl_seconds: int = Field(default=3_600, ge=1, le=31_536_000)
    max_failed_compactions: int = Field(default=3, ge=1, le=100)
    rollup_turns: int = Field(default=20, ge=1, le=1_000_000)
    rollup_fraction: float = Field(default=0.60, gt=0.0, le=1.0)
    amplification_saturation: float = Field(default=1.5, gt=0.0, le=1000.0)
    amplification_fragmentation: float = Field(default=3.0, gt=0.0, le=1000.0)
    amplification_pathological: float = Field(default=8.0, gt=0.0, le=1000.0)
    # dumped as its plain string, as before it was an enum (and a model_copy's unvalidated
    # string too, without a serializer warning)
    compaction: Annotated[CompactionMode, PlainSerializer(str, return_type=str)] = Field(
        default=CompactionMode.WORKER,
        strict=False,  # the wire strings too: "worker", "agent"
        description="who compacts the session: 'worker' (the background worker runs its "
        "compactor on due compactions) or 'agent' (the ledger reports a compaction due and "
        "the agent commits it inline through compact; the worker never compacts it)",
    )
    framing_tolerance: int | None = Field(
        default=None,
        ge=0,
        le=TOKENS_MAX,
        description="tokens the real prompt may differ from occupancy at end_turn before "
        "the drift is flagged (message framing the items do not count); None: not judged",
    )
    compaction_min_gain: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="share of the window a compaction must free; one that frees less is a "
        "deferral, counted as a failed compaction (docs/rules.md#compaction-credit); 0: no minimum",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigurationError(f"invalid session budget: {exc}") from exc

    @model_validator(mode="after")
    def _floor_fits(self) -> SessionBudget:
        if self.reserved_floor > self.window:
            raise ValueError(
                f"reserved floor {self.reserved_floor} (system_prompt {self.system_prompt} + "
                f"tool_framing {self.tool_framing} + working_memory_floor "
                f"{self.working_memory_floor} + min_memory {self.min_memory} + output_reserve "
                f"{self.output_reserve}) exceeds window {self.window}: a configuration fault"
            )
        if self.eviction_threshold < self.high_water_mark:
            raise ValueError(
                f"eviction_threshold {self.eviction_threshold} is below high_water_mark "
                f"{self.high_water_mark}: the loud regime would start before a compaction "
                "is even due"
            )
        return self

    @property
    def reserved_floor(self) -> int:
        return (
            self.system_prompt
            + self.tool_framing
            + self.working_memory_floor
            + self.min_memory
            + self.output_reserve
        )

    @property
    def high_water_tokens(self) -> int:
        return int(self.window * self.high_water_mark)

    @property
    def eviction_tokens(self) -> int:
        return int(self.window * self.eviction_threshold)

    @property
    def compaction_min_gain_tokens(self) -> int:
        return int(self.window * self.compaction_min_gain)

    def canonical_json(self) -> str:
        """The budget as canonical JSON (docs/protocol.md): every field, by name."""
        data = self.model_dump()
        data["release_each_turn"] = sorted(c.value for c in self.release_each_turn)
        return canonical_json(data)

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the UTF-8 canonical JSON: what open.lua stores and compares,
        so a session opened again with the same budget, by any client, is the same."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def _number(x: float) -> str:
    """A float as ECMAScript's Number::toString writes it (JSON.stringify, RFC 8785):
    integral values as integers, others in the shortest form that reads back the same."""
    if not math.isfinite(x):
        raise InvalidArgument(f"canonical JSON has no {x!r}")
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    t = decimal.Decimal(repr(abs(x))).as_tuple()  # repr: the shortest round-trip digits
    digits = "".join(map(str, t.digits)).rstrip("0")
    n = len(t.digits) + int(t.exponent)  # abs(x) = 0.<digits> * 10 ** n
    k = len(digits)
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * -n + digits
    else:
        e = n - 1
        out = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + ("+" if e > 0 else "-")
        out += str(abs(e))
    return sign + out


def canonical_json(value: object) -> str:
    """JSON any language reproduces byte for byte (RFC 8785, the JSON Canonicalization
    Scheme): object keys sorted, no whitespace, integers as integers, floats as
    ECMAScript writes them (``3.0`` is ``3``, ``0.1`` is ``0.1``), strings with only
    the escapes JSON requires (non-ASCII written as itself, to be encoded as UTF-8)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise InvalidArgument("canonical JSON object keys must be strings")
        # RFC 8785 sorts by UTF-16 code units; Python compares code points, which
        # agrees for every key below U+10000 (budget fields are ASCII).
        keys = sorted(value, key=lambda k: k.encode("utf-16-be"))
        return "{" + ",".join(f"{canonical_json(k)}:{canonical_json(value[k])}" for k in keys) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    raise InvalidArgument(f"canonical JSON has no {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class Item:
    """One named allocation: a chunk id, a tool-call id, a working-memory turn."""

    id: str
    tokens: int
    priority: int = 0


@dataclass(frozen=True, slots=True)
class BegunBy:
    """A turn named by the op id of the ``begin_turn`` call that opens it: the ``turn`` of
    calls sent in one batch with that call, after it, before the turn's number is known
    (``ledger.run_many([begin, admit(..., turn=BegunBy(begin_op))])``). Such a call is of
    the turn when that ``begin_turn`` opened it, else ``TurnLost`` (nothing changed)."""

    op_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldItem:
    """An item as the ledger holds it."""

    consumer: Consumer
    id: str
    tokens: int
    turn: int
    priority: int
    seq: int


@dataclass(frozen=True, slots=True)
class Opened:
    created: bool
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """Outcome of an admission: what was charged, and what was not."""

    charged: int
    admitted: int
    duplicates: int
    skipped: tuple[str, ...]
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Released:
    released: int
    count: int
    missing: tuple[str, ...]
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    id: str
    deadline_ms: int
    free: int
    epoch: int
    turn: int
    scopes: tuple[str, ...] = ()
    """The budget scopes the reservation holds a model call's worst case in (none: the
    session's window only); settle and void name them again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settled:
    reservation: str
    item: str
    charged: int
    free: int
    epoch: int
    turn: int
    billed_money: int | None = None
    """With scopes: the call's billed usage priced by the tenant's table, in micro-cents."""
    over: int = 0
    """Tokens billed past what the reservation held: charged all the same (and counted in
    each scope's ``ot``), never dropped."""
    over_money: int = 0
    """Micro-cents billed past what the reservation held."""


# --- budget scopes above the session (docs/ceilings.md) ------------------------------


@dataclass(frozen=True, slots=True)
class Price:
    """A model's price in cents per million tokens (so tokens x price is micro-cents,
    a whole number): uncached input, output and cached input."""

    input: int
    output: int
    cached_input: int = 0

    def __post_init__(self) -> None:
        for name in ("input", "output", "cached_input"):
            v = getattr(self, name)
            if type(v) is not int or not 0 <= v <= 10**9:
                raise InvalidArgument(f"price {name} must be an int of cents per Mtok, got {v!r}")

    @property
    def wire(self) -> str:
        return f"{self.input}|{self.output}|{self.cached_input}"


_KINDS = ("input", "output", "cached_input")


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeBudget:
    """The ceilings of a budget scope (a tenant, or a key or user within it) over a
    window of Redis's clock: fixed (``bucket_ms`` None: the window is one bucket,
    aligned on multiples of its length since the epoch) or rolling (the window is
    ``window_ms // bucket_ms`` buckets, the last of them the current one). A ceiling of
    None is no ceiling. ``tokens`` counts the kinds of ``counted`` together; ``cents``
    is a money ceiling priced by ``prices`` (the tenant's table, model -> Price; '*'
    prices any other model). ``hold_limit_ms`` is the longest lease a reservation may
    hold in the scope."""

    window_ms: int
    bucket_ms: int | None = None
    hold_limit_ms: int = 3_600_000
    input: int | None = None
    output: int | None = None
    cached_input: int | None = None
    tokens: int | None = None
    counted: tuple[str, ...] = _KINDS
    cents: int | None = None
    prices: Mapping[str, Price] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bucket = self.bucket_ms or self.window_ms
        if type(self.window_ms) is not int or self.window_ms < 1000:
            raise ConfigurationError(f"window_ms must be an int >= 1000, got {self.window_ms!r}")
        if self.window_ms % bucket or self.window_ms // bucket > 96 or bucket < 1000:
            raise ConfigurationError(
                f"bucket_ms must divide the window into 1..96 buckets of >= 1 s, got {bucket}"
            )
        if not 1 <= self.hold_limit_ms <= 86_400_000:
            raise ConfigurationError(f"hold_limit_ms must be 1..86400000, got {self.hold_limit_ms}")
        if any(k not in _KINDS for k in self.counted):
            raise ConfigurationError(f"counted must be among {_KINDS}, got {self.counted!r}")
        if self.cents is not None and not self.prices:
            raise ConfigurationError("a money ceiling (cents) needs a price table")

    def wire(self) -> list[str]:
        """ARGV[2..] of set_scope."""

        def cap(v: int | None, scale: int = 1) -> str:
            return "-" if v is None else str(v * scale)

        counted = "".join(k[0] if k != "cached_input" else "c" for k in self.counted) or "-"
        out = [
            str(self.window_ms),
            str(self.bucket_ms or self.window_ms),
            str(self.hold_limit_ms),
            cap(self.input),
            cap(self.output),
            cap(self.cached_input),
            cap(self.tokens),
            cap(self.cents, 1_000_000),
            counted,
            str(len(self.prices)),
        ]
        for model, price in sorted(self.prices.items()):
            out += [model, price.wire]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class CallCost:
    """A model call's worst case, held in budget scopes with the reservation: the
    prompt the ledger admitted (``input`` uncached, ``cached_input`` read from the
    provider's cache) and its output reserve (``output``), priced as ``model``.
    ``scopes``: the session's tenant first (by default the tenant its id names), then
    scopes within it ('<tenant>/<name>')."""

    model: str
    input: int
    output: int
    cached_input: int = 0
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """What the provider billed for a call, settled into the scopes of its
    reservation."""

    input: int
    output: int
    cached_input: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildOpened:
    """``open_child``: a child drawing from the reservation, its floor held for it;
    ``free``: what the pool has left past every floor and every draw past a floor."""

    reservation: str
    child: str
    floor: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildDrawn:
    """``draw_child``: the child's tokens drawn so far; ``free``: what it may still draw."""

    reservation: str
    child: str
    used: int
    floor: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScopeSet:
    scope: str
    prices: int


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Voided:
    reservation: str
    released: int
    free: int
    epoch: int
    turn: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Expired:
    """``expire``: reservations released past their deadline, and the turn rolled back
    when its lease had lapsed."""

    expired: int
    released: int
    pending: tuple[str, ...]
    rolled_back: int | None = None


@dataclass(frozen=True, slots=True)
class PartitionCheck:
    """What ``worker_check`` read of one partition: ms until its earliest lease deadline
    (0: passed; None: no lease), and whether a job has been pending long enough to take
    over (or its stream or group is missing)."""

    due_ms: int | None
    idle: bool


@dataclass(frozen=True, slots=True)
class ResetDone:
    epoch: int
    dropped: int
    released: int


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnAborted:
    """``abort_turn``: the turn rolled back (None when it was no longer open)."""

    rolled_back: int | None
    turn: int
    free: int
    epoch: int


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


@dataclass(frozen=True, slots=True)
class Deleted:
    deleted: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
    """Whether a session's counters equal its items, and which leases are overdue."""

    session_id: str
    clean: bool
    problems: tuple[str, ...]
    overdue: tuple[str, ...]
    now_ms: int


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
