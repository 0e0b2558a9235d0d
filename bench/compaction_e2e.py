"""Compaction end to end on a real Redis, with processes:

    python -m bench.compaction_e2e [--turns 50] [--kills 2] [--json]

One agent session (worker-owned, framing tolerance 0) whose turns are served
alternately by two agent processes; one ``ledger worker`` process whose compactor is an
LLM summarizer over a stub model answering after 0.5-2 s, killed with SIGKILL
``--kills`` times while a summary is in flight, and a new one started.

Checked after every turn: every summary committed since the agent's last turn is in the
prompt and what it replaced is not; occupancy equals the real prompt (drift 0); the
items held are the prompt's objects. At the end: each compaction applied once, the
audit clean. Starts its own redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage

from bench.common import ROOT
from ledger.adapters.summarizer import LLMSummarizer
from ledger.testing import WorkerProc, spawn_worker, standalone

SYSTEM = "You are a helpful assistant."
SID = "e2e/agent"


def words(text: str) -> int:
    return len(text.split())


class StubLLM:
    """A chat model stub taking 0.5-2 s per summary."""

    async def ainvoke(self, messages: list[dict[str, str]]) -> AIMessage:
        await asyncio.sleep(random.uniform(0.5, 2.0))
        n = words(messages[-1]["content"])
        return AIMessage(f"summary of {n} words: " + "gist " * 25)


summarizer = LLMSummarizer(StubLLM(), words)


def budget() -> Any:
    from ledger import SessionBudget

    return SessionBudget(
        window=4_000, system_prompt=words(SYSTEM), output_reserve=200, framing_tolerance=0
    )


def agent_process(url: str, prefix: str, inbox: Any, outbox: Any) -> None:
    """Serves turns: gets (turn number, prompt objects), returns the turn's outcome."""
    from ledger import Agent, Ledger

    led = Ledger.from_url(url, prefix=prefix)
    agent = Agent(led.session(SID), words, await_compaction=30.0)
    while True:
        job = inbox.get()
        if job is None:
            return
        n, state = job
        agent.track("working_memory", state)
        with agent.turn() as turn:
            gone = {o["id"] for o in turn.dropped}
            new_state = [o for o in state if o["id"] not in gone] + list(turn.summaries)
            msg = {"id": f"m{n}", "role": "user", "content": f"turn {n} " + "word " * 400}
            got = turn.admit("working_memory", [msg])
            new_state += list(got.kept)
            turn.prompt([SYSTEM, *new_state])
        report = turn.report
        assert report is not None
        outbox.put({
            "pid": os.getpid(), "state": new_state, "dropped": sorted(gone),
            "summaries": [o["id"] for o in turn.summaries], "drift": report.drift,
            "occupancy": report.occupancy, "due": report.compaction_due,
            "held": sorted(i.id for i in led.items(SID)),
            "compactions": led.session(SID).snapshot().raw["kn"],
        })  # fmt: skip


def start_worker(url: str, prefix: str, n: int, log_dir: Path) -> WorkerProc:
    env = {"LEDGER_REDIS_URL": url, "LEDGER_PREFIX": prefix, "PYTHONPATH": str(ROOT),
           "LEDGER_WORKER_COMPACTOR": "bench.compaction_e2e:summarizer",
           "LEDGER_WORKER_CLAIM_IDLE_MS": "500", "LEDGER_WORKER_POLL_INTERVAL": "0.02"}  # fmt: skip
    return spawn_worker(f"e2e-worker-{n}", env, log_dir / f"worker-{n}.log")


def run(url: str, turns: int, kills: int) -> dict[str, Any]:
    from ledger import Ledger

    prefix = f"e2e{os.getpid()}{int(time.time())}"
    led = Ledger.from_url(url, prefix=prefix)
    led.open_session(SID, budget())
    log_dir = Path(tempfile.mkdtemp(prefix="compaction-e2e-"))
    ctx = mp.get_context("spawn")
    pipes = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    agents = [ctx.Process(target=agent_process, args=(url, prefix, i, o)) for i, o in pipes]
    for p in agents:
        p.start()
    workers = [start_worker(url, prefix, 0, log_dir)]
    kill_at = sorted(random.Random(7).sample(range(5, turns - 5), kills)) if kills else []
    killed, pending_kill = 0, False
    state: list[dict[str, str]] = []
    applied: list[str] = []
    rows, failures = [], []
    expect_summary = False
    t0 = time.perf_counter()
    for n in range(turns):
        inbox, outbox = pipes[n % 2]
        inbox.put((n, state))
        r = outbox.get(timeout=120)
        if expect_summary and not r["summaries"]:
            failures.append(f"turn {n}: the compaction due at turn {n - 1} did not reach it")
        before = {o["id"] for o in state}
        if not set(r["dropped"]) <= before:
            failures.append(f"turn {n}: dropped {r['dropped']} not all in the prompt")
        state = r["state"]
        ids = {o["id"] for o in state}
        if ids & set(r["dropped"]):
            failures.append(f"turn {n}: replaced content still in the prompt")
        if r["drift"] != 0:
            failures.append(f"turn {n}: drift {r['drift']}")
        if sorted(ids) != r["held"] and not r["due"]:
            failures.append(f"turn {n}: ledger holds {r['held']}, prompt {sorted(ids)}")
        applied += r["summaries"]
        rows.append({k: r[k] for k in ("pid", "summaries", "dropped", "drift", "due")})
        expect_summary = r["due"]
        if pending_kill or (n in kill_at):
            pending_kill = not r["due"]  # kill while a summary is in flight
            if r["due"]:
                time.sleep(0.3)
                workers[-1].kill()
                killed += 1
                workers.append(start_worker(url, prefix, len(workers), log_dir))
    wall = time.perf_counter() - t0
    for i, _ in pipes:
        i.put(None)
    for p in agents:
        p.join(10)
    for i, o in pipes:
        i.close()
        o.close()
    for w in workers:
        w.stop()
    snap = led.session(SID).snapshot()
    compactions = snap.raw["kn"]
    if len(set(applied)) != len(applied):
        failures.append("a summary applied twice")
    if compactions != len(applied) and compactions != len(applied) + int(expect_summary):
        failures.append(f"{compactions} compactions committed, {len(applied)} applied")
    audit = led.audit(SID)
    if not audit.clean:
        failures.append(f"audit: {audit.problems}")
    result = {
        "turns": turns, "agent_processes": len({r["pid"] for r in rows}), "worker_kills": killed,
        "compactions": compactions, "summaries_applied": len(applied),
        "max_abs_drift": max(abs(r["drift"]) for r in rows),
        "failed_compactions": snap.raw.get("x:failed_compactions", 0),
        "resets": snap.raw.get("x:resets", 0), "wall_seconds": round(wall, 1),
        "failures": failures, "logs": str(log_dir),
    }  # fmt: skip
    led.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with standalone() as server:
        res = run(server.url, args.turns, args.kills)
    print(json.dumps(res, indent=2) if args.json else res)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
