"""The fleet the examples run in: agent processes serving one session's turns in turn,
and a background ``ledger worker`` compacting. Not part of the glue: an app has its own
way of routing turns to processes (an HTTP load balancer, a queue).

An example module provides ``Server(url, session_id, db)`` whose ``turn(n, inject, wait)``
returns a row, and calls ``DRILL`` in its tool (``crash``: kill -9 there) and its model
(``hold``: a slow call, seconds). ``serve`` runs one process; ``run`` drives the turns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ledger.errors import TurnInProgress

DRILL: dict[str, float] = {}  # this turn's drill: crash (kill -9 in the tool), hold (seconds)


def crash_here() -> None:
    """In the tool: the process dies there when the turn's drill says so."""
    if DRILL.get("crash"):
        os.kill(os.getpid(), signal.SIGKILL)


def hold_here() -> None:
    """In the model call: a slow call, holding the turn, when the drill says so."""
    time.sleep(DRILL.get("hold", 0))


def serve(server: Any) -> None:
    """An agent process: one JSON request a line in ({"turn", "inject", "crash", "hold",
    "wait"}), one JSON row out (or {"error", "owner", "left_ms"} when the turn is held)."""
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        DRILL.clear()
        DRILL.update({k: float(req.get(k, 0)) for k in ("crash", "hold")})
        try:
            row = server.turn(req["turn"], bool(req.get("inject")), float(req.get("wait", 0)))
        except TurnInProgress as exc:
            row = {"turn": req["turn"], "pid": os.getpid(), "error": "TurnInProgress",
                   "owner": exc.owner, "left_ms": exc.lease_left_ms}
        print(json.dumps(row), flush=True)


class Fleet:
    """Agent processes (``python <script> --serve``) and a ``ledger worker``."""

    def __init__(self, script: str, url: str, session_id: str, processes: int, compactor: str) -> None:
        self.script, self.url, self.session_id = script, url, session_id
        self.db = str(Path(tempfile.mkdtemp()) / "checkpoints.sqlite")
        self.env = dict(os.environ)
        self.procs = [self.spawn() for _ in range(processes)]
        here = str(Path(script).resolve().parent)
        env = {**self.env, "PYTHONPATH": os.pathsep.join([here, self.env.get("PYTHONPATH", "")])}
        # the worker's JSON log lines (in LEDGER_EXAMPLE_WORKER_LOG, if named): read until it
        # says it started, as a deployment waits for its workers to be ready
        log = Path(os.environ.get("LEDGER_EXAMPLE_WORKER_LOG") or Path(self.db).with_name("worker.log"))
        seen = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "ledger.cli", "--url", url, "worker", "--compactor", compactor,
                 "--claim-idle-ms", "1000"],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while b"worker started" not in log.read_bytes()[seen:]:
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start: {log.read_bytes()[seen:][-2000:]!r}")
            time.sleep(0.05)

    def spawn(self) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, self.script, "--serve", "--url", self.url, "--session",
                              self.session_id, "--db", self.db], env=self.env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and "ready" in json.loads(p.stdout.readline())
        return p

    def send(self, i: int, req: dict[str, Any]) -> None:
        p = self.procs[i]
        assert p.stdin is not None
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()

    def reply(self, i: int) -> dict[str, Any] | None:
        p = self.procs[i]
        assert p.stdout is not None
        line = p.stdout.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        for p in self.procs:
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=60)
        self.worker.send_signal(signal.SIGTERM)
        self.worker.wait(timeout=60)


def in_process(server: Any, turns: int, drift_at: int | None, compactor: Any) -> list[dict[str, Any]]:
    """One process serving every turn, a worker compacting in a thread beside it."""
    from ledger import Ledger
    from ledger.workers.runner import Worker, WorkerSettings

    agent = server.gov.agent if hasattr(server, "gov") else server.agent
    ledger = Ledger.from_settings(agent.session.ledger.settings)  # (the worker's own)
    worker = Worker(ledger, WorkerSettings(), compactor=compactor)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        return [{**server.turn(n, n == drift_at), "process": 0} for n in range(1, turns + 1)]
    finally:
        stop.set()
        thread.join(timeout=30)
        worker.close()
        ledger.close()


