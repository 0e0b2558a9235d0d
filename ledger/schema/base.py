"""A stored field (:class:`Field`: the string of its wire name, with its long name, unit,
owner and meaning), the units and owners, and the registry of every field in definition
order (:data:`FIELDS`, :func:`fields`, :func:`lookup`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

Unit = Literal[
    "tokens",
    "ms",
    "time",
    "count",
    "per_mille",
    "flag",
    "epoch",
    "turn",
    "id",
    "text",
    "binary",
    "version",
]
Owner = Literal[
    "session",
    "outcome",
    "tally",
    "job",
    "summary",
    "compacted",
    "content",
    "spill",
    "history",
    "dead_letter",
    "errors",
    "scope",
    "scope_holds",
]

# What each unit means, for the legend.
UNITS: dict[str, str] = {
    "tokens": "tokens",
    "ms": "a duration in ms",
    "time": "a time in ms on Redis's clock",
    "count": "a count",
    "per_mille": "per mille",
    "flag": "1 or 0",
    "epoch": "an epoch",
    "turn": "a turn number",
    "id": "an identifier (text)",
    "text": "text",
    "binary": "binary (control-character separated)",
    "version": "a version number (docs/protocol.md#versions)",
}

# Where each owner lives (docs/protocol.md#keys).
OWNERS: dict[str, str] = {
    "session": "the session hash '<tag>:s:<session>' (KEYS[1] of every session script)",
    "outcome": "the outcome hashes '<tag>:out:<session>' and '<tag>:old:<session>' (the "
    "current and previous generation; the last two KEYS of every mutating script)",
    "tally": "the partition's tally '<tag>:tally': each indicator counted in a session's "
    "'x:<name>' is counted here too, in the same step",
    "job": "an entry of the partition's job stream '<tag>:jobs' (written in this order)",
    "summary": "the JSON record of one summary, in the summaries hash",
    "compacted": "the summaries hash '<tag>:compacted:<session>'",
    "content": "the content store '<tag>:content:<session>'",
    "spill": "the spill hash '<tag>:spill:<session>'",
    "history": "the history hash '<tag>:history:<session>'",
    "dead_letter": "an entry of the partition's dead-letter stream '<tag>:dead' (written by "
    "the worker, ledger/workers/delivery.py): the job entry's fields as read, then these",
    "errors": "the worker's errors hash '<tag>:errors' (ledger/workers/delivery.py)",
    "scope": "a budget scope's hash '<tag>:t:<scope>' (docs/ceilings.md): a tenant, or a "
    "key or user within it, in the tenant's partition; quantities <q>: i input, o output, "
    "c cached input tokens, $ micro-cents",
    "scope_holds": "a budget scope's holds index '<tag>:th:<scope>' (sorted set)",
}
# The owners only the worker writes: no script touches them (not in the Lua legend).
WORKER_OWNERS: frozenset[str] = frozenset({"dead_letter", "errors"})

# The consumers' one-letter codes (ledger.models.Consumer.code): w working memory,
# r retrieval, m recall, s scratchpad.
CONSUMERS: dict[str, str] = {
    "w": "working memory",
    "r": "retrieval",
    "m": "recall",
    "s": "scratchpad",
}

_PLACEHOLDER = re.compile(r"<(\w+)>")
# What a placeholder stands for, where it is not any text.
_PLACES = {"c": "|".join(CONSUMERS), "bucket": "[0-9a-f]{2,4}"}


class Field(str):
    """One stored field: equal to its wire name, with its long name, unit, owner and
    meaning."""

    name: str
    unit: Unit
    owner: Owner
    meaning: str

    def __new__(cls, wire: str, name: str, unit: Unit, owner: Owner, meaning: str) -> Field:
        self = super().__new__(cls, wire)
        self.name, self.unit, self.owner, self.meaning = name, unit, owner, meaning
        return self

    @property
    def wire(self) -> str:
        return str.__str__(self)

    @property
    def pattern(self) -> bool:
        """Whether the wire name stands for several (``u_<c>``, ``x:<name>``)."""
        return "<" in self

    @property
    def opaque(self) -> bool:
        """Whether the whole name is data (``<bucket>``, ``<c>:<id>``): any name of its
        hash is one, so it is looked up only in a hash known to be its owner's."""
        return self.startswith("<")

    @property
    def prefix(self) -> str:
        """The literal start of a pattern (``u_`` of ``u_<c>``; the name itself otherwise)."""
        return self.wire.split("<", 1)[0]

    def of(self, *parts: str) -> str:
        """The wire name of a pattern with its placeholders filled in, in order:
        ``HELD.of("w") == "u_w"``, ``ITEM.of("w", "m1") == "i:w:m1"``."""
        it = iter(parts)
        out = _PLACEHOLDER.sub(lambda _: next(it), self.wire)
        if next(it, None) is not None:
            raise ValueError(f"too many parts for {self.wire}: {parts}")
        return out

    def matches(self, wire: str) -> bool:
        """Whether a concrete wire name is this field (or one this pattern stands for)."""
        if not self.pattern:
            return wire == self.wire
        rx = "".join(
            "(" + _PLACES.get(m.group(1), ".+") + ")" if m.group(1) else re.escape(m.group(0))
            for m in re.finditer(r"<(\w+)>|[^<]+", self.wire)
        )
        return re.fullmatch(rx, wire) is not None

    def __repr__(self) -> str:
        return f"Field({self.wire!r}, {self.name!r})"


FIELDS: list[Field] = []


def _f(wire: str, name: str, unit: Unit, owner: Owner, meaning: str) -> Field:
    f = Field(wire, name, unit, owner, meaning)
    FIELDS.append(f)
    return f


def fields(owner: str | None = None) -> Iterator[Field]:
    """The defined fields, in definition order (of one owner when given)."""
    return (f for f in FIELDS if owner is None or f.owner == owner)


def lookup(wire: str, owner: str | None = None) -> Field | None:
    """The field a concrete wire name is (an exact name before a pattern), or None.
    Without an owner, an opaque field (any name of its hash) is not a candidate."""
    candidates = list(fields(owner))
    for f in candidates:
        if not f.pattern and f.wire == wire:
            return f
    patterns = (f for f in candidates if f.pattern and (owner or not f.opaque))
    return next((f for f in patterns if f.matches(wire)), None)
