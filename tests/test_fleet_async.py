"""The asyncio faces in a fleet: two agent OS processes (examples/langgraph_async_agent.py
--serve: AsyncLedgerGraph, async nodes, ainvoke; examples/langchain_async_agent.py --serve:
create_agent with AsyncLedgerMiddleware and an async tool) serve alternate turns of one
conversation back to back on a real redis-server, a real `ledger worker` compacting, the
conversation shared through an AsyncSqliteSaver file both open. One turn's owner is
killed with -9 inside a node or the tool (after a checkpoint of that turn was written)
and the turn is retried on the other process; operators' notes are added with aupdate_state between
turns, by one process, and the next turn, served by the other, has them in its prompt.
After every turn the ledger equals the stub model's own count of the prompt it was
sent (plus its answer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, LedgerSettings
from ledger.testing import spawn_worker
from tests import servers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["langgraph", "langchain"]
TURNS, KILL_AT, NOTES_AFTER, LEASE_S = 14, 6, (3, 9), 1.5


class Proc:
    """One agent process: JSON requests in, JSON rows out."""

    def __init__(self, script: Path, url: str, sid: str, db: Path, env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(script), "--serve", "--url", url, "--session", sid,
             "--db", str(db)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        assert "ready" in self.read()

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        return json.loads(line) if line else {}

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.p.stdin is not None and not self.p.stdin.closed:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(timeout=10)
        if self.p.stdout is not None:
            self.p.stdout.close()


@pytest.mark.redis
@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", EXAMPLES)
def test_two_asyncio_processes_alternate_turns_with_a_crash_and_notes(
    example: str, redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    script = ROOT / "examples" / f"{example}_async_agent.py"
    prefix, sid = f"fa{uuid.uuid4().hex[:8]}", f"fa-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "LEDGER_PREFIX": prefix,
        "LEDGER_TURN_LEASE_MS": str(int(LEASE_S * 1000)),
        "PYTHONPATH": str(ROOT),
    }
    worker = spawn_worker(
        "w1",
        {
            "LEDGER_REDIS_URL": redis_server.url,
            "LEDGER_PREFIX": prefix,
            "LEDGER_WORKER_COMPACTOR": "tests.fleet_compactor:SUMMARIZER",
            "PYTHONPATH": str(ROOT),
        },
        tmp_path / "worker.log",
    )
    db = tmp_path / "checkpoints.sqlite"
    procs: list[Proc] = []
    rows: list[dict[str, Any]] = []
    notes: dict[int, str] = {}
    try:
        worker.wait_started(60)
        procs = [Proc(script, redis_server.url, sid, db, env) for _ in range(2)]
        for n in range(1, TURNS + 1):
            i = n % 2
            if n == KILL_AT:
                assert procs[i].ask({"turn": n, "crash": 1}) == {}  # killed mid-turn
                died = time.monotonic()
                procs[i].close()
                row = procs[1 - i].ask({"turn": n, "wait": LEASE_S * 8})  # the retry
                row["retry_s"] = time.monotonic() - died
                procs[i] = Proc(script, redis_server.url, sid, db, env)
            else:
                row = procs[i].ask({"turn": n})
            rows.append(row)
            if n in NOTES_AFTER:  # between turns, on the process that served this one
                notes[n + 1] = f"note-{n}"
                got = procs[i].ask(
                    {"note": f"Operator note {n}: amounts in euros.", "id": notes[n + 1]}
                )
                assert got["pid"] == row["pid"]
    finally:
        for p in procs:
            p.close()
        worker.stop()

    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    for r in rows:
        # the ledger holds exactly what the model was sent (and its answer)
        assert r["drift"] == 0 and r["flag"] == "none" and r["audit_clean"], r
        assert r["occupancy"] == r["counted"] and not r["turn_open"], r
    # Both processes served turns, alternating; every turn after a note (served by the
    # other process) has the note in its prompt.
    assert len({r["pid"] for r in rows}) == 3  # the two, and the one that replaced the dead
    for n, note in notes.items():
        after = rows[n - 1]
        assert note in after["prompt_ids"], (n, after["prompt_ids"])
        assert after["pid"] != rows[n - 2]["pid"]
    # The killed turn was rolled back and retried on the other process within the lease.
    retried = rows[KILL_AT - 1]
    assert retried["rolled_back"] is not None and retried["retry_s"] <= LEASE_S * 4, retried
    assert rows[KILL_AT]["rolled_back"] is None
    # The worker compacted, and its summaries reached the prompts, each once.
    delivered = [s for r in rows for s in r["delivered"]]
    assert delivered and len(delivered) == len(set(delivered))
    for r in rows:
        assert set(r["delivered"]) <= set(r["prompt_ids"]), r
    with Ledger.from_settings(LedgerSettings(redis_url=redis_server.url, prefix=prefix)) as led:
        assert led.audit(sid).clean
    print(f"{example}: {TURNS} turns, retry after kill -9 {retried['retry_s']:.2f} s, "
          f"{len(delivered)} summaries delivered, occupancy {rows[-1]['occupancy']}")  # fmt: skip
