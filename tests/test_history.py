"""The history checker (tests/history): client processes record every call while faults
are injected, and the checker replays the history against a model of the rules. Short
runs here, several seeds and every fault kind; the long form is run by hand
(``python -m tests.history --seed N --long``, figures in docs/reliability.md).

Each run prints its summary: calls checked (ok, refused, unknown), turns (committed,
rolled back), faults injected, anomalies. The checker is shown to catch a defect planted
in a script's text (in the client processes only)."""

from __future__ import annotations

import pytest

from tests.history.run import FAULTS, Plan, run


def show(capsys: pytest.CaptureFixture[str], label: str, text: str) -> None:
    with capsys.disabled():
        print(f"\nhistory {label}: {text}")


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_a_run_with_every_fault_has_no_anomaly(
    seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run(Plan(seed=seed, seconds=5.0))
    show(capsys, f"seed {seed}", report.summary())
    assert report.anomalies == []
    assert report.calls > 100 and report.committed > 10 and report.summaries > 0
    # every fault kind was injected (the proxy lost at least one reply)
    assert {k for k, v in report.faults.items() if v} == set(FAULTS)


@pytest.mark.cluster
@pytest.mark.slow
def test_a_run_through_a_cluster_failover_has_no_anomaly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """replica_acks=1, the primary of every session's slot killed (-9) mid-run."""
    report = run(Plan(seed=21, seconds=10.0, failover=True))
    show(capsys, "failover seed 21", report.summary())
    assert report.anomalies == []
    assert report.faults.get("failover") == 1 and report.committed > 10


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize(
    ("plant", "found"),
    [
        ("replay", "twice"),  # a call sent again is applied again
        ("overallocate", "overallocated"),  # admission ignores the free room
        ("owner", "two_owners"),  # a lost turn's calls still accepted
    ],
)
def test_the_checker_finds_a_planted_defect(
    plant: str, found: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # no faults but the slow turns whose leases lapse (and, for "replay", the clients'
    # duplicate sends): the defect alone makes the anomalies. No worker: the next
    # begin_turn takes a lapsed turn over, the checker's final sweep ends what is left
    # A small window: the sessions are full within the run, so admissions are refused
    plan = Plan(seed=31, seconds=3.0, faults=(), plant=plant, linger_rate=0.3, worker=False)
    plan.window = 1_200
    report = run(plan)
    show(capsys, f"planted {plant}", report.summary().splitlines()[0])
    assert found in report.kinds(), report.summary()
