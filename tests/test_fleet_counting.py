"""A fleet counting with an estimate (docs/agent.md#what-the-model-billed): two agent OS
processes serve one session's turns alternately on a real redis-server, with a real
``ledger worker`` compacting, through the Agents SDK's governed Session and through the
LangChain middleware (tests/support/fleet_counting.py). The counter is ``EstimatingCounter``; the
stub model bills prose at 1.22x, CSV/JSON rows at 2.4x and CJK at 3x of chars/4, and every
fourth turn's tool result is ~20k billed tokens in a 16k window.

What must hold: no prompt over the window reaches the model (each prompt measured by the
stub's own bill), no turn fails, and from the second turn that bills a kind of content on,
the ledger's count of each prompt is within the billing tolerance of what was billed, and
from the second turn the ledger is within 8 tokens of the prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
TURNS = 20


def fleet(framework: str, url: str) -> list[dict[str, Any]]:
    env = {
        **os.environ,
        "LEDGER_PREFIX": f"cnt{uuid.uuid4().hex[:8]}",
        "LEDGER_COUNTING_FRAMEWORK": framework,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests/support/fleet_counting.py"), "--json", "--url", url,
         "--processes", "2", "--turns", str(TURNS), "--session", f"c-{uuid.uuid4().hex[:8]}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


@pytest.mark.redis
@pytest.mark.timeout(180)
@pytest.mark.parametrize("framework", ["sdk", "langchain"])
def test_an_estimating_fleet_never_overflows_and_holds_to_the_bill(
    framework: str, redis_server: servers.RedisProcess
) -> None:
    rows = fleet(framework, redis_server.url)
    assert [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    assert len({r["pid"] for r in rows}) == 2  # two processes, alternating
    assert not [r for r in rows if "error" in r or r["unreconciled"]], "no turn failed"
    sent = [c["billed"] for r in rows for c in r["calls"]]
    assert max(sent) <= rows[0]["window"], "a prompt over the window reached the model"
    tools = [ts for r in rows for ts in zip(r["tool_tokens"], r["spilled"], strict=True)]
    big = [spilled for tokens, spilled in tools if tokens > 16_000]
    assert big and all(big), "every ~20k-token result was spilled"
    seen: set[str] = set()
    judged = 0
    for r in rows:
        kinds = {k for c in r["calls"] for k in c["kinds"]}
        if kinds <= seen:  # every kind of this turn was billed on an earlier turn
            assert len(r["checks"]) == len(r["calls"])
            for c, call in zip(r["checks"], r["calls"], strict=True):
                assert c["billed"] == call["billed"]
                assert abs(c["billed"] - c["counted"]) <= c["tolerance"], (r["turn"], c)
                judged += 1
        seen |= kinds
    assert judged >= 2 * (TURNS - 4)
    # The ledger is the prompt (a turn's drift) once the first turn taught the kinds of the
    # system prompt and the tool schemas (counted at their bound on it).
    assert all(abs(r["drift"]) <= 8 for r in rows[1:]), [r["drift"] for r in rows]
    assert sum(r["delivered"] for r in rows) >= 1, "the worker compacted"
