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
import itertools
import statistics
import time
import uuid

import redis

from bench.common import commandstats, emit, evalsha_usec, interleaved
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
    waits = commandstats(r).get("wait", (0, 0))[0]
    return {"wall_us": wall * 1e6, "server_us": evalsha_usec(r), "waits": waits}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with replicated() as (primary, _replica):
        r = redis.Redis(port=primary.port)
        settings = LedgerSettings(redis_url=primary.url, prefix=f"b{uuid.uuid4().hex[:8]}")
        ledgers = {a: Ledger.from_settings(settings.model_copy(update={"replica_acks": a}))
                   for a in (0, 1)}  # fmt: skip
        rnd = itertools.count()
        runs = interleaved(args.rounds, {
            acks: lambda acks=acks, led=led: phase(led, r, f"s{acks}-{next(rnd)}", args.calls)
            for acks, led in ledgers.items()
        })  # fmt: skip
        for led in ledgers.values():
            led.close()
    med = {
        acks: {k: statistics.median(p[k] for p in ph) for k in ph[0]} for acks, ph in runs.items()
    }
    report: dict[str, object] = {
        "calls": args.calls,
        "rounds": args.rounds,
        "plain": med[0],
        "replica_acks_1": med[1],
        "wall_ratio": med[1]["wall_us"] / med[0]["wall_us"],
        "server_ratio": med[1]["server_us"] / med[0]["server_us"],
    }
    emit(report, args.json, lambda _: print(
        f"admit, {args.calls} calls x {args.rounds} rounds (median): "
        f"plain {med[0]['wall_us']:.0f} us/call, replica_acks=1 {med[1]['wall_us']:.0f} "
        f"us/call: x{report['wall_ratio']:.2f} wall; server time per EVALSHA "
        f"{med[0]['server_us']:.1f} vs {med[1]['server_us']:.1f} us "
        f"(x{report['server_ratio']:.2f}); WAITs counted {med[0]['waits']:.0f} vs "
        f"{med[1]['waits']:.0f}"
    ))  # fmt: skip
    return report


if __name__ == "__main__":
    main()
