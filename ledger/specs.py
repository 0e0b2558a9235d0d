"""Each script's one spec: the header of its ``lua/<name>.lua``, read as data.

The header is the file's first comment block (every line up to the first that is not a
``--`` comment). Its machine-readable lines:

* ``-- <name>.lua: <summary>``, the first line;
* ``-- KEYS[<where>]  <name>  <what>`` and ``-- ARGV[<where>]  <name>  <what>``: a key or an
  argument, its name and what it is (if anything) separated by two spaces or more. ``<where>`` is a
  position (``3``), a run of positions (``21..23``, ``2..6``), a position that depends on a
  count (``7+n``, ``6..5+3n``) or, for KEYS, one counted from the last (``-1`` the last
  key, ``-3`` the third from the end: the tally and the outcome hashes of a mutating
  script, which follow its optional keys). A name that starts with ``(optional)`` may be
  left out of a call (with every later argument). An argument's range is the first
  ``<lo>..<hi>`` of what it is (``1..1e8``, ``0..2^31-1``), its unit the first unit word
  of its name (else of what it is); an argument is an id when its text names the id
  syntax ``[A-Za-z0-9._:/@+=#-]{1,128}``, says it is ``an id``, or its name ends in
  ``id``. An indented line (``--`` and three spaces or more) goes on with the entry above
  it;
* ``-- KEYS count: <text>``: how many KEYS a call has, in words, when not simply one per
  KEYS line (optional keys, keys repeated per budget scope);
* ``-- Mode: read-only`` (changes nothing: no op id, no outcome, a durable write waits for
  none) or ``-- Mode: mutating``;
* ``-- Reply: ...``, ``-- Errors: ...`` (the ``LEDGER_<CODE>`` it names), ``-- Calls: ...``
  (the Redis commands), each with its indented lines.

:func:`parse` reads one header; ``ledger.scripts`` derives ``READ_ONLY`` from the specs,
the fuzz tests their sample calls, and ``tools/protocol_doc.py`` the generated parts of
docs/protocol.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ID_SYNTAX = "[A-Za-z0-9._:/@+=#-]{1,128}"
# Unit words, the first one an argument's name or text names is its unit.
UNITS = {
    "tokens": "tokens",
    "milliseconds": "ms",
    "ms": "ms",
    "per mille": "per mille",
    "micro-cents": "micro-cents",
    "cents": "cents",
}
MODES = {"read-only": True, "mutating": False}

_ENTRY = re.compile(r"^-- (KEYS|ARGV)\[([^\]]+)\] +(\S.*?)(?:  +(\S.*))?$")
_TERM = r"\d+(?:\+\d*n)?"
_WHERE = re.compile(rf"-\d+|{_TERM}(?:\.\.{_TERM})?")
_SECTION = re.compile(r"^-- (Reply|Errors|Calls|Mode|KEYS count):\s*(.*)$")
_MORE = re.compile(r"^--   +(\S.*)$")
_RANGE = re.compile(r"(-?\d+(?:e\d+)?)\.\.(-?\d+(?:e\d+|\^\d+(?:-1)?)?)(?![\d.])")
_UNIT = re.compile(r"\b(" + "|".join(sorted(UNITS, key=len, reverse=True)) + r")\b")


def _number(text: str) -> int:
    if "^" in text:  # 2^31-1
        base, _, exp = text.partition("^")
        exp, _, minus = exp.partition("-")
        return int(int(base) ** int(exp)) - (int(minus) if minus else 0)
    return int(float(text)) if "e" in text else int(text)


@dataclass(frozen=True)
class Entry:
    """One KEYS or ARGV line of a header (with its indented lines)."""

    kind: str  # "KEYS" or "ARGV"
    where: str  # as written between the brackets
    name: str  # without the "(optional)" mark
    what: str
    optional: bool = False

    @property
    def positions(self) -> tuple[int, ...]:
        """The fixed positions it stands at (1-based; negative: from the last key), or
        () when its position depends on a count."""
        if "n" in self.where:
            return ()
        first, _, last = self.where.partition("..")
        return tuple(range(int(first), int(last or first) + 1))

    @property
    def range_text(self) -> str | None:
        """The bounds of an integer argument at one position as its header writes them
        (``1..1e8``), else None."""
        if self.kind != "ARGV" or len(self.positions) != 1:
            return None
        m = _RANGE.search(self.what)
        return m.group(0) if m else None

    @property
    def range(self) -> tuple[int, int] | None:
        """The inclusive bounds of an integer argument at one position, else None."""
        lo, _, hi = (self.range_text or "").partition("..")
        return (_number(lo), _number(hi)) if hi else None

    @property
    def unit(self) -> str | None:
        """An argument's unit: the first unit word of its name, else of what it is."""
        if self.kind != "ARGV" or self.is_id or not self.positions:
            return None
        m = _UNIT.search(self.name) or _UNIT.search(self.what)
        return UNITS[m.group(1)] if m else None

    @property
    def is_id(self) -> bool:
        named = self.name.endswith(" id") or re.search(r"\ban id\b", self.what) is not None
        return ID_SYNTAX in self.what or named


