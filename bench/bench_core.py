"""Core benchmark of the ledger on one Redis server, in one process and one run.

    python -m bench.bench_core [--n N] [--reps R] [--json]

It starts its own redis-server and measures:

1. Server time per script call (SERVER_PHASES): N calls after CONFIG RESETSTAT, then
   EVALSHA usec / calls from INFO commandstats, each phase's set-up done before; phases
   interleaved over the repetitions, median reported; the other commandstats lines give
   the commands each script issues per call; the static ``redis.call(`` sites as well.
2. Client throughput in a plain loop (CLIENT_LOOPS): ops/s, wall and CPU per op of a bare
   ``evalsha`` of ``return 1``, of ``session.admit`` and of a bare ``evalsha`` of the
   admit script with pre-built arguments; and the client CPU of the pieces of one call
   without I/O (CPU_PARTS).
3. Memory: MEMORY USAGE of a freshly opened session hash and of one after 40 turns of
   (admit 3 items, release 1).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis
from tenacity import Retrying

from bench.common import commandstats, emit, environment, interleaved, machine, steal_during, table
from ledger import Item, Ledger, SessionBudget, protocol, scripts
from ledger.client import Session
from ledger.testing import standalone

Body = Callable[[], None]

# Large window so that no phase is ever refused (16 x N one-token items per session).
BENCH_BUDGET = SessionBudget(window=100_000_000, system_prompt=2_100, tool_framing=150,
                             working_memory_floor=6_000, output_reserve=1_024)  # fmt: skip
MEMORY_BUDGET = BENCH_BUDGET.model_copy(update={"window": 128_000})  # a realistic session
LEASE_MS = 3_600_000
TURNS = 40

# phase name -> (what it is, Lua file it runs)
SERVER_PHASES: dict[str, tuple[str, str | None]] = {
    "return1": ("bare `return 1` script (floor)", None),
    "prelude_return1": ("admit's prelude (the _common.lua it uses) + return 1", "_common.lua"),
    "admit_commands": ("admit's HMGET, TIME and HSET alone, constant values", None),
    "admit_1": ("admit 1 new item per call", "admit.lua"),
    "return1_warm": ("return 1, calls back to back in pipelines of 100 (warm)", None),
    "admit_commands_warm": ("admit_commands, back to back in pipelines of 100 (warm)", None),
    "admit_1_warm": ("admit 1 item, back to back in pipelines of 100 (warm)", "admit.lua"),
    "admit_16": ("admit a batch of 16 items", "admit.lua"),
    "release_1": ("release 1 item", "release.lua"),
    "reserve": ("reserve (estimate 1 token)", "reserve.lua"),
    "settle": ("settle a reservation to an item", "settle.lua"),
    "snapshot": (f"snapshot, session after {TURNS} turns", "snapshot.lua"),
}
CLIENT_LOOPS: dict[str, str] = {
    "bare_evalsha": "redis-py r.evalsha(sha of 'return 1', 0)",
    "ledger_admit": 'session.admit("retrieval", [Item(f"i{k}", 1)])',
    "raw_admit": "redis-py r.evalsha(sha of admit, 1, *keys, *args), pre-built calls",
}
CPU_PARTS: dict[str, str] = {
    "tenacity": "for attempt in Retrying(**ledger.retry_policy()): with attempt: pass",
    "build_call": 'session.admit_call("retrieval", [Item(f"i{k}", 1)]) (op id, checks, blake2b)',
    "parse_reply": "call.parse(protocol.decode(raw_reply))",
}
IGNORED_STATS = ("evalsha", "info", "config")


def prelude_sites(lua: str) -> int:
    """`redis.call(` sites in the part of _common.lua prepended to the script `lua`."""
    if lua == "_common.lua":
        body = (scripts.lua_dir() / "admit.lua").read_text()  # the prelude_return1 phase
    else:
        body = (scripts.lua_dir() / lua).read_text()
    return scripts.strip_comments(scripts.prelude(body)).count("redis.call(")


def static_redis_calls() -> dict[str, int]:
    """Occurrences of `redis.call(` in every Lua file (comments included: there are none)."""
    d = scripts.lua_dir()
    return {p.name: p.read_text().count("redis.call(") for p in sorted(d.glob("*.lua"))}


# --- the benchmark -------------------------------------------------------------------


class Bench:
    def __init__(self, led: Ledger, n: int, reps: int) -> None:
        self.led = led
        self.r: redis.Redis = led.client  # type: ignore[assignment]
        self.n = n
        self.reps = reps
        self.bare = self.r.register_script("return 1")
        admit_body = (scripts.lua_dir() / "admit.lua").read_text()
        self.prelude_bare = self.r.register_script(scripts.prelude(admit_body) + "\nreturn 1")
        self.admit_commands = self.r.register_script(
            (Path(__file__).with_name("admit_commands.lua")).read_text()
        )
        self.admit_script = self.r.register_script(scripts.source("admit"))
        for script in (self.bare, self.admit_commands, self.admit_script):
            self.r.script_load(script.script)  # the warm phases send bare EVALSHA
        self._seq = itertools.count()
        self._pending: tuple[Session, list[str]] | None = None
        self._keys: list[str] = []

    # -- helpers

    def session(self, budget: SessionBudget = BENCH_BUDGET) -> Session:
        s = self.led.open_session(f"b{next(self._seq)}", budget)
        self._keys.append(s.keys.session)
        return s

    def drop_sessions(self) -> None:
        """Delete the sessions made so far (between phases, never inside a measurement)."""
        if self._keys:
            self.r.delete(*self._keys)
            self._keys.clear()

    @staticmethod
    def turns(s: Session, count: int, tokens: int = 1) -> None:
        for k in range(count):
            s.admit("retrieval", [Item(f"t{k}.{j}", tokens) for j in range(3)])
            s.release("retrieval", [f"t{k}.0"])

    def server_stats(self) -> dict[str, Any]:
        """EVALSHA's calls, usec and failed calls, and {command: (calls, usec)} of the rest."""
        ev = self.r.info("commandstats").get("cmdstat_evalsha", {})
        figures = {k: int(ev.get(k, 0)) for k in ("calls", "usec", "failed_calls")}
        return figures | {"inner": commandstats(self.r, IGNORED_STATS)}

    def _admit_calls(self, n: int) -> list[tuple[tuple[str, ...], tuple[Any, ...]]]:
        """KEYS and ARGV of n single-item admits on a new session, built beforehand."""
        s = self.session()
        built = [s.admit_call("retrieval", [Item(f"i{k}", 1)]) for k in range(n)]
        return [(c.keys, c.args) for c in built]

    def _warm(self, sha: str, calls: list[tuple[tuple[str, ...], tuple[Any, ...]]]) -> Body:
        """Calls sent back to back in pipelines of 100: Redis runs them one after the
        other, its caches warm, as on a busy server."""

        def body() -> None:
            for lo in range(0, len(calls), 100):
                with self.r.pipeline(transaction=False) as pipe:
                    for keys, args in calls[lo : lo + 100]:
                        pipe.evalsha(sha, len(keys), *keys, *args)
                    pipe.execute()

        return body

    @staticmethod
    def _each(xs: Iterable[Any], step: Callable[[Any], object]) -> Body:
        def body() -> None:
            for x in xs:
                step(x)

        return body

    # -- server phases: each does its set-up and returns the loop to measure

    def phase(self, name: str, n: int) -> Body:
        each = self._each
        if name == "return1":
            return each(range(n), lambda _: self.bare())
        if name == "prelude_return1":
            return each(range(n), lambda _: self.prelude_bare())
        if name == "admit_commands":  # the calls admit_1 would send: same keys, same ARGV
            script = self.admit_commands
            return each(self._admit_calls(n), lambda c: script(keys=c[0], args=c[1]))
        if name == "return1_warm":
            return self._warm(self.bare.sha, [((), ())] * n)
        if name.endswith("_warm"):
            script = self.admit_commands if name == "admit_commands_warm" else self.admit_script
            return self._warm(script.sha, self._admit_calls(n))
        if name == "settle":
            assert self._pending is not None, "settle runs right after reserve"
            s, rids = self._pending
            self._pending = None
            return each(enumerate(rids), lambda kr: s.settle(kr[1], 1, f"x{kr[0]}"))
        s = self.session()
        if name == "admit_1":
            return each(range(n), lambda k: s.admit("retrieval", [Item(f"i{k}", 1)]))
        if name == "admit_16":
            batches = [[Item(f"b{k}.{j}", 1) for j in range(16)] for k in range(n)]
            return each(batches, lambda b: s.admit("retrieval", b))
        if name == "release_1":
            ids = [f"i{k}" for k in range(n)]
            for lo in range(0, n, 1000):
                s.admit("retrieval", [Item(i, 1) for i in ids[lo : lo + 1000]])
            return each(ids, lambda i: s.release("retrieval", [i]))
        if name == "reserve":
            rids = [f"r{k}" for k in range(n)]
            self._pending = (s, rids)
            return each(rids, lambda rid: s.reserve("retrieval", rid, 1, lease_ms=LEASE_MS))
        assert name == "snapshot", name
        self.turns(s, TURNS)
        return each(range(n), lambda _: s.snapshot())

    def run_server_phase(self, name: str, n: int) -> dict[str, Any]:
        body = self.phase(name, n)
        self.r.config_resetstat()
        body()
        stats = self.server_stats()
        if name != "reserve":  # settle still needs the reservations
            self.drop_sessions()
        return stats

    def server(self, phases: Iterable[str] = SERVER_PHASES) -> dict[str, Any]:
        names = list(phases)
        # Warm-up: loads every script (no NOSCRIPT inside a measurement), warms caches.
        for name in names:
            self.run_server_phase(name, min(self.n, 200))
        units = {p: [p, "settle"] if p == "reserve" else [p] for p in names if p != "settle"}
        got = interleaved(self.reps, {
            u: lambda ps=ps: [self.run_server_phase(p, self.n) for p in ps]
            for u, ps in units.items()
        })  # fmt: skip
        raw = {p: [res[i] for res in got[u]] for u, ps in units.items() for i, p in enumerate(ps)}
        static = static_redis_calls()
        out: dict[str, Any] = {}
        for name in names:
            (what, lua), runs = SERVER_PHASES[name], raw[name]
            per = [r["usec"] / r["calls"] if r["calls"] else 0.0 for r in runs]
            in_cmds = [sum(u for _, u in r["inner"].values()) / r["calls"] if r["calls"] else 0.0
                       for r in runs]  # fmt: skip
            total_calls = sum(r["calls"] for r in runs)
            inner_tot: dict[str, int] = {}
            for cmd, (c, _) in (kv for r in runs for kv in r["inner"].items()):
                inner_tot[cmd] = inner_tot.get(cmd, 0) + c
            warnings = (
                [
                    f"evalsha calls per repetition {[r['calls'] for r in runs]} != n={self.n}: "
                    "another client used the server, or a script was reloaded"
                ]
                if any(r["calls"] != self.n for r in runs)
                else []
            )
            if any(r["failed_calls"] for r in runs):
                warnings.append(f"failed evalsha calls: {[r['failed_calls'] for r in runs]}")
            out[name] = {
                "what": what,
                "script": lua or "(inline) return 1",
                # the sites in the script, and in the part of _common.lua prepended to it
                "static_redis_call": {
                    "script": static.get(lua, 0) if lua and lua != "_common.lua" else 0,
                    "common": prelude_sites(lua) if lua else 0,
                },
                "usec_per_call": statistics.median(per),
                "usec_per_call_reps": per,
                # time inside the commands the script issued; the rest is Lua and EVALSHA
                "usec_in_commands_per_call": statistics.median(in_cmds),
                "inner_calls_per_call": {cmd: c / total_calls for cmd, c in sorted(
                    inner_tot.items(), key=lambda kv: -kv[1])} if total_calls else {},
                "warnings": warnings,
            }  # fmt: skip
        floor = out["return1"]["usec_per_call"]  # every subset measures the floor
        for v in out.values():
            v["ratio_to_return1"] = v["usec_per_call"] / floor if floor else None
        return out

    # -- client throughput

    def loop(self, name: str, n: int) -> Body:
        r = self.r
        if name == "bare_evalsha":
            return self._each(range(n), lambda _: r.evalsha(self.bare.sha, 0))
        if name == "raw_admit":
            sha = self.admit_script.sha
            return self._each(
                self._admit_calls(n), lambda c: r.evalsha(sha, len(c[0]), *c[0], *c[1])
            )
        s = self.session()
        return self._each(range(n), lambda k: s.admit("retrieval", [Item(f"i{k}", 1)]))

    def run_client_loop(self, name: str, n: int) -> dict[str, float]:
        body = self.loop(name, n)
        self.r.config_resetstat()
        w0, c0 = time.perf_counter(), time.process_time()
        body()
        w1, c1 = time.perf_counter(), time.process_time()
        st = self.server_stats()
        self.drop_sessions()
        return {
            "ops_per_s": n / (w1 - w0),
            "wall_us_per_op": (w1 - w0) / n * 1e6,
            "cpu_us_per_op": (c1 - c0) / n * 1e6,
            "server_us_per_op": st["usec"] / st["calls"] if st["calls"] else 0.0,
        }

    def client(self) -> dict[str, Any]:
        names = list(CLIENT_LOOPS)
        for name in names:
            self.run_client_loop(name, min(self.n, 200))
        raw = interleaved(
            self.reps, {k: lambda k=k: self.run_client_loop(k, self.n) for k in names}
        )
        out: dict[str, Any] = {
            name: {"what": CLIENT_LOOPS[name], "reps": runs}
            | {m: statistics.median(r[m] for r in runs) for m in runs[0]}
            for name, runs in raw.items()
        }
        b = out["bare_evalsha"]
        for v in out.values():
            v["slowdown_vs_bare"] = b["ops_per_s"] / v["ops_per_s"]
            v["cpu_ratio_vs_bare"] = v["cpu_us_per_op"] / b["cpu_us_per_op"]
        return out

    def cpu_parts(self) -> dict[str, Any]:
        """Client CPU of the pieces of one ledger call, without any I/O."""
        led, s, n = self.led, self.session(), self.n
        call = s.admit_call("retrieval", [Item("probe", 1)])
        raw_reply = self.admit_script(keys=call.keys, args=call.args)
        self.drop_sessions()

        def tenacity_loop() -> None:
            for _ in range(n):
                for attempt in Retrying(**led.retry_policy()):
                    with attempt:
                        pass

        def build_loop() -> None:
            for k in range(n):
                s.admit_call("retrieval", [Item(f"i{k}", 1)])

        def parse_loop() -> None:
            for _ in range(n):
                call.parse(protocol.decode(raw_reply))

        def cpu(fn: Body) -> float:
            c0 = time.process_time()
            fn()
            return (time.process_time() - c0) / n * 1e6

        loops = {"tenacity": tenacity_loop, "build_call": build_loop, "parse_reply": parse_loop}
        res = interleaved(self.reps, {k: lambda fn=fn: cpu(fn) for k, fn in loops.items()})
        return {
            k: {"what": CPU_PARTS[k], "cpu_us_per_op": statistics.median(v)} for k, v in res.items()
        }

    # -- memory

    def describe(self, key: str) -> dict[str, Any]:
        fields = self.r.hgetall(key)
        names = {"i:": "items", "r:": "reservations", "x:": "telemetry"}
        classes: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for f, v in fields.items():
            c = names.get(f[:2].decode(), "base")
            classes[c] = classes.get(c, 0) + 1
            sizes[c] = sizes.get(c, 0) + len(f) + len(v)
        return {
            "bytes": int(self.r.memory_usage(key, samples=0) or 0),
            "fields": len(fields),
            "encoding": self.r.object("encoding", key).decode(),
            "fields_by_class": classes,
            "payload_bytes_by_class": sizes,
        }

    def memory(self) -> dict[str, Any]:
        s = self.session(MEMORY_BUDGET)
        fresh = self.describe(s.keys.session)
        self.turns(s, TURNS, tokens=250)
        after = self.describe(s.keys.session)
        # Outcomes live in their own hashes (current and previous generation).
        after["outcome_bytes"] = sum(
            int(self.r.memory_usage(k, samples=0) or 0)
            for k in (s.keys.outcomes, s.keys.outcomes_old)
        )
        self.drop_sessions()
        after["ratio_to_fresh"] = after["bytes"] / fresh["bytes"] if fresh["bytes"] else None
        return {"fresh": fresh, f"after_{TURNS}_turns": after}


