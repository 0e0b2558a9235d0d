"""Where a single-item admit's server time goes, step by step.

    python -m bench.admit_steps [--calls 1000] [--rounds 7]

Starts its own redis-server and runs, on sessions of 40 turns, the same admit calls
against ledger/lua/admit.lua stopped at each step, against bench/admit_commands.lua, and
against `return 1`. A step ends at a Redis command admit sends (before or after the
first call of it): the script runs under a `redis` of its own whose `call` throws once
it gets there, and the variant returns 1. Nothing depends on the script's text. The
calls go back to back in pipelines (warm: what a busy server sees), and each variant's
EVALSHA usec per call is taken from INFO commandstats, best and median of the rounds.
A step's cost is the difference to the variant before it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import redis

from bench.bench_core import BENCH_BUDGET
from bench.common import table
from ledger import Item, Ledger, LedgerSettings, scripts
from ledger.testing import standalone

# (step, 'before' or 'after', the first call of this command): where each step ends
STEPS = (
    ("check the 9 arguments", "before", "HMGET"),
    ("read the fields (HMGET)", "after", "HMGET"),
    ("read the outcome, replay, session, epoch, TIME", "after", "TIME"),
    ("the arithmetic, the fields to write", "before", "HSET"),
)
# A `redis` of the variant's own: its `call` throws STOP at the step's end. The chunk
# runs in a pcall, inside the one error wrapper every script runs in.
STOPPED = """local real, STOP, seen = redis, {}, false
local redis = setmetatable({ call = function(cmd, ...)
  if string.upper(cmd) == '%(cmd)s' then
    if '%(when)s' == 'before' then error(STOP) end
    seen = true
  end
  local r = real.call(cmd, ...)
  if seen then error(STOP) end
  return r
end }, { __index = real })
local ok, e = pcall(function()
%(chunk)s
end)
if e == STOP then return 1 end
error(ok and 'the step never came: admit sent no %(cmd)s' or e, 0)
"""


def stopped(when: str, cmd: str) -> str:
    """admit.lua stopped before or after its first call of `cmd`, returning 1."""
    body = (scripts.lua_dir() / "admit.lua").read_text()
    chunk = scripts.prelude(body) + "\n" + body
    return scripts.wrap(STOPPED % {"cmd": cmd, "when": when, "chunk": chunk})


def variants() -> dict[str, str]:
    """name -> Lua source: the floor, the commands alone, the prelude, then admit stopped
    at each step, then the whole of it (each under the error wrapper)."""
    prelude = scripts.prelude((scripts.lua_dir() / "admit.lua").read_text())
    out = {
        "return 1": "return 1",
        "admit's commands alone": Path(__file__).with_name("admit_commands.lua").read_text(),
        "prelude (the _common.lua it uses)": scripts.wrap(prelude + "\nreturn 1\n"),
    }
    out.update({name: stopped(when, cmd) for name, when, cmd in STEPS})
    out["outcome record, reply, HSETs"] = scripts.source("admit")
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
    rows, prev = [], None
    for name, v in per.items():
        best = min(v)
        step = "" if prev is None or name == "admit's commands alone" else f"{best - prev:+.2f}"
        rows.append([name, f"{best:.2f}", f"{statistics.median(v):.2f}", step])
        prev = prev if name == "admit's commands alone" else best
    title = f"admit, step by step (warm, {a.calls} calls x {a.rounds} rounds)"
    table(title, ["variant", "µs/call best", "median", "step (best)"], rows)


if __name__ == "__main__":
    main()
