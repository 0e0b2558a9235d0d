"""An agent process of a fleet test: a script run with ``sys.executable``, JSON requests
written to its stdin one a line, JSON rows read from its stdout; it says "ready" first."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def checkpoint_file(path: Path) -> Path:
    """A LangGraph SQLite checkpoint file with its tables made, for a fleet's processes to
    share. Each process's checkpointer makes them at its first use otherwise; two processes
    doing so at once can get "database is locked" at once (switching the file to WAL takes
    a lock that SQLite does not wait for), whatever their busy timeout."""
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    with contextlib.closing(sqlite3.connect(path, check_same_thread=False)) as conn:
        SqliteSaver(conn).setup()
    return path


class AgentProcess:
    """One agent process: ``args`` after the interpreter (the script first), ``env`` its
    whole environment (None: this one's)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args, self.env = args, env
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        assert "ready" in self.read()

    def again(self) -> AgentProcess:
        """A new process of the same script and environment (after a crash)."""
        return AgentProcess(self.args, self.env)

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        return json.loads(line) if line else {}

    def send(self, req: dict[str, Any]) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        self.send(req)
        return self.read()

    def close(self) -> None:
        if self.p.stdin is not None and not self.p.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # gone (it failed, or was killed)
                self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=10)
        if self.p.stdout is not None:
            self.p.stdout.close()


def run_together(
    commands: list[list[str]], env: dict[str, str], timeout: float
) -> tuple[list[str], float]:
    """Start every command (a script and its arguments, run with ``sys.executable`` in the
    checkout) at once and wait for them all: their stdouts, and the seconds they took
    together. A process that exits non-zero raises with the end of its stderr."""
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    t0 = time.monotonic()
    out = [p.communicate(timeout=timeout) for p in procs]
    elapsed = time.monotonic() - t0
    for p, (_, err) in zip(procs, out, strict=True):
        if p.returncode != 0:
            raise RuntimeError(err[-3000:])
    return [o for o, _ in out], elapsed