# --- output --------------------------------------------------------------------------


def server_table(title: str, res: dict[str, Any], key: str = "server") -> None:
    rows = []
    for name, v in res[key].items():
        st, reps, us = v["static_redis_call"], v["usec_per_call_reps"], v["usec_per_call"]
        inner = ", ".join(f"{c.upper()} {x:.3g}" for c, x in v["inner_calls_per_call"].items())
        rows.append([
            f"{name}\n[dim]{v['what']}[/dim]", v["script"],
            f"{st['script']} + {st['common']}" if v["script"].endswith(".lua") else "0",
            inner or "-", f"{us:.2f}", f"{min(reps):.2f}-{max(reps):.2f}",
            f"{v['usec_in_commands_per_call']:.2f}", f"{us - v['usec_in_commands_per_call']:.2f}",
            f"{v['ratio_to_return1']:.2f}", f"{1e6 / us:,.0f}" if us else "-",
        ])  # fmt: skip
        rows += [[f"[red]warning[/red] {w}"] for w in v["warnings"]]
    table(title, ["phase", "script", "redis.call(\nsites: script\n+ common",
                  "commands issued per call (dynamic)", "µs/call\nmedian", "min-max",
                  "µs in those\ncommands", "µs in Lua\nitself", "x return 1",
                  "calls/s/core\n(1e6/µs)"], rows, width=210,
          left=("script", "commands issued per call (dynamic)"))  # fmt: skip


