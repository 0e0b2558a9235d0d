"""Core benchmark of the ledger on one Redis server, in one process and one run.

    python -m bench.bench_core [--n N] [--reps R] [--json] [--url redis://host:port/0]

Without ``--url`` it starts its own redis-server on a free port (ledger.testing.standalone)
and stops it afterwards. With ``--url`` it runs CONFIG RESETSTAT on that server many
times (its INFO commandstats are lost) and writes keys under a fresh ``bench<hex>``
prefix, deleted at the end; use a server nobody else is using.

What it measures:

1. Server time per script call: CONFIG RESETSTAT, N calls, then INFO commandstats
   (usec / calls of ``cmdstat_evalsha``). Phases: a bare ``return 1`` script, the
   ledger's admit of one item, admit of 16 items, release of one item, reserve,
   settle, snapshot. Each phase's set-up (opening a session, admitting the items a
   release phase gives back, ...) happens before the RESETSTAT. Every phase runs
   once per repetition, phases interleaved (their order rotated) across repetitions
   to cancel drift; the median over repetitions is reported. The other commandstats
   lines give the commands each script issues per call (HMGET, TIME, HSET, ...);
   the static number of ``redis.call(`` sites in every Lua file is counted as well.
2. Client throughput in a plain loop: ops/s, wall and CPU (time.process_time) per op
   of a bare redis-py ``evalsha`` of ``return 1`` against the ledger's
   ``session.admit("retrieval", [Item(...)])`` (which builds an op id and a
   fingerprint, sends EVALSHA and parses the reply; tenacity only after a failure),
   plus a bare ``evalsha`` of the admit script with pre-built arguments, and an
   I/O-free attribution of the client's CPU (building the call, parsing the reply,
   and for reference what a tenacity wrapper would cost).
3. Memory: MEMORY USAGE (SAMPLES 0) of a freshly opened session hash and of one after
   40 turns of (admit 3 items, release 1).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parents[1]

import redis  # noqa: E402
import redis.utils  # noqa: E402
import tenacity  # noqa: E402
from tenacity import Retrying  # noqa: E402

from ledger import Item, Ledger, SessionBudget, protocol, scripts  # noqa: E402
from ledger.client import Session  # noqa: E402

Body = Callable[[], None]

# Large window so that no phase is ever refused (16 x N one-token items per session).
BENCH_BUDGET = SessionBudget(
    window=100_000_000,
    system_prompt=2_100,
    tool_framing=150,
    working_memory_floor=6_000,
    output_reserve=1_024,
)
# A realistic session for the memory figures.
MEMORY_BUDGET = SessionBudget(
    window=128_000,
    system_prompt=2_100,
    tool_framing=150,
    working_memory_floor=6_000,
    output_reserve=1_024,
)
LEASE_MS = 3_600_000
TURNS = 40

# phase name -> (what it is, Lua file it runs)
SERVER_PHASES: dict[str, tuple[str, str | None]] = {
    "return1": ("bare `return 1` script (floor)", None),
    "prelude_return1": ("admit's prelude (the _common.lua it uses) + return 1", "_common.lua"),
    "admit_commands": (
        "admit's HMGET, TIME and HSET alone, constant values (bench/admit_commands.lua)",
        None,
    ),
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
IGNORED_STATS = ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config")


# --- environment ---------------------------------------------------------------------


def nproc() -> int:
    exe = shutil.which("nproc")
    if exe:
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            return int(subprocess.run([exe], capture_output=True, text=True, timeout=5).stdout)
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat, None where unavailable."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return (f[7] if len(f) > 7 else 0), sum(f[:8])
    return None


def loadavg() -> list[float] | None:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def redact(url: str) -> str:
    p = urlsplit(url)
    if p.password:
        host = p.hostname or ""
        netloc = f"{p.username or ''}:***@{host}" + (f":{p.port}" if p.port else "")
        return urlunsplit(p._replace(netloc=netloc))
    return url


def environment(r: redis.Redis, where: str) -> dict[str, Any]:
    info = r.info("server")
    cfg = r.config_get("hash-max-listpack-*")
    return {
        "redis_version": info.get("redis_version"),
        "redis_mode": info.get("redis_mode"),
        "server": where,
        "hash_max_listpack_entries": int(cfg.get("hash-max-listpack-entries") or -1),
        "hash_max_listpack_value": int(cfg.get("hash-max-listpack-value") or -1),
        "nproc": nproc(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "tenacity": getattr(tenacity, "__version__", None) or _dist_version("tenacity"),
        "hiredis": bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False)),
        "platform": platform.platform(),
    }


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


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

    def server_stats(self) -> tuple[int, int, int, dict[str, tuple[int, int]]]:
        """evalsha calls, usec, failed calls, and {command: (calls, usec)} of the rest."""
        stats = self.r.info("commandstats")
        ev = stats.get("cmdstat_evalsha", {})
        inner = {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in stats.items()
            if not name.startswith(IGNORED_STATS)
        }
        return (
            int(ev.get("calls", 0)),
            int(ev.get("usec", 0)),
            int(ev.get("failed_calls", 0)),
            inner,
        )

    # -- server phases: each does its set-up and returns the loop to measure

    def ph_return1(self, n: int) -> Body:
        bare = self.bare

        def body() -> None:
            for _ in range(n):
                bare()

        return body

    def ph_prelude_return1(self, n: int) -> Body:
        script = self.prelude_bare

        def body() -> None:
            for _ in range(n):
                script()

        return body

    def ph_admit_commands(self, n: int) -> Body:
        """The calls admit_1 would send, to admit_commands.lua: same keys, same ARGV."""
        calls, script = self._admit_calls(n), self.admit_commands

        def body() -> None:
            for keys, args in calls:
                script(keys=keys, args=args)

        return body

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

    def _admit_calls(self, n: int) -> list[tuple[tuple[str, ...], tuple[Any, ...]]]:
        """KEYS and ARGV of n single-item admits on a new session, built beforehand."""
        s = self.session()
        built = [s.admit_call("retrieval", [Item(f"i{k}", 1)]) for k in range(n)]
        return [(c.keys, c.args) for c in built]

    def ph_return1_warm(self, n: int) -> Body:
        return self._warm(self.bare.sha, [((), ())] * n)

    def ph_admit_commands_warm(self, n: int) -> Body:
        return self._warm(self.admit_commands.sha, self._admit_calls(n))

    def ph_admit_1_warm(self, n: int) -> Body:
        return self._warm(self.admit_script.sha, self._admit_calls(n))

    def ph_admit_1(self, n: int) -> Body:
        s = self.session()

        def body() -> None:
            for k in range(n):
                s.admit("retrieval", [Item(f"i{k}", 1)])

        return body

    def ph_admit_16(self, n: int) -> Body:
        s = self.session()
        batches = [[Item(f"b{k}.{j}", 1) for j in range(16)] for k in range(n)]

        def body() -> None:
            for b in batches:
                s.admit("retrieval", b)

        return body

    def ph_release_1(self, n: int) -> Body:
        s = self.session()
        ids = [f"i{k}" for k in range(n)]
        for lo in range(0, n, 1000):
            s.admit("retrieval", [Item(i, 1) for i in ids[lo : lo + 1000]])

        def body() -> None:
            for i in ids:
                s.release("retrieval", [i])

        return body

    def ph_reserve(self, n: int) -> Body:
        s = self.session()
        rids = [f"r{k}" for k in range(n)]
        self._pending = (s, rids)

        def body() -> None:
            for rid in rids:
                s.reserve("retrieval", rid, 1, lease_ms=LEASE_MS)

        return body

    def ph_settle(self, n: int) -> Body:
        assert self._pending is not None, "settle runs right after reserve"
        s, rids = self._pending
        self._pending = None

        def body() -> None:
            for k, rid in enumerate(rids):
                s.settle(rid, 1, f"x{k}")

        return body

    def ph_snapshot(self, n: int) -> Body:
        s = self.session()
        self.turns(s, TURNS)

        def body() -> None:
            for _ in range(n):
                s.snapshot()

        return body

    def run_server_phase(self, name: str, n: int) -> dict[str, Any]:
        body = getattr(self, f"ph_{name}")(n)
        self.r.config_resetstat()
        body()
        calls, usec, failed, inner = self.server_stats()
        if name != "reserve":  # settle still needs the reservations
            self.drop_sessions()
        return {"calls": calls, "usec": usec, "failed": failed, "inner": inner}

    def server(self) -> dict[str, Any]:
        # Warm-up: loads every script (no NOSCRIPT inside a measurement), warms caches.
        for name in SERVER_PHASES:
            self.run_server_phase(name, min(self.n, 200))
        units = [[p] for p in SERVER_PHASES if p not in ("reserve", "settle")]
        units.insert(list(SERVER_PHASES).index("reserve"), ["reserve", "settle"])
        raw: dict[str, list[dict[str, Any]]] = {p: [] for p in SERVER_PHASES}
        for rep in range(self.reps):
            k = rep % len(units)
            for unit in units[k:] + units[:k]:
                for name in unit:
                    raw[name].append(self.run_server_phase(name, self.n))
        static = static_redis_calls()
        out: dict[str, Any] = {}
        for name, (what, lua) in SERVER_PHASES.items():
            runs = raw[name]
            per = [r["usec"] / r["calls"] if r["calls"] else 0.0 for r in runs]
            in_cmds = [sum(u for _, u in r["inner"].values()) / r["calls"] if r["calls"] else 0.0
                       for r in runs]  # fmt: skip
            inner_tot: dict[str, int] = {}
            for r in runs:
                for cmd, (c, _) in r["inner"].items():
                    inner_tot[cmd] = inner_tot.get(cmd, 0) + c
            total_calls = sum(r["calls"] for r in runs)
            warnings = []
            if any(r["calls"] != self.n for r in runs):
                warnings.append(
                    f"evalsha calls per repetition {[r['calls'] for r in runs]} != n={self.n}: "
                    "another client used the server, or a script was reloaded"
                )
            if any(r["failed"] for r in runs):
                warnings.append(f"failed evalsha calls: {[r['failed'] for r in runs]}")
            out[name] = {
                "what": what,
                "script": lua or "(inline) return 1",
                "static_redis_call": {
                    "script": static.get(lua, 0) if lua and lua != "_common.lua" else 0,
                    # the sites in the part of _common.lua prepended to this script
                    "common": prelude_sites(lua) if lua else 0,
                },
                "usec_per_call": statistics.median(per),
                "usec_per_call_reps": per,
                # time Redis spent inside the commands the script issued (HMGET, HSET, ...);
                # the rest of usec_per_call is Lua (argument checks, string work) and EVALSHA.
                "usec_in_commands_per_call": statistics.median(in_cmds),
                "inner_calls_per_call": {
                    cmd: c / total_calls
                    for cmd, c in sorted(inner_tot.items(), key=lambda kv: -kv[1])
                }
                if total_calls
                else {},
                "warnings": warnings,
            }
        floor = out["return1"]["usec_per_call"]
        for v in out.values():
            v["ratio_to_return1"] = v["usec_per_call"] / floor if floor else None
        return out

    # -- client throughput

    def cl_bare_evalsha(self, n: int) -> Body:
        r, sha = self.r, self.bare.sha

        def body() -> None:
            for _ in range(n):
                r.evalsha(sha, 0)

        return body

    def cl_ledger_admit(self, n: int) -> Body:
        s = self.session()

        def body() -> None:
            for k in range(n):
                s.admit("retrieval", [Item(f"i{k}", 1)])

        return body

    def cl_raw_admit(self, n: int) -> Body:
        calls, r, sha = self._admit_calls(n), self.r, self.admit_script.sha

        def body() -> None:
            for keys, args in calls:
                r.evalsha(sha, len(keys), *keys, *args)

        return body

    def run_client_loop(self, name: str, n: int) -> dict[str, float]:
        body = getattr(self, f"cl_{name}")(n)
        self.r.config_resetstat()
        w0, c0 = time.perf_counter(), time.process_time()
        body()
        w1, c1 = time.perf_counter(), time.process_time()
        calls, usec, _, _ = self.server_stats()
        self.drop_sessions()
        return {
            "ops_per_s": n / (w1 - w0),
            "wall_us_per_op": (w1 - w0) / n * 1e6,
            "cpu_us_per_op": (c1 - c0) / n * 1e6,
            "server_us_per_op": usec / calls if calls else 0.0,
        }

    def client(self) -> dict[str, Any]:
        names = list(CLIENT_LOOPS)
        for name in names:
            self.run_client_loop(name, min(self.n, 200))
        raw: dict[str, list[dict[str, float]]] = {k: [] for k in names}
        for rep in range(self.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                raw[name].append(self.run_client_loop(name, self.n))
        out: dict[str, Any] = {}
        for name, runs in raw.items():
            out[name] = {
                "what": CLIENT_LOOPS[name],
                **{m: statistics.median(r[m] for r in runs) for m in runs[0]},
                "reps": runs,
            }
        b = out["bare_evalsha"]
        for v in out.values():
            v["slowdown_vs_bare"] = b["ops_per_s"] / v["ops_per_s"]
            v["cpu_ratio_vs_bare"] = v["cpu_us_per_op"] / b["cpu_us_per_op"]
        return out

    def cpu_parts(self) -> dict[str, Any]:
        """Client CPU of the pieces of one ledger call, without any I/O."""
        led = self.led
        s = self.session()
        n = self.n
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

        loops = {"tenacity": tenacity_loop, "build_call": build_loop, "parse_reply": parse_loop}
        res: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(self.reps):
            for name, fn in loops.items():
                c0 = time.process_time()
                fn()
                res[name].append((time.process_time() - c0) / n * 1e6)
        return {
            name: {"what": CPU_PARTS[name], "cpu_us_per_op": statistics.median(v)}
            for name, v in res.items()
        }

    # -- memory

    def describe(self, key: str) -> dict[str, Any]:
        fields = self.r.hgetall(key)
        classes = {"base": 0, "items": 0, "reservations": 0, "telemetry": 0}
        sizes = dict.fromkeys(classes, 0)
        for f, v in fields.items():
            name = f.decode() if isinstance(f, bytes) else str(f)
            if name.startswith("i:"):
                c = "items"
            elif name.startswith("r:"):
                c = "reservations"
            elif name.startswith("x:"):
                c = "telemetry"
            else:
                c = "base"
            classes[c] += 1
            sizes[c] += len(f) + len(v)
        enc = self.r.object("encoding", key)
        return {
            "bytes": int(self.r.memory_usage(key, samples=0) or 0),
            "fields": len(fields),
            "encoding": enc.decode() if isinstance(enc, bytes) else str(enc),
            "fields_by_class": {k: v for k, v in classes.items() if v},
            "payload_bytes_by_class": {k: v for k, v in sizes.items() if v},
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


def _fmt_inner(d: dict[str, float]) -> str:
    parts = []
    for cmd, v in d.items():
        parts.append(f"{cmd.upper()} {v:.3g}")
    return ", ".join(parts) or "-"


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    env, p = res["env"], res["params"]
    console.print(
        f"[bold]ledger core bench[/bold]  redis-server {env['redis_version']} "
        f"({env['server']})  nproc={env['nproc']}  cpu={env['cpu_model']}\n"
        f"python {env['python']}, redis-py {env['redis_py']} (hiredis {env['hiredis']}), "
        f"tenacity {env['tenacity']}, "
        f"{env['platform']}\n"
        f"load avg before/after {env.get('loadavg_before')}/{env.get('loadavg_after')}, "
        f"CPU steal during run {env.get('cpu_steal_pct_during_run', 'n/a')} %\n"
        f"N={p['n']} calls per phase, median of {p['reps']} repetitions (phases interleaved), "
        f"op retention {p['op_retention_s']} s, hash-max-listpack-entries/value "
        f"{env['hash_max_listpack_entries']}/{env['hash_max_listpack_value']}, "
        f"total {res['elapsed_s']:.1f} s"
    )

    t = Table(title="1. Server time per call (INFO commandstats, cmdstat_evalsha usec/calls)")
    t.add_column("phase", no_wrap=True)
    t.add_column("script", no_wrap=True)
    t.add_column("redis.call(\nsites: script\n+ common", justify="right")
    t.add_column("commands issued per call (dynamic)")
    t.add_column("µs/call\nmedian", justify="right", no_wrap=True)
    t.add_column("min-max", justify="right", no_wrap=True)
    t.add_column("µs in those\ncommands", justify="right", no_wrap=True)
    t.add_column("x return 1", justify="right", no_wrap=True)
    t.add_column("calls/s/core\n(1e6/µs)", justify="right", no_wrap=True)
    for name, v in res["server"].items():
        st = v["static_redis_call"]
        reps = v["usec_per_call_reps"]
        t.add_row(
            f"{name}\n[dim]{v['what']}[/dim]",
            v["script"],
            f"{st['script']} + {st['common']}" if v["script"].endswith(".lua") else "0",
            _fmt_inner(v["inner_calls_per_call"]),
            f"{v['usec_per_call']:.2f}",
            f"{min(reps):.2f}-{max(reps):.2f}",
            f"{v['usec_in_commands_per_call']:.2f}",
            f"{v['ratio_to_return1']:.2f}",
            f"{1e6 / v['usec_per_call']:,.0f}" if v["usec_per_call"] else "-",
        )
    console.print(t)
    for name, v in res["server"].items():
        for w in v["warnings"]:
            console.print(f"[red]warning[/red] {name}: {w}")

    t = Table(
        title="Static `redis.call(` occurrences per Lua file (a script's prelude is the "
        "part of _common.lua it uses)"
    )
    for f in res["static_redis_call"]:
        t.add_column(f, justify="right")
    t.add_row(*(str(c) for c in res["static_redis_call"].values()))
    console.print(t)

    t = Table(title="2. Client throughput, one connection, sequential loop (median)")
    t.add_column("loop", no_wrap=True)
    t.add_column("ops/s", justify="right", no_wrap=True)
    t.add_column("ops/s\nmin-max", justify="right", no_wrap=True)
    t.add_column("wall µs/op", justify="right")
    t.add_column("client CPU µs/op", justify="right")
    t.add_column("server µs/op", justify="right")
    t.add_column("slowdown\nvs bare", justify="right")
    t.add_column("CPU\nx bare", justify="right")
    for name, v in res["client"].items():
        t.add_row(
            f"{name}\n[dim]{v['what']}[/dim]",
            f"{v['ops_per_s']:,.0f}",
            f"{min(r['ops_per_s'] for r in v['reps']):,.0f}-"
            f"{max(r['ops_per_s'] for r in v['reps']):,.0f}",
            f"{v['wall_us_per_op']:.1f}",
            f"{v['cpu_us_per_op']:.1f}",
            f"{v['server_us_per_op']:.2f}",
            f"{v['slowdown_vs_bare']:.2f}",
            f"{v['cpu_ratio_vs_bare']:.2f}",
        )
    console.print(t)

    t = Table(title="Client CPU of the pieces of one ledger call (no I/O, median)")
    t.add_column("piece")
    t.add_column("what")
    t.add_column("CPU µs/op", justify="right")
    t.add_column("share of ledger-admit CPU", justify="right")
    led_cpu = res["client"]["ledger_admit"]["cpu_us_per_op"]
    for name, v in res["client_cpu_parts"].items():
        t.add_row(
            name, v["what"], f"{v['cpu_us_per_op']:.1f}", f"{v['cpu_us_per_op'] / led_cpu:.0%}"
        )
    console.print(t)

    t = Table(title="3. Memory of one session hash (MEMORY USAGE key SAMPLES 0)")
    t.add_column("state")
    t.add_column("bytes", justify="right")
    t.add_column("x fresh", justify="right")
    t.add_column("fields", justify="right")
    t.add_column("encoding")
    t.add_column("fields by class")
    t.add_column("payload bytes (field+value) by class")
    fresh = res["memory"]["fresh"]["bytes"]
    for name, v in res["memory"].items():
        t.add_row(
            name,
            f"{v['bytes']:,}",
            f"{v['bytes'] / fresh:.2f}",
            str(v["fields"]),
            v["encoding"],
            ", ".join(f"{k} {c}" for k, c in v["fields_by_class"].items()),
            ", ".join(f"{k} {c:,}" for k, c in v["payload_bytes_by_class"].items()),
        )
    console.print(t)
    console.print(
        "[dim]usec_per_call is Redis's own timing of EVALSHA (script run incl. its commands), "
        "without network, parsing or reply writing. One turn = admit 3 items of 250 tokens, "
        "release 1. Outcomes (o:*) stay for the op retention; a run shorter than it never "
        "sweeps journal chunks.[/dim]"
    )


# --- main ----------------------------------------------------------------------------


@contextlib.contextmanager
def target(url: str | None) -> Iterator[tuple[str, str]]:
    if url:
        yield url, redact(url)
        return
    from ledger.testing import standalone

    with standalone() as server:
        yield server.url, f"self-started on 127.0.0.1:{server.port}"


def run(n: int, reps: int, url: str | None, op_retention: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    load0, ticks0 = loadavg(), cpu_ticks()
    with target(url) as (u, where):
        overrides: dict[str, Any] = {"prefix": f"bench{uuid.uuid4().hex[:10]}"}
        if op_retention is not None:
            overrides["op_retention_seconds"] = op_retention
        with Ledger.from_url(u, **overrides) as led:
            b = Bench(led, n, reps)
            try:
                env = environment(b.r, where)
                server = b.server()
                client = b.client()
                parts = b.cpu_parts()
                memory = b.memory()
            finally:
                b.drop_sessions()
                keys = list(b.r.scan_iter(match=f"{led.keyspace.prefix}:*", count=1000))
                if keys:
                    b.r.delete(*keys)
            retention = led.settings.op_retention_seconds
    ticks1 = cpu_ticks()
    if ticks0 and ticks1 and ticks1[1] > ticks0[1]:
        env["cpu_steal_pct_during_run"] = round(
            100 * (ticks1[0] - ticks0[0]) / (ticks1[1] - ticks0[1]), 2
        )
    env["loadavg_before"], env["loadavg_after"] = load0, loadavg()
    return {
        "env": env,
        "params": {"n": n, "reps": reps, "op_retention_s": retention},
        "static_redis_call": static_redis_calls(),
        "server": server,
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
    ap.add_argument(
        "--url",
        help="an existing Redis (CONFIG RESETSTAT is run on it!); default: start a redis-server",
    )
    ap.add_argument(
        "--op-retention",
        type=int,
        default=None,
        help="op_retention_seconds of the ledger (default: the ledger's own, 300)",
    )
    a = ap.parse_args(argv)
    if a.n < 1 or a.reps < 1:
        ap.error("--n and --reps must be at least 1")
    res = run(a.n, a.reps, a.url, a.op_retention)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
