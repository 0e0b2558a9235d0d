"""Fuzzing the two attack surfaces with hypothesis, on embedded and a real Redis.

* The mutating Lua scripts, called directly: a protocol builder's valid ARGV is
  spoiled by a few drawn mutations (arguments dropped, duplicated, inserted,
  truncated, or replaced by text, invalid UTF-8, huge or negative numbers, floats,
  empty strings). A call either succeeds (a mutation may be harmless) or raises a
  ``LEDGER_*`` error and leaves the session hash and the deadline index unchanged.
* Every public ``Session`` method with drawn Python arguments (valid ones mixed
  with ints, text, bytes, floats, None, bools, lists): a call returns, or raises a
  :class:`LedgerError`; InvalidArgument and ConfigurationError change nothing.

After every call the session's audit is clean (or the session was closed).
State is compared as in tests/test_bad_input.py: HGETALL of the session hash
plus ZRANGE WITHSCORES of the partition's deadline index, byte for byte.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis.exceptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import (
    ConfigurationError,
    Consumer,
    InvalidArgument,
    Item,
    Ledger,
    LedgerError,
    Price,
    ScopeBudget,
    Session,
    SessionBudget,
    UnknownSession,
    protocol,
    scripts,
)
from ledger.core import new_op_id
from tests.conftest import backend_url, make_settings

pytestmark = pytest.mark.slow

BUDGET = SessionBudget(
    window=32_000,
    system_prompt=2_100,
    working_memory_floor=6_000,
    min_memory=0,
    tool_framing=150,
    output_reserve=1_024,
)
EXAMPLES = {"embedded": 60, "redis": 25}

State = tuple[dict[bytes, bytes], list[tuple[bytes, float]]]


@pytest.fixture(
    params=[
        pytest.param("embedded", marks=pytest.mark.embedded, id="embedded"),
        pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    ]
)
def fz(request: pytest.FixtureRequest) -> Iterator[tuple[str, Ledger]]:
    """A ledger on embedded or a real Redis (no cluster: too slow for fuzzing)."""
    kind = str(request.param)
    with Ledger.from_settings(make_settings(backend_url(request, kind))) as led:
        yield kind, led


def state(ledger: Ledger, s: Session) -> State:
    return (
        ledger.client.hgetall(s.keys.session),
        ledger.client.zrange(s.keys.deadlines, 0, -1, withscores=True),
    )


def fresh_session(ledger: Ledger) -> tuple[Session, int]:
    """A session with items for three consumers, an open reservation and a started turn."""
    s = ledger.open_session(f"fuzz/{uuid.uuid4().hex[:16]}", BUDGET)
    s.admit("retrieval", [Item("doc1", 400), Item("doc2", 300, priority=5)])
    s.admit("working_memory", [Item("turn1", 200)])
    s.reserve("scratchpad", "res1", 500, lease_ms=600_000)
    s.open_child("res1", "kid0", 100)
    turn = s.begin_turn(1_000).turn
    return s, turn


def assert_audit_clean(ledger: Ledger, s: Session, label: str) -> None:
    try:
        report = ledger.audit(s.id)
    except UnknownSession:
        # Closed: only a tombstone (no epoch field) may be left.
        assert b"ep" not in ledger.client.hgetall(s.keys.session), label
        return
    assert report.clean, f"{label}: audit {report.problems}"


# --- 1. the scripts, called directly with mutated ARGV ---------------------------------


def good_call(name: str, s: Session, turn: int) -> protocol.Call[Any]:
    k, op, e = s.keys, new_op_id(), s.epoch
    ep = protocol.stamp(e, turn)  # the calls of the open turn (docs/agent.md#turn-leases)
    calls: dict[str, Callable[[], protocol.Call[Any]]] = {
        "open": lambda: protocol.open_session(k, op, BUDGET, 300_000),
        "admit": lambda: protocol.admit(
            k, op, ep, Consumer.RETRIEVAL, [Item("new1", 10, 1), Item("new2", 20)]
        ),
        "release": lambda: protocol.release(k, op, ep, Consumer.RETRIEVAL, ["doc1", "zz"]),
        "reserve": lambda: protocol.reserve(k, op, ep, Consumer.SCRATCHPAD, "res2", 50, 60_000),
        "settle": lambda: protocol.settle(k, op, ep, "res1", 450, "out1", 3),
        "void": lambda: protocol.void(k, op, ep, "res1"),
        "expire": lambda: protocol.expire(k, op, ["res1"]),
        "reset": lambda: protocol.reset(k, op, e, "operator"),
        "begin_turn": lambda: protocol.begin_turn(k, op, e, 1_000, None, s.owner, 60_000),
        "record_span": lambda: protocol.record_span(k, op, e, turn, "recall", 100, 10),
        "end_turn": lambda: protocol.end_turn(k, op, e, turn, 5_000, 0),
        "finish_turn": lambda: protocol.finish_turn(
            k, op, e, turn, 5_000, [("call-2", 100, b"{}"), ("call-3", 50, "x")], s._token
        ),
        "abort_turn": lambda: protocol.abort_turn(k, op, e, turn),
        "renew_turn": lambda: protocol.renew_turn(k, op, e, turn, 30_000),
        "compact": lambda: protocol.compact(
            k, op, ep, ["turn1", (Consumer.RETRIEVAL, "doc2")], Item("sum1", 50)
        ),
        "admit_tool": lambda: protocol.admit_tool(k, op, ep, "call-1", 200, b'{"ok": 1}'),
        "delete": lambda: protocol.delete(k, op, e),
        "reconcile": lambda: protocol.reconcile(
            k, op, ep, {"retrieval": [Item("doc1", 300), Item("new3", 40, 2)]}
        ),
        "open_child": lambda: protocol.open_child(k, op, ep, "res1", "kid1", 100),
        "draw_child": lambda: protocol.draw_child(k, op, ep, "res1", "kid0", 50),
        "set_scope": lambda: protocol.set_scope(
            s.ledger.keyspace,
            op,
            "fuzz",
            ScopeBudget(window_ms=60_000, tokens=1_000, cents=5, prices={"m": Price(300, 900)}),
        ),
    }
    return calls[name]()


MUTATING = [name for name in scripts.NAMES if name not in scripts.READ_ONLY]

ARG_VALUES: st.SearchStrategy[str | bytes] = st.one_of(
    st.just(""),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=10**15, max_value=10**30).map(str),
    st.integers(max_value=-1).map(str),
    st.integers(min_value=0, max_value=2_000).map(str),  # plausible counts and sizes
    st.floats().map(str),
    st.floats().map(repr),
)
INDEX = st.integers(min_value=0, max_value=40)
MUTATION = st.one_of(
    st.tuples(st.just("replace"), INDEX, ARG_VALUES),
    st.tuples(st.just("insert"), INDEX, ARG_VALUES),
    st.tuples(st.just("drop"), INDEX),
    st.tuples(st.just("duplicate"), INDEX),
    st.tuples(st.just("truncate"), INDEX),
)


def mutate(args: list[str | bytes], mutations: list[tuple[Any, ...]]) -> list[str | bytes]:
    out = list(args)
    for kind, i, *value in mutations:
        if kind == "insert":
            out.insert(i % (len(out) + 1), value[0])
        elif not out:
            continue
        elif kind == "replace":
            out[i % len(out)] = value[0]
        elif kind == "drop":
            del out[i % len(out)]
        elif kind == "duplicate":
            j = i % len(out)
            out.insert(j, out[j])
        else:
            del out[i % (len(out) + 1) :]
    return out


def test_scripts_survive_mutated_argv(fz: tuple[str, Ledger]) -> None:
    kind, ledger = fz

    @settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(
        calls=st.lists(
            st.tuples(st.sampled_from(MUTATING), st.lists(MUTATION, min_size=1, max_size=3)),
            min_size=1,
            max_size=4,
        )
    )
    def run(calls: list[tuple[str, list[tuple[Any, ...]]]]) -> None:
        s, turn = fresh_session(ledger)
        for name, mutations in calls:
            call = good_call(name, s, turn)
            args = mutate(list(call.args), mutations)
            label = f"{name} ARGV={args!r}"[:600]
            before = state(ledger, s)
            try:
                ledger._scripts[name](keys=list(call.keys), args=args)
            except redis.exceptions.ResponseError as exc:
                assert str(exc).startswith("LEDGER_"), f"{label}: untyped error {exc}"
                assert state(ledger, s) == before, f"{label}: raised {exc} but changed state"
            assert_audit_clean(ledger, s, label)

    run()


# --- 2. the Session methods with fuzzed Python arguments -------------------------------

IDS = ["doc1", "doc2", "turn1", "res1", "res2", "new1", "call-1", "x=y"]
FUZZ: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.floats(),
    st.none(),
    st.booleans(),
    st.lists(st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=3),
)


def rarely(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A valid value, or (one time in sixteen) a fuzzed one: for values inside lists."""
    return st.one_of(*[valid] * 15, FUZZ)