def drive(fleet: Fleet, turns: int, drift_at: int | None, kill_at: int | None,
          race_at: int | None, lease_s: float) -> list[dict[str, Any]]:
    """Turn n served by process n % processes, with the drills: a turn whose owner is
    killed inside its tool (the next process takes over), a turn started on two
    processes at once (a retried request)."""
    rows: list[dict[str, Any]] = []
    n_procs = len(fleet.procs)
    try:
        for n in range(1, turns + 1):
            i = n % n_procs
            if n == kill_at:
                fleet.send(i, {"turn": n, "crash": 1})
                assert fleet.reply(i) is None  # killed
                died = time.monotonic()
                fleet.procs[i].wait(timeout=30)
                i = (i + 1) % n_procs
                fleet.send(i, {"turn": n, "wait": lease_s * 5})
                row = fleet.reply(i)
                assert row is not None
                row["takeover_s"] = round(time.monotonic() - died, 3)
                fleet.procs[(i - 1) % n_procs] = fleet.spawn()
            elif n == race_at:
                j = (i + 1) % n_procs
                fleet.send(i, {"turn": n, "hold": 1.0})
                time.sleep(0.3)
                fleet.send(j, {"turn": n})
                refused, row = fleet.reply(j), fleet.reply(i)
                assert row is not None and refused is not None
                row["raced"] = refused
            else:
                fleet.send(i, {"turn": n, "inject": n == drift_at})
                row = fleet.reply(i)
                assert row is not None
            rows.append({**row, "process": i})
    finally:
        fleet.close()
    return rows


def main(script: str, server: Callable[[str, str, str], Any], compactor: Any, compactor_path: str,
         default_url: str, prefix: str) -> None:
    """The examples' command line (see each example's docstring)."""
    import argparse
    import uuid

    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=default_url)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--drift-at", type=int, default=None)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--race-at", type=int, default=None)
    ap.add_argument("--lease", type=float, default=3.0, help="the turn lease, seconds")
    ap.add_argument("--session", default=None)
    ap.add_argument("--db", default=None)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sid = a.session or f"{prefix}-{uuid.uuid4().hex[:12]}"
    os.environ.setdefault("LEDGER_TURN_LEASE_MS", str(int(a.lease * 1000)))
    if a.serve:
        return serve(server(a.url, sid, a.db))
    if a.processes <= 1:
        db = a.db or str(Path(tempfile.mkdtemp()) / "checkpoints.sqlite")
        rows = in_process(server(a.url, sid, db), a.turns, a.drift_at, compactor)
    else:
        fleet = Fleet(script, a.url, sid, a.processes, compactor_path)
        rows = drive(fleet, a.turns, a.drift_at, a.kill_at, a.race_at, a.lease)
    if a.json:
        print(json.dumps(rows))
        return
    print("turn  proc  prompt  billed  drift  flag         max_sent/window  docs  tool(spilled)  dropped  summaries")
    for r in rows:
        print(f"{r['turn']:>4}  {r['process']:>4}  {r['prompt']:>6}  {r.get('billed') or '-':>6}  {r['drift']:>5}  "
              f"{r['flag']:<11}  {r['max_sent']:>6}/{r['window']:<6}  {r['docs']:>4}  "
              f"{r['tool_tokens']:>6}({'y' if r['spilled'] else 'n'})  {r['dropped']:>7}  {len(r['delivered'])}")
    print(f"max prompt sent {max(r['max_sent'] for r in rows)} <= window {rows[0]['window']}; "
          f"max |drift| outside injected turns {max(abs(r['drift']) for r in rows if r['turn'] != a.drift_at)}; "
          f"flagged turns {[r['turn'] for r in rows if r['flag'] != 'none']}")
