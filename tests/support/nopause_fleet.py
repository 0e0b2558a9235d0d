"""A fleet whose agents never pause (docs/compaction.md#measured): N OS processes, each
running one session's turns back to back (a stub model call of ``--model-ms``, no time
between turns), one real ``ledger worker`` with a summarizer taking ``--summary-s``
seconds, on a real redis-server. Each turn admits a retrieval chunk and a message; the
figures are per session: compactions landed, the turns from a compaction becoming due to
its summary reaching a turn, and the retrieval admission of every window of 10 turns.

CI runs the short form (tests/test_fleet_nopause.py); the issue's long form by hand:

    python -m tests.support.nopause_fleet --processes 8 --turns 120

``--code DIR`` runs the worker and the agents on the ``ledger`` package of another
checkout (e.g. one from before staging, to see the old behaviour)."""

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
WINDOW = 10  # turns per retrieval-admission window


def agent(url: str, sid: str, turns: int, model_ms: int) -> list[dict[str, Any]]:
    """One session's turns back to back; a row per turn."""
    from ledger import Agent, Ledger, SessionBudget
    from ledger.agent import TiktokenCounter

    system = "You are a helpful assistant."
    counter = TiktokenCounter()
    budget = SessionBudget(window=8_000, system_prompt=counter(system), output_reserve=500)
    rows: list[dict[str, Any]] = []
    with Ledger.from_url(url) as led:
        session = led.open_session(sid, budget)
        ag = Agent(session, counter)
        prompt: list[Any] = []
        for n in range(turns):
            with ag.turn() as turn:
                prompt = turn.apply(prompt)
                got = turn.admit("retrieval", [{"id": f"r{n}", "content": "chunk " * 400}])
                prompt += got.kept
                prompt += turn.admit(
                    "working_memory", [{"id": f"m{n}", "content": "say " * 200}]
                ).kept
                time.sleep(model_ms / 1000)  # the model call
                turn.prompt([system, *prompt])
            report = turn.report
            rows.append(
                {
                    "turn": n,
                    "retrieval": bool(got.kept),
                    "reason": got.reason,
                    "due": bool(report.compaction_due),
                    "summaries": len(turn.summaries),
                    "drift": report.drift,
                    "waited": round(turn.state.waited_compaction, 3) if turn.state else 0.0,
                }
            )
        snap = session.snapshot()
        rows.append(
            {
                "kn": snap.raw.get("kn", 0),
                "kf": snap.raw.get("kf", 0),
                "failed": snap.raw.get("x:failed_compactions", 0),
            }
        )
    return rows


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A session's compactions, landing lags (turns from due to delivered) and the worst
    retrieval admission of a window of 10 turns."""
    turns = [r for r in rows if "turn" in r]
    lags, due_at = [], None
    for r in turns:
        if r["summaries"] and due_at is not None:
            lags.append(r["turn"] - due_at)
            due_at = None
        if r["due"] and due_at is None:
            due_at = r["turn"]
    windows = [turns[i : i + WINDOW] for i in range(0, len(turns) - WINDOW + 1, WINDOW)]
    rates = [sum(r["retrieval"] for r in w) / len(w) for w in windows]
    return {
        "compactions": sum(r["summaries"] for r in turns),
        "kn": rows[-1]["kn"],
        "failed": rows[-1]["failed"],
        "reasons": sorted({str(r["reason"]) for r in turns if not r["retrieval"]}),
        "max_lag": max(lags, default=0),
        "lags": lags,
        "min_window": min(rates),
        "windows": rates,
        "max_drift": max(abs(r["drift"]) for r in turns),
        "waits": [r["waited"] for r in turns],
        "due": [r["turn"] for r in turns if r["due"]],
        "delivered": [r["turn"] for r in turns if r["summaries"]],
    }


def fleet(
    url: str, processes: int, turns: int, model_ms: int = 20, summary_s: float = 1.0,
    code: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The fleet on the Redis at `url`: one worker, `processes` agents started at once."""
    from ledger.testing import spawn_worker
    from tests.support.agent_process import run_together

    prefix = f"np{uuid.uuid4().hex[:8]}"
    # (the scripts run by path, the compactor from this folder: `code` gives `ledger`)
    path = os.pathsep.join([*([code] if code else []), str(ROOT / "tests" / "support")])
    env = {
        "LEDGER_REDIS_URL": url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_WORKER_COMPACTOR": "fleet_compactor:SLOW_SUMMARIZER",
        "LEDGER_TEST_SUMMARY_S": str(summary_s),
        "PYTHONPATH": path,
    }
    with tempfile.TemporaryDirectory() as tmp:
        worker = spawn_worker("w1", env, Path(tmp) / "worker.log")
        try:
            worker.wait_started(60)
            outs, elapsed = run_together(
                [
                    [__file__, "--agent", url, f"np-{k}", str(turns), str(model_ms)]
                    for k in range(processes)
                ],
                {**os.environ, **env},
                timeout=900,
            )
        finally:
            worker.stop()
    sessions = [figures(json.loads(o)) for o in outs]
    return {"elapsed_s": round(elapsed, 1), "sessions": sessions}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--agent"]:
        url, sid, turns, model_ms = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(agent(url, sid, turns, model_ms)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=120)
    ap.add_argument("--model-ms", type=int, default=20)
    ap.add_argument("--summary-s", type=float, default=1.0)
    ap.add_argument("--code", help="run the worker and agents on this checkout's ledger")
    args = ap.parse_args(argv)
    from ledger.testing import standalone

    with standalone() as server:
        got = fleet(
            server.url, args.processes, args.turns, args.model_ms, args.summary_s, args.code
        )
    for k, s in enumerate(got["sessions"]):
        print(
            f"session {k}: compactions {s['compactions']:3d} (kn {s['kn']}), max lag "
            f"{s['max_lag']} turns, worst 10-turn retrieval {s['min_window']:.2f}, "
            f"windows {' '.join(f'{w:.1f}' for w in s['windows'])}"
        )
    print(f"elapsed {got['elapsed_s']} s")
    if os.environ.get("NOPAUSE_DUMP"):
        print(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
