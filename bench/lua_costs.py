"""What the pieces of a ledger script cost inside Redis's Lua.

    python -m bench.lua_costs [--n 20000]

Starts its own redis-server and runs each piece of ``bench/lua_costs.lua`` N times
inside one EVALSHA; the cost of a piece is (EVALSHA usec from INFO commandstats -
the same for the empty piece) / N, best of 3. These are warm, in-loop costs: a fresh
call pays them again with cold caches, several times over (see the README).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from ledger.testing import standalone

PIECES = (
    "empty",
    "number to string (..)",
    "number to string (%d)",
    "13-digit number (..)",
    "tonumber",
    "checked integer argument",
    "checked identifier argument",
    "table of 13 strings",
    "reply of 17 parts",
    "closure",
    "TIME",
    "HGET, field present",
    "HGET, field missing",
    "HGET missing, 300-field listpack",
    "HMGET of 14 fields",
    "HSET 1 field, string value",
    "HSET 1 field, number value",
    "HSET 8 fields",
)


def measure(r: redis.Redis, n: int, reps: int = 3) -> dict[str, float]:
    """Nanoseconds per iteration of each piece, the empty loop subtracted."""
    sha = r.script_load(Path(__file__).with_name("lua_costs.lua").read_text())
    r.hset("costs:ht", mapping={f"f{i}": "x" * 80 for i in range(300)})  # > 64 B: hashtable
    r.hset("costs:lp", mapping={f"f{i}": str(i) for i in range(300)})  # short: listpack
    args = ("3f9a0c1b2d4e5f6a7b8c1a", "1764481234")
    raw: dict[str, float] = {}
    for piece in PIECES:
        best = float("inf")
        for _ in range(reps):
            r.config_resetstat()
            r.evalsha(sha, 2, "costs:ht", "costs:lp", piece, n, *args)
            usec = float(r.info("commandstats")["cmdstat_evalsha"]["usec"])
            best = min(best, usec * 1000 / n)
        raw[piece] = best
    base = raw.pop("empty")
    return {piece: ns - base for piece, ns in raw.items()} | {"empty loop": base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=20_000)
    n = ap.parse_args().n
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        costs = measure(r, n)
        encodings = {k: r.object("encoding", k) for k in ("costs:ht", "costs:lp")}
    t = Table(title=f"Lua pieces, warm, in-loop ({n:,} iterations in one call, best of 3)")
    t.add_column("piece")
    t.add_column("ns per use", justify="right")
    for piece, ns in costs.items():
        t.add_row(piece, f"{ns:,.0f}")
    Console().print(t)
    Console().print(f"[dim]scratch hashes: {encodings}[/dim]")


if __name__ == "__main__":
    main()
