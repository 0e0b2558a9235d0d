"""Bad input gets a typed error and changes no byte, on every backend.

Two layers are attacked:

* the Python API (``Session.admit`` ... ``Ledger.open_session``): every malformed
  argument must raise :class:`InvalidArgument` (or :class:`ConfigurationError` for a
  budget) and leave the session hash and the partition's deadline index exactly as
  they were; arguments the client checks itself must not reach Redis at all;
* the Lua scripts called directly with malformed ARGV (bypassing the Python
  checks): every one must be refused with ``LEDGER_BADARG`` before its first write.

"State" is HGETALL of the session hash plus ZRANGE WITHSCORES of the deadline
index, compared byte for byte before and after each bad call. Each test holds one
session with items and an open reservation, so a partial write would show.

The regression tests at the end pin bugs that were found and fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.exceptions

from ledger import (
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    Session,
    SessionBudget,
    StaleEpoch,
    protocol,
)
from ledger.core import new_op_id

BUDGET_FIELDS: dict[str, Any] = {
    "window": 32_000,
    "system_prompt": 2_100,
    "working_memory_floor": 6_000,
    "min_memory": 0,
    "tool_framing": 150,
    "output_reserve": 1_024,
}
BUDGET = SessionBudget(**BUDGET_FIELDS)
SID = "bad-input/s-1"

State = tuple[dict[bytes, bytes], list[tuple[bytes, float]]]


def state(ledger: Ledger, s: Session) -> State:
    return (
        ledger.client.hgetall(s.keys.session),
        ledger.client.zrange(s.keys.deadlines, 0, -1, withscores=True),
    )


def diff(before: State, after: State) -> str:
    (h0, z0), (h1, z1) = before, after
    changed = sorted(k for k in h0.keys() | h1.keys() if h0.get(k) != h1.get(k))
    parts = [f"{k!r}: {h0.get(k)!r} -> {h1.get(k)!r}" for k in changed[:8]]
    if z0 != z1:
        parts.append(f"deadlines: {z0!r} -> {z1!r}")
    return "; ".join(parts)


@pytest.fixture
def session(ledger: Ledger) -> Session:
    """A session with items for two consumers and one open reservation."""
    s = ledger.open_session(SID, BUDGET)
    s.admit("retrieval", [Item("doc1", 400), Item("doc2", 300, priority=5)])
    s.admit("working_memory", [Item("turn1", 200)])
    s.reserve("scratchpad", "res1", 500, lease_ms=600_000)
    h, z = state(ledger, s)
    assert b"i:r:doc1" in h and b"r:res1" in h and len(z) == 1
    return s


@pytest.fixture
def sent(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> list[protocol.Call[Any]]:
    """Every call the ledger sends to Redis from here on."""
    calls: list[protocol.Call[Any]] = []
    run = ledger.run

    def counting(call: protocol.Call[Any]) -> Any:
        calls.append(call)
        return run(call)

    monkeypatch.setattr(ledger, "run", counting)
    return calls


# --- bad values -----------------------------------------------------------------------

BAD_TOKENS: dict[str, Any] = {
    "negative": -1,
    "zero": 0,
    "1e9": 10**9,
    "1e20": 10**20,
    "float": 1.5,
    "integral float": 10.0,
    "bool": True,
    "str": "10",
    "None": None,
}
# '=' is NOT here: it is in the documented id alphabet [A-Za-z0-9._:/@+=#-]
# (base64 padding); test_ids_with_equals_sign_are_accepted pins that it is harmless.
BAD_IDS: dict[str, str] = {
    "empty": "",
    "129 chars": "x" * 129,
    "open brace": "a{b",
    "close brace": "a}b",
    "hash tag": "{p0}",
    "pipe": "a|b",
    "comma": "a,b",
    "space": "a b",
    "newline": "a\nb",
    "trailing newline": "ab\n",
    "tab": "a\tb",
    "nul": "a\x00b",
    "non-ascii": "caf\u00e9",
    "cjk": "\u65e5\u672c",
}
BAD_PRIORITIES: dict[str, Any] = {
    "negative": -1,
    "1001": 1001,
    "1e9": 10**9,
    "1e20": 10**20,
    "float": 1.5,
    "bool": True,
    "str": "1",
    "None": None,
}
BAD_LEASES: dict[str, Any] = {
    "zero": 0,
    "negative": -1,
    "over a day": 86_400_001,
    "1e20": 10**20,
    "float": 1.5,
    "bool": True,
}
BAD_CONSUMERS: dict[str, Any] = {
    "empty": "",
    "script code": "w",
    "upper case": "RETRIEVAL",
    "unknown": "memory",
    "None": None,
    "int": 1,
}
NEWER = object()  # stands for the session's epoch + 1
BAD_EPOCHS: dict[str, Any] = {
    "negative": -1,
    "newer than the session's": NEWER,
    "1e20": 10**20,
    "float": 1.0,
    "bool": True,
    "str": "1",
}
# None is the default (a fresh id per call); '' is pinned as a bug below.
BAD_OP_IDS: dict[str, Any] = {**{k: v for k, v in BAD_IDS.items() if v}, "int": 7, "bytes": b"op"}

BAD_BUDGETS: dict[str, dict[str, Any]] = {
    "window zero": {"window": 0},
    "window negative": {"window": -1},
    "window 1e9": {"window": 10**9},
    "window 1e20": {"window": 10**20},
    "window float": {"window": 32_000.0},
    "window bool": {"window": True},
    "window str": {"window": "32000"},
    "system prompt negative": {"system_prompt": -1},
    "system prompt float": {"system_prompt": 2_100.5},
    "output reserve 1e20": {"output_reserve": 10**20},
    "floor over window": {"window": 9_000},
    "working-memory floor over window": {"working_memory_floor": 40_000},
    "high-water mark zero": {"high_water_mark": 0.0},
    "high-water mark over one": {"high_water_mark": 1.5},
    "high-water mark nan": {"high_water_mark": float("nan")},
    "eviction threshold zero": {"eviction_threshold": 0.0},
    "eviction threshold negative": {"eviction_threshold": -0.1},
    "idle ttl zero": {"idle_ttl_seconds": 0},
    "idle ttl over a year": {"idle_ttl_seconds": 31_536_001},
    "unknown field": {"max_tokens": 5},
}


# --- the Python API -------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    label: str
    call: Callable[[Session], object]
    error: type[Exception] | tuple[type[Exception], ...] = InvalidArgument
    local: bool = False  # refused by the client before anything is sent


# The one well-formed call per operation that each case spoils in one place.
GOOD: dict[str, Callable[..., object]] = {
    "admit": lambda s, op=None: s.admit("retrieval", [Item("new1", 10, 1)], op_id=op),
    "release": lambda s, op=None: s.release("retrieval", ["doc1"], op_id=op),
    "reserve": lambda s, op=None: s.reserve("scratchpad", "res2", 50, op_id=op),
    "settle": lambda s, op=None: s.settle("res1", 450, "out1", priority=3, op_id=op),
    "void": lambda s, op=None: s.void("res1", op_id=op),
    "reset": lambda s, op=None: s.reset("operator", op_id=op),
    "delete": lambda s, op=None: s.delete(op_id=op),
    "open": lambda s, op=None: s.ledger.open_session(s.id, BUDGET, op_id=op),
    "reconcile": lambda s, op=None: s.reconcile({"retrieval": [Item("doc1", 410)]}, op_id=op),
}


def _fenced(op: str) -> list[Case]:
    """Bad operation ids and epochs: every mutating call carries both."""
    good = GOOD[op]
    cases = [
        Case(f"op id {name}", lambda s, v=v, g=good: g(s, v), local=True)
        for name, v in BAD_OP_IDS.items()
    ]
    if op != "open":  # open ignores the epoch
        cases += [
            Case(
                f"epoch {name}",
                lambda s, v=v, g=good: g(
                    Session(s.ledger, s.keys, s.epoch + 1 if v is NEWER else v)
                ),
                # a newer epoch is well formed, and not this session's: stale
                StaleEpoch if v is NEWER else InvalidArgument,
            )
            for name, v in BAD_EPOCHS.items()
        ]
    return cases


def _admit_cases() -> list[Case]:
    def admit(items: list[Item], consumer: Any = "retrieval", partial: bool = False) -> Case:
        return Case("", lambda s: s.admit(consumer, items, partial=partial))

    def named(label: str, case: Case, local: bool = False) -> Case:
        return Case(label, case.call, case.error, local)

    out: list[Case] = []
    for name, v in BAD_TOKENS.items():
        out.append(named(f"tokens {name}", admit([Item("new1", v)])))
        out.append(named(f"tokens {name} after a good item", admit([Item("a", 5), Item("b", v)])))
        out.append(named(f"tokens {name} (partial)", admit([Item("new1", v)], partial=True)))
    for name, v in BAD_IDS.items():
        out.append(named(f"item id {name}", admit([Item(v, 10)])))
        out.append(named(f"item id {name} after a good item", admit([Item("a", 5), Item(v, 5)])))
    for name, v in BAD_PRIORITIES.items():
        out.append(named(f"priority {name}", admit([Item("new1", 10, v)])))
    for name, v in BAD_CONSUMERS.items():
        out.append(named(f"consumer {name}", admit([Item("new1", 10)], consumer=v), local=True))
    out += [
        named("empty item list", admit([]), local=True),
        Case("empty item tuple", lambda s: s.admit("retrieval", ()), local=True),
        named("duplicate ids", admit([Item("new1", 10), Item("new1", 10)])),
        named("duplicate ids, other sizes", admit([Item("new1", 10), Item("new1", 20)])),
        named("duplicate held ids", admit([Item("doc1", 400), Item("doc1", 400)])),
        named("duplicate ids (partial)", admit([Item("n", 1), Item("n", 1)], partial=True)),
        named("1001 items", admit([Item(f"i{k}", 1) for k in range(1001)])),
    ]
    return out + _fenced("admit")


def _release_cases() -> list[Case]:
    out: list[Case] = []
    for name, v in BAD_IDS.items():
        out.append(Case(f"item id {name}", lambda s, v=v: s.release("retrieval", [v])))
        out.append(
            Case(
                f"item id {name} after a held one",
                lambda s, v=v: s.release("retrieval", ["doc1", v]),
            )
        )
    for name, v in BAD_CONSUMERS.items():
        out.append(Case(f"consumer {name}", lambda s, v=v: s.release(v, ["doc1"]), local=True))
    out += [
        Case("empty id list", lambda s: s.release("retrieval", []), local=True),
        Case("duplicate ids", lambda s: s.release("retrieval", ["doc1", "doc1"])),
        Case("duplicate unheld ids", lambda s: s.release("retrieval", ["zz", "zz"])),
        Case("1001 ids", lambda s: s.release("retrieval", [f"i{k}" for k in range(1001)])),
    ]
    return out + _fenced("release")


def _reserve_cases() -> list[Case]:
    out: list[Case] = []
    for name, v in BAD_TOKENS.items():
        out.append(Case(f"tokens {name}", lambda s, v=v: s.reserve("scratchpad", "res2", v)))
    for name, v in BAD_IDS.items():
        out.append(Case(f"reservation id {name}", lambda s, v=v: s.reserve("scratchpad", v, 50)))
    for name, v in BAD_CONSUMERS.items():
        out.append(Case(f"consumer {name}", lambda s, v=v: s.reserve(v, "res2", 50), local=True))
    for name, v in BAD_LEASES.items():
        out.append(
            Case(f"lease {name}", lambda s, v=v: s.reserve("scratchpad", "res2", 50, lease_ms=v))
        )
    return out + _fenced("reserve")


def _settle_cases() -> list[Case]:
    out: list[Case] = []
    for name, v in BAD_TOKENS.items():
        out.append(Case(f"actual tokens {name}", lambda s, v=v: s.settle("res1", v, "out1")))
    for name, v in BAD_IDS.items():
        out.append(Case(f"reservation id {name}", lambda s, v=v: s.settle(v, 450, "out1")))
        out.append(Case(f"item id {name}", lambda s, v=v: s.settle("res1", 450, v)))
    for name, v in BAD_PRIORITIES.items():
        out.append(
            Case(f"priority {name}", lambda s, v=v: s.settle("res1", 450, "out1", priority=v))
        )
    return out + _fenced("settle")


def _void_cases() -> list[Case]:
    out = [Case(f"reservation id {n}", lambda s, v=v: s.void(v)) for n, v in BAD_IDS.items()]
    return out + _fenced("void")


def _reset_cases() -> list[Case]:
    out = [Case(f"reason {n}", lambda s, v=v: s.reset(v)) for n, v in BAD_IDS.items()]
    return out + _fenced("reset")


def _delete_cases() -> list[Case]:
    return _fenced("delete")


def _open_cases() -> list[Case]:
    out = [
        Case(
            f"budget {name}",
            lambda s, kw=kw: s.ledger.open_session(s.id, SessionBudget(**{**BUDGET_FIELDS, **kw})),
            ConfigurationError,
            local=True,
        )
        for name, kw in BAD_BUDGETS.items()
    ]
    out.append(
        Case(
            "budget without system_prompt",
            lambda s: s.ledger.open_session(s.id, SessionBudget(window=32_000)),
            ConfigurationError,
            local=True,
        )
    )
    # Budgets that skip pydantic's checks (model_construct) reach open.lua, which
    # checks again: a typed error either way, and still no write.
    for name, kw in {
        "floor over window": {"window": 1_000},
        "high-water mark over the window": {"high_water_mark": 1.5},
        "window negative": {"window": -5},
        "window 1e20": {"window": 10**20},
        "idle ttl zero": {"idle_ttl_seconds": 0},
    }.items():
        fields = {**BUDGET.model_dump(), **kw}
        out.append(
            Case(
                f"unvalidated budget {name}",
                lambda s, f=fields: s.ledger.open_session(s.id, SessionBudget.model_construct(**f)),
                (ConfigurationError, InvalidArgument),
            )
        )
    for name, v in BAD_IDS.items():
        out.append(
            Case(f"session id {name}", lambda s, v=v: s.ledger.open_session(v, BUDGET), local=True)
        )
    return out + _fenced("open")


def _reconcile_cases() -> list[Case]:
    def rec(items: Any) -> Callable[[Session], object]:
        return lambda s: s.reconcile(items)

    out = [Case(f"item id {n}", rec({"retrieval": [Item(v, 10)]})) for n, v in BAD_IDS.items()]
    out += [Case(f"tokens {n}", rec({"retrieval": [Item("d", v)]})) for n, v in BAD_TOKENS.items()]
    out += [
        Case(f"priority {n}", rec({"retrieval": [Item("d", 5, v)]}))
        for n, v in BAD_PRIORITIES.items()
    ]
    out += [
        Case(f"consumer {n}", rec({v: [Item("d", 5)]}), local=True)
        for n, v in BAD_CONSUMERS.items()
    ]
    out += [
        Case("no consumer", rec({}), local=True),
        Case("not a mapping", rec([Item("d", 5)]), local=True),
        Case("items not a list", rec({"retrieval": Item("d", 5)}), local=True),
        Case("item not an Item", rec({"retrieval": [("d", 5)]}), local=True),
        Case("item twice", rec({"retrieval": [Item("d", 5), Item("d", 6)]})),
        Case("bad item after a good one", rec({"retrieval": [Item("doc1", 5), Item("d", -1)]})),
    ]
    return out + _fenced("reconcile")


CASES: dict[str, list[Case]] = {
    "reconcile": _reconcile_cases(),
    "admit": _admit_cases(),
    "release": _release_cases(),
    "reserve": _reserve_cases(),
    "settle": _settle_cases(),
    "void": _void_cases(),
    "reset": _reset_cases(),
    "delete": _delete_cases(),
    "open": _open_cases(),
}


def _try(ledger: Ledger, s: Session, case: Case, sent: list[protocol.Call[Any]]) -> Iterator[str]:
    """Run one bad call; yield what went wrong (nothing when it was refused cleanly)."""
    before = state(ledger, s)
    del sent[:]
    try:
        case.call(s)
    except case.error as exc:
        if not str(exc):
            yield f"{case.label}: {type(exc).__name__} without a message"
    except Exception as exc:
        yield f"{case.label}: untyped {type(exc).__name__}: {exc}"
    else:
        yield f"{case.label}: accepted"
    if case.local and sent:
        yield f"{case.label}: sent {[c.script for c in sent]} before refusing"
    after = state(ledger, s)
    if after != before:
        yield f"{case.label}: keys changed: {diff(before, after)}"


@pytest.mark.parametrize("op", list(CASES))
def test_bad_input_is_refused_and_changes_nothing(
    ledger: Ledger, session: Session, sent: list[protocol.Call[Any]], op: str
) -> None:
    problems = [p for case in CASES[op] for p in _try(ledger, session, case, sent)]
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)
    # The well-formed call goes through: each case failed on its one bad argument.
    GOOD[op](session)


def test_bad_budgets_create_no_session(ledger: Ledger, sent: list[protocol.Call[Any]]) -> None:
    """Opening a new session with a bad budget leaves no key behind."""
    probe = ledger.keyspace.session("bad-input/never")
    for name, kw in BAD_BUDGETS.items():
        with pytest.raises(ConfigurationError):
            ledger.open_session(probe.session_id, SessionBudget(**{**BUDGET_FIELDS, **kw}))
        assert not sent, name
    for name, kw in {"floor over window": {"window": 1_000}, "window 0": {"window": 0}}.items():
        bad = SessionBudget.model_construct(**{**BUDGET.model_dump(), **kw})
        with pytest.raises((ConfigurationError, InvalidArgument)):
            ledger.open_session(probe.session_id, bad)
        assert ledger.client.exists(probe.session) == 0, name
    assert ledger.client.exists(probe.session, probe.deadlines) == 0


BRACED = ["a{b", "a}b", "{p0}", "{", "}", "{}", "x{p1}y", "tenant/{s-42}"]


def test_braced_session_ids_are_refused_before_any_io(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A brace in a session id would move its keys to another hash slot: refused
    by the key space, before a script is run or a command is sent."""
    io: list[object] = []
    monkeypatch.setattr(ledger, "run", lambda call: io.append(call))
    monkeypatch.setattr(ledger.client, "execute_command", lambda *a, **k: io.append(a))
    for sid in BRACED:
        with pytest.raises(InvalidArgument, match="brace"):
            ledger.open_session(sid, BUDGET)
        with pytest.raises(InvalidArgument, match="brace"):
            ledger.session(sid)
        with pytest.raises(InvalidArgument, match="brace"):
            ledger.audit(sid)
    assert io == []


