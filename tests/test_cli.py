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


# Each way a session hash can be damaged, and the words the audit names it with.
DAMAGES = {
    "missing": (lambda r, key: r.hdel(key, "u_r"), "damaged: field 'u_r' is missing"),
    "not a number": (
        lambda r, key: r.hset(key, "W", "abc"),
        "damaged: field 'W' holds 'abc', not a whole number",
    ),
    "bad item": (
        lambda r, key: r.hset(key, "i:r:a", "5|x"),
        "damaged: field 'i:r:a' holds '5?x', not 4 numbers (tokens, turn, priority, seq)",
    ),
    "no consumer": (
        lambda r, key: r.hset(key, "i:z:a", "5|1|0|1"),
        "damaged: field 'i:z:a' names no consumer",
    ),
    "bad lease": (
        lambda r, key: r.hset(key, "r:x", "q|1|2"),
        "damaged: field 'r:x' holds 'q?1?2', not a consumer, tokens and a deadline",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_audit_of_1000_sessions_names_the_damaged_one_and_judges_the_others(
    redis_server: RedisProcess, prefix: str, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """One session hash damaged (a field missing, a number that is not one, an item or a
    lease not of the layout): the 999 others get their verdicts, the damaged one is
    named with its field, in the text and in --json (still one JSON object), exit 1.
    Before, audit.lua met the damage with a Lua error and no session got a verdict.
    (1,000 sessions for a field missing; 600, still six round trips, for the others.)"""
    corrupt, words = DAMAGES[damage]
    n = 1000 if damage == "missing" else 600
    ids = [f"fleet-{i:04d}" for i in range(n)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)  # pipelined
        victim = led.session(ids[500])
        victim.admit("retrieval", [Item("a", 5)])
        led.session(ids[7]).admit("retrieval", [Item("b", 5)])
        r = redis.Redis.from_url(redis_server.url)
        r.hset(led.keyspace.session(ids[7]).session, "u_r", 6)  # a violation, not damage
        corrupt(r, victim.keys.session)
        r.close()
    base = ["--url", redis_server.url, "--prefix", prefix, "audit"]
    started = time.monotonic()
    code = cli.main(base)
    took = time.monotonic() - started
    out = " ".join(capsys.readouterr().out.split())
    assert code == cli.EXIT_VIOLATION
    assert f"{ids[500]}: {words}" in out and "not audited" in out, out
    assert f"{ids[7]}: retrieval used is 6, items say 5" in out
    assert (
        f"{n - 1} session(s) audited: {n - 2} clean, 1 with violations, 1 damaged (not audited)"
        in out
    )
    assert took < 30, took  # a round trip per 100 audits
    with capsys.disabled():  # shown with -s
        print(f"\nledger audit, {n} sessions, one damaged ({damage}): {took:.2f} s")
    assert cli.main([*base, "--json"]) == cli.EXIT_VIOLATION
    got = json.loads(capsys.readouterr().out)
    assert (got["audited"], got["clean"], got["ok"]) == (n - 1, n - 2, False)
    assert list(got["violations"]) == [ids[7]]
    assert list(got["damaged"]) == [ids[500]] and words in got["damaged"][ids[500]][0]
    # the damaged session alone, by name: named, exit 1, no verdict
    assert cli.main([*base, ids[500], ids[0], "-v"]) == cli.EXIT_VIOLATION
    out = capsys.readouterr().out
    assert f"{ids[0]}: clean" in out and "1 session(s) audited: 1 clean" in out


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


def _render(view: cli.TopView, led: Ledger, width: int, height: int = 24) -> list[str]:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, height=height).print(view.frame(led, width, height=height))
    return buf.getvalue().splitlines()


def test_top_flags_a_damaged_session_and_keeps_running(
    redis_server: RedisProcess, prefix: str
) -> None:
    """A session whose field holds no number (one `top` ranks by, and one it only shows)
    is a row flagged DAMAGED and the live view keeps refreshing until q; before, the
    first frame raised (ValueError, exit 2) and a running `top` died."""
    import io
    import os
    import threading

    from rich.console import Console

    ids = ["good-1", "bad-rank", "good-2", "bad-shown"]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
        led.session("good-1").admit("retrieval", [Item("a", 50)])
        args = cli.build_parser().parse_args(
            ["--url", redis_server.url, "--prefix", prefix, "top", "--interval", "0.05"]
        )
        buf = io.StringIO()
        codes: list[int] = []
        r, w = os.pipe()
        with os.fdopen(r) as keys:
            t = threading.Thread(
                target=lambda: codes.append(
                    cli.cmd_top(args, Console(file=buf, width=100, height=24), keys)
                )
            )
            t.start()
            time.sleep(0.3)
            # damaged while it runs: a field the rank reads, then one only the row shows
            led.client.hset(led.keyspace.session("bad-rank").session, "a_w", "12x")
            led.client.hset(led.keyspace.session("bad-shown").session, "ep", "oops")
            time.sleep(0.5)
            assert t.is_alive(), buf.getvalue()[-2000:]
            os.write(w, b"q")
            t.join(10)
            os.close(w)
        assert not t.is_alive() and codes == [cli.EXIT_OK]
        last = _render(cli.TopView(limit=10), led, 100)
    text = "\n".join(last)
    assert "4 sessions (2 DAMAGED); jobs" in text, text
    assert "DAMAGED: ledger inspect <id> names the field" in last[-1], text
    flagged = [ln.split()[0] for ln in last if " DAMAGED " in f"{ln} "]
    assert sorted(flagged) == ["bad-rank", "bad-shown"], text
    assert [ln.split()[0] for ln in last if ln.startswith("good-")] == ["good-1", "good-2"]
    assert "DAMAGED" in buf.getvalue()  # the live frames flagged them too
    assert cli.main(["--url", redis_server.url, "--prefix", prefix, "top", "--once"]) == 0


def test_top_ids_that_differ_only_in_the_middle_stay_distinct() -> None:
    """`-eu-west-1` and `-eu-west-2` used to collapse into one `tenant…eu-w…sion-0001`."""
    ids = [
        f"tenant-acme/agents/{region}/session-{n:04d}"
        for region in ("eu-west-1", "eu-west-2", "us-east-1")
        for n in (1, 2)
    ] + ["tenant-b/short"]
    for width in (12, 16, 20, 24, 30):
        got = cli.distinct_cuts(ids, width)
        assert len(set(got)) == len(ids), (width, got)
        assert all(len(g) <= width for g in got), (width, got)
    import random

    rnd = random.Random(5)
    for _ in range(200):  # ids that share long runs, differing at one place or two
        base = "".join(rnd.choice("ab-/0") for _ in range(rnd.randint(20, 60)))
        many = sorted(
            {
                base[:k] + rnd.choice("xyz") + base[k + 1 :]
                for k in (rnd.randrange(len(base)) for _ in range(rnd.randint(2, 12)))
            }
        )
        width = rnd.randint(8, 30)
        got = cli.distinct_cuts(many, width)
        assert len(set(got)) == len(many) and all(len(g) <= width for g in got), (many, got)


def test_top_rows_follow_the_height_of_each_frame(redis_server: RedisProcess, prefix: str) -> None:
    """Without --limit the rows are counted again for each frame: a resize is followed."""
    ids = [f"h{i:02d}" for i in range(40)]
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, ids)
        view = cli.TopView(None)
        rows = [
            len([ln for ln in _render(view, led, 80, height) if ln.startswith("h")])
            for height in (24, 40, 15)
        ]
        tall = _render(view, led, 80, 40)
    assert rows == [24 - view.CHROME, 40 - view.CHROME, 15 - view.CHROME]
    assert len(tall) <= 40


@pytest.mark.parametrize("width", [40, 52, 64, 79])
def test_top_below_80_columns_drops_columns_never_cuts_a_number(
    redis_server: RedisProcess, prefix: str, width: int
) -> None:
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("tenant/narrow-1", SessionBudget(window=1_234_567, system_prompt=10))
        s.admit("working_memory", [Item("a", 987_654)])
        for n in range(12):
            with pytest.raises(ledger.AdmissionRefused):
                s.reserve("scratchpad", f"r{n}", 10_000_000)
        snap = s.snapshot()
        lines = _render(cli.TopView(limit=5), led, width)
    assert max(len(ln) for ln in lines) <= width, lines
    head = next(ln for ln in lines if ln.startswith("session")).split()
    row = next(ln for ln in lines if "row-1 " in ln).split()
    assert len(row) == len(head) and "regime" in head and "util" in head, lines
    for col, cell in zip(head[1:], row[1:], strict=True):
        assert "…" not in cell, (col, cell, lines)  # whole, or its column left out
    assert "0.80" in row and (str(snap.free) in row or "free" not in head)
    assert lines[-1].startswith("* compaction pending; indicators: ") and len(lines[-1]) <= width


def test_top_footer_stays_one_line(redis_server: RedisProcess, prefix: str) -> None:
    """Many indicators: those that do not fit are counted (+N more), never wrapped."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("f", SessionBudget(window=10_000, system_prompt=10))
        with pytest.raises(ledger.AdmissionRefused):
            s.reserve("scratchpad", "r", 10_000_000)
        view = cli.TopView(limit=5)
        text = cli.TopView._render(
            view, "h", "t", [], {f"indicator_{i}": i + 1 for i in range(30)}, 80, True
        )
        import io

        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=80).print(text)
    lines = buf.getvalue().splitlines()
    footer = [ln for ln in lines if "indicators" in ln]
    assert len(footer) == 1 and lines[-1] == footer[0], lines
    assert len(footer[0]) <= 80 and footer[0].endswith("more; q quits"), footer
    assert "indicator_0=1" in footer[0] and "indicator_29" not in footer[0]


def test_top_piped_prints_whole_lines(redis_server: RedisProcess, prefix: str) -> None:
    """`ledger top --once | less`: no terminal, no COLUMNS: ids and header whole (a
    terminal's 80 columns used to cut them); COLUMNS, when set, still bounds it."""
    import os

    long_id = "tenant-acme/agent-eu-west-1/session-0001-of-the-long-running-fleet"
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        led.open_session(long_id, SessionBudget(window=10_000, system_prompt=10))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    argv = [sys.executable, "-m", "ledger.cli", "--url", redis_server.url, "--prefix", prefix]
    got = subprocess.run([*argv, "top", "--once"], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr
    assert long_id in got.stdout and "…" not in got.stdout, got.stdout
    assert max(len(ln) for ln in got.stdout.splitlines()) > 80
    row = next(ln for ln in got.stdout.splitlines() if ln.startswith(long_id)).split()
    assert len(row) == len(cli.TopView.COLUMNS)  # all but dead: shown when a row has a letter
    got = subprocess.run(
        [*argv, "top", "--once"], capture_output=True, text=True, env={**env, "COLUMNS": "60"}
    )
    assert max(len(ln) for ln in got.stdout.splitlines()) <= 60 and long_id not in got.stdout


def _dead_letter(led: Ledger, session: str, age_ms: int, error: str) -> str:
    """A dead letter as the worker writes it (schema.DeadLetterEntry), dead-lettered
    `age_ms` ago by Redis's clock (its entry id); its ref."""
    from ledger import schema

    secs, micros = led.client.time()
    at = int(secs) * 1000 + int(micros) // 1000 - age_ms
    p = led.keyspace.partition_of(session)
    entry = schema.DeadLetterEntry(
        {"kind": "compact", "session": session, "epoch": "1"}, "1-0", "max deliveries", error
    )
    eid = led.client.xadd(led.keyspace.dead_letters(p), entry.to_fields(), id=f"{at}-0")
    return f"p{p}:{eid.decode() if isinstance(eid, bytes) else eid}"


def test_dead_show_list_by_name_and_age(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dead show` prints named letters whole (before: no such command, exit 2);
    `dead list <ref>` lists only those named (before: every letter); each row has its
    age on Redis's clock (before: none)."""
    long_error = "RuntimeError: summarizer down; " + "detail " * 60 + "END-OF-ERROR"
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        old = _dead_letter(led, "dl-old", 2 * 3600_000 + 5_000, long_error)
        new = _dead_letter(led, "dl-new", 5 * 60_000 + 5_000, "ValueError: bad plan")
    argv = ["--url", redis_server.url, "--prefix", prefix, "dead"]
    assert cli.main([*argv, "list"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("p")}
    assert rows[old][1] == "2h" and rows[new][1] == "5m", out
    assert "END-OF-ERROR" not in out  # list cuts the error
    assert cli.main([*argv, "list", new]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert new in out and old not in out and "dl-old" not in out
    assert cli.main([*argv, "show", old]) == cli.EXIT_OK
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert f"{old} dead for 2h" in flat and "END-OF-ERROR" in flat and new not in out
    assert "session: dl-old" in flat and "why: max deliveries" in flat and "kind: compact" in flat
    assert cli.main([*argv, "show"]) == cli.EXIT_USAGE  # names, or --all
    assert cli.main([*argv, "show", "p0:1-1"]) == cli.EXIT_VIOLATION  # no such letter
    assert cli.main([*argv, "show", "--all"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert old in out and new in out
    assert cli.main([*argv, "list", "--json"]) == cli.EXIT_OK
    got = {r["ref"]: r for r in json.loads(capsys.readouterr().out)["letters"]}
    assert 2 * 3600 <= got[old]["age_s"] < 2 * 3600 + 60 and got[new]["session"] == "dl-new"


def test_audit_names_a_session_with_a_dead_letter(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ledger audit` names each session one of whose jobs was dead-lettered, with the
    letters' refs (text and --json); the other sessions are not named."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        for sid in ("held-1", "fine-1"):
            led.open_session(sid, SessionBudget(window=8000, system_prompt=10))
        ref = _dead_letter(led, "held-1", 60_000, "RuntimeError: summarizer down")
    argv = ["--url", redis_server.url, "--prefix", prefix, "audit"]
    cli.main(argv)
    out = capsys.readouterr().out
    assert f"held-1: a job dead-lettered ({ref})" in " ".join(out.split()), out
    assert "fine-1" not in out
    cli.main([*argv, "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["dead_letters"] == {"held-1": [ref]}


def test_help_has_no_rst_quotes() -> None:
    """`ledger --help` and each command's: plain text, no ``double backticks``."""
    texts = [cli.build_parser().format_help()]
    sub = cli.build_parser()._subparsers
    assert sub is not None
    for action in sub._group_actions:
        for parser in getattr(action, "choices", {}).values():
            texts.append(parser.format_help())
    assert len(texts) == 9  # the parser and its eight commands
    assert "The ledger command: demo, inspect" in texts[0]
    for text in texts:
        assert "`" not in text, text


def test_inspect_items_newest_first(
    redis_server: RedisProcess, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--items N shows the N newest items, the newest first, as its help and title say
    (before: the title said oldest first, and the help newest)."""
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        s = led.open_session("items", SessionBudget(window=10_000, system_prompt=10))
        for n in range(5):
            s.admit("retrieval", [Item(f"doc-{n}", 10)])
    argv = ["--url", redis_server.url, "--prefix", prefix, "inspect", "items", "--items", "2"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    shown = re.findall(r"\bdoc-\d\b", out)
    assert shown == ["doc-4", "doc-3"], out
    assert "items (5; the newest 2, newest first)" in " ".join(out.split())


class BrokenCheck:
    """A compactor whose check() raises what is not a ConfigurationError."""

    def __call__(self, request: object) -> object:
        raise AssertionError("never called")

    def check(self) -> None:
        raise RuntimeError("endpoint http://summarizer:8000 refused the connection")


BROKEN = BrokenCheck()


def test_worker_whose_compactor_check_raises_exits_2_without_a_traceback(
    redis_server: RedisProcess, prefix: str
) -> None:
    """Exit 1 is a violation's: a compactor that cannot work is configuration (2), named
    with its error (before: a traceback and exit 1)."""
    argv = [sys.executable, "-m", "ledger.cli", "--url", redis_server.url, "--prefix", prefix]
    got = subprocess.run(
        [*argv, "worker", "--once", "--compactor", "tests.test_cli:BROKEN"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == cli.EXIT_USAGE, got.stderr
    assert "Traceback" not in got.stderr
    assert "the compactor 'tests.test_cli:BROKEN' cannot work: RuntimeError: endpoint" in (
        got.stderr
    )


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


@pytest.mark.timeout(90)
def test_top_in_tmux_follows_a_resize(redis_server: RedisProcess, prefix: str) -> None:
    """The live view in a real terminal: made taller, it shows more rows at the next
    refresh; made narrower, it still fits and cuts no number (before: the rows were
    counted once, at start)."""
    assert shutil.which("tmux"), "tmux is needed (apt-get install tmux; .ci/run installs it)"
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        _open_many(led, [f"rs-{i:03d}" for i in range(60)])
    name = f"top-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "ledger.cli", "--url", redis_server.url, "--prefix", prefix]
    # as from a shell: the size is the terminal's (a LINES or COLUMNS in the environment,
    # as tmux started under pytest passes on, would fix it)
    cmd = shlex.join(["env", "-u", "LINES", "-u", "COLUMNS", *argv, "top", "--interval", "0.3"])
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", "80", "-y", "20", cmd], check=True
    )

    def rows(lines: list[str]) -> int:
        return len([ln for ln in lines if ln.startswith("rs-")])

    def settled(want: int) -> list[str]:
        deadline = time.monotonic() + 20
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = _pane(name)
            if any("q quits" in ln for ln in lines) and rows(lines) == want:
                break
            time.sleep(0.2)
        return lines

    try:
        short = settled(20 - cli.TopView.CHROME)
        assert rows(short) == 20 - cli.TopView.CHROME, short
        subprocess.run(["tmux", "resize-window", "-t", name, "-x", "60", "-y", "36"], check=True)
        tall = settled(36 - cli.TopView.CHROME)
        assert rows(tall) == 36 - cli.TopView.CHROME, tall
        assert len(tall) <= 36 and max(len(ln) for ln in tall) <= 60, tall
        assert all("…" not in c for ln in tall if ln.startswith("rs-") for c in ln.split()[1:])
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def test_url_and_prefix_are_taken_after_the_command_too() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["audit", "--url", "redis://b", "--prefix", "p2"]).url == "redis://b"
    assert parse(["--url", "redis://a", "audit"]).url == "redis://a"
    got = parse(["--url", "redis://a", "--prefix", "p1", "top", "--url", "redis://b"])
    assert (got.url, got.prefix) == ("redis://b", "p1")  # the later one wins
    assert parse(["inspect", "s"]).url is None  # no URL given: the settings decide
