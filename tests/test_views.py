"""The operator views' batched reads (`ledger top`, `ledger audit`) on every backend."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

from ledger import Item, Ledger, SessionBudget, views
from ledger.errors import AdmissionRefused, UnknownSession


def _fleet(ledger: Ledger) -> None:
    budget = SessionBudget(window=1_000, system_prompt=100)
    for sid, tokens in (("low", 0), ("high", 600), ("mid", 300), ("gone", 800)):
        s = ledger.open_session(sid, budget)
        if tokens:
            s.admit("retrieval", [Item("a", tokens)])
        if sid == "mid":
            with pytest.raises(AdmissionRefused):  # counted in x:refused
                s.reserve("scratchpad", "r1", 10_000)
    ledger.session("gone").delete()


def test_busiest_ranks_by_utilization_and_sums_indicators(ledger: Ledger) -> None:
    _fleet(ledger)
    rows, totals = views.busiest(ledger, limit=2)
    assert [sid for sid, _ in rows] == ["high", "mid"]
    assert rows[0][1].utilization == 0.7 and rows[1][1].utilization == 0.4
    assert totals["refused"] == 1
    everyone = [sid for sid, _ in views.busiest(ledger, limit=10)[0]]
    assert everyone == ["high", "mid", "low"]  # the closed one left out


def test_audits_in_batches_report_every_session(ledger: Ledger) -> None:
    budget = SessionBudget(window=1_000, system_prompt=100)
    ids = [f"a{i:03d}" for i in range(views.BATCH + 5)]
    for sid in ids:
        ledger.open_session(sid, budget)
    ledger.session(ids[3]).delete()
    if not isinstance(ledger.client, RedisCluster):
        ledger.client.script_flush()  # the batch loads its script again
    got = dict(views.audits(ledger, views.listed(ledger)))
    assert set(got) == set(ids)
    assert isinstance(got[ids[3]], UnknownSession)  # a tombstone: listed, refused
    assert all(not isinstance(r, UnknownSession) and r.clean for k, r in got.items() if k != ids[3])
