"""What grows with the fleet and with a session's history: the costs of docs/scale.md.

    python -m bench.bench_scale [--sessions 10000] [--outcomes 100,1000,10000,50000]
                                [--calls 500] [--rounds 5]

Starts its own redis-server and reports, each as a ratio or bound measured in this
one run:

- admit: server time of a single-item admit beside ``bench/admit_plain.lua`` (HMGET,
  two HINCRBY, XADD), phases interleaved, each on a session holding 1,000 items and
  1,000 retained outcomes (EVALSHA usec per call from INFO commandstats, CONFIG
  RESETSTAT before each phase; median over the rounds); beside it, in the same rounds,
  ``bench/admit_commands.lua`` (admit's Redis commands, no logic) and
  ``bench/admit_lean.lua`` (the least a checked, at-most-once admit does);
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
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
from redis.commands.core import Script

from ledger import Item, Ledger, LedgerSettings, SessionBudget, cli
from ledger.client import Session
from ledger.testing import standalone

BUDGET = SessionBudget(window=100_000_000, system_prompt=100)
RECLAIM = SessionBudget(window=10_000, system_prompt=100, working_memory_floor=0)


def server_us(r: redis.Redis, step: Callable[[int], object], n: int) -> float:
    """EVALSHA usec per call of n steps (the phase's calls only)."""
    r.config_resetstat()
    for i in range(n):
        step(i)
    st = r.info("commandstats")["cmdstat_evalsha"]
    return float(st["usec"]) / float(st["calls"])


def usage(r: redis.Redis, s: Session) -> int:
    """MEMORY USAGE of the session hash and its outcome hashes, in bytes."""
    keys = (s.keys.session, s.keys.outcomes, s.keys.outcomes_old)
    return sum(r.memory_usage(k, samples=0) or 0 for k in keys)


def fill(led: Ledger, s: Session, outcomes: int) -> None:
    """`outcomes` retained outcomes: admit and release one item, in batches."""
    for start in range(0, outcomes, 1000):
        calls = []
        for i in range(start, min(start + 1000, outcomes)):
            if i % 2 == 0:
                calls.append(s.admit_call("scratchpad", [Item("churn", 1)]))
            else:
                calls.append(s.release_call("scratchpad", ["churn"]))
        led.run_many(calls)


def admit_vs_plain(led: Ledger, r: redis.Redis, calls: int, rounds: int) -> dict[str, float]:
    """Server µs per single-item admit: the ledger's, the plain script's, and two
    references: admit's Redis commands alone and the lean checked, at-most-once admit."""
    here = Path(__file__).parent
    plain = r.register_script((here / "admit_plain.lua").read_text())
    refs = {
        n: r.register_script((here / f"admit_{n}.lua").read_text()) for n in ("commands", "lean")
    }
    sessions = {}
    for name in ("ledger", "plain", *refs):
        s = led.open_session(f"admit-{name}", BUDGET)
        for b in range(10):
            led.run_many(
                [s.admit_call("retrieval", [Item(f"held{b}-{i}", 10)]) for i in range(100)]
            )
        sessions[name] = s
    # a scratch stream in the session's hash slot (a key name no script uses)
    p = sessions["plain"]
    audit_key = p.keys.spills + ":bench-audit-stream"
    per: dict[str, list[float]] = {name: [] for name in sessions}
    own = sessions["ledger"]
    for rnd in range(rounds):
        per["ledger"].append(
            server_us(r, lambda i, rnd=rnd: own.admit("retrieval", [Item(f"n{rnd}-{i}", 1)]), calls)
        )
        per["plain"].append(
            server_us(
                r,
                lambda i, rnd=rnd: plain(
                    keys=[p.keys.session, audit_key], args=[f"q{rnd}-{i}", f"n{i}", 1]
                ),
                calls,
            )
        )
        for name, script in refs.items():
            ref = sessions[name]

            def step(i: int, rnd: int = rnd, ref: Session = ref, script: Script = script) -> None:
                c = ref.admit_call("retrieval", [Item(f"n{rnd}-{i}", 1)])
                script(keys=list(c.keys), args=list(c.args))

            per[name].append(server_us(r, step, calls))
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
        fill(led, s, k)
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
