"""What grows with the fleet and with a session's history: the costs of docs/scale.md.

    python -m bench.bench_scale [--sessions 10000] [--outcomes 100,1000,10000,50000]
                                [--calls 500] [--rounds 5]

Starts its own redis-server and reports, each as a ratio or bound measured in this
one run:

- admit: server time of a single-item admit beside ``bench/admit_plain.lua`` (HMGET,
  two HINCRBY, XADD), ``bench/admit_commands.lua`` (admit's Redis commands, no logic)
  and ``bench/admit_lean.lua`` (the least a checked, at-most-once admit does), phases
  interleaved, each on a session holding 1,000 items and 1,000 retained outcomes
  (EVALSHA usec per call from INFO commandstats; median over the rounds);
- a reclaiming begin_turn's server time on a session holding 5 scratchpad items and
  K retained outcomes, beside a fresh one (K = 0), median of the rounds;
- Redis memory per retained outcome: MEMORY USAGE of the session's keys (session
  hash and outcome hashes) with K outcomes, minus the same before them, divided by K;
- ``ledger top --once`` and ``ledger audit`` wall time at N sessions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from bench import bench_turn
from bench.common import interleaved, phase_usec
from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from ledger.client import Session
from ledger.testing import standalone

BUDGET = SessionBudget(window=100_000_000, system_prompt=100)
RECLAIM = SessionBudget(window=10_000, system_prompt=100, working_memory_floor=0)


def server_us(r: redis.Redis, step: Callable[[int], object], n: int) -> float:
    """EVALSHA usec per call of n steps (the phase's calls only)."""
    return phase_usec(r, lambda: [step(i) for i in range(n)])


def usage(r: redis.Redis, s: Session) -> int:
    """MEMORY USAGE of the session hash and its outcome hashes, in bytes."""
    keys = (s.keys.session, s.keys.outcomes, s.keys.outcomes_old)
    return sum(r.memory_usage(k, samples=0) or 0 for k in keys)


def admit_vs_plain(led: Ledger, r: redis.Redis, calls: int, rounds: int) -> dict[str, float]:
    """Server µs per single-item admit: the ledger's, the plain script's, and two
    references: admit's Redis commands alone and the lean checked, at-most-once admit."""
    script = {n: r.register_script(Path(__file__).with_name(f"admit_{n}.lua").read_text())
              for n in ("plain", "commands", "lean")}  # fmt: skip
    sessions = {name: led.open_session(f"admit-{name}", BUDGET) for name in ("ledger", *script)}
    for s in sessions.values():
        bench_turn.fill(led, s, 1000, 1000)
    # the plain script's audit: a scratch stream in the session's hash slot
    p = sessions["plain"]
    audit_key = p.keys.spills + ":bench-audit-stream"

    def phase(name: str, rnd: int) -> Callable[[int], object]:
        s = sessions[name]
        if name == "ledger":
            return lambda i: s.admit("retrieval", [Item(f"n{rnd}-{i}", 1)])
        if name == "plain":
            return lambda i: script["plain"](keys=[p.keys.session, audit_key],
                                             args=[f"q{rnd}-{i}", f"n{i}", 1])  # fmt: skip

        def step(i: int) -> None:
            c = s.admit_call("retrieval", [Item(f"n{rnd}-{i}", 1)])
            # the lean script reads the session and the outcome hashes of admit's KEYS
            keys = [c.keys[0], *c.keys[3:5]] if name == "lean" else list(c.keys)
            script[name](keys=keys, args=list(c.args))

        return step

    rnd = itertools.count()
    per = interleaved(
        rounds, {n: lambda n=n: server_us(r, phase(n, next(rnd)), calls) for n in sessions}
    )
    med = {name: statistics.median(v) for name, v in per.items()}
    return {**{f"{n}_us": v for n, v in med.items()}, "ratio": med["ledger"] / med["plain"]}


def begin_turn_reclaim(
    led: Ledger, r: redis.Redis, outcomes: list[int], rounds: int
) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for k in [0, *outcomes]:
        s = led.open_session(f"reclaim-{k}", RECLAIM)
        s.admit("scratchpad", [Item(f"keep{i}", 100) for i in range(3)])
        before = usage(r, s)
        bench_turn.fill(led, s, 0, k)
        after = usage(r, s)
        times = []
        for rnd in range(rounds):
            s.admit("scratchpad", [Item(f"big{rnd}-{i}", 2000) for i in range(2)])
            times.append(server_us(r, lambda i, s=s: s.begin_turn(7_000), 1))
        out[k] = {
            "us": statistics.median(times),
            "bytes_per_outcome": (after - before) / k if k else 0.0,
            "fields": float(r.hlen(s.keys.session)),
        }
    return out


def operator_views(url: str, sessions: int) -> dict[str, float]:
    prefix = f"scale{uuid.uuid4().hex[:6]}"
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=prefix)) as led:
        budget = SessionBudget(window=100_000, system_prompt=10)
        for start in range(0, sessions, 500):
            led.run_many(
                [
                    led.open_call(f"agent-{i:06d}", budget, None)
                    for i in range(start, min(start + 500, sessions))
                ]
            )
    res = {}
    for name, argv in (("top", ["top", "--once"]), ("audit", ["audit"])):
        with contextlib.redirect_stdout(io.StringIO()):
            t = time.perf_counter()
            code = cli.main(["--url", url, "--prefix", prefix, *argv])
            res[name] = time.perf_counter() - t
        assert code == cli.EXIT_OK, (name, code)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--outcomes", default="100,1000,10000,50000")
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ks = [int(x) for x in a.outcomes.split(",") if x]
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        settings = LedgerSettings(
            redis_url=srv.url, prefix="bench-scale", op_retention_seconds=3600
        )
        with Ledger.from_settings(settings) as led:
            adm = admit_vs_plain(led, r, a.calls, a.rounds)
            plain_us = adm["plain_us"]
            print(
                f"admit {adm['ledger_us']:.1f} us, plain {plain_us:.1f} us: "
                f"{adm['ratio']:.2f}x (target <= 1.5x); admit's commands alone "
                f"{adm['commands_us'] / plain_us:.2f}x, lean checked admit "
                f"{adm['lean_us'] / plain_us:.2f}x"
            )
            rec = begin_turn_reclaim(led, r, ks, a.rounds)
            base = rec[0]["us"]
            for k, v in rec.items():
                print(
                    f"reclaiming begin_turn, {k:6d} outcomes ({v['fields']:.0f} fields): "
                    f"{v['us']:8.1f} us ({v['us'] / base:.1f}x fresh)"
                    + (f", {v['bytes_per_outcome']:.0f} B/outcome" if k else "")
                )
        views = operator_views(srv.url, a.sessions)
        print(
            f"{a.sessions} sessions: top --once {views['top']:.2f} s (target <= 1 s), "
            f"audit {views['audit']:.2f} s (target <= 3 s)"
        )


if __name__ == "__main__":
    main()