ID = st.sampled_from(IDS)
TOKENS = st.integers(min_value=1, max_value=5_000)
CONSUMER = st.sampled_from([c.value for c in Consumer])
ITEM = st.builds(Item, rarely(ID), rarely(TOKENS), rarely(st.integers(min_value=0, max_value=10)))
PAIR = st.tuples(rarely(CONSUMER), rarely(ID))

# Per method, a valid value of each parameter; a call then has up to two of them fuzzed.
METHODS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "admit": {
        "consumer": CONSUMER,
        "items": st.lists(ITEM, min_size=1, max_size=4),
        "partial": st.booleans(),
    },
    "release": {"consumer": CONSUMER, "item_ids": st.lists(rarely(ID), min_size=1, max_size=4)},
    "reserve": {
        "consumer": CONSUMER,
        "reservation_id": ID,
        "tokens": TOKENS,
        "lease_ms": st.integers(min_value=1, max_value=600_000),
    },
    "settle": {
        "reservation_id": ID,
        "actual": TOKENS,
        "item_id": ID,
        "priority": st.integers(min_value=0, max_value=1_000),
    },
    "void": {"reservation_id": ID},
    "begin_turn": {
        "working_set": st.integers(min_value=0, max_value=30_000),
        "output_reserve": st.none() | st.integers(min_value=0, max_value=5_000),
    },
    "record_span": {
        "turn": st.integers(min_value=1, max_value=2),
        "kind": st.sampled_from(["recall", "rerank", "fetch"]),
        "input_tokens": st.integers(min_value=0, max_value=5_000),
        "output_tokens": st.integers(min_value=0, max_value=5_000),
    },
    "end_turn": {
        "turn": st.integers(min_value=1, max_value=2),
        "final_prompt_tokens": st.integers(min_value=1, max_value=32_000),
        "p99_trend": st.integers(min_value=-1, max_value=1),
    },
    "finish_turn": {
        "turn": st.integers(min_value=1, max_value=2),
        "final_prompt_tokens": st.integers(min_value=1, max_value=32_000),
        "tools": st.lists(st.tuples(ID, TOKENS, st.text(max_size=30)), max_size=2),
    },
    "compact": {
        "replaced": st.lists(st.one_of(rarely(ID), PAIR), max_size=4),
        "summary": st.none() | ITEM,
    },
    "admit_tool_result": {
        "call_id": ID,
        "tokens": TOKENS,
        "content": st.one_of(st.text(max_size=30), st.binary(max_size=30)),
    },
    "reconcile": {
        "items": st.dictionaries(CONSUMER, st.lists(ITEM, max_size=3), min_size=1, max_size=2),
    },
    "reset": {"reason": st.sampled_from(["operator", "fuzz"])},
    "delete": {},
}
OP_ID = st.one_of(*[st.none()] * 6, st.just("fuzz-op"), FUZZ)


