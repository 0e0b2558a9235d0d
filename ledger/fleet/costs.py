"""What each scenario's cure cost, read from what its agents did (docs/demo.md): per
column, into the summary (:func:`ledger.fleet.report.summarize`), each figure with
the number it rests on. Scenario 000's (items reclaimed and fetched again) is in
``report.py``; 002's are counts of the run (:class:`ledger.fleet.truncation.Counts`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ledger.fleet import decay, fanout


def spread(xs: Sequence[float], count: str = "n") -> dict[str, Any]:
    """Median and p90 (nearest rank) of `xs`, with their number under the key `count`
    ("sessions" where each x is a session's)."""
    if not xs:
        return {"median": None, "p90": None, count: 0}
    ys = sorted(xs)
    return {
        "median": statistics.median(ys),
        "p90": ys[max(0, math.ceil(0.9 * len(ys)) - 1)],
        count: len(ys),
    }


def decay_costs(runs: Sequence[decay.SessionRun]) -> dict[str, Any]:
    """Scenario 001, every session (the tail's too): the context each hard reset
    discarded; the turns whose begin waited for a compaction and how long (in a
    deployment's ms); the retrieval tokens refused; the naive arbiter's synchronous
    compactions, charged to the turns that ran them."""
    records = [r for run in runs for r in run.records]
    resets = [d for r in records for d in r.discarded]
    waits = [r.wait_ms for r in records if r.wait_ms > 0]
    refused = [r.refused_tokens for r in records if r.refused_tokens]
    sync = [r.compaction_ms for r in records if r.compaction_ms > 0]
    latency = sum(r.latency_ms for r in records)
    return {
        "sessions": len(runs),
        "turns": len(records),
        "resets": len(resets),
        "reset_sessions": sum(1 for run in runs if any(r.discarded for r in run.records)),
        "discarded_tokens": spread([t for t, _ in resets]),
        "discarded_items": spread([i for _, i in resets]),
        "discarded_tokens_total": sum(t for t, _ in resets),
        "waited_turns": len(waits),
        "waited_ms_total": sum(waits),
        "waited_ms": spread(waits),
        "retrieval_refused_turns": len(refused),
        "retrieval_refused_tokens": sum(refused),
        "sync_compaction_turns": len(sync),
        "sync_compaction_ms_total": sum(sync),
        "sync_compaction_ms": spread(sync),
        "sync_compaction_latency_share": sum(sync) / latency if latency else None,
    }


def fanout_costs(rows: Sequence[fanout.TurnRow]) -> dict[str, Any]:
    """Scenario 004: the summarize spans (one a turn) and their share of the turns'
    latency; the same over the turns the guard stopped (summarize and proceed)."""

    def share(rs: Sequence[fanout.TurnRow]) -> dict[str, Any]:
        total = sum(r.latency_ms for r in rs)
        ms = [r.summarize_ms for r in rs]
        return {
            "spans": len(ms),
            "ms_total": sum(ms),
            "ms": spread(ms),
            "latency_share": sum(ms) / total if total else None,
        }

    return {"summarize": share(rows), "guard_summarize": share([r for r in rows if r.guard_stops])}
