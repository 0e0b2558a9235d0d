"""Budget scopes where operators look (docs/ceilings.md#seen-where-operators-look): the
worker's scope metrics (bounded by LEDGER_WORKER_SCOPE_METRICS_MAX), `ledger inspect
--tenant`, `ledger top --tenant`, and the dead-letter flag of `ledger top`; on a real
redis-server (and a real `ledger worker` process for the metrics it serves)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ledger import (
    CallCost,
    CeilingReached,
    Consumer,
    Ledger,
    LedgerSettings,
    Price,
    ScopeBudget,
    SessionBudget,
    Usage,
    cli,
)
from ledger.scope_reads import scope_names
from ledger.testing import free_port, spawn_worker
from ledger.views import tenant_view
from tests.support import servers
from tests.support.jobs import new_worker

pytestmark = pytest.mark.redis

W = Consumer.WORKING_MEMORY
DAY = 86_400_000
BUDGET = SessionBudget(window=200_000, system_prompt=1_000)
PRICE = {"m": Price(input=100, output=400)}  # cents per million tokens


@pytest.fixture
def led(redis_server: servers.RedisProcess) -> Iterator[Ledger]:
    settings = LedgerSettings(redis_url=redis_server.url, prefix=f"so{uuid.uuid4().hex[:10]}")
    with Ledger.from_settings(settings) as ledger:
        yield ledger


def tenant(name: str = "acme") -> str:
    return f"{name}{uuid.uuid4().hex[:6]}"


def refuse(led: Ledger, sid: str, output: int, scopes: tuple[str, ...] = ()) -> None:
    s = led.session(sid)
    with pytest.raises(CeilingReached):
        s.reserve(
            W,
            f"r-{uuid.uuid4().hex[:6]}",
            1,
            cost=CallCost(model="m", input=0, output=output, scopes=scopes),
        )


def spend(led: Ledger) -> tuple[str, str]:
    """Two tenants: a (tokens and money, a key within it) and b (input only). a's
    window: 3,000 input + 700 output billed, one hold of 500 input open; 2 refusals of a,
    1 of its key; b: one refusal."""
    a, b = tenant(), tenant("beta")
    led.set_scope(a, ScopeBudget(window_ms=DAY, tokens=10_000, cents=5, prices=PRICE))
    led.set_scope(f"{a}/key-7", ScopeBudget(window_ms=DAY, output=2_000))
    led.set_scope(b, ScopeBudget(window_ms=DAY, input=1_000))
    s = led.open_session(f"@{a}/chat-1", BUDGET)
    r = s.reserve(
        W, "c1", 10, cost=CallCost(model="m", input=3_000, output=1_000, scopes=(f"{a}/key-7",))
    )
    s.settle("c1", 10, billed=Usage(input=3_000, output=700), scopes=r.scopes)
    s.reserve(W, "c2", 10, cost=CallCost(model="m", input=500, output=0))
    refuse(led, f"@{a}/chat-1", 50_000)
    refuse(led, f"@{a}/chat-1", 9_000)
    refuse(led, f"@{a}/chat-1", 1_500, (f"{a}/key-7",))  # the key's output ceiling
    led.open_session(f"@{b}/x", BUDGET)
    with pytest.raises(CeilingReached):
        led.session(f"@{b}/x").reserve(W, "big", 1, cost=CallCost(model="m", input=2_000, output=0))
    return a, b


def test_scopes_are_found_by_a_scan_of_their_key_prefix_only(led: Ledger) -> None:
    a, b = spend(led)
    led.open_session(f"@{a}/chat-2", BUDGET)  # sessions of the tenant: not scopes
    assert scope_names(led) == sorted([a, f"{a}/key-7", b])
    assert scope_names(led, a) == [a, f"{a}/key-7"]
    assert led.keyspace.scope_pattern(a).endswith(f":t:{a}*")


def test_the_worker_exports_each_scopes_remaining_ceiling_and_refusals(led: Ledger) -> None:
    a, b = spend(led)
    w = new_worker(led, "none", scope_metrics_max=100)
    w.observe()
    reg = w.metrics.registry

    def got(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    assert got("ledger_scope_remaining", scope=a, quantity="tokens") == 10_000 - 3_700 - 500
    assert got("ledger_scope_ceiling", scope=a, quantity="tokens") == 10_000
    # money: 3,000 x 100 + 700 x 400 billed, 500 x 100 held: micro-cents, exported in cents
    assert got("ledger_scope_remaining", scope=a, quantity="cents") == pytest.approx(
        5 - (300_000 + 280_000 + 50_000) / 1e6
    )
    assert got("ledger_scope_ceiling", scope=a, quantity="cents") == 5
    assert got("ledger_scope_remaining", scope=f"{a}/key-7", quantity="output") == 2_000 - 700
    assert got("ledger_scope_remaining", scope=a, quantity="output") is None  # no ceiling set
    assert got("ledger_scope_refused_total", scope=a) == 2
    assert got("ledger_scope_refused_total", scope=f"{a}/key-7") == 1
    assert got("ledger_scope_refused_total", scope=b) == 1
    assert got("ledger_scopes", state="exported") == 3
    assert got("ledger_scopes", state="folded") == 0
    assert got("ledger_scope_refused_total", scope="other") is None
    # a second worker does not hold the observer lease: no scope sample at all
    other = new_worker(led, "none")
    other.observe()
    assert other.metrics.registry.get_sample_value("ledger_scopes", {"state": "exported"}) is None


def test_scopes_past_the_limit_are_folded_into_other(led: Ledger) -> None:
    """With a limit of 2 the tenants come first (a and b, by name), and the key's
    refusal is summed under scope="other"; its remaining is not exported at all."""
    a, b = spend(led)
    w = new_worker(led, "none", scope_metrics_max=2)
    w.observe()
    reg = w.metrics.registry
    names = {s.labels["scope"] for m in reg.collect() for s in m.samples if "scope" in s.labels}
    assert names == {a, b, "other"}
    assert reg.get_sample_value("ledger_scope_refused_total", {"scope": "other"}) == 1
    assert reg.get_sample_value("ledger_scopes", {"state": "folded"}) == 1
    series = [s for m in reg.collect() for s in m.samples if s.name.startswith("ledger_scope")]
    assert len(series) <= 2 * 2 * 5 + 3 + 2  # remaining, ceiling: 5 quantities at most each
    off = new_worker(led, "none", scope_metrics_max=0)
    led.client.delete(led.keyspace.observer())
    off.observe()
    assert not [s for m in off.metrics.registry.collect() for s in m.samples if "scope" in s.labels]


def test_new_scopes_are_found_at_the_next_search_not_every_pass(led: Ledger) -> None:
    spend(led)
    w = new_worker(led, "none", scope_scan_interval=3600)
    w.observe()
    c = tenant("gamma")
    led.set_scope(c, ScopeBudget(window_ms=DAY, tokens=5))
    led.client.config_resetstat()
    w.observe()
    calls = led.client.info("commandstats")
    assert "cmdstat_scan" not in calls  # no search before the interval is over
    assert w.metrics.registry.get_sample_value("ledger_scopes", {"state": "exported"}) == 3
    w.observer.scanned -= 3600
    w.observe()
    assert w.metrics.registry.get_sample_value("ledger_scopes", {"state": "exported"}) == 4
    left = w.metrics.registry.get_sample_value(
        "ledger_scope_remaining", {"scope": c, "quantity": "tokens"}
    )
    assert left == 5


def test_a_metrics_pass_reads_each_exported_scope_once_and_searches_by_interval(
    led: Ledger,
) -> None:
    """What a pass sends, counted by the server (INFO commandstats): the SCAN only when
    the search interval is over; one HGETALL and one ZRANGE per exported scope, one HGET
    per folded one, whatever the number of sessions; nothing per session."""
    spend(led)  # 3 scopes
    for i in range(300):
        led.open_session(f"many-{i}", BUDGET)
    w = new_worker(led, "none", scope_metrics_max=2, scope_scan_interval=3600)
    r = led.client

    def calls() -> dict[str, int]:
        r.config_resetstat()
        w.observe()
        stats = r.info("commandstats")
        names = ("scan", "hgetall", "zrange", "hget", "evalsha", "hmget")
        return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in names}

    first = calls()
    partitions = led.keyspace.partitions  # the indicators' tallies: one HGETALL each
    assert first["scan"] >= 1 and first["hgetall"] == partitions + 2
    assert (first["zrange"], first["hget"], first["evalsha"], first["hmget"]) == (2, 1, 0, 0)
    again = calls()
    assert again == {**first, "scan": 0}  # within the interval: no search


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body: bytes = r.read()
    return body.decode()


def test_a_ledger_worker_process_serves_the_scope_metrics(
    redis_server: servers.RedisProcess, led: Ledger, tmp_path: Path
) -> None:
    """A real `ledger worker` (its own OS process) serves them on /metrics, and a refusal
    made afterwards in this process shows at its next metrics pass."""
    a, _ = spend(led)
    port = free_port()
    env = {
        "LEDGER_REDIS_URL": redis_server.url,
        "LEDGER_PREFIX": led.keyspace.prefix,
        "LEDGER_WORKER_COMPACTOR": "none",
        "LEDGER_WORKER_METRICS_PORT": str(port),
        "LEDGER_WORKER_METRICS_HOST": "127.0.0.1",
        "LEDGER_WORKER_OBSERVE_INTERVAL": "0.2",
        "LEDGER_WORKER_SCOPE_METRICS_MAX": "2",
    }
    proc = spawn_worker("scopes-1", env, tmp_path / "worker.log")
    try:
        proc.wait_started()
        want = f'ledger_scope_refused_total{{scope="{a}"}} 2.0'
        deadline = time.monotonic() + 20
        text = ""
        while time.monotonic() < deadline and want not in text:
            with contextlib.suppress(OSError):
                text = scrape(port)
            time.sleep(0.1)
        assert want in text, text[-2000:]
        assert f'ledger_scope_remaining{{quantity="tokens",scope="{a}"}} 5800.0' in text
        assert 'ledger_scope_refused_total{scope="other"} 1.0' in text
        refuse(led, f"@{a}/chat-1", 50_000)
        want = f'ledger_scope_refused_total{{scope="{a}"}} 3.0'
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and want not in text:
            text = scrape(port)
            time.sleep(0.1)
        assert want in text
    finally:
        assert proc.stop() == 0, proc.tail()


def test_tenant_view_reads_ceilings_holds_and_sessions(led: Ledger) -> None:
    a, _ = spend(led)
    v = tenant_view(led, a)
    assert [u.scope for u in v.scopes] == [a, f"{a}/key-7"]
    acme = v.scopes[0]
    assert acme.ceilings == {"tokens": 10_000, "money": 5_000_000}
    assert acme.held["input"] == 500 and acme.open_holds == 1 and acme.refused == 2
    [hold] = v.holds
    assert (hold.scope, hold.session_id, hold.reservation) == (a, f"@{a}/chat-1", "c2")
    assert hold.held["input"] == 500 and not hold.overdue
    assert v.sessions == [f"@{a}/chat-1"]


def test_ledger_inspect_tenant(
    redis_server: servers.RedisProcess, led: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = spend(led)
    base = ["--url", redis_server.url, "--prefix", led.keyspace.prefix, "inspect"]
    assert cli.main([*base, "--tenant", a, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [s["scope"] for s in got["scopes"]] == [a, f"{a}/key-7"]
    assert got["scopes"][0]["ceilings"] == {"tokens": 10_000, "money": 5_000_000}
    assert got["scopes"][0]["remaining"]["tokens"] == 5_800
    assert got["scopes"][0]["refused"] == 2 and got["scopes"][1]["refused"] == 1
    assert got["holds"][0]["reservation"] == "c2" and got["sessions"] == [f"@{a}/chat-1"]
    assert cli.main([*base, "--tenant", a]) == 0
    out = capsys.readouterr().out
    assert "ceiling" in out and "remaining" in out and "5800" in out and "c2" in out
    assert cli.main([*base, "--tenant", "nobody"]) == 1  # no scope set for that tenant
    assert "no budget scope" in capsys.readouterr().err
    assert cli.main(base) == cli.EXIT_USAGE  # neither a session nor a tenant
    assert cli.main([*base, f"@{a}/chat-1", "--tenant", a]) == cli.EXIT_USAGE  # both
    assert "a session id or --tenant" in capsys.readouterr().err


def test_ledger_inspect_tenant_says_which_listed_holds_are_overdue(
    redis_server: servers.RedisProcess, led: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hold past its deadline is still listed (OVERDUE) until the next reserve in its
    scope gives it back, while its scope's line counts it given back already: the tenant's
    line said "1 open holds" above a scope's "open holds 0" without saying why."""
    a = tenant()
    led.set_scope(a, ScopeBudget(window_ms=DAY, tokens=10_000))
    s = led.open_session(f"@{a}/chat-1", BUDGET)
    s.reserve(W, "late", 10, lease_ms=1, cost=CallCost(model="m", input=500, output=0))
    time.sleep(0.05)  # past the hold's deadline on Redis's clock
    base = ["--url", redis_server.url, "--prefix", led.keyspace.prefix, "inspect"]
    assert cli.main([*base, "--tenant", a]) == 0
    out = capsys.readouterr().out
    assert "1 open holds (1 overdue)" in out and "open holds 0" in out and "OVERDUE" in out


