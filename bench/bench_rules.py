"""Server time of the rule scripts (docs/rules.md), from INFO commandstats.

    python -m bench.bench_rules [--n 1000]

Starts its own redis-server; each phase runs N calls on a fresh session of a
huge window (so nothing is refused) holding 20 working-memory items, and reports
EVALSHA usec per call (median of 3), beside a bare `return 1`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable
from typing import Any

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
        count = itertools.count()

        def session(extra: int = 0, turn: bool = False) -> Any:
            s = led.open_session(f"s{next(count)}", BUDGET)
            s.admit("working_memory", [Item(f"w{i}", 10) for i in range(20)])
            if extra:
                s.admit("working_memory", [Item(f"x{i}", 10) for i in range(extra)])
            if turn:
                s.begin_turn(0)
            return s

        def turn_pair(s: Any, i: int) -> None:
            t = s.begin_turn(100)
            s.end_turn(t.turn, 500)

        ret1 = r.register_script("return 1")
        phases: list[tuple[str, Callable[[], Any], Callable[[Any, int], object]]] = [
            ("return 1 (floor)", lambda: None, lambda s, i: ret1()),
            ("begin_turn, ok regime", session, lambda s, i: s.begin_turn(100)),
            ("begin_turn + end_turn (mean of both)", session, turn_pair),
            ("record_span", lambda: session(turn=True),
             lambda s, i: s.record_span(1, "recall", 10, 1)),
            ("admit_tool_result (whole)", session,
             lambda s, i: s.admit_tool_result(f"c{i}", 10, b"{}")),
            ("compact (one item replaced)", lambda: session(extra=n),
             lambda s, i: s.compact([f"x{i}"], Item(f"sum{i}", 5))),
        ]  # fmt: skip

        def usec(setup: Callable[[], Any], step: Callable[[Any, int], object]) -> float:
            s = setup()
            return phase_usec(r, lambda: [step(s, i) for i in range(n)])

        for name, setup, step in phases:
            res = [usec(setup, step) for _ in range(3)]
            print(f"{name:34s} {statistics.median(res):8.1f} us/call")


if __name__ == "__main__":
    main()
