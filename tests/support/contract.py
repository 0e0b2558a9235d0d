"""Helpers for the contract tests (tests/test_contract*.py): fresh sessions, the budgets
they use, a session's stored numbers, and the invariants every session must satisfy. No
tests here.
"""

from __future__ import annotations

import uuid

import pytest

from ledger import (
    Consumer,
    Ledger,
    Session,
    SessionBudget,
    Snapshot,
)

WM, RET, REC, SCR = (
    Consumer.WORKING_MEMORY,
    Consumer.RETRIEVAL,
    Consumer.RECALL,
    Consumer.SCRATCHPAD,
)
EXHAUSTED = "token_budget_exhausted"


def new_sid() -> str:
    return f"tenant-c/s-{uuid.uuid4().hex[:12]}"


def base_free(b: SessionBudget) -> int:
    """Free tokens of an empty session: the window minus the reserved floor."""
    return b.window - b.reserved_floor


def floors_budget() -> SessionBudget:
    """Both floors non-zero: 10k window, 2k working-memory floor, 1.5k minimum memory."""
    return SessionBudget(
        window=10_000,
        system_prompt=1_000,
        working_memory_floor=2_000,
        min_memory=1_500,
        tool_framing=100,
        output_reserve=400,
    )


def state(s: Session) -> dict[str, int]:
    """Every stored number of the session except the clock."""
    raw = dict(s.snapshot().raw)
    del raw["now"]
    return raw


def allocation(s: Session) -> dict[str, int]:
    """The allocation only: what a refusal or a fenced call must leave alone."""
    return {k: v for k, v in state(s).items() if not k.startswith("x:")}


def expected_free(b: SessionBudget, snap: Snapshot) -> int:
    active = {c: snap.used[c] + snap.reserved[c] for c in Consumer}
    return (
        b.window
        - b.system_prompt
        - b.tool_framing
        - b.output_reserve
        - max(active[WM], b.working_memory_floor)
        - max(active[RET] + active[REC], b.min_memory)
        - active[SCR]
    )


def check(ledger: Ledger, s: Session, b: SessionBudget) -> Snapshot:
    """The invariants every session must satisfy after any sequence of calls."""
    snap = s.snapshot()
    assert snap.free >= 0
    assert snap.free == expected_free(b, snap)
    wm = snap.used[WM] + snap.reserved[WM]
    assert snap.residual_working_memory == snap.free + max(wm, b.working_memory_floor)
    occupancy = (
        b.system_prompt + b.tool_framing + sum(snap.used.values()) + sum(snap.reserved.values())
    )
    assert snap.occupancy == occupancy
    assert snap.utilization == pytest.approx(occupancy / b.window)
    report = ledger.audit(s.id)
    assert report.clean, report.problems
    assert report.problems == ()
    assert report.session_id == s.id
    return snap


def assert_new_epoch(epoch: int) -> None:
    """A new session's epoch is Redis's clock in ms (above every earlier incarnation's)."""
    assert 1_600_000_000_000 < epoch < 10**14, epoch


def open_fresh(ledger: Ledger, b: SessionBudget) -> Session:
    s = ledger.open_session(new_sid(), b)
    assert_new_epoch(s.epoch)
    return s
