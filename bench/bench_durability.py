"""The cost of durable writes (``replica_acks``): a call that waits for a replica beside
the same call that does not, in one run, on a primary and a local replica it starts.

    python -m bench.bench_durability [--calls 500] [--rounds 5] [--json]

Each round sends ``calls`` single-item admits with ``replica_acks=0`` and as many with
``replica_acks=1`` (phases interleaved, one session each), and reports the median over
the rounds of: wall time per call of each (client to primary and back, plus WAIT's round
trip to the replica), their ratio, and the primary's server time per EVALSHA (INFO
commandstats, CONFIG RESETSTAT before each phase) beside the WAIT calls it counted. The
replica is on the same machine, so the wait measured is the least a real network adds to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import redis

from ledger import Consumer, Item, Ledger, LedgerSettings, SessionBudget
from ledger.testing import replicated

BUDGET = SessionBudget(window=100_000_000, system_prompt=100)


def phase(led: Ledger, r: redis.Redis, sid: str, calls: int) -> dict[str, float]:
    s = led.open_session(sid, BUDGET)
    r.config_resetstat()
    t0 = time.perf_counter()
    for i in range(calls):
        s.admit(Consumer.RETRIEVAL, [Item(f"i{i}", 1)])
    wall = (time.perf_counter() - t0) / calls
    stats = r.info("commandstats")
    ev = stats["cmdstat_evalsha"]
    waits = stats.get("cmdstat_wait", {}).get("calls", 0)
    return {"wall_us": wall * 1e6, "server_us": ev["usec"] / ev["calls"], "waits": waits}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    with replicated() as (primary, _replica):
        r = redis.Redis(port=primary.port)
        prefix = f"b{uuid.uuid4().hex[:8]}"
        ledgers = {
            acks: Ledger.from_settings(
                LedgerSettings(redis_url=primary.url, prefix=prefix, replica_acks=acks)
            )
            for acks in runs
        }
        try:
            for rnd in range(args.rounds):
                for acks, led in ledgers.items():
                    runs[acks].append(phase(led, r, f"s{acks}-{rnd}", args.calls))
        finally:
            for led in ledgers.values():
                led.close()
            r.close()
    med = {
        acks: {k: statistics.median(p[k] for p in phases) for k in phases[0]}
        for acks, phases in runs.items()
    }
    report: dict[str, object] = {
        "calls": args.calls,
        "rounds": args.rounds,
        "plain": med[0],
        "replica_acks_1": med[1],
        "wall_ratio": med[1]["wall_us"] / med[0]["wall_us"],
        "server_ratio": med[1]["server_us"] / med[0]["server_us"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"admit, {args.calls} calls x {args.rounds} rounds (median): "
            f"plain {med[0]['wall_us']:.0f} us/call, replica_acks=1 {med[1]['wall_us']:.0f} "
            f"us/call: x{report['wall_ratio']:.2f} wall; server time per EVALSHA "
            f"{med[0]['server_us']:.1f} vs {med[1]['server_us']:.1f} us "
            f"(x{report['server_ratio']:.2f}); WAITs counted {med[0]['waits']:.0f} vs "
            f"{med[1]['waits']:.0f}"
        )
    return report


if __name__ == "__main__":
    main()
