"""A short scripted run: several workers serve turns of one agent session.

Each worker is a thread with its own ledger client (on a real Redis URL they
could as well be processes on other hosts). They admit retrieval chunks, park
tool results in the scratchpad through reserve/settle, and release what they no
longer need; a fraction of calls is sent twice with the same operation id, as a
retry after a lost reply would. At the end the shared budget is audited.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ledger.client import Ledger
from ledger.core import new_op_id
from ledger.errors import AdmissionRefused
from ledger.models import AuditReport, Consumer, Item, SessionBudget, Snapshot
from ledger.settings import LedgerSettings

T = TypeVar("T")

BUDGET = SessionBudget(
    window=32_000,
    system_prompt=2_100,
    working_memory_floor=6_000,
    min_memory=0,
    tool_framing=150,
    output_reserve=1_024,
)


@dataclass
class WorkerStats:
    name: str
    calls: int = 0
    retries: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    charged: int = 0


@dataclass
class DemoResult:
    session: str
    stats: list[WorkerStats]
    snapshot: Snapshot
    audit: AuditReport
    elapsed: float


def _worker(
    settings: LedgerSettings, session_id: str, name: str, turns: int, seed: int, stats: WorkerStats
) -> None:
    rng = random.Random(seed)
    with Ledger.from_settings(settings) as ledger:
        session = ledger.session(session_id)

        def twice(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
            op = new_op_id()
            first = fn(*args, op_id=op, **kwargs)
            stats.calls += 1
            if rng.random() < 0.2:  # the reply was "lost": the same op id again
                stats.retries += 1
                if fn(*args, op_id=op, **kwargs) != first:
                    raise AssertionError("a retry must get the first outcome back")
            return first

        for turn in range(turns):
            chunks = [
                Item(f"{name}-t{turn}-c{k}", rng.randint(300, 500))
                for k in range(rng.randint(4, 8))
            ]
            try:
                got = twice(session.admit, Consumer.RETRIEVAL, chunks, partial=True)
                stats.charged += got.charged
            except AdmissionRefused as exc:
                stats.refusals[exc.reason] += 1
            tool = f"{name}-t{turn}-tool"
            estimate = rng.randint(500, 4_000)
            try:
                twice(session.reserve, Consumer.SCRATCHPAD, tool, estimate, lease_ms=10_000)
                actual = max(1, int(estimate * rng.uniform(0.5, 1.5)))
                try:
                    done = twice(session.settle, tool, actual, tool)
                    stats.charged += done.charged
                except AdmissionRefused as exc:
                    stats.refusals[exc.reason] += 1
                    twice(session.void, tool)
            except AdmissionRefused as exc:
                stats.refusals[exc.reason] += 1
            if turn >= 2:  # give back what entered two turns ago
                old = [f"{name}-t{turn - 2}-c{k}" for k in range(8)]
                twice(session.release, Consumer.RETRIEVAL, old)
                twice(session.release, Consumer.SCRATCHPAD, [f"{name}-t{turn - 2}-tool"])


def run(settings: LedgerSettings, workers: int = 6, turns: int = 25, seed: int = 7) -> DemoResult:
    """Run the scripted fleet and return what happened (also used by the tests)."""
    session_id = f"demo/{new_op_id()[:8]}"
    with Ledger.from_settings(settings) as ledger:
        ledger.open_session(session_id, BUDGET)
        stats = [WorkerStats(f"w{i}") for i in range(workers)]
        threads = [
            threading.Thread(
                target=_worker, args=(settings, session_id, s.name, turns, seed + i, s)
            )
            for i, s in enumerate(stats)
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        snap = ledger.session(session_id).snapshot()
        report = ledger.audit(session_id)
        ledger.session(session_id).close()
    return DemoResult(session_id, stats, snap, report, elapsed)
