"""Where a single-item admit's server time goes, step by step.

    python -m bench.admit_steps [--calls 1000] [--rounds 7]

Starts its own redis-server and runs, on sessions of 40 turns, the same admit calls
against ledger/lua/admit.lua cut short after each step (`return 1` in place of the rest),
against bench/admit_commands.lua, and against `return 1`. The calls go back to back
in pipelines (warm: what a busy server sees), and each variant's EVALSHA usec per
call is taken from INFO commandstats, best and median of the rounds. A step's cost
is the difference to the variant before it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from ledger import Item, Ledger, LedgerSettings, scripts
from ledger.testing import standalone

from .bench_core import BENCH_BUDGET

# Each step ends before the line that starts with this text (ledger/lua/admit.lua).
STEPS = (
    ("prelude (the _common.lua it uses)", "local op, fp, epoch, tok = op_args('admit', false)"),
    ("check the 9 arguments", "local key = KEYS[1]"),
    ("read the fields (HMGET)", "local again = gate(recorded(op)"),
    ("read the outcome, replay, session, epoch, TIME", "local a, floor, sq, fr"),
    ("the arithmetic", "local J = {"),
    ("outcome record, reply, HSETs", None),
)


def variants() -> dict[str, str]:
    """name -> Lua source: the floor, the commands alone, then admit cut after each step
    (each under the error wrapper every script runs in)."""
    body = (scripts.lua_dir() / "admit.lua").read_text()
    full = scripts.source("admit")
    lines = (scripts.prelude(body) + "\n" + body).split("\n")
    out = {
        "return 1": "return 1",
        "admit's commands alone": Path(__file__).with_name("admit_commands.lua").read_text(),
    }
    for name, marker in STEPS:
        if marker is None:
            out[name] = full
            continue
        cut = next((i for i, line in enumerate(lines) if line.startswith(marker)), None)
        if cut is None:
            raise ValueError(f"ledger/lua/admit.lua has no line starting {marker!r}: update STEPS")
        out[name] = scripts.wrap("\n".join(lines[:cut]) + "\nreturn 1\n")
    return out


def measure(url: str, calls: int, rounds: int) -> dict[str, list[float]]:
    r = redis.Redis.from_url(url)
    led = Ledger.from_settings(LedgerSettings(redis_url=url, prefix="bench-steps"))
    shas = {name: r.script_load(src) for name, src in variants().items()}
    per: dict[str, list[float]] = {name: [] for name in shas}
    for rnd in range(rounds):
        for k, (name, sha) in enumerate(shas.items()):
            s = led.open_session(f"steps{rnd}.{k}", BENCH_BUDGET)
            for t in range(40):
                s.admit("retrieval", [Item(f"t{t}.{j}", 1) for j in range(3)])
            built = [s.admit_call("retrieval", [Item(f"i{j}", 1)]) for j in range(calls)]
            pipe = r.pipeline(transaction=False)
            for c in built:
                pipe.evalsha(sha, len(c.keys), *c.keys, *c.args)
            r.config_resetstat()
            pipe.execute()
            per[name].append(float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]))
    led.close()
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    with standalone() as srv:
        per = measure(srv.url, a.calls, a.rounds)
    t = Table(title=f"admit, step by step (warm, {a.calls} calls x {a.rounds} rounds)")
    for col in ("variant", "µs/call best", "median", "step (best)"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    prev: float | None = None
    for name, v in per.items():
        best = min(v)
        step = "" if prev is None or name == "admit's commands alone" else f"{best - prev:+.2f}"
        t.add_row(name, f"{best:.2f}", f"{statistics.median(v):.2f}", step)
        if name != "admit's commands alone":
            prev = best
    Console().print(t)


if __name__ == "__main__":
    main()
