"""The effects an agent operation yields besides its calls (a generator of the agent
layer, see :mod:`ledger.agent.core`): a batch of calls, a sleep, and the reads and writes
outside the ledger's scripts."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from ledger.protocol import Call

T = TypeVar("T")
Obj = Any
Op = Generator["Call[Any] | Batch | Sleep | Held | Store | Fetch | Note", Any, T]
Effect = Any  # Held | Store | Fetch | Note: the reads and writes outside the ledger's scripts


@dataclass(frozen=True, slots=True)
class Sleep:
    """An effect: wait this long (the drivers sleep, sync or async)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Batch:
    """An effect: these calls in one round trip (``run_many``), in order; the operation
    is sent each call's result, or its error, in its place."""

    calls: tuple[Call[Any], ...]


@dataclass(frozen=True, slots=True)
class Held:
    """An effect: which of these items the session holds (a read of the session hash)."""

    fields: tuple[str, ...]  # 'i:<consumer code>:<item id>'


@dataclass(frozen=True, slots=True)
class Store:
    """An effect: write item texts to the session's content store (the hash the
    worker's compactor reads), refreshing its TTL to the session's idle TTL."""

    texts: tuple[tuple[str, str], ...]  # ('<consumer code>:<item id>', text)


@dataclass(frozen=True, slots=True)
class Fetch:
    """An effect: these fields of the session's summaries hash (a summary's JSON record,
    the calibration; each a text or None)."""

    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Note:
    """An effect: write these fields of the session's summaries hash (the calibration,
    the last billing report), which every process reads."""

    fields: tuple[tuple[str, str], ...]
