"""Fuzzing the two attack surfaces with hypothesis, on embedded and a real Redis.

* The mutating Lua scripts, called directly: a valid call's ARGV (the one the script's
  spec gives, tests/support/spec_calls.py, or for the few it cannot, a protocol builder's of the
  table below) is spoiled by a few drawn mutations (arguments dropped, duplicated,
  inserted, truncated, or replaced by text, invalid UTF-8, huge or negative numbers,
  floats, empty strings, an integer of the spec at or just past one of its bounds). A
  call either succeeds (a mutation may be harmless) or raises a ``LEDGER_*`` error and
  leaves the session hash and the deadline index unchanged.
* Every public ``Session`` method with drawn Python arguments (valid ones mixed
  with ints, text, bytes, floats, None, bools, lists): a call returns, or raises a
  :class:`LedgerError`; InvalidArgument and ConfigurationError change nothing.

After every call the session's audit is clean (or the session was closed).
State is compared as in tests/test_bad_input.py: HGETALL of the session hash
plus ZRANGE WITHSCORES of the partition's deadline index, byte for byte.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from hypothesis import HealthCheck, Phase, given, settings
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
from ledger.keys import KeySpace
from tests.conftest import backend_url, make_settings
from tests.support import spec_calls

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
KEYS = KeySpace("ledger", 64).session("fuzz/s")

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


# The calls that record the turn's real prompt: one whose size differs from occupancy past
# the tolerance, or exceeds the window (the fuzz sends sizes up to 1e8), is accepted and
# flagged as drift, which the audit reports until a reconcile (docs/agent.md#drift).
PROMPT_CALLS = frozenset({"end_turn", "finish_turn"})


def assert_audit_clean(
    ledger: Ledger, s: Session, label: str, prompt_recorded: bool = False
) -> None:
    """The audit finds no problem; after a call that recorded a prompt, none but its drift."""
    try:
        report = ledger.audit(s.id)
    except UnknownSession:
        # Closed: only a tombstone (no epoch field) may be left.
        assert b"ep" not in ledger.client.hgetall(s.keys.session), label
        return
    problems = [p for p in report.problems if not (prompt_recorded and p.startswith("drift: "))]
    assert not problems, f"{label}: audit {report.problems}"


# --- 1. the scripts, called directly with mutated ARGV ---------------------------------


# Samples of the scripts whose spec cannot give one (tests/support/spec_calls.py): an
# argument of its own syntax (a mode, consumer letters, a budget, a job entry id, tool
# results) or keys that are not a session's. Every other mutating script is fuzzed from the
# sample its spec gives.
TABLE: dict[str, Callable[[Session, int, str], protocol.Call[Any]]] = {
    "open": lambda s, turn, op: s.ledger.open_call(s.id, BUDGET, op),
    "admit": lambda s, turn, op: protocol.admit(
        s.keys, op, s._stamp(turn), Consumer.RETRIEVAL, [Item("new1", 10, 1), Item("new2", 20)]
    ),
    "finish_turn": lambda s, turn, op: protocol.finish_turn(
        s.keys, op, s.epoch, turn, 5_000, [("call-2", 100, b"{}"), ("call-3", 50, "x")], s._token
    ),
    "compact": lambda s, turn, op: protocol.compact(
        s.keys, op, s._stamp(turn), ["turn1", (Consumer.RETRIEVAL, "doc2")], Item("sum1", 50)
    ),
    "admit_tool": lambda s, turn, op: protocol.admit_tool(
        s.keys, op, s._stamp(turn), "call-1", 200, b'{"ok": 1}'
    ),
    "reconcile": lambda s, turn, op: protocol.reconcile(
        s.keys, op, s._stamp(turn), {"retrieval": [Item("doc1", 300), Item("new3", 40, 2)]}
    ),
    "set_scope": lambda s, turn, op: protocol.set_scope(
        s.ledger.keyspace,
        op,
        "fuzz",
        ScopeBudget(window_ms=60_000, tokens=1_000, cents=5, prices={"m": Price(300, 900)}),
    ),
}


def good_call(name: str, s: Session, turn: int) -> tuple[tuple[str, ...], list[str | bytes]]:
    """(KEYS, ARGV) of a valid call of a mutating script on a fresh session: the one its
    spec gives, else its table's."""
    derived = spec_calls.sample(name, spec_calls.Context(s.keys, s.epoch, turn, s._token))
    if derived is not None:
        return derived[0], list(derived[1])
    call = TABLE[name](s, turn, new_op_id())
    return call.keys, list(call.args)


MUTATING = [name for name in scripts.NAMES if name not in scripts.READ_ONLY]


