"""A mutating script's sample call, derived from its spec (its Lua header, read by
ledger/specs.py) with no line of its own: its KEYS by their names, its ARGV by their
names, ranges and ids, against the context of a fuzzed session (tests/test_fuzz.py; the
probe operation of tests/test_operations.py checks that a new script gets one).

What cannot be derived (an argument of its own syntax, an id that must be new where
another script's must exist) gives None: such a script keeps a sample in
tests/test_fuzz.py's table."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ledger import protocol, scripts, specs
from ledger.core import new_op_id
from ledger.keys import SessionKeys

# A spec's key name -> the session's keys it stands for.
KEYS: dict[str, Callable[[SessionKeys], tuple[str, ...]]] = {
    "session hash": lambda k: (k.session,),
    "partition deadline index": lambda k: (k.deadlines,),
    "partition job stream": lambda k: (k.jobs,),
    "partition tally": lambda k: (k.tally,),
    "outcome hash": lambda k: (k.outcomes,),
    "previous outcome hash": lambda k: (k.outcomes_old,),
    "content store": lambda k: (k.content,),
    "summaries": lambda k: (k.compacted,),
    "spill hash": lambda k: (k.spills,),
    "spill index": lambda k: (k.spilled,),
    "reclaim-order index": lambda k: (k.order,),
    "the session's data": lambda k: k.data,
}
# The ids the fuzzed session holds (tests/test_fuzz.py's fresh_session), by the name of
# the argument that names one (unless the spec says it is new or unique); any other id is
# a new one.
HELD = {
    "reservation id": "res1",
    "reservation ids": "res1",
    "child id": "kid0",
    "item ids": "doc1",
    "consumer": "r",
}
# Arguments whose valid value for the fuzzed session is not the one their range gives:
# reset's wait 0 applies the reset (the session has a turn open, which a wait above 0 would
# stage it for); the fuzz's bound mutations reach the waits above 0.
FIXED = {"wait": "0"}


@dataclass(frozen=True)
class Context:
    """The session a sample call is made on: its keys, epoch, open turn and its token."""

    keys: SessionKeys
    epoch: int
    turn: int
    token: str


def _value(e: specs.Entry, ctx: Context) -> str | None:
    """An argument's valid value, from its name, its range or its being an id."""
    name = e.name
    if name == "operation id":
        return new_op_id()
    if name == "protocol version":
        return str(protocol.VERSION)
    if name.startswith(("epoch", "v:epoch")):  # '<version>:<epoch>[@<turn>][!<token>]'
        turn = ctx.turn if "@turn" in name else None
        token = ctx.token if "token" in name or turn is not None else None  # see `fence`
        head = str(ctx.epoch) if turn is None else protocol.stamp(ctx.epoch, turn, token)
        if turn is None and token is not None:
            head += f"!{token}"
        return f"{protocol.VERSION}:{head}"
    if name == "session id":
        return ctx.keys.session_id
    if name == "turn":
        return str(ctx.turn)
    if e.is_id and re.search(r"\b(new|unique)\b", e.what):
        return f"fz-{name.replace(' ', '-')}"
    if name in HELD:
        return HELD[name]
    if name in FIXED:
        return FIXED[name]
    if e.range is not None:
        lo, hi = e.range
        if name == "n":
            return str(lo)
        return str(min(max(lo, 60_000 if e.unit == "ms" else 100), hi))
    if e.is_id:
        return f"fz-{name.replace(' ', '-')}"
    return None


def sample(name: str, ctx: Context) -> tuple[tuple[str, ...], list[str]] | None:
    """(KEYS, ARGV) of a valid call of a mutating script, derived from its spec; None
    when its spec names a key or an argument this cannot make."""
    spec = scripts.spec(name)
    if spec.read_only:
        return None
    keys: list[str] = []
    for k in spec.keys:
        if k.optional:
            continue
        if k.name not in KEYS:
            return None
        keys += KEYS[k.name](ctx.keys)
    args: list[str] = []
    n: int | None = None
    for e in spec.argv:
        if e.optional:
            break
        if e.positions:
            for _ in e.positions:
                v = _value(e, ctx)
                if v is None:
                    return None
                args.append(v)
            if e.name == "n":
                n = int(args[-1])
            continue
        # at a position counted by n: one argument per n ('5..4+n'), or one ('7+n')
        per_n = re.fullmatch(r"(\d+)\.\.(\d+)\+n", e.where)
        if n == 0 and per_n:
            continue
        single = re.fullmatch(r"\d+\+\d*n", e.where)
        if not ((per_n and n == 1) or (single and n is not None)):
            return None
        v = _value(e, ctx)
        if v is None:
            return None
        args.append(v)
    return tuple(keys), args
