"""Loading the Lua scripts that ship in the wheel.

Each operation is one file of the repository's top-level ``lua/`` folder, which the wheel
maps into the package as ``ledger/lua/`` (hatchling's ``sources`` mapping): an installed
package reads them there with ``importlib.resources``; a checkout or an editable install
(whose package has no ``lua/``: editable installs apply no such mapping) reads the
checkout's ``lua/`` beside the package (:func:`lua_dir`). The definitions of
``_common.lua`` that a script uses (directly or through another definition) are
prepended to it, so every script is one chunk. The
clients register each through redis-py's ``Script`` and send it with EVALSHA,
loading it again on NOSCRIPT.

Only the definitions used are prepended because Redis runs the whole chunk on every
call: each ``local function`` is a closure allocated per call and collected later.

Each script, prelude and code, runs as one function under ``xpcall``: a check that
refuses the call raises ``fail(code, msg)`` (``_common.lua``), a tagged table that the
wrapper turns into the error reply ``LEDGER_<CODE> message`` (mapped to an exception
by ``ledger.errors.translate``); any other error (a Redis command's, a Lua runtime
error) is raised again unchanged. Not ``pcall``: Redis's own pcall turns a Redis command's
error into a string, which raised again would reach the client as ``ERR ERR ...``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ledger import specs


def lua_dir() -> Path:
    """Where the .lua files are: the package's ``ledger/lua/`` folder (a wheel), else the
    checkout's ``lua/`` beside the package (a checkout, an editable install)."""
    package = Path(str(resources.files("ledger")))
    for folder in (package / "lua", package.parent / "lua"):
        if (folder / "_common.lua").is_file():
            return folder
    raise FileNotFoundError(
        f"ledger Lua scripts not found in {package / 'lua'} nor {package.parent / 'lua'}"
    )


def script_names(folder: Path | None = None) -> tuple[str, ...]:
    """The operations' scripts: every ``*.lua`` of the folder (by default
    :func:`lua_dir`) but those whose name starts with ``_`` (``_common.lua``)."""
    found = (folder or lua_dir()).glob("*.lua")
    return tuple(sorted(p.stem for p in found if not p.name.startswith("_")))


# Every script a ledger registers: adding an operation's .lua file is enough.
NAMES = script_names()


@functools.cache
def spec(name: str) -> specs.Spec:
    """The spec of one script, read from its header (:mod:`ledger.specs`)."""
    if name not in NAMES:
        raise KeyError(f"no ledger script named {name!r}")
    return specs.parse(name, (lua_dir() / f"{name}.lua").read_text())


# The scripts that change nothing (no op id, no outcome): a durable write waits for none.
# Their headers say so (``-- Mode: read-only``).
READ_ONLY = frozenset(name for name in NAMES if spec(name).read_only)

_DEFINES = re.compile(r"^local\s+(?:function\s+(\w+)|([\w\s,]+?)\s*=)", re.M)
_WORD = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Definition:
    """One top-level definition of _common.lua, with the comment lines above it."""

    names: frozenset[str]
    text: str
    uses: frozenset[str]


# A quoted string (with its escapes), a long bracket [[...]] / [=[...]=], or a comment.
_TOKENS = re.compile(
    r"""(?P<str>'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*")"""
    r"|--\[(?P<eq>=*)\[.*?\](?P=eq)\]"
    r"|(?P<long>\[(?P<eq2>=*)\[.*?\](?P=eq2)\])"
    r"|--[^\n]*",
    re.S,
)


def strip_comments(lua: str) -> str:
    """Lua source without its comments (strings, which may hold '--', are kept)."""
    return _TOKENS.sub(lambda m: m.group(0) if m.group("str") or m.group("long") else " ", lua)


def _words(lua: str) -> frozenset[str]:
    """The identifiers the code names (words inside strings count: harmless)."""
    return frozenset(_WORD.findall(strip_comments(lua)))


@functools.cache
def definitions() -> tuple[Definition, ...]:
    """_common.lua cut at each column-0 ``local``: its comment block goes with it; the
    file's header (everything before the first definition) is dropped."""
    text = (lua_dir() / "_common.lua").read_text()
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line[:1] not in ("", " ", "-", "}") and not re.match(r"local |end\b", line):
            # a top-level statement would be glued to the definition above it
            raise ValueError(f"_common.lua:{i + 1}: only local definitions at top level")
    starts = [i for i, line in enumerate(lines) if line.startswith("local ")]
    out: list[Definition] = []
    for k, i in enumerate(starts):
        first = i
        while k > 0 and first - 1 > starts[k - 1] and lines[first - 1].startswith("--"):
            first -= 1  # its comment (the file's header is no definition's)
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        while end > i + 1 and lines[end - 1].startswith("--"):
            end -= 1  # the next definition's comment
        chunk = "\n".join(lines[first:end]).rstrip() + "\n"
        m = _DEFINES.match(lines[i])
        if not m:
            raise ValueError(f"_common.lua:{i + 1}: cannot tell what this defines: {lines[i]!r}")
        names = frozenset([m.group(1)] if m.group(1) else re.split(r"\s*,\s*", m.group(2)))
        body = "\n".join(lines[i:end])
        out.append(Definition(names, chunk, _words(body) - names))
    # Every line after the header belongs to one definition: none is lost between two.
    covered = [line for d in out for line in d.text.split("\n") if line.strip()]
    if covered != [line for line in lines[starts[0] :] if line.strip()]:
        raise ValueError("_common.lua: a line after the header belongs to no definition")
    return tuple(out)


