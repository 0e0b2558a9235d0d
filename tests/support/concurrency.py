"""Helpers for the concurrency tests (test_concurrency.py, test_concurrency_race.py):
processes started with spawn, a call's outcome as a comparable value, the consumer groups
whose floors the rules protect. No tests here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

from ledger import (
    AdmissionRefused,
    LedgerError,
)

SPAWN = multiprocessing.get_context("spawn")


GROUP = {"working_memory": "w", "retrieval": "m", "recall": "m", "scratchpad": "s"}
REFUSAL_REASONS = {"token_budget_exhausted", "floor_protected"}


def capture(fn: Callable[[], Any]) -> Any:
    """A call's outcome as a comparable value: the result, a refusal, or an error."""
    try:
        return fn()
    except AdmissionRefused as exc:
        return ("refused", exc.reason, exc.requested, exc.free)
    except LedgerError as exc:
        return ("error", type(exc).__name__, str(exc))


@contextlib.contextmanager
def started(processes: list[Any]) -> Iterator[None]:
    """Start processes; on the way out, end those still running (only ours, by object)."""
    try:
        for p in processes:
            p.start()
        yield
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