def test_ids_with_equals_sign_are_accepted(ledger: Ledger, session: Session) -> None:
    """'=' is in the id alphabet; the 'k=v|k=v' replies still parse (split on the first '=')."""
    got = session.admit(
        "retrieval", [Item("small", 1), Item("big", 10**8), Item("k=v", 1)], partial=True
    )
    assert got.skipped == ("big", "k=v")
    assert session.admit("retrieval", [Item("k=v", 7)]).charged == 7
    assert session.release("retrieval", ["k=v", "x=y"]).missing == ("x=y",)
    assert session.reserve("scratchpad", "r=1", 5).id == "r=1"
    assert session.settle("r=1", 6, "o=1").item == "o=1"
    assert session.audit().clean


def test_tiny_window_budget_is_a_configuration_error_or_opens(ledger: Ledger) -> None:
    """high-water and eviction tokens round down to 0 for window 1: the budget is either
    refused when built or opened; never an InvalidArgument from open.lua (fixed bug)."""
    try:
        budget = SessionBudget(window=1, system_prompt=0)
    except ConfigurationError:
        return
    ledger.open_session("bad-input/tiny", budget)


# --- the scripts, called directly -------------------------------------------------------

HUGE = ["9" * 16, "9" * 17, "1" + "0" * 20]
BAD_ARG_IDS: list[str | bytes] = [
    "",
    "x" * 129,
    "a{b",
    "a}b",
    "a|b",
    "a,b",
    "a b",
    "a\nb",
    "ab\n",
    b"\xff\xfe",
    b"ok\xff",
    b"caf\xc3\xa9",
    b"a\x00b",
]
BAD_FPS: list[str | bytes] = ["", "xyz", "a" * 65, "ab cd", "0x1f", "abc\n", b"\xff"]
BAD_NUMBERS: list[str | bytes] = [
    "",
    "-",
    "abc",
    "1.5",
    "1e3",
    " 5",
    "5 ",
    "+5",
    "0x10",
    "05",  # not canonical: one number, one spelling (and one op fingerprint)
    "-0",
    "00",
    "5\n",
    b"\xff",
    b"5\x00",
    *HUGE,
]
BAD_CONSUMER_ARGS: list[str | bytes] = ["", "x", "W", "ww", "working_memory", b"\xff"]
BAD_MODES: list[str | bytes] = ["", "ALL", "partial", "all ", "prefix\n", b"\xff", "+text", "all+"]
BAD_COUNTS: list[str | bytes] = ["0", "1001", "-1", "2", "x", "", "1.0", *HUGE]