def bounds(name: str) -> list[tuple[int, int, int]]:
    """(index in ARGV, lowest, highest) of each integer argument of a script whose spec
    gives its range."""
    spec = scripts.spec(name)
    return [(a.positions[0] - 1, *a.range) for a in spec.argv if a.range is not None]


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
    # an integer argument of the spec at, just past or just inside one of its bounds
    st.tuples(st.just("bound"), INDEX, st.integers(min_value=0, max_value=3)),
)


def mutate(
    args: list[str | bytes],
    mutations: list[tuple[Any, ...]],
    ranges: Sequence[tuple[int, int, int]] = (),
) -> list[str | bytes]:
    out = list(args)
    for kind, i, *value in mutations:
        if kind == "bound":
            if ranges:
                at, lo, hi = ranges[i % len(ranges)]
                if at < len(out):
                    out[at] = str((lo - 1, hi + 1, lo, hi)[value[0]])
        elif kind == "insert":
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


def test_every_mutating_script_has_a_sample_and_the_spec_gives_most() -> None:
    derived = {
        n
        for n in MUTATING
        if spec_calls.sample(n, spec_calls.Context(KEYS, 1, 1, "0" * 32)) is not None
    }
    assert set(TABLE) <= set(MUTATING) and not set(TABLE) & derived  # no hand entry needed
    assert derived | set(TABLE) == set(MUTATING)
    assert len(derived) > len(TABLE)


def test_the_samples_are_valid_calls() -> None:
    """Unmutated, each sample is taken: the fuzzing starts from a call that passes every
    check, so a mutation reaches each of them."""
    with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as ledger:
        for name in MUTATING:
            s, turn = fresh_session(ledger)
            keys, args = good_call(name, s, turn)
            reply = ledger._scripts[name](keys=list(keys), args=args)
            assert reply.startswith(b"status=ok"), (name, args, reply)


def fuzz_scripts(
    ledger: Ledger, names: list[str], examples: int, phases: Sequence[Phase] = tuple(Phase)
) -> None:
    @settings(
        max_examples=examples,
        phases=phases,
        derandomize=len(phases) == 1,  # a search for a known finding: the same every run
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(
        calls=st.lists(
            st.tuples(st.sampled_from(names), st.lists(MUTATION, min_size=1, max_size=3)),
            min_size=1,
            max_size=4,
        )
    )
    def run(calls: list[tuple[str, list[tuple[Any, ...]]]]) -> None:
        s, turn = fresh_session(ledger)
        recorded = False
        for name, mutations in calls:
            keys, good = good_call(name, s, turn)
            args = mutate(good, mutations, bounds(name))
            label = f"{name} ARGV={args!r}"[:600]
            before = state(ledger, s)
            try:
                ledger._scripts[name](keys=list(keys), args=args)
                recorded = recorded or name in PROMPT_CALLS
            except redis.exceptions.ResponseError as exc:
                assert str(exc).startswith("LEDGER_"), f"{label}: untyped error {exc}"
                assert state(ledger, s) == before, f"{label}: raised {exc} but changed state"
            assert_audit_clean(ledger, s, label, recorded)

    run()


def test_scripts_survive_mutated_argv(fz: tuple[str, Ledger]) -> None:
    kind, ledger = fz
    fuzz_scripts(ledger, MUTATING, EXAMPLES[kind])


# A check moved after a write: renew_turn (a script fuzzed from its spec alone) bumps a
# counter before it checks how many arguments it got. Only a call whose four arguments
# pass their checks reaches it: the sample the spec gives, with one argument added.
WRITES_FIRST = (
    "if #ARGV ~= 4 then",
    "redis.call('HINCRBY', KEYS[1], 'x:fz', 1)\nif #ARGV ~= 4 then",
)


def test_the_fuzzing_finds_a_script_that_writes_before_it_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lua = tmp_path / "lua"
    shutil.copytree(scripts.lua_dir(), lua)
    text = (lua / "renew_turn.lua").read_text()
    assert WRITES_FIRST[0] in text
    (lua / "renew_turn.lua").write_text(text.replace(*WRITES_FIRST))
    monkeypatch.setattr(scripts, "lua_dir", lambda: lua)
    for cached in (scripts.source, scripts.sha, scripts.definitions, scripts.spec):
        cached.cache_clear()
    found = pytest.raises(AssertionError, match=r"renew_turn ARGV=.*changed state")
    try:
        with Ledger.from_url(f"embedded://{uuid.uuid4().hex}") as ledger, found:
            # the first finding ends it (not shrunk)
            fuzz_scripts(ledger, ["renew_turn"], 500, (Phase.generate,))
    finally:
        for cached in (scripts.source, scripts.sha, scripts.definitions, scripts.spec):
            cached.cache_clear()


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
