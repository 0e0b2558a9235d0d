"""Helpers for the bad-input tests (test_bad_input.py, test_bad_input_scripts.py): a
session's state (its hash and the deadline index), compared byte for byte, and the budget
its sessions are opened with. No tests here.
"""

from __future__ import annotations

from typing import Any

from ledger import (
    Ledger,
    Session,
    SessionBudget,
)

BUDGET_FIELDS: dict[str, Any] = {
    "window": 32_000,
    "system_prompt": 2_100,
    "working_memory_floor": 6_000,
    "min_memory": 0,
    "tool_framing": 150,
    "output_reserve": 1_024,
}
BUDGET = SessionBudget(**BUDGET_FIELDS)
SID = "bad-input/s-1"
State = tuple[dict[bytes, bytes], list[tuple[bytes, float]]]


def state(ledger: Ledger, s: Session) -> State:
    return (
        ledger.client.hgetall(s.keys.session),
        ledger.client.zrange(s.keys.deadlines, 0, -1, withscores=True),
    )


def diff(before: State, after: State) -> str:
    (h0, z0), (h1, z1) = before, after
    changed = sorted(k for k in h0.keys() | h1.keys() if h0.get(k) != h1.get(k))
    parts = [f"{k!r}: {h0.get(k)!r} -> {h1.get(k)!r}" for k in changed[:8]]
    if z0 != z1:
        parts.append(f"deadlines: {z0!r} -> {z1!r}")
    return "; ".join(parts)
