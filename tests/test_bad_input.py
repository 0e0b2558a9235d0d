"""Bad input to the Python API gets a typed error and changes no byte, on every backend.

Every malformed argument to ``Session.admit`` ... ``Ledger.open_session`` must raise
:class:`InvalidArgument` (or :class:`ConfigurationError` for a budget) and leave the
session hash and the partition's deadline index exactly as they were; arguments the
client checks itself must not reach Redis at all. The Lua scripts called directly with
malformed ARGV are attacked in test_bad_input_scripts.py.

"State" is HGETALL of the session hash plus ZRANGE WITHSCORES of the deadline
index, compared byte for byte before and after each bad call. Each test holds one
session with items and an open reservation, so a partial write would show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ledger import (
    ConfigurationError,
    InvalidArgument,
    Item,
    Ledger,
    Session,
    SessionBudget,
    StaleEpoch,
    protocol,
)
from tests.support.bad_input import BUDGET, BUDGET_FIELDS, diff, state


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