@dataclass(frozen=True)
class Spec:
    """A script's spec: what its header says it takes, answers and refuses."""

    name: str
    summary: str
    read_only: bool
    keys: tuple[Entry, ...]
    argv: tuple[Entry, ...]
    reply: str
    errors: tuple[str, ...]
    calls: str
    key_count: str  # the header's "KEYS count", else the number of its KEYS

    def arg(self, position: int) -> Entry | None:
        """The ARGV entry at a fixed position."""
        return next((a for a in self.argv if position in a.positions), None)


def header(text: str) -> list[str]:
    """The first comment block of a script: its lines up to the first non-comment one."""
    out = []
    for line in text.split("\n"):
        if not line.startswith("--"):
            break
        out.append(line.rstrip())
    return out


def parse(name: str, text: str) -> Spec:
    """The spec of script `name` from its source; a header that does not say what the
    module docstring asks is a ValueError naming the line."""
    lines = header(text)
    if not lines or not lines[0].startswith(f"-- {name}.lua: "):
        raise ValueError(f"{name}.lua: the header's first line is not '-- {name}.lua: ...'")
    summary = lines[0][len(f"-- {name}.lua: ") :]
    entries: list[Entry] = []
    sections: dict[str, str] = {}
    current: str | None = None  # the entry or section an indented line goes on with
    for no, line in enumerate(lines[1:], start=2):
        where = f"{name}.lua:{no}"
        m = _ENTRY.match(line)
        if m:
            kind, pos, label, what = m.groups()
            if not _WHERE.fullmatch(pos) or (pos.startswith("-") and kind != "KEYS"):
                raise ValueError(f"{where}: cannot read the position {kind}[{pos}]")
            optional = label.startswith("(optional) ")
            label = label.removeprefix("(optional) ")
            entries.append(Entry(kind, pos, label, what or "", optional))
            current = "entry"
            continue
        m = _SECTION.match(line)
        if m:
            if m.group(1) in sections:
                raise ValueError(f"{where}: a second '{m.group(1)}:'")
            current = m.group(1)
            sections[current] = m.group(2)
            continue
        m = _MORE.match(line)
        if m and current == "entry":
            e = entries[-1]
            entries[-1] = Entry(e.kind, e.where, e.name, f"{e.what} {m.group(1)}", e.optional)
        elif m and current is not None:
            sections[current] += " " + m.group(1)
        else:
            current = None  # prose: read by people only
    for needed in ("Mode", "Reply", "Errors", "Calls"):
        if needed not in sections:
            raise ValueError(f"{name}.lua: the header has no '-- {needed}:' line")
    mode = sections["Mode"].strip()
    if mode not in MODES:
        raise ValueError(f"{name}.lua: Mode is {mode!r}, not one of {sorted(MODES)}")
    keys = tuple(e for e in entries if e.kind == "KEYS")
    argv = tuple(e for e in entries if e.kind == "ARGV")
    if not keys or keys[0].positions[:1] != (1,):
        raise ValueError(f"{name}.lua: the header names no KEYS[1]")
    if not argv or argv[0].positions[:1] != (1,):
        raise ValueError(f"{name}.lua: the header names no ARGV[1]")
    count = sections.get("KEYS count")
    if count is None and any(k.optional or not k.positions for k in keys):
        raise ValueError(f"{name}.lua: optional or counted KEYS need a '-- KEYS count:' line")
    count = count or str(sum(len(k.positions) for k in keys))
    return Spec(
        name=name,
        summary=summary,
        read_only=MODES[mode],
        keys=keys,
        argv=argv,
        reply=sections["Reply"].strip(),
        errors=tuple(dict.fromkeys(re.findall(r"LEDGER_([A-Z]+)", sections["Errors"]))),
        calls=sections["Calls"].strip(),
        key_count=count.strip(),
    )
