"""The Redis settings the ledger needs (ledger/health.py), as the worker and
``ledger audit`` report them: maxmemory-policy noeviction, persistence on, no evicted
keys. Judged from what each server says (pure), then asked of real servers started
with each setting, of every primary of a cluster, and through a user whose ACL or a
disabled CONFIG hides them."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable, Iterator

import pytest

from ledger import Ledger, LedgerSettings, cli, health
from tests.support import jobs, servers

NOEVICTION = {"maxmemory_policy": "noeviction"}
AOF_ON, AOF_OFF = {"aof_enabled": 1}, {"aof_enabled": 0}
NO_EVICTIONS = {"evicted_keys": 0}


# --- pure -------------------------------------------------------------------------------


def test_assess_good_settings() -> None:
    for persistence, save in ((AOF_ON, None), (AOF_OFF, "3600 1 300 100")):
        got = health.assess("s", NOEVICTION, persistence, NO_EVICTIONS, save)
        assert got.ok and got.problems == () and got.unknown == (), got


def test_assess_each_problem() -> None:
    got = health.assess("s", {"maxmemory_policy": "allkeys-lru"}, AOF_OFF, {"evicted_keys": 7}, "")
    assert len(got.problems) == 3 and not got.unknown
    policy, persistence, evicted = got.problems
    assert "maxmemory-policy is allkeys-lru" in policy and "noeviction" in policy
    assert "persistence is off" in persistence and "appendonly yes" in persistence
    assert evicted.startswith("7 keys evicted")
    assert (got.policy, got.aof, got.save, got.evicted_keys) == ("allkeys-lru", False, "", 7)


def test_assess_what_cannot_be_read_is_unknown() -> None:
    why = {"memory": "NoPermissionError: no permissions", "save": "ResponseError: unknown command"}
    got = health.assess("s", None, AOF_OFF, NO_EVICTIONS, None, why)
    assert got.problems == () and not got.ok
    policy, persistence = got.unknown
    assert "maxmemory-policy unknown" in policy and "no permissions" in policy
    assert "persistence unknown" in persistence and "unknown command" in persistence
    # AOF on needs no CONFIG
    assert health.assess("s", NOEVICTION, AOF_ON, NO_EVICTIONS, None).ok


def test_report_gauge() -> None:
    good = health.assess("a", NOEVICTION, AOF_ON, NO_EVICTIONS, None)
    bad = health.assess("b", NOEVICTION, AOF_OFF, NO_EVICTIONS, "")
    unknown = health.assess("c", None, AOF_ON, NO_EVICTIONS, None)
    assert health.HealthReport((good,)).gauge == 1
    assert health.HealthReport((good, bad, unknown)).gauge == 0
    assert health.HealthReport((good, unknown)).gauge == -1
    report = health.HealthReport((good, bad))
    assert report.problems == [f"b: {bad.problems[0]}"]
    assert health.describe(report) == [f"Redis b: {bad.problems[0]}"]
    assert health.describe(health.HealthReport((), embedded=True)) == []


# --- real servers -------------------------------------------------------------------------


Start = Callable[..., servers.RedisProcess]


@pytest.fixture
def start() -> Iterator[Start]:
    """Starts a redis-server with the given extra arguments (stopped at teardown)."""
    with contextlib.ExitStack() as stack:
        yield lambda *extra: stack.enter_context(servers.standalone(*extra))


def check_url(url: str) -> health.HealthReport:
    with Ledger.from_settings(LedgerSettings(redis_url=url)) as led:
        return health.check(led.client, url)


@pytest.mark.redis
def test_real_servers(start: Start) -> None:
    aof = start("--appendonly", "yes")
    rdb = start("--save", "60 1")
    off = start()  # the tests' default: no AOF, no RDB save policy
    lru = start("--appendonly", "yes", "--maxmemory-policy", "allkeys-lru")
    assert check_url(aof.url).gauge == 1
    assert check_url(rdb.url).gauge == 1
    [s] = check_url(off.url).servers
    assert s.server == f"127.0.0.1:{off.port}"
    assert len(s.problems) == 1 and "persistence is off" in s.problems[0]
    [s] = check_url(lru.url).servers
    assert len(s.problems) == 1 and "maxmemory-policy is allkeys-lru" in s.problems[0]


@pytest.mark.redis
def test_evicted_keys_are_reported(start: Start) -> None:
    srv = start("--appendonly", "yes", "--maxmemory-policy", "allkeys-lru", "--maxmemory", "3mb")
    r = srv.client()
    pipe = r.pipeline(transaction=False)
    for i in range(400):
        pipe.set(f"filler:{i}", b"x" * 20_000)
    pipe.execute()
    evicted = int(r.info("stats")["evicted_keys"])
    r.close()
    assert evicted > 0
    [s] = check_url(srv.url).servers
    assert s.evicted_keys >= evicted  # Redis may evict more in between
    assert any(p.startswith(f"{s.evicted_keys} keys evicted") for p in s.problems), s.problems


@pytest.mark.redis
def test_config_disabled_and_info_refused_say_unknown(start: Start) -> None:
    managed = start("--rename-command", "CONFIG", '""')  # as managed Redis often does
    [s] = check_url(managed.url).servers
    assert s.problems == () and s.policy == "noeviction"
    [u] = s.unknown
    assert "persistence unknown" in u and "CONFIG GET save" in u

    admin = managed.client()
    admin.execute_command("ACL", "SETUSER", "noinfo", "reset", "on", ">pw", "~*", "+@all", "-info")
    admin.close()
    [s] = check_url(f"redis://noinfo:pw@127.0.0.1:{managed.port}/0").servers
    assert len(s.unknown) == 3 and all("refused" in u or "CONFIG" in u for u in s.unknown)
    assert health.HealthReport((s,)).gauge == -1


@pytest.mark.cluster
def test_every_primary_of_a_cluster(redis_cluster: list[servers.RedisProcess]) -> None:
    report = check_url(f"redis+cluster://127.0.0.1:{redis_cluster[0].port}")
    assert sorted(s.server for s in report.servers) == sorted(
        f"127.0.0.1:{n.port}" for n in redis_cluster
    )
    for s in report.servers:
        assert len(s.problems) == 1 and "persistence is off" in s.problems[0], s
    assert report.gauge == 0


@pytest.mark.embedded
def test_embedded_checks_nothing() -> None:
    report = check_url(f"embedded://{uuid.uuid4().hex}")
    assert report.embedded and report.servers == () and report.gauge == 1


# --- where it is reported ------------------------------------------------------------------


@pytest.mark.redis
def test_audit_prints_the_warnings(start: Start, capsys: pytest.CaptureFixture[str]) -> None:
    lru = start("--maxmemory-policy", "allkeys-lru")
    prefix = f"h{uuid.uuid4().hex[:8]}"
    with Ledger.from_settings(LedgerSettings(redis_url=lru.url, prefix=prefix)) as led:
        led.open_session("s-1", jobs.BUDGET)
    code = cli.main(["--url", lru.url, "--prefix", prefix, "audit"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_OK  # a warning, not a violation
    assert "1 session(s) audited: 1 clean, 0 with violations, 2 Redis setting warning(s)" in out
    assert cli.main(["--url", lru.url, "--prefix", prefix, "audit", "--strict"]) == 1
    capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 2, out
    assert "maxmemory-policy is allkeys-lru" in lines[0] and f":{lru.port}" in lines[0]
    assert "persistence is off" in lines[1]

    good = start("--appendonly", "yes")
    assert cli.main(["--url", good.url, "--prefix", prefix, "audit"]) == cli.EXIT_OK
    assert "warning" not in capsys.readouterr().out


@pytest.mark.redis
def test_worker_warns_and_sets_the_gauge(start: Start, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ledger.worker")
    for extra, gauge in (
        (("--maxmemory-policy", "volatile-lru", "--appendonly", "yes"), 0),
        (("--appendonly", "yes"), 1),
    ):
        srv = start(*extra)
        caplog.clear()
        settings = LedgerSettings(redis_url=srv.url, prefix="hw", partitions=2)
        with Ledger.from_settings(settings) as led:
            worker = jobs.new_worker(led)
            with jobs.LoopThread(worker) as loop:
                jobs.wait_until(
                    lambda w=worker: (
                        w.metrics.registry.get_sample_value("ledger_redis_config_ok") is not None
                        and any(r.getMessage() == "worker started" for r in caplog.records)
                    ),
                    10,
                    "the check at start",
                )
                assert loop.alive
        assert jobs.metric(worker, "ledger_redis_config_ok") == gauge
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if gauge == 0:
            assert len(warned) == 1 and "maxmemory-policy is volatile-lru" in warned[0]
            assert "docs/operations.md" in warned[0]
        else:
            assert warned == []
