"""Cost at fleet scale: the same load on Redis Clusters of 1, 2 and 3 primaries.

    python -m bench.bench_cluster [--primaries 1,2,3] [--sessions 1500] [--turns 10]
                                  [--threads 4] [--seed 1] [--rounds 1] [--json]

Per size N: a throwaway cluster (ledger.testing.cluster: for N < 3 every slot is given
to the first N of 3 nodes), the scripts loaded, CONFIG RESETSTAT, then one fixed load in
--threads threads: --sessions seeded random ids, each opened, then --turns cycles of
begin_turn, admit, end_turn. Per primary, from INFO commandstats (evalsha, eval, fcall)
and INFO cpu: its share of the calls, server usec per call, the partitions it owns and
the share of the ids in them. capacity(N) = server usec per op of the N=1 cluster / the
busiest primary's at N (N if the calls spread evenly); cpu_capacity: the same of server
CPU time (network I/O included); balance_capacity: 1 / the largest share. --rounds R:
every size R times, interleaved, and the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from bench.common import emit
from ledger import Item, Ledger, LedgerSettings, SessionBudget, scripts
from ledger.testing import cluster

BUDGET = SessionBudget(
    window=100_000, system_prompt=1_000, output_reserve=1_000, release_each_turn={"retrieval"}
)
LEDGER_CMDS = ("evalsha", "eval", "fcall")
PREFIX = "bench-cluster"
METRICS = ("capacity", "cpu_capacity", "balance_capacity")


def drive(url: str, ids: list[str], turns: int) -> None:
    """Open each session and run `turns` cycles of begin_turn/admit/end_turn."""
    with Ledger.from_settings(LedgerSettings(redis_url=url, prefix=PREFIX)) as led:
        for sid in ids:
            s = led.open_session(sid, BUDGET)
            for k in range(turns):
                t = s.begin_turn(working_set=2_000)
                s.admit("retrieval", [Item(f"doc-{k}", 200)])
                s.end_turn(t.turn, final_prompt_tokens=1_200)


def node_stats(r: redis.Redis) -> dict[str, float]:
    cs, cpu = r.info("commandstats"), r.info("cpu")
    led = [cs.get(f"cmdstat_{c}", {}) for c in LEDGER_CMDS]
    return {
        "ledger_calls": sum(int(s.get("calls", 0)) for s in led),
        "ledger_usec": sum(int(s.get("usec", 0)) for s in led),
        "all_calls": sum(int(s["calls"]) for s in cs.values()),
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
    }


def run_size(n: int, ids: list[str], turns: int, threads: int) -> dict[str, Any]:
    with cluster(n) as nodes:
        url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
        rs = [nd.client() for nd in nodes]
        for r in rs:
            for name in scripts.NAMES:
                r.script_load(scripts.source(name))
            r.config_resetstat()  # after setup; the load below is all the stats hold
        settings = LedgerSettings(redis_url=url, prefix=PREFIX)
        with Ledger.from_settings(settings) as led:  # which primary owns each partition
            parts = [led.keyspace.partition_of(sid) for sid in ids]
            owner = [
                led.client.get_node_from_key(led.keyspace.deadlines(p)).port  # type: ignore[union-attr]
                for p in range(settings.partitions)
            ]
        cpu0 = [node_stats(r)["cpu_s"] for r in rs]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            done = [ex.submit(drive, url, ids[i::threads], turns) for i in range(threads)]
        for f in done:
            f.result()  # raises a thread's error
        wall = time.perf_counter() - t0
        stats = [node_stats(r) for r in rs]
        for r in rs:
            r.close()
    ops = len(ids) * (1 + 3 * turns)
    total_calls = sum(s["ledger_calls"] for s in stats)
    prims: list[dict[str, Any]] = []
    for nd, s, c0 in zip(nodes, stats, cpu0, strict=True):
        calls = s["ledger_calls"]
        mine = [q for q, o in enumerate(owner) if o == nd.port]
        prims.append(
            dict(s, port=nd.port, partitions=mine, share=calls / total_calls, cpu_s=s["cpu_s"] - c0)
            | {
                "session_share": sum(1 for q in parts if q in mine) / len(ids),
                "usec_per_call": s["ledger_usec"] / calls if calls else 0.0,
                "usec_per_op": s["ledger_usec"] / ops,
            }
        )
    if total_calls != ops:
        raise RuntimeError(f"{total_calls} ledger calls for {ops} operations")
    usec, cpu = sum(p["ledger_usec"] for p in prims), sum(p["cpu_s"] for p in prims)
    out: dict[str, Any] = dict(primaries=n, partitions=len(owner), ops=ops, wall_s=wall)
    return out | {"ops_per_s": ops / wall, "ledger_usec": usec, "cpu_s": cpu, "nodes": prims}


def add_capacity(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = next(r for r in results if r["primaries"] == 1)
    for r in results:
        r["capacity"] = base["ledger_usec"] / max(p["ledger_usec"] for p in r["nodes"])
        r["balance_capacity"] = 1 / max(p["share"] for p in r["nodes"])
        r["cpu_capacity"] = base["cpu_s"] / max(p["cpu_s"] for p in r["nodes"])
    return results


def table(results: list[dict[str, Any]]) -> str:
    cols = ("N", "primary", "parts", "sess", "calls", "share", "us/call", "server s", "cpu s")
    lines = [" ".join(f"{c:>8}" for c in cols)]
    for r in results:
        for p in r["nodes"]:
            row = [r["primaries"], p["port"], len(p["partitions"]), f"{p['session_share']:.3f}"]
            row += [p["ledger_calls"], f"{p['share']:.3f}", f"{p['usec_per_call']:.1f}"]
            row += [f"{p['ledger_usec'] / 1e6:.3f}", f"{p['cpu_s']:.2f}"]
            lines.append(" ".join(f"{c:>8}" for c in row))
        lines.append(
            f"   N={r['primaries']}, round {r['round']}: {r['ops']} ops in {r['wall_s']:.1f} s "
            f"({r['ops_per_s']:.0f}/s client-bound), server {r['ledger_usec'] / 1e6:.3f} s, "
            f"cpu {r['cpu_s']:.2f} s; capacity {r['capacity']:.2f}x, "
            f"cpu_capacity {r['cpu_capacity']:.2f}x, 1/max share {r['balance_capacity']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--primaries", default="1,2,3")
    ap.add_argument("--sessions", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every size, interleaved")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sizes = sorted({int(x) for x in a.primaries.split(",") if x} | {1})
    rng = random.Random(a.seed)
    ids = [f"agent-{rng.getrandbits(64):016x}" for _ in range(a.sessions)]
    results: list[dict[str, Any]] = []
    for k in range(a.rounds):  # each round: every size, its capacity against its own N=1
        results += add_capacity(
            [run_size(n, ids, a.turns, a.threads) | {"round": k} for n in sizes]
        )
    med = {n: {m: statistics.median(r[m] for r in results if r["primaries"] == n) for m in METRICS}
           for n in sizes}  # fmt: skip
    summary = [f"median of {a.rounds} round(s), N={n}: "
               + ", ".join(f"{m} {v:.2f}x" for m, v in med[n].items()) for n in sizes]  # fmt: skip
    out = {"params": vars(a), "results": results, "median": med}
    emit(out, a.json, lambda _: print("\n".join([table(results), *summary])))


if __name__ == "__main__":
    main()
