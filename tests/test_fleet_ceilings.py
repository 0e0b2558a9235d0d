"""A tenant's ceiling across a fleet, on both faces: two agent OS processes
(tests/support/fleet_ceilings.py: the LangGraph adapter with the tenant named, ``--face sync`` or
``--face asyncio``) serve the turns of three sessions, each session's turns alternating
between the processes (tenant A's two sessions at the same time, one on each), the
conversations shared through one SQLite checkpoint file both open, on a real redis-server
with a real ``ledger worker`` running. A's two sessions grow until A's token ceiling
refuses them: what the model billed for A never passes the ceiling and equals what A's
scope charged, every refusal is a ``CeilingReached`` naming A, and tenant B's session,
served between them, is never refused. One process is killed with SIGKILL inside a model
call of A (its hold taken, nothing billed): the hold stays in A's scope until its deadline
on Redis's clock, then lapses, and the turn is served again by the other process."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ledger import Ledger, LedgerSettings, ScopeBudget, SessionBudget, TiktokenCounter
from ledger.testing import spawn_worker
from tests.support import servers
from tests.support.agent_process import AgentProcess, checkpoint_file

ROOT = Path(__file__).resolve().parent.parent
TURNS, CEILING_A, CEILING_B = 8, 4_000, 1_000_000
KILL_AT, LEASE_MS, HOLD_S = 2, 1_500, 3.0  # HOLD_S: tests/support/fleet_ceilings.py's HOLD_MS
DAY = 86_400_000


@pytest.mark.redis
@pytest.mark.timeout(180)
@pytest.mark.parametrize("face", ["sync", "asyncio"])
def test_two_processes_two_sessions_of_a_tenant_hit_its_ceiling(
    face: str, redis_server: servers.RedisProcess, tmp_path: Path
) -> None:
    prefix = f"fc{uuid.uuid4().hex[:8]}"
    a, b = f"a{uuid.uuid4().hex[:6]}", f"b{uuid.uuid4().hex[:6]}"
    sessions = [f"@{a}/s1", f"@{a}/s2", f"@{b}/s1"]
    settings = LedgerSettings(redis_url=redis_server.url, prefix=prefix)
    with Ledger.from_settings(settings) as led:
        led.set_scope(a, ScopeBudget(window_ms=DAY, tokens=CEILING_A))
        led.set_scope(b, ScopeBudget(window_ms=DAY, tokens=CEILING_B))
        system = TiktokenCounter()("Answer from the conversation.")
        for sid in sessions:
            led.open_session(sid, SessionBudget(window=16_000, system_prompt=system,
                                                output_reserve=200))  # fmt: skip
    worker = spawn_worker(
        "w1",
        {"LEDGER_REDIS_URL": redis_server.url, "LEDGER_PREFIX": prefix, "PYTHONPATH": str(ROOT)},
        tmp_path / "worker.log",
    )
    db = checkpoint_file(tmp_path / "checkpoints.sqlite")
    procs: list[AgentProcess] = []
    rows: list[dict[str, Any]] = []
    try:
        worker.wait_started(60)
        args = [
            str(ROOT / "tests" / "support" / "fleet_ceilings.py"),
            "--url",
            redis_server.url,
            "--prefix",
            prefix,
            "--db",
            str(db),
            "--face",
            face,
        ]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")},
               "PYTHONPATH": str(ROOT), "LEDGER_TURN_LEASE_MS": str(LEASE_MS)}  # fmt: skip
        procs = [AgentProcess(args, env) for _ in range(2)]
        for n in range(1, TURNS + 1):
            # A's two sessions at once, one on each process (their holds race for the
            # tenant's room); each session's turns alternate processes; then B's
            first, second = procs[n % 2], procs[(n + 1) % 2]
            crash = n == KILL_AT
            first.send({"session": sessions[0], "turn": n, "crash": int(crash)})
            second.send({"session": sessions[1], "turn": n})
            if crash:  # killed inside its model call, the hold taken
                assert first.read() == {}
                killed = time.monotonic()
                with Ledger.from_settings(settings) as led:
                    dead_hold = led.scope_usage(a).open_holds
                first.close()
                rows.append(second.read())
                # the other process serves the turn again once the dead turn's lease lapsed
                rows.append(second.ask({"session": sessions[0], "turn": n, "wait": 10}))
                first = procs[n % 2] = first.again()
            else:
                rows += [first.read(), second.read()]
            rows.append(first.ask({"session": sessions[2], "turn": n}))
        time.sleep(max(0.0, HOLD_S + 0.2 - (time.monotonic() - killed)))
        # a reserve in A after the dead hold's deadline (refused or not) gives it back
        last = procs[0].ask({"session": sessions[1], "turn": TURNS + 1})
    finally:
        for p in procs:
            p.close()
        worker.stop()

    assert len(rows) == TURNS * len(sessions) and all(r.get("pid") for r in rows), rows
    assert dead_hold == 1  # (A's other session settled its own call: the dead one's hold)
    for sid in sessions:  # each session was served by both processes, turn by turn
        pids = [r["pid"] for r in rows if r["session"] == sid]
        assert len(set(pids)) >= 2, pids
        if sid != sessions[0]:  # (the killed turn was served again by the other process)
            assert all(x != y for x, y in itertools.pairwise(pids)), pids
    rows.append(last)
    of_a = [r for r in rows if r["session"].startswith(f"@{a}/")]
    of_b = [r for r in rows if r["session"].startswith(f"@{b}/")]
    refused = [r for r in of_a if "refused" in r]
    # Both sessions of A reached the ceiling; each refusal typed, naming A, the model
    # not called for it.
    assert {r["session"] for r in refused} == set(sessions[:2]), of_a
    for r in refused:
        assert r["refused"] == "CeilingReached" and r["scope"] == a, r
        assert r["quantity"] == "tokens" and r["billed"] == 0, r
    billed_a = sum(r["billed"] for r in of_a)
    assert all(r.get("over", 0) == 0 for r in rows)  # every bill within its hold
    # B: never refused, every turn billed.
    assert all("refused" not in r and r["billed"] > 0 for r in of_b), of_b
    with Ledger.from_settings(settings) as led:
        ua, ub = led.scope_usage(a), led.scope_usage(b)
        for sid in sessions:
            assert led.audit(sid).clean, sid
    # What the model billed for A never passed its ceiling, and A's scope charged exactly it.
    assert 0 < billed_a <= CEILING_A
    assert ua.charged["input"] + ua.charged["output"] == billed_a, (ua, rows)
    assert ua.remaining["tokens"] == CEILING_A - billed_a and ua.open_holds == 0
    assert ua.refused == len(refused)
    assert ub.refused == 0 and ub.charged["input"] + ub.charged["output"] == sum(
        r["billed"] for r in of_b
    )
    print(f"{face}: tenant A billed {billed_a} of {CEILING_A} tokens, {len(refused)} refusals "
          f"(CeilingReached); tenant B {len(of_b)} turns, none refused")  # fmt: skip