@st.composite
def method_call(draw: st.DrawFn) -> tuple[str, dict[str, Any], Any]:
    name = draw(st.sampled_from(sorted(METHODS)))
    kwargs = draw(st.fixed_dictionaries(METHODS[name]))
    if kwargs:
        for key in draw(st.lists(st.sampled_from(sorted(kwargs)), max_size=2, unique=True)):
            kwargs[key] = draw(FUZZ)
    return name, kwargs, draw(OP_ID)


METHOD_CALL = method_call()


def test_session_methods_survive_fuzzed_arguments(fz: tuple[str, Ledger]) -> None:
    kind, ledger = fz

    @settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(calls=st.lists(METHOD_CALL, min_size=1, max_size=5))
    def run(calls: list[tuple[str, dict[str, Any], Any]]) -> None:
        s, _ = fresh_session(ledger)
        for name, kwargs, op_id in calls:
            label = f"{name}({kwargs!r}, op_id={op_id!r})"[:600]
            before = state(ledger, s)
            try:
                getattr(s, name)(**kwargs, op_id=op_id)
            except (InvalidArgument, ConfigurationError) as exc:
                assert str(exc), f"{label}: {type(exc).__name__} without a message"
                assert state(ledger, s) == before, f"{label}: raised {exc!r} but changed state"
            except LedgerError:
                pass
            except Exception as exc:  # pragma: no cover - a finding
                raise AssertionError(f"{label}: untyped {type(exc).__name__}: {exc}") from exc
            assert_audit_clean(ledger, s, label)

    run()