def prelude(body: str) -> str:
    """The definitions of _common.lua that `body` uses, directly or through another
    definition, in their order in the file."""
    defs = definitions()
    wanted = set(_words(body))
    keep: set[int] = set()
    changed = True
    while changed:
        changed = False
        for k, d in enumerate(defs):
            if k not in keep and d.names & wanted:
                keep.add(k)
                wanted |= d.uses
                changed = True
    return "".join(d.text for k, d in enumerate(defs) if k in keep)


# The prelude goes inside the function too: its definitions are then locals of the
# operation's function, not upvalues of a closure made on every call. The opener
# shares the first line, so the lines keep their numbers.
_OPEN = "local ok, out = xpcall(function() "
_CLOSE = """
end, function(e) return e end)
if ok then return out end
if type(out) == 'table' and out.ledger then
  return redis.error_reply('LEDGER_' .. out.ledger .. ' ' .. out.msg)
end
error(out, 0)
"""


def wrap(chunk: str) -> str:
    """`chunk` (an operation's prelude and code) under the one error wrapper."""
    return _OPEN + chunk + _CLOSE


@functools.cache
def source(name: str) -> str:
    """The full text sent to Redis for one operation."""
    if name not in NAMES:
        raise KeyError(f"no ledger script named {name!r}")
    body = (lua_dir() / f"{name}.lua").read_text()
    return wrap(prelude(body) + "\n" + body)


@functools.cache
def sha(name: str) -> str:
    return hashlib.sha1(source(name).encode()).hexdigest()


def dump(directory: Path) -> list[Path]:
    """Write each operation's full text (what the clients send) to ``<directory>/<name>.lua``,
    for a client in another language to load as it is (docs/protocol.md)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name in NAMES:
        path = directory / f"{name}.lua"
        path.write_bytes(source(name).encode())
        out.append(path)
    return out


@functools.cache
def reply_codes() -> dict[str, str]:
    """The coded reply keys of a stored outcome (``PACK`` in _common.lua): control
    character -> the '|<key>=' it stands for."""
    text = (lua_dir() / "_common.lua").read_text()
    pairs = re.findall(r"\['(\|\w+=)'\] = '\\(\d+)'", text)
    if not pairs:
        raise ValueError("_common.lua: no reply codes (PACK)")
    return {chr(int(n)): key for key, n in pairs}


def outcome_key(op_id: str) -> tuple[str, str]:
    """Where an op id's outcome is stored: (bucket, key), the first two and the next
    fourteen hex digits of the SHA-1 of its UTF-8 bytes (lua/_common.lua, ``recorded``).
    A generation of many outcomes writes the later ones to buckets of the first three or
    four digits (:func:`outcome_buckets`); the key is the same in each."""
    h = hashlib.sha1(op_id.encode()).hexdigest()
    return h[:2], h[2:16]


def outcome_buckets(op_id: str) -> tuple[str, str, str]:
    """The bucket fields an op id's outcome may be in: the first 2, 3 and 4 hex digits
    of the SHA-1 of its UTF-8 bytes."""
    h = hashlib.sha1(op_id.encode()).hexdigest()
    return h[:2], h[:3], h[:4]


def is_bucket(field: str) -> bool:
    """Whether a field of an outcome hash is a bucket (2 to 4 hex digits), not one of the
    generation's own fields (``e``, ``k``, ``g``)."""
    return 2 <= len(field) <= 4 and all(c in "0123456789abcdef" for c in field)


def stored_outcomes(bucket: str, base: int = 0) -> list[tuple[str, str, str]]:
    """(key, fingerprint, reply) of each outcome in one bucket of an outcome hash
    (records '\\x1e<key><fingerprint><coded reply>', see lua/_common.lua): the key is
    :func:`outcome_key`'s second part for the op id that stored it. A stored epoch is
    relative to the generation's field ``e``, given as ``base``."""
    codes = reply_codes()
    out = []
    for rec in bucket.split("\x1e")[1:]:
        key, fp, coded = rec[:14], rec[14:26], rec[26:]
        reply = "".join(codes.get(ch, ch) for ch in coded)[1:]
        reply = _EPOCH.sub(lambda m: f"|epoch={base + int(m.group(1))}", reply, count=1)
        out.append((key, fp, reply))
    return out


_EPOCH = re.compile(r"\|epoch=(-?\d+)")
