"""What the pieces of a ledger script cost inside Redis's Lua.

    python -m bench.lua_costs [--n 20000]
    python -m bench.lua_costs --against <git revision> [--n 1000] [--reps 20]

Runs each piece of ``bench/lua_costs.lua`` N times inside one EVALSHA on its own
redis-server: (EVALSHA usec - the same for the empty piece) / N, best of 3; warm,
in-loop costs (a fresh call pays them again with cold caches).

``--against REV``: the server time of whole scripts (admit of one item, begin_turn,
end_turn) as assembled at git revision REV and in the working tree: N calls a phase on a
fresh session, sent back to back in pipelines of 100; both versions back to back in each
repetition (which runs first alternates), a warm-up round dropped; medians, and the
median ratio working tree / REV within each pair (end_turn's phase opens each turn with
an EVAL of begin_turn, which the evalsha line does not count).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import itertools
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench.common import ROOT, phase_usec, table
from ledger import Item, Ledger, SessionBudget, protocol, scripts
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
    "error wrapper (xpcall)",
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
    raw = {
        piece: min(phase_usec(r, lambda piece=piece: r.evalsha(sha, 2, "costs:ht", "costs:lp",
                                                               piece, n, *args)) * 1000 / n
                   for _ in range(reps))
        for piece in PIECES
    }  # fmt: skip
    base = raw.pop("empty")
    return {piece: ns - base for piece, ns in raw.items()} | {"empty loop": base}


# --- whole scripts: a git revision against the working tree ---------------------------

COMPARED = ("admit", "begin_turn", "end_turn")
# Window large enough that no call is refused; a final prompt of S + T: no drift.
BUDGET = SessionBudget(window=100_000_000, system_prompt=2_100, tool_framing=150)
FINAL_PROMPT = 2_250


def sources_at(rev: str, names: tuple[str, ...] = COMPARED) -> dict[str, str]:
    """Each script's text as sent to Redis at git revision `rev`: that revision's
    loader (ledger/scripts.py) run on that revision's scripts (ledger/lua, or lua before
    they moved into the package)."""
    tree = ["git", "-C", str(ROOT), "ls-tree", rev, "ledger/lua"]
    listed = subprocess.run(tree, capture_output=True, text=True).stdout
    folder = "ledger/lua" if listed.startswith("040000") else "lua"
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, folder, "ledger/scripts.py"],
        check=True,
        capture_output=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
            tf.extractall(tmp, filter="data")
        spec = importlib.util.spec_from_file_location(
            "_scripts_at_rev", Path(tmp, "ledger", "scripts.py")
        )
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        try:
            spec.loader.exec_module(mod)
            mod.lua_dir = lambda: Path(tmp, folder)  # type: ignore[attr-defined]
            return {name: str(mod.source(name)) for name in names}
        finally:
            del sys.modules[spec.name]


def _phase(
    led: Ledger, name: str, sha: str, n: int, seq: Callable[[], int], older: bool = False
) -> float:
    """Server usec per EVALSHA of `sha` (one version of script `name`) over n calls,
    built beforehand and sent back to back in pipelines of 100; `older`: a version from
    before the reclaim-order index, sent without its key."""
    r: redis.Redis = led.client  # type: ignore[assignment]
    s = led.open_session(f"cmp{seq()}", BUDGET)
    sends: list[tuple[str, protocol.Call[Any]]] = []  # (sha, or '' for EVAL of begin_turn)
    for k in range(1, n + 1):
        if name == "admit":
            sends.append((sha, s.admit_call("retrieval", [Item(f"i{k}", 1)])))
        elif name == "begin_turn":
            sends.append((sha, s.begin_turn_call(100)))
        else:  # a fresh session: the k-th begin_turn opens turn k
            sends += [("", s.begin_turn_call(100)), (sha, s.end_turn_call(k, FINAL_PROMPT))]
    begin = scripts.source("begin_turn")
    try:
        r.config_resetstat()
        for lo in range(0, len(sends), 100):
            with r.pipeline(transaction=False) as pipe:
                for h, c in sends[lo : lo + 100]:
                    if h:
                        ks = [k for k in c.keys if not (older and ":order:" in k)]
                        pipe.evalsha(h, len(ks), *ks, *c.args)
                    else:
                        pipe.eval(begin, len(c.keys), *c.keys, *c.args)
                pipe.execute()
        st = r.info("commandstats")["cmdstat_evalsha"]
        if int(st["calls"]) != n or int(st.get("failed_calls", 0)):
            raise RuntimeError(f"{name}: {st} for n={n}: another client, or a refused call")
        return float(st["usec"]) / n
    finally:
        r.delete(s.keys.session)


def compare(led: Ledger, rev: str, n: int, reps: int) -> dict[str, dict[str, float]]:
    """{script: {rev usec, working tree usec, ratio}}: medians over reps of each
    version's usec per call and of the ratio within each pair of back-to-back phases."""
    r: redis.Redis = led.client  # type: ignore[assignment]
    versions = {"rev": sources_at(rev), "tree": {m: scripts.source(m) for m in COMPARED}}
    sha = {(m, v): r.script_load(src[m]) for v, src in versions.items() for m in COMPARED}
    older = {v: "order:%s" not in src["admit"] for v, src in versions.items()}
    per: dict[tuple[str, str], list[float]] = {u: [] for u in sha}
    ratios: dict[str, list[float]] = {m: [] for m in COMPARED}
    counter = itertools.count()
    for rep in range(reps + 1):  # round 0 warms up and is dropped
        k = rep % len(COMPARED)
        for name in COMPARED[k:] + COMPARED[:k]:
            pair = ("rev", "tree") if rep % 2 else ("tree", "rev")
            size = n if rep else min(n, 200)
            got = {
                v: _phase(led, name, sha[(name, v)], size, counter.__next__, older[v]) for v in pair
            }
            if rep:
                for v, usec in got.items():
                    per[(name, v)].append(usec)
                ratios[name].append(got["tree"] / got["rev"])
    med = statistics.median
    return {m: {"rev": med(per[(m, "rev")]), "tree": med(per[(m, "tree")]), "ratio": med(ratios[m])}
            for m in COMPARED}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--n", type=int, default=None, help="iterations (default 20000; 1000 with --against)"
    )
    ap.add_argument("--against", metavar="REV", help="compare whole scripts with git revision REV")
    ap.add_argument("--reps", type=int, default=20, help="repetitions with --against (median)")
    a = ap.parse_args()
    if a.against:
        n = a.n or 1_000
        with standalone() as srv, Ledger.from_url(srv.url) as led:
            res = compare(led, a.against, n, a.reps)
        table(
            f"Server time per EVALSHA, {a.against} vs working tree ({n:,} calls per phase, "
            f"median of {a.reps}, interleaved)",
            ["script", f"{a.against} us", "working tree us", "ratio"],
            [
                [m, f"{v['rev']:.2f}", f"{v['tree']:.2f}", f"{v['ratio']:.3f}"]
                for m, v in res.items()
            ],
        )
        return
    n = a.n or 20_000
    with standalone() as srv:
        r = redis.Redis.from_url(srv.url)
        costs = measure(r, n)
        encodings = {k: r.object("encoding", k) for k in ("costs:ht", "costs:lp")}
    table(
        f"Lua pieces, warm, in-loop ({n:,} iterations in one call, best of 3)",
        ["piece", "ns per use"],
        [[piece, f"{ns:,.0f}"] for piece, ns in costs.items()],
    )
    print(f"scratch hashes: {encodings}")


if __name__ == "__main__":
    main()
