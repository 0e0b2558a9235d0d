"""Helpers for the turn-lease tests (test_turns.py, test_turn_agents.py,
test_turn_regressions.py): a session loaded with items of every consumer, and the state a
rollback must restore. No tests here.
"""

from __future__ import annotations

import uuid
from typing import Any

from ledger import (
    Consumer,
    Item,
    Ledger,
    SessionBudget,
    protocol,
)
from ledger.client import Session

W, R, M, S = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)


BUDGET = SessionBudget(
    window=20_000,
    system_prompt=500,
    tool_framing=100,
    output_reserve=1_000,
    working_memory_floor=1_000,
    spill_preview_tokens=100,
)


# The fields a rollback must give back exactly as the turn found them: everything but the
# turn's own bookkeeping (turn number, lease, undo log, deliveries, telemetry, outcomes).
BOOKKEEPING = {
    "tn",
    "lo",
    "le",
    "ul",
    "vs",
    "vd",
    "lb",
    "qs",
    "qd",
    "rb",
    "ws",
    "ai",
    "ao",
    "an",
    "xp",
    "gz",
}

BOOKKEEPING |= {"sq", "oq", "ox"}  # item sequences are never reused (the order index follows)

# What a compaction attempt counted stays (the jobs it enqueued cannot be taken back), and
# a compaction made due by the turn stays due.
BOOKKEEPING |= {"cd", "cq", "pm", "kf", "kr", "kn", "kt", "rq"}

BOOKKEEPING |= {"kp"}  # a worker's compaction staged under the turn lands at the next begin


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def state(led: Ledger, s: Session) -> tuple[dict[str, str], list[tuple[str, float]]]:
    """What a rollback restores: the session hash without its bookkeeping, and the
    reservations' members of the deadline index."""
    raw = {_text(k): _text(v) for k, v in led.client.hgetall(s.keys.session).items()}
    kept = {k: v for k, v in raw.items() if k not in BOOKKEEPING and not k.startswith("x:")}
    members = [
        (_text(m), score)
        for m, score in led.client.zrange(s.keys.deadlines, 0, -1, withscores=True)
        if _text(m).startswith(f"{s.id}|") and not _text(m).endswith("|~")
    ]
    return kept, members


def whole(led: Ledger, s: Session) -> tuple[dict[bytes, bytes], list[Any]]:
    return (
        led.client.hgetall(s.keys.session),
        led.client.zrange(s.keys.deadlines, 0, -1, withscores=True),
    )


def sid() -> str:
    return f"turns/{uuid.uuid4().hex[:12]}"


def loaded(led: Ledger, owner: str = "A") -> Session:
    """A session with items of every consumer and an open reservation, between turns."""
    s = led.open_session(sid(), BUDGET, owner=owner)
    s.admit(W, [Item("w1", 900), Item("w2", 700, 3)])
    s.admit(R, [Item("r1", 800), Item("r2", 600, 2)])
    s.admit(M, [Item("m1", 300)])
    s.admit_tool_result("s1", 1_200, b"{}")
    s.reserve(S, "res0", 400, lease_ms=600_000)
    return s


def worker_compaction(led: Ledger, s: Session, replaced: list[Any], summary: Item) -> Any:
    """A compaction as the worker commits it: with its job's stream entry."""
    entry = led.client.xadd(s.keys.jobs, {"kind": "compact", "session": s.id})
    return led.run(
        protocol.compact(
            s.keys, f"job-{_text(entry)}", s.epoch, replaced, summary, job=_text(entry)
        )
    )


def words(text: str) -> int:
    return len(text.split())


def msg(i: str, n: int = 50) -> dict[str, str]:
    return {"id": i, "content": "word " * n}
