"""The `ledger` command end to end on a real Redis: the demo, exit codes, `worker --once`,
help and version, options after the command. `ledger top` is in test_cli_top.py, the
audit, dead letters and inspect in test_cli_audit.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ledger
from ledger import Ledger, LedgerSettings, SessionBudget, cli
from tests.support.servers import RedisProcess

pytestmark = pytest.mark.redis


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


def test_url_and_prefix_are_taken_after_the_command_too() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["audit", "--url", "redis://b", "--prefix", "p2"]).url == "redis://b"
    assert parse(["--url", "redis://a", "audit"]).url == "redis://a"
    got = parse(["--url", "redis://a", "--prefix", "p1", "top", "--url", "redis://b"])
    assert (got.url, got.prefix) == ("redis://b", "p1")  # the later one wins
    assert parse(["inspect", "s"]).url is None  # no URL given: the settings decide
