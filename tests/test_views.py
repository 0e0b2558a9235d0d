"""The operator views' batched reads (`ledger top`, `ledger audit`) on every backend."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

from ledger import AuditReport, Item, Ledger, SessionBudget, cli, views
from ledger.errors import AdmissionRefused, UnknownSession
from ledger.testing import RedisProcess
from tests.conftest import make_settings


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


def test_stored_outcome_finds_an_op_ids_reply_by_its_key(ledger: Ledger) -> None:
    """The journal keeps SHA-1 keys, not op ids: stored_outcome (``ledger inspect --op``)
    finds an op id's reply in the current generation, with its own epoch after a reset,
    and says when nothing is kept."""
    s = ledger.open_session("ops", SessionBudget(window=1_000, system_prompt=100))
    first = s.admit("retrieval", [Item("a", 10)], op_id="op-first")
    s.reset("test")
    s.refresh()
    with pytest.raises(AdmissionRefused):
        s.admit("retrieval", [Item("b", 5_000)], op_id="op-refused")
    got = views.stored_outcome(ledger, "ops", "op-first")
    assert got is not None and got[0] == "current"
    assert f"|free={first.free}|epoch={first.epoch}|" in got[1]
    refused = views.stored_outcome(ledger, "ops", "op-refused")
    assert refused is not None and "status=refused" in refused[1]
    assert f"epoch={first.epoch + 1}|" in refused[1]
    assert views.stored_outcome(ledger, "ops", "op-never") is None


@pytest.mark.redis
def test_inspect_op_prints_an_op_ids_outcome(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    with Ledger.from_settings(make_settings(redis_server.url)) as ledger:
        s = ledger.open_session("cli-ops", SessionBudget(window=1_000, system_prompt=100))
        s.admit("retrieval", [Item("a", 10)], op_id="op-cli")
        base = ["--url", redis_server.url, "--prefix", ledger.settings.prefix]
    capsys.readouterr()
    args = [*base, "inspect", "cli-ops", "--op", "op-cli", "--op", "op-none"]
    assert cli.main(args) == cli.EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "op op-cli: current generation: status=ok|charged=10|admitted=1|" in out
    assert "op op-none: not kept" in out


@pytest.mark.redis
def test_inspect_flags_a_damaged_session(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A session whose stored state over-allocates is flagged DAMAGED and exits 1; a
    field that holds no number is named (exit 1: the session is damaged, not the
    command line), and no traceback or int() message reaches the operator."""
    with Ledger.from_settings(make_settings(redis_server.url)) as ledger:
        budget = SessionBudget(window=1_000, system_prompt=100)
        for sid in ("dmg-neg", "dmg-nan"):
            ledger.open_session(sid, budget).admit("retrieval", [Item("a", 100)])
        ledger.client.hset(ledger.keyspace.session("dmg-neg").session, "fr", "-4100")
        ledger.client.hset(ledger.keyspace.session("dmg-nan").session, "u_r", "abc")
        base = ["--url", redis_server.url, "--prefix", ledger.settings.prefix]
    capsys.readouterr()
    assert cli.main([*base, "inspect", "dmg-neg"]) == cli.EXIT_VIOLATION
    out = " ".join(capsys.readouterr().out.split())
    assert "DAMAGED: free -4100 below 0" in out
    assert cli.main([*base, "inspect", "dmg-nan"]) == cli.EXIT_VIOLATION
    err = capsys.readouterr().err
    assert "field 'u_r' holds 'abc', not a number" in err
    assert "int()" not in err and "Traceback" not in err


def test_busiest_sets_a_damaged_session_apart(ledger: Ledger) -> None:
    """A field that holds no number (one the rank reads, one only a shown row has):
    the session is ranked nowhere and named in ``damaged``; without that dict its
    DamagedSession is raised (never a ValueError)."""
    from ledger.errors import DamagedSession

    _fleet(ledger)
    ledger.client.hset(ledger.keyspace.session("high").session, "a_rm", "x1")
    ledger.client.hset(ledger.keyspace.session("low").session, "tn", "?")
    zero = ledger.open_session("zero", SessionBudget(window=1_000, system_prompt=100))
    ledger.client.hset(zero.keys.session, "W", 0)  # utilization would divide by 0
    damaged: dict[str, str] = {}
    rows, totals = views.busiest(ledger, limit=10, damaged=damaged)
    assert [sid for sid, _ in rows] == ["mid"] and totals["refused"] == 1
    assert damaged == {
        "high": "field 'a_rm' holds 'x1', not a number",
        "low": "field 'tn' holds '?', not a number",
        "zero": "field 'W' holds 0, not a window",
    }
    with pytest.raises(DamagedSession):
        views.busiest(ledger, limit=10)


def test_audits_name_a_damaged_session_and_judge_the_others(ledger: Ledger) -> None:
    """audit.lua replies status=damaged (never a Lua error) for a hash not as the scripts
    write it; views.audits yields it as Damaged, and every other session its report."""
    budget = SessionBudget(window=1_000, system_prompt=100)
    for sid in ("whole", "no-w", "bad-item"):
        ledger.open_session(sid, budget).admit("retrieval", [Item("a", 10)])
    ledger.client.hdel(ledger.keyspace.session("no-w").session, "W")
    ledger.client.hset(ledger.keyspace.session("bad-item").session, "i:r:a", "ten")
    got = dict(views.audits(ledger, ["whole", "no-w", "bad-item"]))
    assert isinstance(got["whole"], AuditReport) and got["whole"].clean
    assert got["no-w"] == views.Damaged("no-w", ("damaged: field 'W' is missing",))
    bad = got["bad-item"]
    assert isinstance(bad, views.Damaged) and "field 'i:r:a' holds 'ten'" in bad.problems[0]
    # the client's own audit: not clean, the damage named, no error
    report = ledger.audit("no-w")
    assert not report.clean and report.problems == ("damaged: field 'W' is missing",)


def test_a_session_key_that_is_not_a_hash_is_damaged_not_fatal(ledger: Ledger) -> None:
    """A key of a session's name holding a string (WRONGTYPE in its script): audits and
    busiest name it and go on; before, its error ended the whole view."""
    ledger.open_session("fine", SessionBudget(window=1_000, system_prompt=100))
    ledger.client.set(ledger.keyspace.session("str").session, "x")
    got = dict(views.audits(ledger, views.listed(ledger)))
    assert isinstance(got["fine"], AuditReport) and got["fine"].clean
    bad = got["str"]
    assert isinstance(bad, views.Damaged) and "WRONGTYPE" in bad.problems[0], bad
    damaged: dict[str, str] = {}
    rows, _ = views.busiest(ledger, damaged=damaged)
    assert [sid for sid, _ in rows] == ["fine"] and "WRONGTYPE" in damaged["str"]
