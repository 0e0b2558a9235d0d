"""The closed sets of the protocol: the consumers of a session's window and the wire
strings of the results (each a ``StrEnum``: a member is its string)."""

from __future__ import annotations

import enum

from ledger.errors import InvalidArgument

# What ``ledger.models`` (and so ``ledger``) exports of this module: its classes.
__all__ = [
    "Consumer",
    "CompactionMode",
    "Regime",
    "Classification",
    "DriftFlag",
    "CompactionOutcome",
    "JobKind",
    "ToolResultOutcome",
]


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
