"""The budgets: a session's window (``SessionBudget``) and a budget scope's ceilings
(``ScopeBudget``, priced by ``Price``) over a window of Redis's clock (docs/ceilings.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
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
from ledger.models.canonical import canonical_json
from ledger.models.enums import CompactionMode, Consumer

# What ``ledger.models`` (and so ``ledger``) exports of this module: its classes.
__all__ = [
    "SessionBudget",
    "Price",
    "ScopeBudget",
    "ScopeSet",
]

TOKENS_MAX = 100_000_000


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
    is a money ceiling priced by the tenant's ``prices`` (model -> Price; '*' prices any
    other model): a tenant with a money ceiling needs one, a key or user within it has none
    (``set_scope`` checks both). ``hold_limit_ms`` is the longest lease a reservation may
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
class ScopeSet:
    scope: str
    prices: int
