"""The `ledger` command end to end on a real Redis."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

import ledger
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
    assert "acceptance" in out and "scenario" in out and "naive arbiter" in out
    # A run this small cannot show the late-turn figures: its checks fail, and the
    # demo says so with its exit code (1), not only in its footer.
    verdict = re.search(r"(\d+)/(\d+) checks pass", out)
    assert verdict is not None and verdict.group(1) != verdict.group(2)
    assert code == cli.EXIT_VIOLATION
    # capsys is no terminal: 80 columns, the narrow layout, no line longer, no number cut
    assert "001 compaction-decay: turns with retrieval in the prompt, turn 10" in out
    assert max(len(line) for line in out.splitlines()) <= 80


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
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "--verbose"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert "retrieval used is 6, items say 5" in out
    assert "healthy: clean" in out
    # by default only what is wrong, then the summary; --json the same as one object
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION and "healthy: clean" not in out
    assert "2 session(s) audited: 1 clean, 1 with violations" in out
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_VIOLATION and not got["ok"]
    assert (got["audited"], got["clean"], list(got["violations"])) == (2, 1, ["victim"])
    assert got["warnings"]  # this test server has no persistence
    # --strict: the Redis settings' warnings fail too
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit", "healthy"]
    assert cli.main(argv) == cli.EXIT_OK
    assert cli.main([*argv, "--strict"]) == cli.EXIT_VIOLATION


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
                    "ledger.workers.compactors:simulated",
                ]
            )
            == 0
        )
        snap = s.snapshot()
        assert snap.open_reservations == 0
        assert snap.expirations == 1
        assert led.audit("w").clean


def _open_many(led: Ledger, ids: list[str]) -> None:
    budget = SessionBudget(window=100_000, system_prompt=10)
    for i in range(0, len(ids), 100):
        led.run_many([led.open_call(sid, budget, None) for sid in ids[i : i + 100]])


def test_audit_in_batches_names_every_session(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ledger import views

    ids = [f"s{i:04d}" for i in range(views.BATCH * 2 + 7)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
        victim = led.session(ids[views.BATCH + 3])
        victim.admit("retrieval", [Item("a", 5)])
        redis.Redis.from_url(redis_server.url).hset(victim.keys.session, "u_r", 6)
        led.session(ids[-1]).delete()  # listed by name below: refused
    code = cli.main(["--url", redis_server.url, "--prefix", prefix, "audit", "-v"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert out.count(": clean") == len(ids) - 2
    assert f"{ids[views.BATCH + 3]}: " in out and "retrieval used is 6, items say 5" in out
    assert f"{len(ids) - 1} session(s) audited: {len(ids) - 2} clean, 1 with violations" in out
    # a missing id asked for by name is named, and the others are still audited
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit", ids[-1], ids[0], "-v"]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == cli.EXIT_VIOLATION
    assert f"{ids[-1]}: no such session" in out and f"{ids[0]}: clean" in out
    assert "1 session(s) audited: 1 clean, 0 with violations, 1 missing" in out


def test_top_fits_80_columns_cuts_ids_never_numbers(
    redis_server: RedisProcess,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    long_id = "agent-fleet-eu-west-1/tenant-4711/run-2026-11-30T23:59:59Z/session-" + "x" * 30
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session(long_id, SessionBudget(window=1_234_567, system_prompt=10))
        s.admit("working_memory", [Item("a", 987_654)])
        s.begin_turn(100)
        snap = s.snapshot()
    assert cli.main(["--url", redis_server.url, "--prefix", prefix, "top", "--once"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" in out and long_id not in out  # the id is cut ...
    row = next(line for line in out.splitlines() if line.lstrip().startswith("agent…"))
    assert row.split()[0].endswith("x" * 8)  # cut in the middle: its end stays
    cells = row.split()
    assert snap.compaction_pending  # above the high-water mark: "*"
    assert str(snap.free) in cells and str(snap.residual_working_memory) in cells
    assert "0.80" in cells and "ok*" in cells  # ... numbers never
    assert "regime" in out and "turn/s" in out and "age" in out


def test_top_rates_between_frames(redis_server: RedisProcess, prefix: str) -> None:
    import io

    from rich.console import Console

    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("r", SessionBudget(window=10_000, system_prompt=10))
        view = cli.TopView(limit=5)

        def render() -> list[str]:
            buf = io.StringIO()
            Console(file=buf, width=80).print(view.frame(led, 80))
            return next(
                ln for ln in buf.getvalue().splitlines() if ln.lstrip().startswith("r ")
            ).split()

        first = render()
        for _ in range(3):
            s.begin_turn(10)
        second = render()
    turn_rate = cli.TopView.COLUMNS.index("turn/s") + 1
    assert first[turn_rate] == "-"
    assert float(second[turn_rate]) > 0
    assert second[cli.TopView.COLUMNS.index("turn") + 1] == "3"


def test_top_quits_on_q(redis_server: RedisProcess, prefix: str) -> None:
    import io
    import os
    import threading

    from rich.console import Console

    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        led.open_session("q", SessionBudget(window=10_000, system_prompt=10))
    r, w = os.pipe()
    args = cli.build_parser().parse_args(
        ["--url", redis_server.url, "--prefix", prefix, "top", "--interval", "0.05"]
    )
    buf = io.StringIO()
    codes: list[int] = []
    with os.fdopen(r) as keys:
        t = threading.Thread(
            target=lambda: codes.append(cli.cmd_top(args, Console(file=buf, width=80), keys))
        )
        t.start()
        t.join(0.5)
        assert t.is_alive()  # refreshing until a key says otherwise
        os.write(w, b"x")
        t.join(0.5)
        assert t.is_alive()  # another key does not quit
        os.write(w, b"q")
        t.join(10)
        os.close(w)
    assert not t.is_alive() and codes == [cli.EXIT_OK]
    assert "q" in buf.getvalue()


def test_top_keeps_ids_that_share_a_tenant_prefix_distinct(
    redis_server: RedisProcess,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    ids = [f"tenant-acme/agent-session-of-the-long-running-fleet-{i:03d}" for i in range(30)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
    assert cli.main(["--url", redis_server.url, "--prefix", prefix, "top", "--once"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and len(lines) <= 24  # fits 80x24
    shown = [line.split()[0] for line in lines if line.lstrip().startswith("tenant")]
    assert len(shown) >= 10 and len(set(shown)) == len(shown)  # every row's id distinct
    assert all("…" in sid for sid in shown)  # cut in the middle: the distinct ends stay
    assert "q quits" not in out  # --once: nothing to quit
    assert lines[-1].startswith("* compaction pending; indicators: none")  # zeros left out


def test_version_and_a_closed_pipe(tmp_path: Path) -> None:
    got = subprocess.run(
        [sys.executable, "-m", "ledger.cli", "--version"], capture_output=True, text=True
    )
    want = f"ledger {ledger.__version__} (protocol {ledger.protocol.VERSION})"
    assert got.returncode == 0 and got.stdout.strip() == want
    # `ledger scripts DIR | head -1`: the reader leaves early, no traceback
    pipe = subprocess.run(
        f"{sys.executable} -m ledger.cli scripts {tmp_path} | head -1",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert pipe.returncode == 0 and pipe.stdout.count("\n") == 1
    assert "Traceback" not in pipe.stderr and "BrokenPipe" not in pipe.stderr


def _pane(name: str) -> list[str]:
    got = subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True, check=True
    )
    return got.stdout.splitlines()


@pytest.mark.timeout(120)
def test_top_in_tmux_at_80x24_with_300_sessions_of_one_tenant(
    redis_server: RedisProcess, prefix: str
) -> None:
    """`ledger top`, live, in a real terminal (tmux, 80x24), 300 sessions whose ids share
    a tenant prefix: the frame fits, every row's id is distinct, every number whole, a
    fleet header on top; `--sort refused` ranks the refused sessions first; q quits."""
    assert shutil.which("tmux"), "tmux is needed (apt-get install tmux; .ci/run installs it)"
    ids = [f"tenant-acme/agent-se-{i:04d}-of-the-fleet" for i in range(300)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
        for sid in ids[:3]:
            with pytest.raises(ledger.AdmissionRefused):  # x:refused
                led.session(sid).reserve("scratchpad", "r", 10_000_000)
    name = f"top-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "ledger.cli", "--url", redis_server.url, "--prefix", prefix]
    cmd = shlex.join([*argv, "top", "--interval", "0.5", "--sort", "refused"])
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "24", cmd], check=True
    )
    try:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = _pane(name)
            if any("q quits" in line for line in lines):
                break
            time.sleep(0.2)
        text = "\n".join(lines)
        assert "q quits" in text, text
        assert len(lines) <= 24 and max(len(line) for line in lines) <= 80, text
        assert re.search(r"\b300 sessions; jobs lag 0, pending 0; dead letters 0\b", text), text
        rows = [line.split() for line in lines if line.lstrip().startswith("tenant")]
        assert len(rows) >= 10, text  # as many rows as the height leaves
        shown = [r[0] for r in rows]
        assert len(set(shown)) == len(shown), shown  # distinct: cut in the middle
        for r in rows:  # regime, then numbers that are whole (no cell cut or wrapped)
            assert all(re.fullmatch(r"[+-]?\d+(\.\d+)?!?|-|\d+[smhd]", c) for c in r[3:]), r
        refused = [r[7] for r in rows]  # session, regime, util, free, resid, turn, turn/s
        assert refused[:3] == ["1", "1", "1"] and set(refused[3:]) == {"0"}, rows  # --sort
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


def test_url_and_prefix_are_taken_after_the_command_too() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["audit", "--url", "redis://b", "--prefix", "p2"]).url == "redis://b"
    assert parse(["--url", "redis://a", "audit"]).url == "redis://a"
    got = parse(["--url", "redis://a", "--prefix", "p1", "top", "--url", "redis://b"])
    assert (got.url, got.prefix) == ("redis://b", "p1")  # the later one wins
    assert parse(["inspect", "s"]).url is None  # no URL given: the settings decide