def cpu_parts_table(title: str, res: dict[str, Any]) -> None:
    """The CPU pieces, and their share of ledger_admit's CPU when the client loops ran."""
    led = res.get("client", {}).get("ledger_admit", {}).get("cpu_us_per_op")
    rows = [[n, v["what"], f"{v['cpu_us_per_op']:.1f}"] for n, v in res["client_cpu_parts"].items()]
    for row, v in zip(rows, res["client_cpu_parts"].values(), strict=True):
        row += [f"{v['cpu_us_per_op'] / led:.0%}"] if led else []
    share = ["share of ledger-admit CPU"] if led else []
    table(title, ["piece", "what", "CPU µs/op", *share], rows, left=("what",))


def print_table(res: dict[str, Any]) -> None:
    env, p = res["env"], res["params"]
    print(
        f"ledger core bench  {machine(env)}\nN={p['n']} calls per phase, median of {p['reps']} "
        f"repetitions (phases interleaved), op retention {p['op_retention_s']} s, total "
        f"{res['elapsed_s']:.1f} s"
    )
    server_table("1. Server time per call (INFO commandstats, cmdstat_evalsha usec/calls)", res)
    st = res["static_redis_call"]
    table(
        "Static `redis.call(` occurrences per Lua file (a script's prelude is the part of "
        "_common.lua it uses)",
        ["", *st],
        [["sites", *(str(c) for c in st.values())]],
    )
    table(
        "2. Client throughput, one connection, sequential loop (median)",
        ["loop", "ops/s", "ops/s\nmin-max", "wall µs/op", "client CPU µs/op", "server µs/op",
         "slowdown\nvs bare", "CPU\nx bare"],
        [[f"{name}\n[dim]{v['what']}[/dim]", f"{v['ops_per_s']:,.0f}",
          f"{min(r['ops_per_s'] for r in v['reps']):,.0f}-"
          f"{max(r['ops_per_s'] for r in v['reps']):,.0f}",
          f"{v['wall_us_per_op']:.1f}", f"{v['cpu_us_per_op']:.1f}",
          f"{v['server_us_per_op']:.2f}", f"{v['slowdown_vs_bare']:.2f}",
          f"{v['cpu_ratio_vs_bare']:.2f}"] for name, v in res["client"].items()],
    )  # fmt: skip
    cpu_parts_table("Client CPU of the pieces of one ledger call (no I/O, median)", res)
    fresh = res["memory"]["fresh"]["bytes"]
    table(
        "3. Memory of one session hash (MEMORY USAGE key SAMPLES 0)",
        ["state", "bytes", "x fresh", "fields", "encoding", "fields by class",
         "payload bytes (field+value) by class"],
        [[name, f"{v['bytes']:,}", f"{v['bytes'] / fresh:.2f}", str(v["fields"]), v["encoding"],
          ", ".join(f"{k} {c}" for k, c in v["fields_by_class"].items()),
          ", ".join(f"{k} {c:,}" for k, c in v["payload_bytes_by_class"].items())]
         for name, v in res["memory"].items()],
        left=("encoding", "fields by class", "payload bytes (field+value) by class"),
    )  # fmt: skip
    print(
        "usec_per_call is Redis's own timing of EVALSHA (script run incl. its commands), "
        "without network, parsing or reply writing. One turn = admit 3 items of 250 tokens, "
        "release 1. Outcomes stay for the op retention."
    )


# --- main ----------------------------------------------------------------------------


def run(n: int, reps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with (
        standalone() as server,
        Ledger.from_url(server.url, prefix=f"bench{uuid.uuid4().hex[:10]}") as led,
    ):
        b = Bench(led, n, reps)
        env = environment(b.r)
        with steal_during(env):
            server_res, client, parts, memory = b.server(), b.client(), b.cpu_parts(), b.memory()
        retention = led.settings.op_retention_seconds
    return {
        "env": env,
        "params": {"n": n, "reps": reps, "op_retention_s": retention},
        "static_redis_call": static_redis_calls(),
        "server": server_res,
        "client": client,
        "client_cpu_parts": parts,
        "memory": memory,
        "elapsed_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_core", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--n", type=int, default=3000, help="calls per phase and repetition")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (median reported)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = ap.parse_args(argv)
    if a.n < 1 or a.reps < 1:
        ap.error("--n and --reps must be at least 1")
    emit(run(a.n, a.reps), a.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
