"""Helpers for the rules tests (tests/test_rules*.py): fresh session ids, a session's
stored hash, numbers and job entries, threads started together, and the audit every
session must pass. No tests here.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

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


def new_sid() -> str:
    return f"rules/s-{uuid.uuid4().hex[:12]}"


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def raw_hash(ledger: Ledger, s: Session) -> dict[bytes, bytes]:
    """The session hash, byte for byte."""
    return dict(ledger.client.hgetall(s.keys.session))


def jobs(ledger: Ledger, s: Session, kind: str | None = None) -> list[dict[str, str]]:
    """This session's entries in its partition's job stream, oldest first."""
    out = []
    for _id, fields in ledger.client.xrange(s.keys.jobs):
        f = {_text(k): _text(v) for k, v in fields.items()}
        if f["session"] == s.id and (kind is None or f["kind"] == kind):
            out.append(f)
    return out


def numbers(s: Session) -> dict[str, int]:
    """Every stored number of the session except the clock and the telemetry counters."""
    return {k: v for k, v in s.snapshot().raw.items() if k != "now" and not k.startswith("x:")}


def run_workers(worker: Callable[[str], None], names: tuple[str, ...]) -> None:
    """worker(name) in one thread per name, started together; returns when all end."""
    threads = [threading.Thread(target=worker, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def clean(ledger: Ledger, s: Session) -> Snapshot:
    """No over-allocation, and every counter equals its items (audit)."""
    snap = s.snapshot()
    assert snap.free >= 0
    report = ledger.audit(s.id)
    assert report.clean, report.problems
    return snap


def held(ledger: Ledger, s: Session) -> list[tuple[Consumer, str, int]]:
    return [(i.consumer, i.id, i.tokens) for i in ledger.items(s.id)]


def budget_002() -> SessionBudget:
    """32k window, 2.1k system prompt, a working-memory floor, a 512-token spill preview."""
    return SessionBudget(
        window=32_000,
        system_prompt=2_100,
        working_memory_floor=6_000,
        tool_framing=150,
        output_reserve=1_024,
        spill_preview_tokens=512,
    )


WINDOW_004 = 32_000


def budget_004() -> SessionBudget:
    return SessionBudget(
        window=WINDOW_004, system_prompt=2_100, tool_framing=150, output_reserve=1_024
    )
