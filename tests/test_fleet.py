"""The fleet simulator (ledger demo) at a small size: each record's failure shows under
the naive arbiter and not under the ledger, with 0 over-allocations and clean audits."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from ledger.fleet.run import FleetConfig, FleetReport, run
from tests.conftest import make_settings
from tests.servers import RedisProcess


@pytest.fixture(autouse=True)
def _quiet_worker() -> None:
    logging.getLogger("ledger.worker").setLevel(logging.ERROR)


def small(settings: LedgerSettings) -> FleetReport:
    return run(settings, FleetConfig(sessions=6, workers=2, max_turns=70, seed=1))


def check_headlines(r: FleetReport) -> None:
    n, lg = r.naive.counts, r.ledger.counts
    # Record 002: the naive arbiter truncates tool results, damages the system prompt
    # and over-allocates; the ledger admits whole or spills, and never over-allocates.
    assert n.get("truncated_tool_results", 0) > 0
    assert n.get("system_prompt_damage", 0) > 0
    assert n.get("over_allocations", 0) > 0
    assert lg.get("tool_truncated", 0) == 0
    assert lg.get("system_prompt_damage", 0) == 0
    assert lg.get("tool_spilled", 0) > 0
    assert r.over_allocations == 0
    # Record 001: the naive arbiter's failed compactions go unnoticed; the ledger counts
    # its own and compacts less often.
    assert n.get("failed_compactions", 0) > 0
    assert lg["compactions"] > 0
    assert lg["compactions"] < n["compactions"]
    # Record 000: the ledger detects starvation and reclaims instead of running silently.
    detected = sum(v for k, v in lg.items() if k.startswith("starvation_"))
    assert detected > 0 and lg.get("reclaimed_items", 0) > 0
    # Record 004: every turn is classified; the fan-out guard exists.
    assert sum(r.ledger.classes.values()) == r.ledger.turns
    # Retries with the same op id got their first outcome back.
    assert lg.get("retries_replayed", 0) > 0
    assert r.audits_clean == r.audits_total == 6


@pytest.mark.embedded
@pytest.mark.slow
def test_fleet_headlines_on_embedded() -> None:
    check_headlines(small(make_settings(f"embedded://{uuid.uuid4().hex}", partitions=4)))


@pytest.mark.redis
@pytest.mark.slow
def test_fleet_headlines_on_real_redis_with_worker_processes(redis_server: RedisProcess) -> None:
    check_headlines(small(make_settings(redis_server.url, partitions=4)))


@pytest.mark.redis
@pytest.mark.slow
def test_demo_json(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"f{uuid.uuid4().hex[:8]}"
    code = cli.main(
        [
            "--url",
            redis_server.url,
            "--prefix",
            prefix,
            "demo",
            "--sessions",
            "3",
            "--workers",
            "2",
            "--max-turns",
            "30",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK
    assert data["over_allocations"] == 0
    assert data["audits_clean"] == data["audits_total"] == 3
    assert set(data["ledger"]["retrieval_admission"]) == {"10"}  # no session reached 60


@pytest.mark.redis
def test_inspect_and_top(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"i{uuid.uuid4().hex[:8]}"
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        s = led.open_session("tenant-a/s-1", SessionBudget(window=8_000, system_prompt=500))
        t = s.begin_turn(1_000)
        s.admit("retrieval", [Item("doc7#3", 410)])
        s.reserve("scratchpad", "call-1", 300)
        s.end_turn(t.turn, 1_210)
        led.open_session("tenant-a/s-2", SessionBudget(window=8_000, system_prompt=500))
    base = ["--url", redis_server.url, "--prefix", prefix]
    assert cli.main([*base, "inspect", "tenant-a/s-1"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "doc7#3" in out and "call-1" in out and "regime ok" in out
    assert "status=ok|charged=410" in out  # the journal shows the admit's outcome
    assert cli.main([*base, "top", "--once"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "tenant-a/s-1" in out and "tenant-a/s-2" in out
    assert cli.main([*base, "inspect", "nope"]) == cli.EXIT_VIOLATION
    assert "does not exist" in capsys.readouterr().err