def test_ledger_top_tenant_shows_its_scopes_and_only_its_sessions(
    redis_server: servers.RedisProcess,
    led: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, _ = spend(led)
    led.open_session("no-tenant-1", BUDGET)
    monkeypatch.setenv("COLUMNS", "100")
    base = ["--url", redis_server.url, "--prefix", led.keyspace.prefix, "top", "--once"]
    assert cli.main([*base, "--tenant", a]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"1 sessions of tenant {a}" in lines[0]
    assert lines[1] == f"{a}: left money 4.37/5.00 cents, tokens 5800/10000; refused 2; holds 1"
    assert lines[2] == f"{a}/key-7: left output 1300/2000; refused 1; holds 0"
    rows = [ln.split()[0] for ln in lines if ln.split()[1:2] == ["ok"]]
    assert rows == ["chat-1"]  # not b's, not the session without a tenant
    for k in range(4):  # 6 scopes: 4 lines, then how many more
        led.set_scope(f"{a}/user-{k}", ScopeBudget(window_ms=DAY, input=10))
    assert cli.main([*base, "--tenant", a]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"{a}: left") and lines[4].startswith(f"{a}/user-1: left input")
    assert lines[5] == "+2 more scopes: ledger inspect --tenant"
    assert cli.main([*base, "--tenant", f"{a}/key-7"]) == cli.EXIT_USAGE  # not a tenant
    assert "a tenant is a scope without '/'" in capsys.readouterr().err


def test_ledger_top_flags_a_session_whose_compaction_was_dead_lettered(
    led: Ledger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A compactor that always raises, max_deliveries 1: the first dead letter is of the
    session's current epoch (`1!`: its compaction is held by it); once the failures
    escalated to a hard reset (a new epoch) its letters are of an older one (`3`)."""
    from ledger.views import dead_lettered
    from tests.support.jobs import busy, open_compaction

    open_compaction(led, "held-1")
    led.open_session("calm-1", BUDGET)
    w = new_worker(led, "tests.support.worker_scenarios:always_fails", max_deliveries=1)
    w.ensure_groups()
    deadline = time.monotonic() + 20
    while not dead_lettered(led) and time.monotonic() < deadline:
        w.poll_once() or time.sleep(0.02)
    monkeypatch.setenv("COLUMNS", "100")
    base = ["--url", led.settings.redis_url, "--prefix", led.keyspace.prefix, "top", "--once"]

    def rows() -> tuple[dict[str, list[str]], str]:
        assert cli.main(base) == 0
        out = capsys.readouterr().out
        return {ln.split()[0]: ln.split() for ln in out.splitlines() if "-1 " in ln}, out

    got, out = rows()
    epoch = led.session("held-1").snapshot().epoch
    assert got["held-1"][-1] == "1!" and got["calm-1"][-1] == "-", out
    assert "dead: letters, ! of its epoch" in out
    while busy(led) and time.monotonic() < deadline + 20:
        w.poll_once() or time.sleep(0.02)
    assert led.session("held-1").snapshot().epoch != epoch  # the hard reset
    got, out = rows()
    assert got["held-1"][-1] == "3", out


def _pane(name: str) -> list[str]:
    got = subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True, check=True
    )
    return got.stdout.splitlines()


@pytest.mark.timeout(120)
def test_top_tenant_live_in_tmux_at_80x24(led: Ledger) -> None:
    """`ledger top --tenant`, live, in a real terminal (tmux, 80x24): the tenant's scope
    lines under the header, its 40 sessions' rows (ids sharing the tenant's prefix stay
    distinct, numbers whole), one of them flagged dead-lettered, all in 80x24; a refusal
    made while it runs shows at a later refresh; q quits."""
    from ledger import schema

    assert shutil.which("tmux"), "tmux is needed (apt-get install tmux; .ci/run installs it)"
    a, _ = spend(led)
    ids = [f"@{a}/agent-{i:03d}-of-the-fleet" for i in range(40)]
    for sid in ids:
        led.open_session(sid, BUDGET)
    snap = led.session(ids[5]).snapshot()
    p = led.keyspace.partition_of(ids[5])
    entry = schema.DeadLetterEntry(
        {"kind": "compact", "session": ids[5], "epoch": str(snap.epoch)}, "1-0", "why", "boom"
    )
    led.client.xadd(led.keyspace.dead_letters(p), entry.to_fields())  # as the worker writes it
    name = f"top-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "ledger.cli", "--url", led.settings.redis_url]
    argv += ["--prefix", led.keyspace.prefix, "top", "--tenant", a, "--interval", "0.3"]
    cmd = shlex.join(["env", "-u", "LINES", "-u", "COLUMNS", *argv, "--sort", "turn"])
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd], check=True
    )

    def settled(want: str) -> list[str]:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = _pane(name)
            if any("q quits" in ln for ln in lines) and any(want in ln for ln in lines):
                break
            time.sleep(0.2)
        return lines

    try:
        lines = settled(f"{a}: left")
        text = "\n".join(lines)
        assert "q quits" in text, text
        assert len(lines) <= 24 and max(len(ln) for ln in lines) <= 80, text
        assert f"41 sessions of tenant {a}" in lines[0], text  # 40 and chat-1
        assert lines[1].startswith(f"{a}: left money 4.37/5.00 cents, tokens 5800/10000;"), text
        assert lines[2].startswith(f"{a}/key-7: left output 1300/2000; refused 1"), text
        rows = [ln.split() for ln in lines if ln.split()[1:2] == ["ok"]]
        assert len(rows) >= 10 and all(re.search(r"0\d\d", r[0]) for r in rows), text
        assert len({r[0] for r in rows}) == len(rows), rows  # distinct ids
        for r in rows:  # regime, then whole numbers and the dead flag
            assert all(re.fullmatch(r"[+-]?\d+(\.\d+)?!?|-|\d+[smhd]", c) for c in r[2:]), r
        flagged = [r for r in rows if r[-1] == "1!"]
        assert len(flagged) == 1 and "005" in flagged[0][0], rows
        refuse(led, f"@{a}/chat-1", 50_000)
        lines = settled("refused 3")
        assert any(ln.startswith(f"{a}: left") and "refused 3" in ln for ln in lines), lines
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run(["tmux", "has-session", "-t", name], capture_output=True)
            if alive.returncode != 0:
                break
            time.sleep(0.2)
        assert alive.returncode != 0, "q did not quit"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


@pytest.mark.cluster
def test_on_a_redis_cluster_scopes_are_found_on_every_primary(
    redis_cluster: list[servers.RedisProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    """On a real Redis Cluster (3 primaries) the scopes of tenants in different slots are
    found (a SCAN on every primary), read (each scope's keys on its own primary), exported
    by a metrics pass, and shown by `ledger inspect --tenant`."""
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    settings = LedgerSettings(redis_url=url, prefix=f"so{uuid.uuid4().hex[:10]}")
    with Ledger.from_settings(settings) as led:
        tenants = [tenant(f"t{k}x") for k in range(6)]
        for t in tenants:
            led.set_scope(t, ScopeBudget(window_ms=DAY, tokens=1_000))
            s = led.open_session(f"@{t}/s", BUDGET)
            s.reserve(W, "r", 1, cost=CallCost(model="m", input=100, output=0))
            refuse(led, f"@{t}/s", 5_000)
        slots = {led.client.keyslot(led.keyspace.scope(t).hash) for t in tenants}
        nodes = {led.client.get_node_from_key(led.keyspace.scope(t).hash).name for t in tenants}
        assert len(nodes) >= 2, (slots, nodes)  # the test means something: several primaries
        assert scope_names(led) == sorted(tenants)
        w = new_worker(led, "none", scope_metrics_max=4)
        w.observe()
        reg = w.metrics.registry
        for t in sorted(tenants)[:4]:
            assert (
                reg.get_sample_value("ledger_scope_remaining", {"scope": t, "quantity": "tokens"})
                == 900
            )
        assert reg.get_sample_value("ledger_scope_refused_total", {"scope": "other"}) == 2
        assert tenant_view(led, tenants[0]).holds[0].reservation == "r"
    argv = ["--url", url, "--prefix", settings.prefix, "inspect", "--tenant", tenants[1], "--json"]
    assert cli.main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["scopes"][0]["remaining"] == {"tokens": 900} and got["sessions"] == [
        f"@{tenants[1]}/s"
    ]


def test_a_damaged_scope_is_left_out_and_logged_the_others_exported(
    led: Ledger, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A scope hash written by hand (a counter that holds no number) does not stop the
    metrics pass: the others are exported, it is named in one warning line."""
    a, b = spend(led)
    led.client.hset(led.keyspace.scope(b).hash, "cf", "soon")
    w = new_worker(led, "none")
    with caplog.at_level("WARNING", logger="ledger.worker"):
        w.observe()
        w.observe()
    reg = w.metrics.registry
    assert reg.get_sample_value("ledger_scope_refused_total", {"scope": a}) == 2
    assert reg.get_sample_value("ledger_scope_refused_total", {"scope": b}) is None
    warned = [r for r in caplog.records if r.getMessage().startswith("budget scopes not")]
    assert len(warned) == 1 and b in warned[0].damaged  # type: ignore[attr-defined]
    argv = ["--url", led.settings.redis_url, "--prefix", led.keyspace.prefix, "inspect"]
    assert cli.main([*argv, "--tenant", b]) == 1
    assert f"scope {b}: damaged" in capsys.readouterr().err
