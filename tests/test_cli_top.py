"""`ledger top` on a real Redis: frames rendered at a width and height, rates between
frames, damaged sessions, and the real terminal (tmux).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

import ledger
from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from tests.conftest import _open_many
from tests.support.servers import RedisProcess

pytestmark = pytest.mark.redis


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
