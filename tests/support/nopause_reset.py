"""Hard resets in sessions whose turns never pause (docs/rules.md#a-reset-waits-for-the-turns-end):
N OS processes, each running one session's turns back to back (a stub model call of
``--model-ms``, no time between turns), one real ``ledger worker`` whose compactor always
raises (``tests.support.reset_agent:always_raises``, each job dead after one delivery), on a
real redis-server: every compaction fails, the failures escalate to hard resets, and each
reset finds a turn open. A row per turn: the error that reached the app's code (a
``LedgerError``'s class name, the turn then begun again), whether the turn's end applied a
reset (``TurnReport.reset``), whether the turn began as the turn after a reset.

tests/test_fleet_nopause.py runs the short form; by hand, with the worker of protocol 3's
behaviour (every reset applied at once, ``--reset-wait 0``) to see the errors it causes:

    python -m tests.support.nopause_reset --processes 2 --turns 60 [--reset-wait 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def words(text: str) -> int:
    return len(text.split())


def agent(url: str, sid: str, turns: int, model_ms: int) -> dict[str, Any]:
    """One session's turns back to back. The app's conversation starts over after a hard
    reset (what the ledger held went with it)."""
    from ledger import Agent, Ledger, LedgerError, SessionBudget

    system = "You answer briefly."
    # H = 0.72 x 4_000: about five turns of 200-word messages pass it, and every
    # compaction fails, so max_failed_compactions (3) failures reset the session
    budget = SessionBudget(window=4_000, system_prompt=words(system), output_reserve=200)
    rows: list[dict[str, Any]] = []
    with Ledger.from_url(url) as led:
        session = led.open_session(sid, budget)
        ag = Agent(session, words, await_compaction=0)  # (never waits between turns)
        prompt: list[Any] = []
        n = 0
        while n < turns:
            try:
                with ag.turn() as turn:
                    if turn.reset_from_epoch is not None:
                        prompt = []  # the ledger holds nothing: the conversation starts over
                    prompt = turn.apply(prompt)
                    msg = {"id": f"m{n}", "content": "say " * 200}
                    prompt += turn.admit("working_memory", [msg]).kept
                    time.sleep(model_ms / 1000)  # the model call
                    turn.prompt([system, *prompt])
            except LedgerError as exc:  # what reached the app's code
                rows.append({"turn": n, "error": type(exc).__name__, "message": str(exc)[:200]})
                prompt = []
                session.refresh()
                n += 1
                continue
            report = turn.report
            assert report is not None
            rows.append(
                {
                    "turn": n,
                    "error": None,
                    "reset_at_end": report.reset is not None,
                    "reset_from": turn.reset_from_epoch,
                    "drift": report.drift,
                }
            )
            if report.reset is not None:
                prompt = []
            n += 1
        raw = session.snapshot().raw
    return {
        "rows": rows,
        "resets": int(raw.get("x:resets", 0)),
        "failed": int(raw.get("x:failed_compactions", 0)),
    }


def figures(got: dict[str, Any]) -> dict[str, Any]:
    rows = got["rows"]
    ok = [r for r in rows if r["error"] is None]
    return {
        "turns": len(rows),
        "errors": [f"{r['error']}: {r['message']}" for r in rows if r["error"]],
        "resets": got["resets"],
        "failed_compactions": got["failed"],
        "reset_at_end": sum(r["reset_at_end"] for r in ok),
        "began_after_reset": sum(r["reset_from"] is not None for r in ok),
        "max_drift": max((abs(r["drift"]) for r in ok), default=0),
    }


def fleet(
    url: str, processes: int, turns: int, model_ms: int = 20, reset_wait: float | None = None
) -> dict[str, Any]:
    """The fleet on the Redis at `url`: one worker, `processes` agents started at once."""
    from ledger.testing import spawn_worker
    from tests.support.agent_process import run_together

    prefix = f"nr{uuid.uuid4().hex[:8]}"
    env = {
        "LEDGER_REDIS_URL": url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_WORKER_COMPACTOR": "tests.support.reset_agent:always_raises",
        "LEDGER_WORKER_MAX_DELIVERIES": "1",
        "LEDGER_WORKER_CLAIM_IDLE_MS": "100",
        "PYTHONPATH": str(ROOT),
    }
    if reset_wait is not None:
        env["LEDGER_WORKER_RESET_WAIT"] = str(reset_wait)
    with tempfile.TemporaryDirectory() as tmp:
        worker = spawn_worker("w1", env, Path(tmp) / "worker.log")
        try:
            worker.wait_started(60)
            outs, elapsed = run_together(
                [
                    [__file__, "--agent", url, f"nr-{k}", str(turns), str(model_ms)]
                    for k in range(processes)
                ],
                {**os.environ, **env},
                timeout=600,
            )
            staged = sum(m.get("kind") == "hard_reset" for m in worker.messages("job deferred"))
        finally:
            worker.stop()
    sessions = [figures(json.loads(o)) for o in outs]
    return {"elapsed_s": round(elapsed, 1), "deferred_jobs": staged, "sessions": sessions}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--agent"]:
        url, sid, turns, model_ms = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(agent(url, sid, turns, model_ms)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--model-ms", type=int, default=20)
    ap.add_argument("--reset-wait", type=float, help="the worker's reset_wait (s)")
    args = ap.parse_args(argv)
    from ledger.testing import standalone

    with standalone() as server:
        got = fleet(server.url, args.processes, args.turns, args.model_ms, args.reset_wait)
    for k, s in enumerate(got["sessions"]):
        print(
            f"session {k}: {s['turns']} turns, {s['resets']} resets "
            f"({s['reset_at_end']} applied at a turn's end, {s['began_after_reset']} turns "
            f"began after one), {len(s['errors'])} errors reaching the app, max drift "
            f"{s['max_drift']}"
        )
        for e in s["errors"][:5]:
            print(f"  {e}")
    print(f"worker: {got['deferred_jobs']} reset jobs deferred; elapsed {got['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
