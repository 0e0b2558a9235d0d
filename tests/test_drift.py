"""Drift detection and reconcile at the script level, on every backend: end_turn stores
the real prompt minus occupancy and flags it; snapshot, audit, inspect, top and the
worker's metrics show it; reconcile sets consumers' items to what the prompt holds."""

from __future__ import annotations

import uuid
import warnings

import pytest

from ledger import (
    AdmissionRefused,
    Consumer,
    ContextDriftWarning,
    InvalidArgument,
    Item,
    Ledger,
    SessionBudget,
    cli,
)
from ledger.views import busiest
from ledger.workers.runner import Metrics, Worker, WorkerSettings
from tests.conftest import make_settings
from tests.support import servers

B = SessionBudget(
    window=10_000,
    system_prompt=500,
    output_reserve=1_000,
    working_memory_floor=1_000,
    tool_framing=100,
    framing_tolerance=20,
)


def sid() -> str:
    return f"d-{uuid.uuid4().hex[:10]}"


def allocations(led: Ledger, s_id: str) -> dict[bytes, bytes]:
    h = led.client.hgetall(led.keyspace.session(s_id).session)
    return {k: v for k, v in h.items() if k[:2] not in (b"x:", b"gz", b"xp")}


def test_end_turn_stores_drift_within_and_beyond_tolerance(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B)
    s.admit("retrieval", [Item("a", 1_000), Item("b", 400)])
    occ = 500 + 100 + 1_400
    t = s.begin_turn(0)
    r = s.end_turn(t.turn, occ + 20)  # within the tolerance: stored, not flagged
    assert (r.occupancy, r.drift, r.tolerance, r.flag) == (occ, 20, 20, "none")
    snap = s.snapshot()
    assert (snap.last_prompt, snap.drift, snap.drift_flagged) == (occ + 20, 20, False)
    assert s.audit().clean
    t = s.begin_turn(0)
    with pytest.warns(ContextDriftWarning, match=r"by -21 tokens"):
        r = s.end_turn(t.turn, occ - 21)
    assert r.flag == "drift" and s.snapshot().drift_flagged
    report = s.audit()
    assert not report.clean and any("drift" in p for p in report.problems)
    # The next end_turn within the tolerance clears the flag.
    t = s.begin_turn(0)
    assert s.end_turn(t.turn, occ).flag == "none" and s.audit().clean


def test_no_tolerance_judges_no_drift_but_the_window(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B.model_copy(update={"framing_tolerance": None}))
    t = s.begin_turn(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = s.end_turn(t.turn, 9_000)
    assert r.flag == "none" and r.tolerance is None and r.drift == 9_000 - 600
    t = s.begin_turn(0)
    with pytest.warns(ContextDriftWarning, match="larger than the window"):
        assert s.end_turn(t.turn, 10_001).flag == "over_window"


def test_reconcile_sets_named_consumers_exactly(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B)
    s.admit("retrieval", [Item("keep", 300), Item("resize", 200), Item("gone", 100)])
    s.admit("recall", [Item("m1", 50)])
    s.admit("working_memory", [Item("t1", 400)])
    s.reserve("scratchpad", "res", 250, lease_ms=600_000)
    done = s.reconcile(
        {
            "retrieval": [Item("keep", 300), Item("resize", 260, 5), Item("new", 90)],
            Consumer.RECALL: [],
        }
    )
    assert (done.added, done.resized, done.kept) == (1, 1, 1)
    assert set(done.removed) == {(Consumer.RETRIEVAL, "gone"), (Consumer.RECALL, "m1")}
    assert done.delta == (300 + 260 + 90) - (300 + 200 + 100 + 50)
    held = {(i.consumer, i.id): (i.tokens, i.priority) for i in ledger.items(s.id)}
    assert held == {
        (Consumer.RETRIEVAL, "keep"): (300, 0),
        (Consumer.RETRIEVAL, "resize"): (260, 5),
        (Consumer.RETRIEVAL, "new"): (90, 0),
        (Consumer.WORKING_MEMORY, "t1"): (400, 0),  # not named: untouched
    }
    snap = s.snapshot()
    assert snap.reserved[Consumer.SCRATCHPAD] == 250 and snap.open_reservations == 1
    assert s.audit().clean


def test_reconcile_that_does_not_fit_changes_no_allocation(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B)
    s.admit("retrieval", [Item("a", 1_000)])
    before = allocations(ledger, s.id)
    with pytest.raises(AdmissionRefused) as caught:
        s.reconcile({"retrieval": [Item("a", 1_000), Item("huge", 9_000)]})
    assert caught.value.reason == "token_budget_exhausted"
    assert allocations(ledger, s.id) == before and s.audit().clean


def test_reconcile_is_idempotent_per_op_id_and_clears_the_flag(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B)
    t = s.begin_turn(0)
    with pytest.warns(ContextDriftWarning):
        s.end_turn(t.turn, 3_000)  # 2,400 tokens the ledger does not hold
    first = s.reconcile({"working_memory": [Item("behind", 2_400)]}, op_id="rec-1")
    again = s.reconcile({"working_memory": [Item("behind", 2_400)]}, op_id="rec-1")
    assert first == again and first.added == 1
    assert s.snapshot().occupancy == 3_000 and s.audit().clean
    with pytest.raises(Exception, match="already used"):
        s.reconcile({"working_memory": []}, op_id="rec-1")
    with pytest.raises(InvalidArgument):
        s.reconcile({"retrieval": [Item("x", 1), Item("x", 2)]})


@pytest.mark.redis
def test_inspect_top_and_worker_metrics_show_drift(
    redis_server: servers.RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = Ledger.from_settings(make_settings(redis_server.url))
    s = ledger.open_session(sid(), B)
    t = s.begin_turn(0)
    with pytest.warns(ContextDriftWarning):
        s.end_turn(t.turn, 4_000)
    base = ["--url", ledger.settings.redis_url, "--prefix", ledger.settings.prefix]
    assert cli.main([*base, "inspect", s.id]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "drift +3400" in out and "DRIFT FLAGGED" in out
    assert cli.main([*base, "top", "--once"]) == 0
    assert "+3400" in capsys.readouterr().out
    rows, totals = busiest(ledger)
    assert totals["drift"] == 1 and rows[0][1].drift == 3_400
    metrics = Metrics()
    worker = Worker(
        ledger, WorkerSettings(compactor="ledger.workers.compactors:simulated"), metrics
    )
    worker.ensure_groups()
    worker.observe()
    # the flagged turn, counted for the fleet from the partition's tally
    got = metrics.registry.get_sample_value("ledger_indicator_total", {"name": "drift"})
    assert got == 1
    ledger.close()


def test_a_session_opened_before_drift_detection_judges_no_drift(ledger: Ledger) -> None:
    s = ledger.open_session(sid(), B)
    ledger.client.hdel(s.keys.session, "dt")  # as a session opened by an older version
    assert s.snapshot().framing_tolerance is None
    t = s.begin_turn(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.end_turn(t.turn, 5_000).flag == "none"
    assert s.audit().clean
