"""Record 004 of docs/rules.md, replayed with the demo scenario's numbers: the
amplification ratio, its classes, and the fan-out guard.

Every test takes the parametrized ``ledger`` fixture (embedded fakeredis, a real
redis-server, a real Redis Cluster); the helpers are in tests/support/rules.py. Tests named
``test_bug_*`` are regressions of defects found and fixed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ledger import (
    InvalidArgument,
    Item,
    Ledger,
    TurnLost,
)
from ledger.errors import ContextDriftWarning, FanoutRefused
from tests.support.rules import (
    WINDOW_004,
    WM,
    budget_004,
    clean,
    new_sid,
    raw_hash,
)

# --- amplification ratio and the fan-out guard (rules.md#amplification) -----------------


def test_record004_classes_and_the_fanout_guard(ledger: Ledger) -> None:
    b = budget_004()
    s = ledger.open_session(new_sid(), b)
    s.admit(WM, [Item("ctx", 20_000 - b.system_prompt - b.tool_framing)])
    assert s.snapshot().occupancy == 20_000

    # A baseline turn sets the utilization the next one is compared with.
    t = s.begin_turn(6_000)
    base = s.end_turn(t.turn, 17_600)
    assert base.utilization == 0.55 and base.utilization_delta == 0
    assert base.ratio == 0 and base.classification == "ambiguous"  # no fan-out, flat

    # Turn A: utilization rising to 0.61, 4 spans, ratio 1.3 -> saturation.
    t = s.begin_turn(6_000)
    final_a = 19_520
    for _ in range(4):
        s.record_span(t.turn, "recall", final_a * 13 // 40, 300)
    a = s.end_turn(t.turn, final_a)
    assert (a.ratio, a.classification) == (1.3, "saturation")
    assert a.utilization == 0.61 and a.utilization_delta > 0 and a.spans == 4

    # Turn B: utilization falling to 0.44, p99 rising, 23 recall spans of 6-8k each.
    t = s.begin_turn(6_000)
    final_b = 14_080
    span = 7_224
    for k in range(23):
        got = s.record_span(t.turn, "recall", span, 200)
        assert got.spans == k + 1
    assert got.ratio > b.amplification_pathological  # past the guard now
    # The guard: the next fan-out is refused; the agent must summarize and proceed.
    with pytest.raises(FanoutRefused) as info:
        s.record_span(t.turn, "recall", span, 200)
    assert info.value.reason == "fanout_guard"
    assert info.value.threshold == b.amplification_pathological
    assert info.value.ratio > info.value.threshold
    assert info.value.detail["advice"] == "summarize_and_proceed"
    report = s.end_turn(t.turn, final_b, p99_trend=1)
    assert report.spans == 23 and report.span_input == 23 * span  # the refused one not counted
    assert (report.ratio, report.classification) == (11.8, "pathological")
    assert report.utilization == 0.44 and report.utilization_delta < 0

    # A ratio between 3 and 8 with utilization flat: fragmentation.
    t = s.begin_turn(6_000)
    for _ in range(10):
        s.record_span(t.turn, "recall", final_b // 2, 0)
    f = s.end_turn(t.turn, final_b, p99_trend=1)
    assert (f.ratio, f.classification, f.utilization_delta) == (5.0, "fragmentation", 0)
    # Above 8 with falling utilization but p99 not rising: not pathological.
    t = s.begin_turn(6_000)
    for _ in range(20):
        s.record_span(t.turn, "recall", 6_000, 0)
    g = s.end_turn(t.turn, 12_000, p99_trend=0)
    assert g.ratio == 10.0 and g.utilization_delta < 0
    assert g.classification == "fragmentation"
    clean(ledger, s)


def test_record004_inconsistent_final_prompt_and_wrong_turn(ledger: Ledger) -> None:
    s = ledger.open_session(new_sid(), budget_004())
    t = s.begin_turn(1_000)
    s.record_span(t.turn, "recall", 500)
    before = raw_hash(ledger, s)
    bad: list[tuple[type[Exception], Callable[[], object]]] = [
        (InvalidArgument, lambda: s.end_turn(t.turn, 0)),
        # a turn that is not the open one: another turn's call (docs/agent.md#turn-leases)
        (TurnLost, lambda: s.end_turn(t.turn + 1, 1_000)),
        (TurnLost, lambda: s.end_turn(t.turn - 1, 1_000)),
        (TurnLost, lambda: s.record_span(t.turn + 1, "recall", 500)),
        (TurnLost, lambda: s.record_span(t.turn - 1, "recall", 500)),
    ]
    for kind, call in bad:
        with pytest.raises(kind):
            call()
        assert raw_hash(ledger, s) == before
    # The window itself is a consistent final prompt.
    assert s.end_turn(t.turn, WINDOW_004).utilization == 1.0
    # A prompt larger than the window ends the turn, flagged loudly (drift detection).
    t = s.begin_turn(1_000)
    with pytest.warns(ContextDriftWarning, match="larger than the window") as caught:
        s.end_turn(t.turn, WINDOW_004 + 1)
    assert caught[0].message.report.flag == "over_window"  # type: ignore[union-attr]
    assert s.snapshot().drift_flagged and not s.audit().clean
