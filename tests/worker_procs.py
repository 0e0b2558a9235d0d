"""Worker processes (``python -m ledger.cli worker``) for the tests and the benchmarks,
each logging its JSON lines to its own file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class WorkerProc:
    consumer: str
    proc: subprocess.Popen[bytes]
    log: Path

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
                    out.append(json.loads(line))
        return out

    def messages(self, msg: str) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("msg") == msg]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_started(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.consumer} exited: {self.tail()}")
            if self.messages("worker started"):
                return
            time.sleep(0.02)
        raise RuntimeError(f"worker {self.consumer} did not start within {timeout}s")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def spawn_worker(consumer: str, env: Mapping[str, str], log: Path) -> WorkerProc:
    """A worker process with the LEDGER_* settings in env only (none inherited)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    full["LEDGER_WORKER_COMPACTOR"] = "workers.compactors:simulated"  # env may override
    full.update(env)
    full["LEDGER_WORKER_CONSUMER"] = consumer
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ledger.cli", "worker"],
            cwd=ROOT,
            env=full,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    return WorkerProc(consumer, proc, log)