def ints(lo: int, hi: int) -> list[str | bytes]:
    return [*BAD_NUMBERS, str(lo - 1), str(hi + 1)]


TOKENS = ints(1, 100_000_000)
PRIORITY = ints(0, 1000)
V = f"{protocol.VERSION}:"  # ARGV[2] starts with the protocol version
EPOCH_BASE: list[str | bytes] = [
    V + e for e in ("", "-1", "1.0", "abc", "1000000000000001", "0100", "-0", *HUGE)
] + [V.encode() + b"\xff", V + "1@1!xyz", V + "1@1!" + "a" * 15, V + "1!" + "0" * 65]
EPOCH_FENCED = [*EPOCH_BASE, V + "*"]  # (a newer epoch is well formed: refused as stale)
EPOCH_OPEN = [*EPOCH_BASE, V + "*"]  # open ignores the value, but it must be a number
EPOCH_OR_STAR = EPOCH_BASE  # close and expire accept '*'
# ARGV[2] of another protocol version, or of none (protocol 1): LEDGER_VERSION, not BADARG
NO_VERSION: list[str | bytes] = [
    "",
    "1",
    "*",
    "12345",
    "1:12345",
    "2:12345",
    "4:12345",
    ":1",
    b"\xff",
]

# ARGV position (1-based) -> malformed values, per script (see each script's header).
COMMON: dict[int, list[str | bytes]] = {1: BAD_ARG_IDS, 2: EPOCH_FENCED}
ARGV_SPEC: dict[str, dict[int, list[str | bytes]]] = {
    "open": {
        1: BAD_ARG_IDS,
        2: EPOCH_OPEN,
        # window: also one the budget json does not say (the server takes nothing on trust)
        3: [*ints(1, 100_000_000), str(BUDGET.window + 1)],
        4: ints(0, 100_000_000),  # system prompt
        5: ints(0, 100_000_000),  # tool framing
        6: ints(0, 100_000_000),  # working-memory floor
        7: ints(0, 100_000_000),  # minimum memory
        8: ints(0, 100_000_000),  # output reserve
        9: ints(0, 100_000_000),  # high-water mark
        10: ints(0, 100_000_000),  # eviction threshold
        11: ints(1000, 31_536_000_000),  # idle ttl ms
        12: ints(1000, 86_400_000),  # op retention ms
        13: [*BAD_FPS, "0" * 64, BUDGET.fingerprint().upper()],  # not the json's SHA-256
        14: [  # budget json: too long, not JSON, or another budget than the ARGV say
            "x" * 4097,
            "{",
            "[]",
            BUDGET.model_copy(update={"window": BUDGET.window + 1}).canonical_json(),
            BUDGET.canonical_json()[:-1] + ',"extra":1}',
        ],
        24: ints(-1, 100_000_000),  # framing tolerance
        25: ["", "Worker", "none", "w", b"\xff"],  # compaction owner
        26: ints(0, 100_000_000),  # compaction min gain
    },
    "reconcile": {
        **COMMON,
        3: [*BAD_CONSUMER_ARGS, "rr", "wrmsw", "s"],
        4: BAD_COUNTS,
        5: BAD_CONSUMER_ARGS,
        6: BAD_ARG_IDS,
        7: TOKENS,
        8: PRIORITY,
    },
    "admit": {
        **COMMON,
        3: BAD_CONSUMER_ARGS,
        4: BAD_MODES,
        5: BAD_COUNTS,
        6: BAD_ARG_IDS,
        7: TOKENS,
        8: PRIORITY,
    },
    "release": {**COMMON, 3: BAD_CONSUMER_ARGS, 4: BAD_COUNTS, 5: BAD_ARG_IDS},
    "reserve": {
        **COMMON,
        3: BAD_ARG_IDS,
        4: BAD_CONSUMER_ARGS,
        5: BAD_ARG_IDS,
        6: TOKENS,
        7: ints(1, 86_400_000),
    },
    "settle": {**COMMON, 3: BAD_ARG_IDS, 4: BAD_ARG_IDS, 5: TOKENS, 6: BAD_ARG_IDS, 7: PRIORITY},
    "void": {**COMMON, 3: BAD_ARG_IDS, 4: BAD_ARG_IDS},
    "reset": {**COMMON, 3: BAD_ARG_IDS, 4: BAD_ARG_IDS},
    "delete": {**COMMON, 2: EPOCH_OR_STAR, 3: BAD_ARG_IDS},
    "expire": {**COMMON, 2: EPOCH_OR_STAR, 3: BAD_ARG_IDS, 4: BAD_COUNTS, 5: BAD_ARG_IDS},
    # good call: two replaced items (ARGV[7], ARGV[8]), then the job entry id '-'
    "compact": {
        **COMMON,
        3: BAD_ARG_IDS,  # session id
        4: BAD_ARG_IDS,  # summary item id
        5: ints(0, 100_000_000),  # summary tokens
        6: ["0", "1", "3", "1001", "-1", "x", "", "1.0", *HUGE],  # item count
        7: ["", "turn1", "x:turn1", "w:", "W:turn1", "w:a b", "w:a{b", b"\xff"],
        9: [
            "",
            "*",
            "1",
            "1-",
            "-1",
            "1-1-1",
            "a-1",
            " 1-1",
            "1-1\n",
            "9" * 20 + "-0",
            b"\xff",
            "01-1",
            "1-01",
        ],
    },
}


