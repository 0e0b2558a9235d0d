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

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, LedgerSettings
from ledger.testing import spawn_worker
from tests.support import servers
from tests.support.agent_process import AgentProcess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["langgraph", "langchain"]
TURNS, KILL_AT, NOTES_AFTER, LEASE_S = 14, 6, (3, 9), 1.5


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
            "LEDGER_WORKER_COMPACTOR": "tests.support.fleet_compactor:SUMMARIZER",
            "PYTHONPATH": str(ROOT),
        },
        tmp_path / "worker.log",
    )
    db = tmp_path / "checkpoints.sqlite"
    procs: list[AgentProcess] = []
    rows: list[dict[str, Any]] = []
    notes: dict[int, str] = {}
    try:
        worker.wait_started(60)
        args = [
            str(script),
            "--serve",
            "--url",
            redis_server.url,
            "--session",
            sid,
            "--db",
            str(db),
        ]
        procs = [AgentProcess(args, env) for _ in range(2)]
        for n in range(1, TURNS + 1):
            i = n % 2
            if n == KILL_AT:
                assert procs[i].ask({"turn": n, "crash": 1}) == {}  # killed mid-turn
                died = time.monotonic()
                procs[i].close()
                row = procs[1 - i].ask({"turn": n, "wait": LEASE_S * 8})  # the retry
                row["retry_s"] = time.monotonic() - died
                procs[i] = procs[i].again()
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
