"""The `ledger` command end to end on a real Redis."""

from __future__ import annotations

import uuid

import pytest
import redis

from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from tests.servers import RedisProcess

pytestmark = pytest.mark.redis


@pytest.fixture
def prefix() -> str:
    return f"cli{uuid.uuid4().hex[:10]}"


def test_demo_on_real_redis(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        [
            "--url",
            redis_server.url,
            "--prefix",
            prefix,
            "demo",
            "--sessions",
            "4",
            "--workers",
            "2",
            "--max-turns",
            "25",
        ]
    )
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK
    assert "acceptance" in out and "scenario" in out and "naive arbiter" in out


def test_audit_fails_on_corrupted_counters(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        s = led.open_session("victim", SessionBudget(window=1000, system_prompt=10))
        s.admit("retrieval", [Item("a", 5)])
        led.open_session("healthy", SessionBudget(window=1000, system_prompt=10))
        assert cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"]) == 0
        redis.Redis.from_url(redis_server.url).hset(s.keys.session, "u_r", 6)  # corrupt
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert "u_r is 6, items say 5" in out
    assert "healthy: clean" in out


def test_unavailable_backend_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["--url", "redis://127.0.0.1:1/0", "audit", "x"])
    assert code == cli.EXIT_UNAVAILABLE
    assert "unavailable" in capsys.readouterr().err.lower()


def test_bad_url_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--url", "mongodb://x", "audit"]) == cli.EXIT_USAGE
    assert "unsupported Redis URL scheme" in capsys.readouterr().err


def test_worker_once_releases_expired(redis_server: RedisProcess, prefix: str) -> None:
    import time

    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        s = led.open_session("w", SessionBudget(window=1000, system_prompt=10))
        s.reserve("scratchpad", "r1", 100, lease_ms=20)
        time.sleep(0.1)
        assert (
            cli.main(
                [
                    "--url",
                    redis_server.url,
                    "--prefix",
                    prefix,
                    "worker",
                    "--once",
                    "--compactor",
                    "workers.compactors:simulated",
                ]
            )
            == 0
        )
        snap = s.snapshot()
        assert snap.open_reservations == 0
        assert snap.expirations == 1
        assert led.audit("w").clean
