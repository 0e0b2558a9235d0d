"""The rules of docs/rules.md on every backend: honest refusal reasons, two workers racing
on one session, bad input to every turn-level operation, and retries with the same
operation id.

The rules replayed with the demo scenarios' numbers (each test rebuilds the load a record
describes under "What was observed", then shows the ledger's rule firing and the failure
not happening) are in test_rules_starvation.py (000), test_rules_compaction.py (001,
003), test_rules_tool_results.py (002) and test_rules_amplification.py (004).

Every test takes the parametrized ``ledger`` fixture (embedded fakeredis, a real
redis-server, a real Redis Cluster); the helpers are in tests/support/rules.py. Tests named
``test_bug_*`` are regressions of defects found and fixed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ledger import (
    AdmissionRefused,
    ConfigurationError,
    InvalidArgument,
    Item,
    Ledger,
    LedgerSettings,
    OperationIdReused,
    Session,
    SessionBudget,
    TurnInProgress,
)
from ledger.errors import FanoutRefused, WorkingMemoryStarvation
from tests.support.rules import (
    REC,
    RET,
    SCR,
    WM,
    budget_002,
    budget_004,
    clean,
    new_sid,
    raw_hash,
    run_workers,
)

# --- honest reasons --------------------------------------------------------------------


def floors_budget() -> SessionBudget:
    """10k window, 2k working-memory floor, 1.5k minimum memory: 5,000 free."""
    return SessionBudget(
        window=10_000,
        system_prompt=1_000,
        working_memory_floor=2_000,
        min_memory=1_500,
        tool_framing=100,
        output_reserve=400,
    )


def test_honest_reasons_for_admissions(ledger: Ledger) -> None:
    b = floors_budget()
    s = ledger.open_session(new_sid(), b)
    free = s.snapshot().free
    assert free == 5_000
    floors = b.working_memory_floor + b.min_memory
    # The room exists, but only inside the other consumers' floors.
    with pytest.raises(AdmissionRefused) as info:
        s.admit(SCR, [Item("x", free + floors)])
    assert info.value.reason == "floor_protected"
    # Not even the unclaimed room (floors included) would hold it.
    with pytest.raises(AdmissionRefused) as info:
        s.admit(SCR, [Item("x", free + floors + 1)])
    assert info.value.reason == "token_budget_exhausted"
    # Retrieval inside its own floor is not refused for the working-memory floor.
    assert s.admit(RET, [Item("r", b.min_memory)]).charged == b.min_memory
    assert s.snapshot().free == free
    # Tool results: free room 100, the working-memory floor empty.
    s.admit(SCR, [Item("fill", free - 100)])
    with pytest.raises(AdmissionRefused) as info:
        s.admit_tool_result("call-1", 1_000, "{}")
    assert info.value.reason == "floor_protected"
    # With the working-memory floor taken, not even the preview has any room.
    s.admit(WM, [Item("h", b.working_memory_floor)])
    assert s.snapshot().free == 100
    with pytest.raises(AdmissionRefused) as info:
        s.admit_tool_result("call-2", 1_000, "{}")
    assert info.value.reason == "token_budget_exhausted"
    clean(ledger, s)


def test_bug_tool_refusal_reason_judges_the_preview(ledger: Ledger) -> None:
    b = floors_budget()
    s = ledger.open_session(new_sid(), b)
    s.admit(SCR, [Item("fill", s.snapshot().free - 100)])
    # Any result over the free room is spilled: only its 256-token preview must fit.
    # 100 tokens are free and 3,500 more sit in the empty floors, so the preview was
    # refused for the floors: the same reason whatever the result's full size.
    reasons = []
    for tokens in (1_000, 24_000):
        with pytest.raises(AdmissionRefused) as info:
            s.admit_tool_result(f"call-{tokens}", tokens, "{}")
        reasons.append(info.value.reason)
    assert reasons == ["floor_protected", "floor_protected"]


# --- two workers racing on one session --------------------------------------------------


def test_two_workers_race_on_the_same_turns(ledger: Ledger, settings: LedgerSettings) -> None:
    """Both workers serve every turn: begin_turn with the turn's op id, then each admits
    a chunk that fits only alone. 50 rounds, two Ledger instances, two threads."""
    b = SessionBudget(
        window=32_000,
        system_prompt=2_100,
        tool_framing=150,
        output_reserve=1_024,
        release_each_turn={"retrieval"},
    )
    s = ledger.open_session(new_sid(), b)
    chunk = (b.window - b.reserved_floor) * 6 // 10
    rounds = 50
    barrier = threading.Barrier(2)
    seen: dict[str, list[tuple[int, int, int, str]]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            with Ledger.from_settings(settings) as led:
                # one owner serving each turn from two places with one op id: a retried
                # call, replayed (docs/agent.md#turn-leases); one owner is one name and
                # one owner token (docs/protocol.md#turns)
                sess = led.session(s.id, owner="fleet", owner_token="f1" * 16)
                for r in range(rounds):
                    barrier.wait()
                    t = sess.begin_turn(1_000, op_id=f"{s.id}:turn-{r}")
                    try:
                        got = sess.admit(RET, [Item(f"{name}-{r}", chunk)])
                        verdict, turn = "admitted", got.turn
                    except AdmissionRefused as exc:
                        verdict, turn = exc.reason, int(exc.detail["turn"])
                    seen[name].append((r, t.turn, turn, verdict))
                    barrier.wait()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    run_workers(worker, ("a", "b"))
    assert not errors, errors
    a, b_ = seen["a"], seen["b"]
    assert len(a) == len(b_) == rounds
    for (r, ta, ua, va), (_, tb, ub, vb) in zip(a, b_, strict=True):
        assert ta == tb == r + 1  # the same verdict: no turn skipped, none duplicated
        assert ua == ub == r + 1  # both admissions judged within that turn
        assert sorted([va, vb]) == ["admitted", "token_budget_exhausted"]
    snap = clean(ledger, s)
    assert snap.turn == rounds
    assert snap.used[RET] == chunk


def test_two_workers_distinct_turns_never_collide(ledger: Ledger, settings: LedgerSettings) -> None:
    """Each worker begins its own turns (its own op ids, its own owner): the turn lease
    lets one serve at a time (the other waits for it), every turn number is handed out
    once, none skipped, and concurrent admissions never over-allocate."""
    b = SessionBudget(window=32_000, system_prompt=2_100, tool_framing=150, output_reserve=1_024)
    s = ledger.open_session(new_sid(), b)
    rounds = 50
    barrier = threading.Barrier(2)
    turns: dict[str, list[int]] = {"a": [], "b": []}
    charged: dict[str, int] = {"a": 0, "b": 0}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            with Ledger.from_settings(settings) as led:
                sess = led.session(s.id)
                for r in range(rounds):
                    barrier.wait()
                    while True:
                        try:
                            t = sess.begin_turn(500)
                            break
                        except TurnInProgress:
                            time.sleep(0.001)
                    turns[name].append(t.turn)
                    res = sess.admit_tool_result(f"{name}-{r}", 200, "{}")
                    assert res.outcome == "admitted"
                    charged[name] += res.charged
                    sess.end_turn(t.turn, 2_100 + 150 + 1)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    run_workers(worker, ("a", "b"))
    assert not errors, errors
    all_turns = turns["a"] + turns["b"]
    assert sorted(all_turns) == list(range(1, 2 * rounds + 1))
    assert all(x < y for x, y in zip(turns["a"], turns["a"][1:], strict=False))
    snap = clean(ledger, s)
    assert snap.turn == 2 * rounds
    assert snap.used[SCR] == charged["a"] + charged["b"]


# --- bad input to each turn-level operation ---------------------------------------------


@pytest.fixture
def busy(ledger: Ledger) -> tuple[Session, int]:
    """A session in turn 1 with items of every kind, a span and a compaction history."""
    s = ledger.open_session(new_sid(), budget_002())
    s.admit(WM, [Item("h1", 3_000), Item("h2", 2_000)])
    s.admit(RET, [Item("r1", 400)])
    s.admit_tool_result("call-1", 800, "{}")
    t = s.begin_turn(2_000)
    s.record_span(t.turn, "recall", 700, 50)
    return s, t.turn


BAD_CALLS: dict[str, Callable[[Session, int], object]] = {
    "begin_turn ws -1": lambda s, t: s.begin_turn(-1),
    "begin_turn ws str": lambda s, t: s.begin_turn("6000"),
    "begin_turn ws bool": lambda s, t: s.begin_turn(True),
    "begin_turn ws float": lambda s, t: s.begin_turn(6000.0),
    "begin_turn ws 1e8+1": lambda s, t: s.begin_turn(10**8 + 1),
    "begin_turn out -1": lambda s, t: s.begin_turn(100, output_reserve=-1),
    "begin_turn out 1.5": lambda s, t: s.begin_turn(100, output_reserve=1.5),
    "record_span turn -1": lambda s, t: s.record_span(-1, "recall", 10),
    "record_span kind": lambda s, t: s.record_span(t, "re call", 10),
    "record_span kind empty": lambda s, t: s.record_span(t, "", 10),
    "record_span input -1": lambda s, t: s.record_span(t, "recall", -1),
    "record_span input 1e8+1": lambda s, t: s.record_span(t, "recall", 10**8 + 1),
    "record_span output -1": lambda s, t: s.record_span(t, "recall", 1, -1),
    "record_span turn str": lambda s, t: s.record_span(str(t), "recall", 1),
    "end_turn final 0": lambda s, t: s.end_turn(t, 0),
    "end_turn final -5": lambda s, t: s.end_turn(t, -5),
    "end_turn trend 2": lambda s, t: s.end_turn(t, 1_000, p99_trend=2),
    "end_turn trend str": lambda s, t: s.end_turn(t, 1_000, p99_trend="up"),
    "compact twice the same item": lambda s, t: s.compact(["h1", "h1"], Item("sum", 10)),
    "compact unknown consumer": lambda s, t: s.compact([("nope", "h1")], None),
    "compact bad item id": lambda s, t: s.compact(["h 1"], None),
    "compact negative summary": lambda s, t: s.compact(["h1"], Item("sum", -1)),
    "compact summary of the wrong type": lambda s, t: s.compact(["h1"], "sum"),
    "compact bad summary id": lambda s, t: s.compact(["h1"], Item("s u m", 10)),
    "compact replaced is a string": lambda s, t: s.compact("h1", None),
    "compact 1001 items": lambda s, t: s.compact([f"x{i}" for i in range(1001)], None),
    "tool tokens 0": lambda s, t: s.admit_tool_result("call-9", 0, "{}"),
    "tool tokens -1": lambda s, t: s.admit_tool_result("call-9", -1, "{}"),
    "tool tokens 1e8+1": lambda s, t: s.admit_tool_result("call-9", 10**8 + 1, "{}"),
    "tool tokens bool": lambda s, t: s.admit_tool_result("call-9", True, "{}"),
    "tool call id": lambda s, t: s.admit_tool_result("call 9", 10, "{}"),
    "tool call id braces": lambda s, t: s.admit_tool_result("{p1}", 10, "{}"),
    "tool content int": lambda s, t: s.admit_tool_result("call-9", 10, 5),
    "empty op id": lambda s, t: s.begin_turn(10, op_id=""),
}


def test_bad_input_is_invalid_argument_and_changes_nothing(
    ledger: Ledger, busy: tuple[Session, int]
) -> None:
    s, turn = busy
    problems = []
    for label, call in BAD_CALLS.items():
        before = raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)
        try:
            call(s, turn)
        except InvalidArgument:
            pass
        except Exception as exc:
            problems.append(f"{label}: {type(exc).__name__}: {exc}")
        else:
            problems.append(f"{label}: accepted")
        if (raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)) != before:
            problems.append(f"{label}: the session changed")
    assert not problems, "\n".join(problems)
    clean(ledger, s)


def test_bug_begin_turn_output_reserve_beyond_window_is_a_fault(ledger: Ledger) -> None:
    b = budget_002()
    s = ledger.open_session(new_sid(), b)
    before = raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)
    try:
        s.begin_turn(1_000, output_reserve=b.window)  # floor: 2,100 + 150 + 6,000 + 32,000
    except (InvalidArgument, ConfigurationError):
        pass
    except WorkingMemoryStarvation as exc:
        assert int(exc.detail["free"]) >= 0, exc.detail  # fails: free=-8250
        raise AssertionError("refused as starvation") from exc
    assert (raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)) == before


# --- retries: the same op id twice applies once -----------------------------------------


def test_each_turn_operation_retried_applies_once(ledger: Ledger) -> None:
    b = budget_002()
    s = ledger.open_session(new_sid(), b)
    s.admit(WM, [Item("h1", 3_000), Item("h2", 2_000)])

    def twice(label: str, call: Callable[[str], Any]) -> Any:
        first = call(f"op-{label}")
        state = raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)
        assert call(f"op-{label}") == first, label
        assert (raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)) == state, label
        return first

    t = twice("begin", lambda op: s.begin_turn(1_000, op_id=op))
    assert t.turn == s.snapshot().turn == 1
    span = twice("span", lambda op: s.record_span(t.turn, "recall", 700, 30, op_id=op))
    assert span.spans == 1 and s.snapshot().raw["ai"] == 700
    tool = twice("tool", lambda op: s.admit_tool_result("call-1", 24_000, "big", op_id=op))
    assert tool.outcome == "spilled" and s.snapshot().used[SCR] == b.spill_preview_tokens
    tool2 = twice("tool2", lambda op: s.admit_tool_result("call-2", 900, "{}", op_id=op))
    assert tool2.outcome == "admitted"
    report = twice("end", lambda op: s.end_turn(t.turn, 8_000, op_id=op))
    assert report.span_input == 700
    assert ledger.client.hget(s.keys.session, f"x:class:{report.classification}") == b"1"
    comp = twice("compact", lambda op: s.compact(["h1"], Item("sum", 500), op_id=op))
    assert comp.compacted and comp.dropped == 3_000
    assert s.snapshot().used[WM] == 2_500

    # Refusals are replayed too, without a second effect.
    s.admit(REC, [Item("m1", s.snapshot().free)])
    t2 = s.begin_turn(0)
    with pytest.raises(WorkingMemoryStarvation) as first:
        s.begin_turn(b.window, op_id="op-starve")
    state = raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)
    with pytest.raises(WorkingMemoryStarvation) as again:
        s.begin_turn(b.window, op_id="op-starve")
    assert again.value.detail == first.value.detail
    assert (raw_hash(ledger, s), ledger.client.xlen(s.keys.jobs)) == state
    assert s.snapshot().raw["x:starvation"] == 1 and s.snapshot().turn == t2.turn

    # The same op id with other arguments is refused, for every operation.
    reused: list[Callable[[], object]] = [
        lambda: s.begin_turn(1_001, op_id="op-begin"),
        lambda: s.record_span(t.turn, "recall", 701, 30, op_id="op-span"),
        lambda: s.end_turn(t.turn, 8_001, op_id="op-end"),
        lambda: s.compact(["h2"], Item("sum", 500), op_id="op-compact"),
        lambda: s.admit_tool_result("call-1", 24_000, "other", op_id="op-tool"),
    ]
    for call in reused:
        with pytest.raises(OperationIdReused):
            call()
    clean(ledger, s)


def test_fanout_refusal_is_replayed(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_004())
    t = s.begin_turn(0)
    occupancy = s.snapshot().occupancy
    s.record_span(t.turn, "recall", occupancy * 9)
    with pytest.raises(FanoutRefused) as first:
        s.record_span(t.turn, "recall", 10, op_id="op-fan")
    before = raw_hash(ledger, s)
    with pytest.raises(FanoutRefused) as again:
        s.record_span(t.turn, "recall", 10, op_id="op-fan")
    assert again.value.detail == first.value.detail
    assert raw_hash(ledger, s) == before
