"""Bad input to the Lua scripts, called directly (bypassing the Python checks), on every
backend: every malformed ARGV must be refused with ``LEDGER_BADARG`` before its first
write, and so must keys that are not the session's and budgets whose JSON is not
canonical. The Python API is attacked in test_bad_input.py.

"State" is HGETALL of the session hash plus ZRANGE WITHSCORES of the deadline
index, compared byte for byte before and after each bad call (tests/support/bad_input.py).

The regression tests at the end pin bugs that were found and fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
    protocol,
)
from ledger.core import new_op_id
from tests.support.bad_input import BUDGET, BUDGET_FIELDS, diff, state

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
    *("", "1", "*", "12345", "1:12345", "2:12345", "3:12345", "5:12345", ":1", b"\xff")
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