def good_call(name: str, s: Session) -> protocol.Call[Any]:
    """A well-formed call of each mutating script on the fixture's session."""
    k, op, ep = s.keys, new_op_id(), s.epoch
    calls: dict[str, Callable[[], protocol.Call[Any]]] = {
        "open": lambda: protocol.open_session(k, op, BUDGET, 120_000),
        "admit": lambda: protocol.admit(k, op, ep, Consumer.RETRIEVAL, [Item("new1", 10, 1)]),
        "release": lambda: protocol.release(k, op, ep, Consumer.RETRIEVAL, ["doc1"]),
        "reserve": lambda: protocol.reserve(k, op, ep, Consumer.SCRATCHPAD, "res2", 50, 60_000),
        "settle": lambda: protocol.settle(k, op, ep, "res1", 450, "out1", 3),
        "void": lambda: protocol.void(k, op, ep, "res1"),
        "reset": lambda: protocol.reset(k, op, ep, "operator"),
        "delete": lambda: protocol.delete(k, op, ep),
        "expire": lambda: protocol.expire(k, op, ["res1"]),
        "reconcile": lambda: protocol.reconcile(k, op, ep, {"retrieval": [Item("doc1", 410)]}),
        "compact": lambda: protocol.compact(
            k, op, ep, ["turn1", (Consumer.RETRIEVAL, "doc2")], Item("sum1", 50)
        ),
    }
    return calls[name]()


