"""Server time of the rule scripts (docs/rules.md), from INFO commandstats.

    python -m bench.bench_rules [--n 1000]

Starts its own redis-server; each phase runs N calls on a fresh session of a
huge window (so nothing is refused) holding 20 working-memory items, and reports
EVALSHA usec per call (median of 3), beside a bare `return 1`.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import redis

from bench.common import phase_usec
from ledger import Item, Ledger, LedgerSettings, SessionBudget
from ledger.testing import standalone

BUDGET = SessionBudget(
    window=100_000_000,
    system_prompt=100,
    high_water_mark=1.0,
    eviction_threshold=1.0,
    amplification_pathological=1000.0,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1000)
    n = ap.parse_args().n
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        led = Ledger.from_settings(LedgerSettings(redis_url=srv.url, prefix="bench-rules"))
        count = 0

        def session() -> object:
            nonlocal count
            count += 1
            s = led.open_session(f"s{count}", BUDGET)
            s.admit("working_memory", [Item(f"w{i}", 10) for i in range(20)])
            return s

        def phase(
            name: str,
            setup: Callable[[], object],
            step: Callable[[object, int], object],
            per_call: int = 1,
        ) -> None:
            res = []
            for _ in range(3):
                s = setup()
                res.append(phase_usec(r, lambda s=s: [step(s, i) for i in range(n)]) * per_call)
            print(f"{name:34s} {statistics.median(res):8.1f} us/call")

        ret1 = r.register_script("return 1")
        phase("return 1 (floor)", lambda: None, lambda s, i: ret1())
        phase("begin_turn, ok regime", session, lambda s, i: s.begin_turn(100))  # type: ignore[attr-defined]

        def turn_pair(s: object, i: int) -> None:
            t = s.begin_turn(100)  # type: ignore[attr-defined]
            s.end_turn(t.turn, 500)  # type: ignore[attr-defined]

        phase("begin_turn + end_turn (mean of both)", session, turn_pair)

        def spans_setup() -> object:
            s = session()
            s.begin_turn(0)  # type: ignore[attr-defined]
            return s

        phase("record_span", spans_setup, lambda s, i: s.record_span(1, "recall", 10, 1))  # type: ignore[attr-defined]
        phase(
            "admit_tool_result (whole)",
            session,
            lambda s, i: s.admit_tool_result(f"c{i}", 10, b"{}"),
        )  # type: ignore[attr-defined]

        def compact_setup() -> object:
            s = session()
            s.admit("working_memory", [Item(f"x{i}", 10) for i in range(n)])  # type: ignore[attr-defined]
            return s

        phase(
            "compact (one item replaced)",
            compact_setup,
            lambda s, i: s.compact([f"x{i}"], Item(f"sum{i}", 5)),
        )  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