def malformed(name: str, good: list[str | bytes]) -> Iterator[tuple[str, list[str | bytes]]]:
    """Every single-argument spoiling of a good ARGV, and wrong argument counts."""
    for pos, values in ARGV_SPEC[name].items():
        assert pos <= len(good), (name, pos)
        for v in values:
            args = list(good)
            args[pos - 1] = v
            yield f"ARGV[{pos}]={v!r}"[:80], args
    for v in NO_VERSION:
        yield f"version ARGV[2]={v!r}", [good[0], v, *good[2:]]
    yield "version no ARGV", []
    yield "version only an op id", good[:1]
    yield "prologue only", good[:2]
    yield "last argument missing", good[:-1]
    yield "one argument too many", [*good, "extra"]
    yield "two arguments too many", [*good, "5", "0"]


@pytest.mark.parametrize("name", list(ARGV_SPEC))
def test_scripts_refuse_malformed_argv(ledger: Ledger, session: Session, name: str) -> None:
    call = good_call(name, session)
    keys, good = list(call.keys), list(call.args)
    script = ledger._scripts[name]
    problems: list[str] = []
    for label, args in malformed(name, good):
        before = state(ledger, session)
        try:
            reply = script(keys=keys, args=args)
        except redis.exceptions.ResponseError as exc:
            want = "LEDGER_VERSION" if label.startswith("version") else "LEDGER_BADARG"
            if not str(exc).startswith(want):
                problems.append(f"{label}: {exc}")
        except Exception as exc:
            problems.append(f"{label}: {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{label}: accepted, replied {reply!r}")
        after = state(ledger, session)
        if after != before:
            problems.append(f"{label}: keys changed: {diff(before, after)}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)
    # The unspoiled ARGV (same op id) is accepted: each refusal was for its one fault.
    reply = script(keys=keys, args=good)
    assert protocol.decode(reply)["status"] == "ok", reply


# --- regressions of bugs found by this suite ---------------------------------------------


@pytest.mark.parametrize("bad", [None, 5, b"doc1", "doc\udcff"], ids=repr)
def test_non_string_ids_are_invalid_argument(ledger: Ledger, session: Session, bad: Any) -> None:
    before = state(ledger, session)
    calls: list[Callable[[], object]] = [
        lambda: session.admit("retrieval", [Item(bad, 10)]),
        lambda: session.release("retrieval", [bad]),
        lambda: session.reserve("scratchpad", bad, 50),
        lambda: session.settle(bad, 450),
        lambda: session.void(bad),
        lambda: session.reset(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    assert state(ledger, session) == before


def test_empty_op_id_is_invalid_argument(ledger: Ledger, session: Session) -> None:
    before = state(ledger, session)
    with pytest.raises(InvalidArgument):
        session.admit("retrieval", [Item("new1", 10)], op_id="")
    assert state(ledger, session) == before


def test_budget_of_the_wrong_type_is_a_configuration_error(ledger: Ledger) -> None:
    with pytest.raises(ConfigurationError):
        ledger.open_session("bad-input/dict", BUDGET_FIELDS)  # type: ignore[arg-type]


def test_items_of_the_wrong_shape_are_invalid_argument(ledger: Ledger, session: Session) -> None:
    before = state(ledger, session)
    with pytest.raises(InvalidArgument):
        session.admit("retrieval", [("new1", 10)])  # type: ignore[list-item]
    assert state(ledger, session) == before


def test_release_of_a_bare_string_is_invalid_argument(ledger: Ledger, session: Session) -> None:
    before = state(ledger, session)
    with pytest.raises(InvalidArgument):
        session.release("retrieval", "doc1")
    assert state(ledger, session) == before


def test_reserve_script_refuses_a_session_id_other_than_its_key(
    ledger: Ledger, session: Session
) -> None:
    call = protocol.reserve(
        ledger.keyspace.session("other"), new_op_id(), 1, Consumer.SCRATCHPAD, "res9", 50, 1
    )
    args = list(call.args)
    before = state(ledger, session)
    with pytest.raises(redis.exceptions.ResponseError, match=r"^LEDGER_BADARG"):
        ledger._scripts["reserve"](keys=[session.keys.session, session.keys.deadlines], args=args)
    assert state(ledger, session) == before


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("settle", lambda k, s: protocol.settle(k, "op-keys", s.epoch, "res1", 450, "out1")),
        ("void", lambda k, s: protocol.void(k, "op-keys", s.epoch, "res1")),
        (
            "reserve",
            lambda k, s: protocol.reserve(
                k, "op-keys", s.epoch, Consumer.SCRATCHPAD, "res9", 5, 60_000
            ),
        ),
        (
            "begin_turn",
            lambda k, s: protocol.begin_turn(k, "op-keys", s.epoch, 10, None, "owner-1", 60_000),
        ),
        ("admit_tool", lambda k, s: protocol.admit_tool(k, "op-keys", s.epoch, "call-1", 5, b"{}")),
    ],
)
def test_scripts_refuse_keys_that_are_not_the_sessions(
    ledger: Ledger, session: Session, name: str, build: Any
) -> None:
    """A direct caller passing the wrong second key (another partition's, the session
    key twice, none) gets LEDGER_BADARG before any write."""
    call = build(session.keys, session)
    other = ledger.keyspace.session("another-session-id")
    wrong = [
        (session.keys.session, session.keys.session),
        (
            session.keys.session,
            other.deadlines if other.partition != session.keys.partition else "x:{p9999}:deadlines",
        ),
        (session.keys.session,),
        (session.keys.session, call.keys[1], call.keys[1]),
    ]
    before = state(ledger, session)
    for keys in wrong:
        # On a cluster, keys of two slots are refused before the script runs.
        with pytest.raises(
            (redis.exceptions.ResponseError, redis.exceptions.RedisClusterException),
            match=r"^LEDGER_BADARG|CROSSSLOT|same (key )?slot",
        ):
            ledger._scripts[name](keys=list(keys), args=list(call.args))
        assert state(ledger, session) == before, diff(before, state(ledger, session))


def _open_with_json(ledger: Ledger, sid: str, text: str) -> Any:
    """open, its ARGV[13..14] replaced by ``text`` and that text's own SHA-256."""
    import hashlib

    keys = ledger.keyspace.session(sid)
    call = protocol.open_session(keys, new_op_id(), BUDGET, 120_000)
    args = list(call.args)
    args[12], args[13] = hashlib.sha256(text.encode()).hexdigest(), text
    return ledger._scripts["open"](keys=list(call.keys), args=args)


@pytest.mark.parametrize(
    ("was", "now"),
    [
        ('"window":32000', '"window":32000.0'),  # one budget, two spellings
        ('"window":32000', '"window":3.2e4'),
        ('"eviction_threshold":0.9', '"eviction_threshold":0.90'),
        ('"high_water_mark":0.72', '"high_water_mark":7.2e-1'),
        ('{"amplification', '{ "amplification'),  # whitespace
        ('"window":32000,', '"window":32000,"window":32000,'),  # a key twice
    ],
)
def test_open_refuses_a_budget_json_that_is_not_canonical(
    ledger: Ledger, was: str, now: str
) -> None:
    """docs/protocol.md: ARGV[14] is the canonical JSON, else LEDGER_BADARG. The same
    budget written otherwise (with that text's own SHA-256) would be a second fingerprint
    of one budget: a second open with the canonical text would then conflict."""
    text = BUDGET.canonical_json()
    assert was in text
    spoiled = text.replace(was, now, 1)
    sid = "bad-input/json-" + new_op_id()
    with pytest.raises(redis.exceptions.ResponseError, match=r"^LEDGER_BADARG .*not canonical"):
        _open_with_json(ledger, sid, spoiled)
    assert ledger.client.exists(ledger.keyspace.session(sid).session) == 0
    # The canonical text of the same budget opens it.
    assert protocol.decode(_open_with_json(ledger, sid, text))["created"] == "1"


@pytest.mark.parametrize(
    "update",
    [
        {"high_water_mark": 1 / 3, "eviction_threshold": 0.1 + 0.8},
        {"compaction_min_gain": 0.00001, "rollup_fraction": 0.123456789012},
        {"compaction_min_gain": 1e-7, "framing_tolerance": 0},
        {"release_each_turn": {Consumer.RETRIEVAL, Consumer.RECALL}, "compaction": "agent"},
    ],
    ids=["thirds", "small", "exponent", "lists"],
)
def test_open_takes_the_canonical_json_of_any_budget(ledger: Ledger, update: Any) -> None:
    """The server's canonical form is the clients' (RFC 8785) for numbers of every
    shape a budget holds: shortest digits, decimals from 1e-6 up, an exponent below."""
    budget = SessionBudget(**{**BUDGET_FIELDS, **update})
    s = ledger.open_session("bad-input/canon-" + new_op_id(), budget)
    assert s.snapshot().window == BUDGET.window
